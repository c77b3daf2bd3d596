/* registry.c - the routing policies by name. One line per policy. */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "../policy.h"

extern const struct dp_policy_ops dp_policy_round_robin, dp_policy_least_loaded, dp_policy_power_of_two,
    dp_policy_affinity, dp_policy_weighted, dp_policy_least_tokens, dp_policy_peak_ewma;

static const struct dp_policy_ops *const registry[] = {
    &dp_policy_round_robin,
    &dp_policy_least_loaded,
    &dp_policy_power_of_two,
    &dp_policy_affinity,
    &dp_policy_weighted,
    &dp_policy_least_tokens,
    &dp_policy_peak_ewma,
};

const char *dp_policy_name(unsigned i)
{
    return i < sizeof(registry) / sizeof(registry[0]) ? registry[i]->name : NULL;
}

const char *dp_policy_param(unsigned i)
{
    return i < sizeof(registry) / sizeof(registry[0]) ? registry[i]->param : NULL;
}

int dp_policy_init(struct dp_policy *p, const char *name, uint64_t seed, double param)
{
    memset(p, 0, sizeof(*p));
    for (unsigned i = 0; i < sizeof(registry) / sizeof(registry[0]); i++) {
        if (strcmp(registry[i]->name, name) == 0) {
            if (param != 0 && !registry[i]->param)
                return -EINVAL;           /* a parameter pick never reads: refused, not ignored */
            if (!isfinite(param) || param < 0)
                return -EINVAL;           /* NaN passed `param <= 0` and turned affinity's bound off */
            p->ops = registry[i];
            p->rng = seed ? seed : 0x2545f4914f6cdd1dull;
            p->param = param;
            p->seen_generation = UINT64_MAX;
            return p->ops->init ? p->ops->init(p) : 0;
        }
    }
    return -ENOENT;
}

int dp_policy_check(const char *name, double param)
{
    struct dp_policy p;
    int rc = dp_policy_init(&p, name, 0, param);
    if (rc == 0)
        dp_policy_fini(&p);
    return rc;
}

void dp_policy_fini(struct dp_policy *p)
{
    if (p->ops && p->ops->fini)
        p->ops->fini(p);
    p->warm = NULL;
    p->warm_bytes = 0;
    p->ops = NULL;
}
