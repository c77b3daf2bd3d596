/* power_of_two.c - two random workers, the less loaded one (Mitzenmacher): O(1). */
#include "../policy.h"

static int pick(struct dp_policy *p, const struct dp_workers *w, const struct dp_request *rq)
{
    (void)rq;
    int a, b;
    if (dp_two(p, w, &a, &b) < 0)
        return -1;
    return w->depth[b] < w->depth[a] ? b : a;
}

const struct dp_policy_ops dp_policy_power_of_two = { "power_of_two", 0, pick, 0 };
