/* ring.h - single-producer single-consumer ring of fixed-size slots in shared memory.
 *
 * Free-running 64-bit indices masked by a power-of-two capacity, and a sequence
 * word at the head of every slot (the FastForward / Vyukov-queue recipe): the
 * producer publishes slot i by storing i + 1 in it (release) after the record,
 * and the consumer learns what is readable from the slots themselves (acquire),
 * never from the producer's index. A hand-off is then one cache line moving from
 * the producer's core to the consumer's, the line that holds the sequence word
 * and the record's head; with a published tail index it was two (the index's
 * line, then the record's), measured at 1.53-1.77x a bare one-line hand-off (docs/dataplane.md).
 * The consumer's index is still published (release), on its own line, and the
 * producer reloads it only when the ring looks full; the producer's index is
 * kept for counters and a successor, on the producer's line, read by neither
 * side's fast path.
 *
 * Why fixed-size slots rather than a byte ring of length-prefixed records: a
 * chunk is at most sizeof(struct dp_chunk) = 608 bytes, so a slot per chunk
 * wastes little, makes bulk enqueue/dequeue one pass for n records, lets both
 * sides work in place (reserve/commit, peek/release: zero copy) and keeps a
 * micro-batch contiguous in index space. A commit publishes its slots last to
 * first, so a consumer that sees a batch's first slot sees the whole batch.
 * Writers copy only the bytes a record uses (header + n_tokens), so a slot's
 * unused tail costs nothing. Slots are line-aligned (stride: the sequence word
 * plus slot_size, rounded up to 64 bytes), so the sequence word and the first
 * 56 bytes of a record always share a line; records are 8-byte aligned.
 *
 * The ring lives in a POSIX shared-memory object (/dev/shm/dp-<name>); other
 * processes attach by name. One producer and one consumer process hold their
 * role (pid recorded in the header); a role held by a dead process may be
 * taken over, so a consumer killed mid-stream is replaced without losing
 * committed records: the consumer's index only moves on release, so the records
 * the dead one had read but not released come again (at least once). A producer
 * that died inside a commit is settled by its successor before it writes: a
 * commit published whole (the producer's index not yet moved) stands, the index
 * moved past it; one published in part (its later slots, not its first) is
 * cleared.
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
#define DP_RING_VERSION 2
#define DP_CACHELINE 64
#define DP_RING_SEQ_BYTES 8   /* the sequence word at a slot's head; the record follows */

/* CDEF BEGIN: the API the cffi binding sees (native/ffi_dataplane.py reads it verbatim) */
enum dp_wait { DP_WAIT_SPIN = 0, DP_WAIT_YIELD = 1, DP_WAIT_SLEEP = 2 };
enum dp_role { DP_ROLE_OBSERVER = 0, DP_ROLE_PRODUCER = 1, DP_ROLE_CONSUMER = 2 };

struct dp_ring;
struct dp_ring_stats {
    uint64_t capacity, slot_size, enqueued, dequeued, depth, full_events, refused, sleeps, sleep_timeouts;
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
/* This handle may act as role (producer or consumer): the role is this process's already
 * (through this handle or another), or free, or held by a dead process, and then taken over as
 * claim does (released at this handle's close); -EBUSY: another live process holds it. The
 * inline calls below do not check; the copying ones do, and Python's wait asks first. */
int dp_ring_act(struct dp_ring *r, int role);
/* copying versions of the burst calls, for callers that cannot inline (Python): the count moved,
 * or -EBUSY when another live process holds the role (dp_ring_act) */
int64_t dp_ring_enqueue_copy(struct dp_ring *r, const void *recs, uint32_t n, uint32_t rec_len, uint32_t stride);
int64_t dp_ring_dequeue_copy(struct dp_ring *r, void *out, uint32_t max);
/* CDEF END */

struct dp_ring_hdr {
    /* line 0: fixed at create */
    uint32_t magic;
    uint32_t version;
    uint32_t slot_size;     /* a record's room, bytes, a multiple of 8 */
    uint32_t capacity;      /* slots, a power of two */
    uint32_t mask;
    uint32_t wait_mode;     /* enum dp_wait */
    uint32_t stride;        /* bytes from one slot to the next: DP_RING_SEQ_BYTES + slot_size, line-rounded */
    uint64_t data_offset;   /* slots start here, from the mapping's start */
    uint64_t map_size;
    /* line 1: written by the producer only */
    _Alignas(DP_CACHELINE) uint64_t tail;   /* next slot to fill (the consumer reads slots, not this) */
    uint64_t head_cache;                    /* producer's copy of head */
    uint64_t full_events;                   /* enqueues that found less room than asked */
    uint64_t refused;                       /* records those enqueues could not place */
    int32_t producer_pid;
    /* line 2: written by the consumer only */
    _Alignas(DP_CACHELINE) uint64_t head;   /* next slot to read */
    uint64_t tail_cache;                    /* consumer's: slots below it seen published */
    uint64_t sleeps;                        /* futex waits entered */
    uint64_t sleep_timeouts;                /* of them, ended by their timeout, not a producer's wake */
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
    unsigned acts;           /* the roles this handle took, 1 << role each (released at close) */
    int fd;
};

/* slot idx's sequence word: idx + 1 once published, something else before */
static inline uint64_t *dp_ring_seq(const struct dp_ring *r, uint64_t idx)
{
    return (uint64_t *)(r->slots + (size_t)(idx & r->h->mask) * r->h->stride);
}

/* slot idx's record */
static inline void *dp_ring_slot(const struct dp_ring *r, uint64_t idx)
{
    return (uint8_t *)dp_ring_seq(r, idx) + DP_RING_SEQ_BYTES;
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

/* Publish the n reserved slots: last to first, so the first one seen means all n are there. */
static inline void dp_ring_prod_commit(struct dp_ring *r, uint32_t n)
{
    struct dp_ring_hdr *h = r->h;
    uint64_t tail = h->tail;
    for (uint32_t i = n; i-- > 0; )
        __atomic_store_n(dp_ring_seq(r, tail + i), tail + i + 1, __ATOMIC_RELEASE);
    __atomic_store_n(&h->tail, tail + n, __ATOMIC_RELEASE);
    if (h->wait_mode == DP_WAIT_SLEEP) {
        /* pairs with the consumer's fence between "sleeping = 1" and its last look at the slots */
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

/* Readable slots, up to max: those already seen published, then the next ones' sequence
 * words while they say published (a scan ends at most a lap on: the slot a lap ahead of head
 * is head's own, which holds head + 1 until it is released and rewritten). */
static inline uint32_t dp_ring_cons_peek(struct dp_ring *r, uint32_t max)
{
    struct dp_ring_hdr *h = r->h;
    uint64_t head = h->head, seen = h->tail_cache;
    if (seen - head < max) {
        while (seen - head < max && __atomic_load_n(dp_ring_seq(r, seen), __ATOMIC_ACQUIRE) == seen + 1)
            seen++;
        if (seen != h->tail_cache)       /* an empty poll leaves the line the producer reads head on clean */
            h->tail_cache = seen;
    }
    return seen - head < max ? (uint32_t)(seen - head) : max;
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
    uint32_t k = dp_ring_cons_peek(r, max), sz = r->h->slot_size;   /* out is records, back to back */
    for (uint32_t i = 0; i < k; i++)
        memcpy((uint8_t *)out + (size_t)i * sz, dp_ring_cons_slot(r, i), sz);
    if (k)
        dp_ring_cons_release(r, k);
    return k;
}

#endif /* DP_RING_H */
