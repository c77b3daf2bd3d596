/* affinity.c - session affinity: consistent hashing with bounded loads.
 *
 * Each up worker owns VNODES points on a 64-bit hash ring; a session goes to
 * the first worker clockwise from hash(session) whose depth is below
 * ceil((1 + eps) * mean depth) + 1 (Mirrokni, Thorup, Zadimoghaddam 2018), so
 * a returning session meets its KV cache unless its worker is overloaded,
 * and adding or removing a worker moves only the sessions it owned.
 * The ring is rebuilt when the workers' generation changes (control path).
 *
 * A lookup costs the same with 4 workers as with 256: a bucket index on the
 * hash's top BUCKET_BITS bits gives its starting point (2 points a bucket on
 * average at 256 workers), and the points from there are counted SCAN at a
 * time without a branch on each. The loop `while (pt < h) lo++` it replaces
 * ran a random 0-8 times at 256 workers, a mispredicted exit each lookup:
 * 11 ns at 4 workers, 26 ns at 256 (bench ring's policy_ns_affinity_*).
 * A point is one word (8 bytes, not 16), so the ring takes half the cache.
 */
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>

#include "../policy.h"

#define VNODES 64
#define BUCKET_BITS 13            /* 16 KiB of buckets: small enough to stay cached */

/* A point is its hash's top 48 bits, then its worker's index (< DP_MAX_WORKERS): points sort by
 * hash, and a session's hash, its low bits cleared, is compared with them whole. */
#define WORKER_BITS 16
#define WORKER_MASK ((1ull << WORKER_BITS) - 1)
#define SCAN 4                    /* points compared at once, without a branch: most lookups need one pass */

struct ring {
    uint32_t n;
    uint16_t bucket[1u << BUCKET_BITS];   /* first point with hash >= the bucket's start */
    uint64_t pts[DP_MAX_WORKERS * VNODES + SCAN];   /* then SCAN of UINT64_MAX, which ends any scan */
};
_Static_assert(DP_MAX_WORKERS <= (1u << WORKER_BITS) && DP_MAX_WORKERS * VNODES <= UINT16_MAX,
               "a worker index fits a point's low bits, a point index a bucket");

static int cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
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
                r->pts[r->n++] = (dp_hash64(((uint64_t)w->id[j] << 32) | v) & ~WORKER_MASK) | j;
    qsort(r->pts, r->n, sizeof(r->pts[0]), cmp);
    for (uint32_t i = 0; i < SCAN; i++)
        r->pts[r->n + i] = UINT64_MAX;
    uint32_t i = 0;
    for (uint64_t b = 0; b < (1u << BUCKET_BITS); b++) {
        while (i < r->n && r->pts[i] < (b << (64 - BUCKET_BITS)))
            i++;
        r->bucket[b] = (uint16_t)i;
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
        p->warm_bytes = offsetof(struct ring, pts) + (r->n + SCAN) * sizeof(r->pts[0]);
    }
    if (r->n == 0)
        return -1;
    uint64_t h = dp_hash64(rq->session) & ~WORKER_MASK;
    uint32_t lo = r->bucket[h >> (64 - BUCKET_BITS)];   /* then the first point with hash >= h */
    for (;;) {
        uint32_t c = 0;
        for (uint32_t i = 0; i < SCAN; i++)
            c += r->pts[lo + i] < h;
        lo += c;
        if (c < SCAN)
            break;
    }
    if (lo == r->n)
        lo = 0;
    uint32_t up = r->n / VNODES;
    double cap = (1.0 + p->param) * (double)w->total_depth / (double)up + 1.0;
    for (uint32_t k = 0, i = lo; k < r->n; k++, i = i + 1 == r->n ? 0 : i + 1) {
        uint32_t j = (uint32_t)(r->pts[i] & WORKER_MASK);
        if ((double)w->depth[j] < cap)
            return (int)j;
    }
    return (int)(r->pts[lo] & WORKER_MASK);   /* unreachable: some worker is at or below the mean */
}

static void fini(struct dp_policy *p)
{
    free(p->priv);
    p->priv = NULL;
}

const struct dp_policy_ops dp_policy_affinity = { "affinity", init, pick, fini,
                                                  "load bound: a worker takes up to (1 + x) x the mean load" };
