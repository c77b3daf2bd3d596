/* power_of_two.c - two random workers, the less loaded one (Mitzenmacher): O(1). */
#include "../policy.h"

static int pick(struct dp_policy *p, const struct dp_workers *w, uint64_t session, uint32_t tenant)
{
    (void)session, (void)tenant;
    if (w->n == 0)
        return -1;
    uint64_t r = dp_rand(p);
    uint32_t a = (uint32_t)((r & 0xffffffffu) * w->n >> 32);
    uint32_t b = (uint32_t)((r >> 32) * (w->n - 1) >> 32);
    if (b >= a)
        b++;                       /* b != a when n > 1 */
    if (w->n == 1)
        b = a;
    if (!w->up[a])
        a = b;
    if (!w->up[b])
        b = a;
    if (!w->up[a])                 /* both down: fall back to a scan */
        return dp_next_up(w, a);
    return w->depth[b] < w->depth[a] ? (int)b : (int)a;
}

const struct dp_policy_ops dp_policy_power_of_two = { "power_of_two", 0, pick, 0 };
