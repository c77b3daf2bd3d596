/* least_tokens.c - the up worker with the fewest tokens queued or in flight (O(workers) per decision):
 * a step's cost follows its tokens, so a 128-token chunk weighs 128 decode steps, not one. */
#include "../policy.h"

static int pick(struct dp_policy *p, const struct dp_workers *w, const struct dp_request *rq)
{
    (void)rq;
    return dp_least(p, w, w->tokens);
}

const struct dp_policy_ops dp_policy_least_tokens = { "least_tokens", 0, pick, 0 };
