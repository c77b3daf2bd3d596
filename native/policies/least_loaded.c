/* least_loaded.c - the up worker with the fewest chunks queued or in flight (O(workers) per decision). */
#include "../policy.h"

static int pick(struct dp_policy *p, const struct dp_workers *w, const struct dp_request *rq)
{
    (void)rq;
    return dp_least(p, w, w->depth);
}

const struct dp_policy_ops dp_policy_least_loaded = { "least_loaded", 0, pick, 0 };
