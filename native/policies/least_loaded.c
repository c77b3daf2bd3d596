/* least_loaded.c - the up worker with the shallowest lane (O(workers) per decision). */
#include "../policy.h"

static int pick(struct dp_policy *p, const struct dp_workers *w, uint64_t session, uint32_t tenant)
{
    (void)session, (void)tenant;
    int best = -1;
    uint32_t best_depth = UINT32_MAX, start = w->n ? p->cursor++ % w->n : 0;
    for (uint32_t k = 0; k < w->n; k++) {   /* start rotates so ties spread */
        uint32_t j = (start + k) % w->n;
        if (w->up[j] && w->depth[j] < best_depth) {
            best = (int)j;
            best_depth = w->depth[j];
        }
    }
    return best;
}

const struct dp_policy_ops dp_policy_least_loaded = { "least_loaded", 0, pick, 0 };
