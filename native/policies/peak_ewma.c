/* peak_ewma.c - latency-aware: two random workers (as power_of_two), the one whose expected delay
 * for this request is the least: (its tokens queued + this request's) x its latency per token.
 *
 * The latency per token is learnt from the requests that ended on the worker (the done hook): a
 * request's latency in the router over the tokens that ran of it (prompt + generated), kept as a
 * peak-sensitive moving average (Finagle's peak EWMA, in tokens): a slower sample is taken at
 * once, a faster one blended in with a weight that decays over p->param seconds (default 1 s), so
 * a worker that slows down loses traffic from its next answer, and one that recovered regains it
 * as its answers come. Only requests answered 200 that ran tokens teach it. A worker not measured
 * yet is taken at the mean of those measured (at 0 with none: by its queue alone). Its request's
 * own size matters where workers differ in speed: a short request may go to an idle slow worker,
 * a long one to a busy fast one. What it learnt is indexed by the pool's view, so it starts again
 * when the view's generation changes (a worker added, moved, marked up or down, reweighted). */
#include <errno.h>
#include <stdlib.h>

#include "../policy.h"

struct learnt {
    uint64_t generation;                  /* of the view the figures index */
    uint32_t measured;                    /* workers with a figure */
    double sum;                           /* of their figures */
    double ns_per_token[DP_MAX_WORKERS];  /* 0: not measured */
    uint64_t t_last[DP_MAX_WORKERS];      /* the last sample's end (router clock) */
};

static int init(struct dp_policy *p)
{
    p->priv = calloc(1, sizeof(struct learnt));
    p->warm = p->priv;
    p->warm_bytes = sizeof(struct learnt);
    if (p->param <= 0)
        p->param = 1.0;
    return p->priv ? 0 : -ENOMEM;
}

/* A view of another generation: what was learnt may index other workers now (a function of the
 * view alone, so a rehearsal's pick that does it does what the next real pick would). */
static struct learnt *learnt_for(struct dp_policy *p, const struct dp_workers *w)
{
    struct learnt *l = p->priv;
    if (l->generation != w->generation) {
        *l = (struct learnt){ .generation = w->generation };
        p->warm = l;
        p->warm_bytes = sizeof(*l);
    }
    return l;
}

static double cost(const struct learnt *l, const struct dp_workers *w, int j, double size)
{
    double per_token = l->ns_per_token[j] ? l->ns_per_token[j] : l->measured ? l->sum / l->measured : 0;
    return per_token * ((double)w->tokens[j] + size);
}

static int pick(struct dp_policy *p, const struct dp_workers *w, const struct dp_request *rq)
{
    int a, b;
    if (dp_two(p, w, &a, &b) < 0)
        return -1;
    const struct learnt *l = learnt_for(p, w);
    double size = (double)rq->prompt_tokens + rq->max_output;
    double ca = cost(l, w, a, size), cb = cost(l, w, b, size);
    if (ca != cb)
        return cb < ca ? b : a;
    return w->tokens[b] < w->tokens[a] ? b : a;   /* nothing learnt yet: by the queue */
}

static void done(struct dp_policy *p, const struct dp_workers *w, int worker, const struct dp_outcome *o)
{
    struct learnt *l = learnt_for(p, w);
    uint64_t tokens = (uint64_t)o->prompt_tokens + o->generated;
    if (worker < 0 || (uint32_t)worker >= w->n || o->status != 200 || !tokens || !o->latency_ns)
        return;
    double sample = (double)o->latency_ns / (double)tokens, old = l->ns_per_token[worker], now;
    if (!old || sample >= old) {
        now = sample;                     /* the peak: taken at once */
    } else {
        double tau = p->param * 1e9, dt = o->t_end_ns > l->t_last[worker] ? (double)(o->t_end_ns - l->t_last[worker]) : 0;
        double keep = tau / (tau + dt);   /* ~exp(-dt/tau), without libm */
        now = old * keep + sample * (1 - keep);
    }
    l->measured += !old;
    l->sum += now - old;
    l->ns_per_token[worker] = now;
    l->t_last[worker] = o->t_end_ns;
}

static void fini(struct dp_policy *p)
{
    free(p->priv);
    p->priv = NULL;
}

const struct dp_policy_ops dp_policy_peak_ewma = { "peak_ewma", init, pick, fini,
                                                   "decay time in seconds of the latency average (default 1)", done };
