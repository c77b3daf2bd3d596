/* policy.h - routing policies: which worker gets a new request.
 *
 * One signature for all (struct dp_policy_ops.pick), a registry in
 * policies/registry.c, one file per policy in policies/. A policy is asked
 * once per request (all chunks and decode steps of a request follow its KV
 * cache to the same worker), sees each worker's depth in chunks and in tokens,
 * weight and health in struct dp_workers and the request's size in struct
 * dp_request, and returns a worker index, or -1 if none is up.
 *
 * A policy may also learn from what it placed: its optional done hook is told
 * once of each request its pool placed as the request ends (answered, or
 * refused or failed after placement), with the worker it ended on (a failover
 * or a KV-full move may have taken it from the one picked), its status, the
 * tokens that ran, its latency in the router and its time on that worker
 * (struct dp_outcome). done runs on the router's thread, like pick, never for
 * a rehearsal.
 *
 * pick may also be called for a rehearsal (router.c keeps the path warm while
 * idle), after which the router puts rng and cursor back: any other state a
 * pick changes must be a function of the workers' view alone (a rebuild when
 * the generation changes), so a rehearsal leaves no trace. What done learns
 * is the policy's to keep (p->priv).
 *
 * Adding a policy: write policies/<name>.c defining
 *     const struct dp_policy_ops dp_policy_<name> = { "<name>", init, pick, fini };
 * (a fifth field, when pick reads p->param: what the parameter means; a
 * sixth, done, to learn from outcomes) and add one line to policies/registry.c.
 */
#ifndef DP_POLICY_H
#define DP_POLICY_H

#include <stddef.h>
#include <stdint.h>

/* CDEF BEGIN */
#define DP_MAX_WORKERS 256

struct dp_workers {
    uint32_t n;                          /* workers 0..n-1 */
    uint32_t total_depth;                /* sum of depth[] over the workers up[] (kept by the router) */
    uint64_t generation;                 /* bumped when n, up[] or weight[] change */
    uint64_t membership;                 /* bumped only when an index may come to mean another worker (one
                                          * added, or moved between pools): what a policy learnt per index
                                          * holds across other changes */
    uint32_t depth[DP_MAX_WORKERS];      /* chunks queued for or in flight on each worker */
    uint32_t tokens[DP_MAX_WORKERS];     /* the same in tokens: each such chunk's prompt tokens (until its
                                          * last piece is done), one per request decoding (its next step) */
    uint64_t total_tokens;               /* sum of tokens[] over the workers up[] (kept by the router) */
    uint32_t weight[DP_MAX_WORKERS];     /* relative share for `weighted`, set live from Python */
    uint8_t up[DP_MAX_WORKERS];          /* 1 if up and not stalled (router.c, find_stalls): accepting work */
    uint16_t id[DP_MAX_WORKERS];         /* each worker's own name (the router's index of it): what a policy
                                          * that hashes workers keys on, since an index here shifts when an
                                          * earlier worker leaves the pool */
};

struct dp_request {                      /* what a policy knows of the request it places */
    uint64_t session;
    uint32_t tenant;
    uint32_t prompt_tokens;              /* exact for a one-chunk request; else chunk_count x 128, an upper
                                          * bound: it is placed on its first chunk, before the others come */
    uint32_t max_output;                 /* tokens it may generate (as admitted) */
    uint32_t chunk_count;
    uint64_t t_ns;                       /* the pick's time on the router's clock (now_ns), for decay by time */
};

struct dp_outcome {                      /* a request the policy's pool placed, as it ends */
    uint64_t session;
    uint32_t tenant;
    uint32_t status;                     /* 200, or what it was answered with */
    uint32_t prompt_tokens, generated;   /* what ran of it (0, 0: nothing ran) */
    uint64_t latency_ns;                 /* from the router's first sight of it to its end */
    uint64_t service_ns;                 /* from its first record in the lane of the worker it ended on to its
                                          * end (0: none was sent): that worker's time, not the wait before */
    uint64_t t_end_ns;                   /* its end on the router's clock (now_ns), for decay by time */
};
const char *dp_policy_name(unsigned i);  /* registry walk; NULL past the end */
const char *dp_policy_param(unsigned i); /* what policy i's parameter means; NULL: it takes none */
/* 0 if policy `name` takes param (its own init run and undone), or -ENOENT / -EINVAL (or
 * -ENOMEM): so a caller can refuse a setting before it builds anything */
int dp_policy_check(const char *name, double param);
/* CDEF END */

struct dp_policy;

struct dp_policy_ops {
    const char *name;
    int (*init)(struct dp_policy *p);    /* may allocate p->priv; 0 or -errno */
    int (*pick)(struct dp_policy *p, const struct dp_workers *w, const struct dp_request *rq);
    void (*fini)(struct dp_policy *p);
    const char *param;                   /* what p->param means to pick; NULL: not read (refused) */
    void (*done)(struct dp_policy *p, const struct dp_workers *w, int worker, const struct dp_outcome *o);
};

struct dp_policy {
    const struct dp_policy_ops *ops;
    uint64_t rng;        /* xorshift64 state, seeded at create */
    uint32_t cursor;     /* round-robin position */
    double param;        /* policy parameter (affinity: load bound epsilon) */
    uint64_t seen_generation;
    void *priv;          /* policy-owned state */
    const void *warm;    /* the part of it a pick reads (the router keeps it cached while idle) */
    size_t warm_bytes;
};

int dp_policy_init(struct dp_policy *p, const char *name, uint64_t seed, double param);
void dp_policy_fini(struct dp_policy *p);

static inline int dp_policy_pick(struct dp_policy *p, const struct dp_workers *w, const struct dp_request *rq)
{
    return p->ops->pick(p, w, rq);
}

static inline void dp_policy_done(struct dp_policy *p, const struct dp_workers *w, int worker,
                                  const struct dp_outcome *o)
{
    if (p->ops->done)
        p->ops->done(p, w, worker, o);
}

static inline uint64_t dp_rand(struct dp_policy *p)
{
    uint64_t x = p->rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return p->rng = x;
}

/* splitmix64 finaliser: a cheap, well-mixed hash of a session id */
static inline uint64_t dp_hash64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The up worker with the least load[] (a dp_workers array: depth, tokens), or -1; the scan starts
 * one further each call, so ties spread. */
static inline int dp_least(struct dp_policy *p, const struct dp_workers *w, const uint32_t *load)
{
    int best = -1;
    uint32_t least = UINT32_MAX, start = w->n ? p->cursor++ % w->n : 0;
    for (uint32_t k = 0; k < w->n; k++) {
        uint32_t j = (start + k) % w->n;
        if (w->up[j] && load[j] < least) {
            best = (int)j;
            least = load[j];
        }
    }
    return best;
}

/* first up worker at or after i (wrapping), or -1 */
static inline int dp_next_up(const struct dp_workers *w, uint32_t i)
{
    for (uint32_t k = 0; k < w->n; k++) {
        uint32_t j = (i + k) % w->n;
        if (w->up[j])
            return (int)j;
    }
    return -1;
}

/* Two random workers, both up: distinct when both drawn are up; the same one twice when one of them
 * is down (or n is 1); 0, or -1 if none is up. */
static inline int dp_two(struct dp_policy *p, const struct dp_workers *w, int *a, int *b)
{
    if (w->n == 0)
        return -1;
    uint64_t r = dp_rand(p);
    uint32_t x = (uint32_t)((r & 0xffffffffu) * w->n >> 32);
    uint32_t y = (uint32_t)((r >> 32) * (w->n - 1) >> 32);
    if (y >= x)
        y++;                       /* y != x when n > 1 */
    if (w->n == 1)
        y = x;
    if (!w->up[x])
        x = y;
    if (!w->up[y])
        y = x;
    if (!w->up[x]) {               /* both down: a scan */
        int k = dp_next_up(w, x);
        if (k < 0)
            return -1;
        x = y = (uint32_t)k;
    }
    *a = (int)x, *b = (int)y;
    return 0;
}

#endif /* DP_POLICY_H */
