/* round_robin.c - each new request to the next worker that is up. */
#include "../policy.h"

static int pick(struct dp_policy *p, const struct dp_workers *w, const struct dp_request *rq)
{
    (void)rq;
    if (w->n == 0)
        return -1;
    int j = dp_next_up(w, p->cursor % w->n);
    if (j >= 0)
        p->cursor = (uint32_t)j + 1;
    return j;
}

const struct dp_policy_ops dp_policy_round_robin = { "round_robin", 0, pick, 0 };
