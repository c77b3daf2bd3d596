/* affinity.c - session affinity: consistent hashing with bounded loads.
 *
 * Each up worker owns VNODES points on a 64-bit hash ring; a session goes to
 * the first worker clockwise from hash(session) whose depth is below
 * ceil((1 + eps) * mean depth) + 1 (Mirrokni, Thorup, Zadimoghaddam 2018), so
 * a returning session meets its KV cache unless its worker is overloaded,
 * and adding or removing a worker moves only the sessions it owned.
 * The ring is rebuilt when the workers' generation changes (control path).
 * A bucket index on the hash's top BUCKET_BITS (12) bits gives each lookup its starting
 * point directly (under one point per bucket on average), so a decision costs
 * the same with 4 workers as with 256, instead of a binary search's log n.
 */
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>

#include "../policy.h"

#define VNODES 64
#define BUCKET_BITS 12            /* 16 KiB of buckets: small enough to stay cached (<= 4 points each at 256 workers) */

struct point {
    uint64_t hash;
    uint32_t worker;
};

struct ring {
    uint32_t n;
    uint32_t bucket[1u << BUCKET_BITS];   /* first point with hash >= the bucket's start */
    struct point pts[DP_MAX_WORKERS * VNODES];
};

static int cmp(const void *a, const void *b)
{
    uint64_t x = ((const struct point *)a)->hash, y = ((const struct point *)b)->hash;
    return x < y ? -1 : x > y;
}

static void rebuild(struct ring *r, const struct dp_workers *w)
{
    r->n = 0;
    for (uint32_t j = 0; j < w->n; j++)
        if (w->up[j])
            for (uint32_t v = 0; v < VNODES; v++)
                /* keyed on the worker's own id, not its index: one leaving the pool shifted every
                 * later index, and moved most sessions, not only its own (found by review) */
                r->pts[r->n++] = (struct point){ dp_hash64(((uint64_t)w->id[j] << 32) | v), j };
    qsort(r->pts, r->n, sizeof(r->pts[0]), cmp);
    uint32_t i = 0;
    for (uint64_t b = 0; b < (1u << BUCKET_BITS); b++) {
        while (i < r->n && r->pts[i].hash < (b << (64 - BUCKET_BITS)))
            i++;
        r->bucket[b] = i;
    }
}

static int init(struct dp_policy *p)
{
    p->priv = calloc(1, sizeof(struct ring));
    if (p->param <= 0)
        p->param = 0.25;           /* default load bound: 25% over the mean */
    return p->priv ? 0 : -ENOMEM;
}

static int pick(struct dp_policy *p, const struct dp_workers *w, const struct dp_request *rq)
{
    struct ring *r = p->priv;
    if (p->seen_generation != w->generation) {
        rebuild(r, w);
        p->seen_generation = w->generation;
        p->warm = r;                 /* buckets and the points in use */
        p->warm_bytes = offsetof(struct ring, pts) + r->n * sizeof(r->pts[0]);
    }
    if (r->n == 0)
        return -1;
    uint64_t h = dp_hash64(rq->session);
    uint32_t lo = r->bucket[h >> (64 - BUCKET_BITS)];   /* then the first point with hash >= h */
    while (lo < r->n && r->pts[lo].hash < h)
        lo++;
    uint32_t up = r->n / VNODES;
    double cap = (1.0 + p->param) * (double)w->total_depth / (double)up + 1.0;
    for (uint32_t k = 0; k < r->n; k++) {
        uint32_t j = r->pts[(lo + k) % r->n].worker;
        if ((double)w->depth[j] < cap)
            return (int)j;
    }
    return (int)r->pts[lo % r->n].worker;   /* unreachable: some worker is at or below the mean */
}

static void fini(struct dp_policy *p)
{
    free(p->priv);
    p->priv = NULL;
}

const struct dp_policy_ops dp_policy_affinity = { "affinity", init, pick, fini,
                                                  "load bound: a worker takes up to (1 + x) x the mean load" };
