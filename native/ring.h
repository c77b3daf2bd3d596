/* ring.h - single-producer single-consumer ring of fixed-size slots in shared memory.
 *
 * The rigtorp SPSCQueue / DPDK rte_ring recipe: free-running 64-bit indices
 * masked by a power-of-two capacity; the producer's index and the consumer's
 * index on separate cache lines, each beside its owner's cached copy of the
 * other's index, which is reloaded (acquire) only when the ring looks full or
 * empty; publication is a release store. Nothing stronger on the fast path.
 *
 * Why fixed-size slots rather than a byte ring of length-prefixed records: a
 * chunk is at most sizeof(struct dp_chunk) = 608 bytes, so a slot per chunk
 * wastes little, makes bulk enqueue/dequeue one index update for n records,
 * lets both sides work in place (reserve/commit, peek/release: zero copy) and
 * keeps a micro-batch contiguous in index space, so a batch published with one
 * commit is seen whole by the worker. Writers copy only the bytes a record
 * uses (header + n_tokens), so a slot's unused tail costs nothing.
 *
 * The ring lives in a POSIX shared-memory object (/dev/shm/dp-<name>); other
 * processes attach by name. One producer and one consumer process hold their
 * role (pid recorded in the header); a role held by a dead process may be
 * taken over, so a consumer killed mid-stream is replaced without losing
 * committed records: the consumer's index only moves on release, so the records
 * the dead one had read but not released come again (at least once).
 *
 * Wait strategy (consumer side, chosen at create): spin; spin then yield;
 * spin, yield, then sleep on a futex in the shared header (the producer wakes
 * it only if it announced it sleeps: one seq_cst fence per commit, and only
 * in that mode). The producer never blocks: a full ring returns a short count
 * and bumps the full counters.
 */
#ifndef DP_RING_H
#define DP_RING_H

#include <stdint.h>
#include <string.h>

#define DP_RING_MAGIC 0x474e4952u   /* "RING" */
#define DP_RING_VERSION 1
#define DP_CACHELINE 64

/* CDEF BEGIN: the API the cffi binding sees (native/ffi_dataplane.py reads it verbatim) */
enum dp_wait { DP_WAIT_SPIN = 0, DP_WAIT_YIELD = 1, DP_WAIT_SLEEP = 2 };
enum dp_role { DP_ROLE_OBSERVER = 0, DP_ROLE_PRODUCER = 1, DP_ROLE_CONSUMER = 2 };

struct dp_ring;
struct dp_ring_stats {
    uint64_t capacity, slot_size, enqueued, dequeued, depth, full_events, refused, sleeps;
    int64_t producer_pid, consumer_pid;
};

/* control path (ring.c); each returns NULL / negative errno on failure */
struct dp_ring *dp_ring_create(const char *name, uint32_t slot_size, uint32_t capacity, int wait_mode, int *err);
struct dp_ring *dp_ring_attach(const char *name, int role, int *err);
int dp_ring_claim(struct dp_ring *r, int role);  /* take a role on a handle (after create) */
void dp_ring_close(struct dp_ring *r);
int dp_ring_unlink(const char *name);
/* A ring only this process uses, at both ends (a shadow stage's): created under a unique
 * name, unlinked at once, both roles taken; the handle keeps `role`, what its user checks. */
struct dp_ring *dp_ring_create_private(uint32_t slot_size, uint32_t capacity, int wait_mode, int role, int *err);
void dp_ring_get_stats(const struct dp_ring *r, struct dp_ring_stats *s);
void dp_ring_wake_consumer(struct dp_ring *r);
/* Wait until at least one record is readable or timeout_ns passes (0: no wait,
 * < 0: forever); returns the readable count. Spins/yields/sleeps per wait_mode. */
uint32_t dp_ring_wait(struct dp_ring *r, int64_t timeout_ns);
/* copying versions of the burst calls, for callers that cannot inline (Python) */
uint32_t dp_ring_enqueue_copy(struct dp_ring *r, const void *recs, uint32_t n, uint32_t rec_len, uint32_t stride);
uint32_t dp_ring_dequeue_copy(struct dp_ring *r, void *out, uint32_t max);
/* CDEF END */

struct dp_ring_hdr {
    /* line 0: fixed at create */
    uint32_t magic;
    uint32_t version;
    uint32_t slot_size;     /* bytes, a multiple of 8 */
    uint32_t capacity;      /* slots, a power of two */
    uint32_t mask;
    uint32_t wait_mode;     /* enum dp_wait */
    uint64_t data_offset;   /* slots start here, from the mapping's start */
    uint64_t map_size;
    /* line 1: written by the producer only */
    _Alignas(DP_CACHELINE) uint64_t tail;   /* next slot to fill */
    uint64_t head_cache;                    /* producer's copy of head */
    uint64_t full_events;                   /* enqueues that found less room than asked */
    uint64_t refused;                       /* records those enqueues could not place */
    int32_t producer_pid;
    /* line 2: written by the consumer only */
    _Alignas(DP_CACHELINE) uint64_t head;   /* next slot to read */
    uint64_t tail_cache;                    /* consumer's copy of tail */
    uint64_t sleeps;                        /* futex waits entered */
    int32_t consumer_pid;
    /* line 3: the sleep handshake (touched only in DP_WAIT_SLEEP mode) */
    _Alignas(DP_CACHELINE) uint32_t futex;
    uint32_t sleeping;
};

struct dp_ring {             /* a process's handle (not shared) */
    struct dp_ring_hdr *h;
    uint8_t *slots;
    size_t map_len;          /* what this process mapped (never trust the shared header for it) */
    int role;
    int fd;
};

static inline void *dp_ring_slot(const struct dp_ring *r, uint64_t idx)
{
    return r->slots + (size_t)(idx & r->h->mask) * r->h->slot_size;
}

/* --- producer --------------------------------------------------------------- */

/* Free slots, up to want; refreshes the cached head only when short. */
static inline uint32_t dp_ring_prod_reserve(struct dp_ring *r, uint32_t want)
{
    struct dp_ring_hdr *h = r->h;
    uint64_t tail = h->tail;   /* our own index: no atomic load needed */
    uint64_t free_ = h->capacity - (tail - h->head_cache);
    if (free_ < want) {
        h->head_cache = __atomic_load_n(&h->head, __ATOMIC_ACQUIRE);
        free_ = h->capacity - (tail - h->head_cache);
    }
    return free_ < want ? (uint32_t)free_ : want;
}

/* The i-th reserved slot (i < what reserve returned). */
static inline void *dp_ring_prod_slot(const struct dp_ring *r, uint32_t i)
{
    return dp_ring_slot(r, r->h->tail + i);
}

static inline void dp_ring_prod_commit(struct dp_ring *r, uint32_t n)
{
    struct dp_ring_hdr *h = r->h;
    __atomic_store_n(&h->tail, h->tail + n, __ATOMIC_RELEASE);
    if (h->wait_mode == DP_WAIT_SLEEP) {
        /* pairs with the consumer's fence between "sleeping = 1" and its last look at tail */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (__atomic_load_n(&h->sleeping, __ATOMIC_RELAXED))
            dp_ring_wake_consumer(r);
    }
}

static inline void dp_ring_note_full(struct dp_ring *r, uint32_t asked, uint32_t placed)
{
    if (placed < asked) {
        r->h->full_events++;
        r->h->refused += asked - placed;
    }
}

/* Copy up to n records of rec_len bytes (<= slot_size) from recs, stride
 * `stride`; all published with one commit. Returns how many went in. */
static inline uint32_t dp_ring_enqueue_burst(struct dp_ring *r, const void *recs, uint32_t n,
                                             uint32_t rec_len, uint32_t stride)
{
    uint32_t k = dp_ring_prod_reserve(r, n);
    for (uint32_t i = 0; i < k; i++)
        memcpy(dp_ring_prod_slot(r, i), (const uint8_t *)recs + (size_t)i * stride, rec_len);
    if (k)
        dp_ring_prod_commit(r, k);
    dp_ring_note_full(r, n, k);
    return k;
}

/* --- consumer --------------------------------------------------------------- */

/* Readable slots, up to max; refreshes the cached tail only when it looks empty. */
static inline uint32_t dp_ring_cons_peek(struct dp_ring *r, uint32_t max)
{
    struct dp_ring_hdr *h = r->h;
    uint64_t head = h->head;
    uint64_t avail = h->tail_cache - head;
    if (avail < max) {
        h->tail_cache = __atomic_load_n(&h->tail, __ATOMIC_ACQUIRE);
        avail = h->tail_cache - head;
    }
    return avail < max ? (uint32_t)avail : max;
}

static inline void *dp_ring_cons_slot(const struct dp_ring *r, uint32_t i)
{
    return dp_ring_slot(r, r->h->head + i);
}

static inline void dp_ring_cons_release(struct dp_ring *r, uint32_t n)
{
    __atomic_store_n(&r->h->head, r->h->head + n, __ATOMIC_RELEASE);
}

static inline uint32_t dp_ring_dequeue_burst(struct dp_ring *r, void *out, uint32_t max)
{
    uint32_t k = dp_ring_cons_peek(r, max), sz = r->h->slot_size;
    for (uint32_t i = 0; i < k; i++)
        memcpy((uint8_t *)out + (size_t)i * sz, dp_ring_cons_slot(r, i), sz);
    if (k)
        dp_ring_cons_release(r, k);
    return k;
}

#endif /* DP_RING_H */
