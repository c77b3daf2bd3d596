/* peak_ewma.c - latency-aware: two random workers (as power_of_two), the one whose expected delay
 * for this request is the least: (its tokens queued + this request's) x its time per token.
 *
 * The time per token is learnt from the requests that ended on the worker (the done hook): a
 * request's service time there (from its first record in the worker's lane to its end) over the
 * tokens that ran of it (prompt + generated), kept as a peak-sensitive moving average (Finagle's
 * peak EWMA, in tokens): a slower sample is taken at once; otherwise, and with time, the figure
 * decays with weight exp(-dt / p->param seconds) (default 1 s): towards a faster sample as one
 * comes, towards 0 while none comes, read so at each pick (never stored by it), but never below
 * the other's figure or its own last, whichever is lower. So a worker that slows down loses
 * traffic from its next answer, and one left alone after a slow spell is tried again once its
 * figure has decayed to the other's, by its queue (a peak that only answers could lower would
 * starve it for good under light load; one decayed below the other's took every request until
 * its first answer). Only requests answered 200 that ran tokens teach
 * it. A worker not measured yet is taken at its rival's figure (both at 0 if neither is
 * measured), so it is judged by its queue alone: at 0 (Finagle's), every request would go to a
 * new worker until its first answer came. The request's own size matters where workers differ in
 * speed: a short request may go to an idle slow worker, a long one to a busy fast one. What it
 * learnt is indexed by the pool's view, so it starts again when an index comes to mean another
 * worker (membership). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "../policy.h"

#define MAX_DECAY_S 86400.0               /* a day: beyond, tau in ns is not worth its floating point */

struct learnt {
    uint64_t membership;                  /* of the view the figures index */
    double ns_per_token[DP_MAX_WORKERS];  /* at t_last; 0: not measured */
    uint64_t t_last[DP_MAX_WORKERS];      /* the last sample's end (router clock) */
};

static int init(struct dp_policy *p)
{
    if (p->param > MAX_DECAY_S)
        return -EINVAL;
    p->priv = calloc(1, sizeof(struct learnt));
    p->warm = p->priv;
    p->warm_bytes = sizeof(struct learnt);
    if (p->param <= 0)
        p->param = 1.0;
    return p->priv ? 0 : -ENOMEM;
}

/* A view whose indices may mean other workers: start again (a function of the view alone, so a
 * rehearsal's pick that does it does what the next real pick would). */
static struct learnt *learnt_for(struct dp_policy *p, const struct dp_workers *w)
{
    struct learnt *l = p->priv;
    if (l->membership != w->membership)
        *l = (struct learnt){ .membership = w->membership };
    return l;
}

/* Worker j's figure decayed to time t */
static double figure(const struct dp_policy *p, const struct learnt *l, int j, uint64_t t)
{
    double dt = t > l->t_last[j] ? (double)(t - l->t_last[j]) : 0;
    return l->ns_per_token[j] * exp(-dt / (p->param * 1e9));
}

static int pick(struct dp_policy *p, const struct dp_workers *w, const struct dp_request *rq)
{
    int a, b;
    if (dp_two(p, w, &a, &b) < 0)
        return -1;
    const struct learnt *l = learnt_for(p, w);
    double fa = l->ns_per_token[a] ? figure(p, l, a, rq->t_ns) : 0;
    double fb = l->ns_per_token[b] ? figure(p, l, b, rq->t_ns) : fa;
    fa = l->ns_per_token[a] ? fa : fb;    /* not measured: at its rival's figure */
    /* A figure decays towards its rival's, or its own last if that is lower, never below: below,
     * its queue weighed at a near-0 figure, a worker with no answers coming took every request
     * until its first came back (a herd: seconds of queue on a worker just recovered, session 28's
     * live stragglers; or a hung one). Held there, the queues decide, as for a worker not measured
     * yet, and one measured faster keeps its edge. */
    double ga = fmax(fa, fmin(l->ns_per_token[a], fb)), gb = fmax(fb, fmin(l->ns_per_token[b], fa));
    fa = ga;
    fb = gb;
    double size = (double)rq->prompt_tokens + rq->max_output;
    double ca = fa * ((double)w->tokens[a] + size), cb = fb * ((double)w->tokens[b] + size);
    if (ca != cb)
        return cb < ca ? b : a;
    return w->tokens[b] < w->tokens[a] ? b : a;   /* nothing learnt: by the queue */
}

static void done(struct dp_policy *p, const struct dp_workers *w, int worker, const struct dp_outcome *o)
{
    struct learnt *l = learnt_for(p, w);
    uint64_t tokens = (uint64_t)o->prompt_tokens + o->generated;
    if (worker < 0 || (uint32_t)worker >= w->n || o->status != 200 || !tokens || !o->service_ns)
        return;
    double sample = (double)o->service_ns / (double)tokens, old = l->ns_per_token[worker], now;
    if (!old) {
        now = sample;
    } else {
        double keep = figure(p, l, worker, o->t_end_ns) / old;   /* exp(-dt / tau) */
        now = sample >= old * keep ? sample : old * keep + sample * (1 - keep);
    }
    l->ns_per_token[worker] = now;
    l->t_last[worker] = o->t_end_ns;
}

static void fini(struct dp_policy *p)
{
    free(p->priv);
    p->priv = NULL;
}

const struct dp_policy_ops dp_policy_peak_ewma = {
    "peak_ewma", init, pick, fini, "decay time in seconds of the time per token learnt (default 1, at most a day)", done };
