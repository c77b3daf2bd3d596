/* weighted.c - weighted random choice: worker j gets weight[j] / sum of the up
 * workers' weights. Cumulative weights are rebuilt when the generation changes
 * (Python sets weights live and bumps it); a decision is a binary search. */
#include <errno.h>
#include <stdlib.h>

#include "../policy.h"

struct cumul {
    uint32_t n;
    uint64_t total;
    uint64_t upto[DP_MAX_WORKERS];
    uint32_t worker[DP_MAX_WORKERS];
};

static int init(struct dp_policy *p)
{
    p->priv = calloc(1, sizeof(struct cumul));
    p->warm = p->priv;
    p->warm_bytes = p->priv ? sizeof(struct cumul) : 0;
    return p->priv ? 0 : -ENOMEM;
}

static int pick(struct dp_policy *p, const struct dp_workers *w, const struct dp_request *rq)
{
    (void)rq;
    struct cumul *c = p->priv;
    if (p->seen_generation != w->generation) {
        c->n = 0;
        c->total = 0;
        for (uint32_t j = 0; j < w->n; j++)
            if (w->up[j] && w->weight[j]) {
                c->total += w->weight[j];
                c->upto[c->n] = c->total;
                c->worker[c->n++] = j;
            }
        p->seen_generation = w->generation;
    }
    if (c->total == 0)
        return dp_next_up(w, 0);   /* all weights zero: any up worker */
    uint64_t x = dp_rand(p) % c->total;
    /* the first upto > x, in [lo, lo + len): halved a fixed log2(n) times whatever x is, each step
     * a conditional move, not a branch (a branch per step, mispredicted half the time, took the
     * decision from 16 ns at 4 workers to 41 ns at 256) */
    uint32_t lo = 0, len = c->n;
    while (len > 1) {
        uint32_t half = len / 2;
        lo = c->upto[lo + half - 1] > x ? lo : lo + half;
        len -= half;
    }
    return (int)c->worker[lo];
}

static void fini(struct dp_policy *p)
{
    free(p->priv);
    p->priv = NULL;
}

const struct dp_policy_ops dp_policy_weighted = { "weighted", init, pick, fini };
