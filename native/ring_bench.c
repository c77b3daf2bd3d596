/* ring_bench.c - C loops over the ring for the tests and `python -m bench ring`.
 *
 * Python starts the processes and reads the results; every record is moved
 * and checked here, so the figures are the ring's, not the interpreter's.
 * Every loop is bounded by a count and a deadline.
 */
#define _GNU_SOURCE
#include "ring_bench.h"
#include "clock.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

static void relax(void)
{
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

/* Whole records, as the data path moves them: the producer writes all rec_len bytes of each (a
 * template, then its sequence number in the first word, its complement in the second, which
 * catches torn records, and its low byte in the last past those, which catches short copies); the consumer
 * copies each out whole before it checks it. */
uint64_t dp_seq_produce(struct dp_ring *r, uint64_t first, uint64_t n, uint32_t burst, uint32_t rec_len,
                        uint64_t timeout_ns)
{
    uint64_t deadline = now_ns() + timeout_ns, seq = first, end = first + n;
    unsigned spins = 0;
    uint8_t tmpl[DP_SEQ_MAX_REC];
    if (rec_len < 16 || rec_len > r->h->slot_size || rec_len > sizeof(tmpl))
        return 0;
    for (uint32_t i = 0; i < rec_len; i++)
        tmpl[i] = (uint8_t)(i * 7);
    while (seq < end) {
        uint32_t want = end - seq < burst ? (uint32_t)(end - seq) : burst;
        uint32_t k = dp_ring_prod_reserve(r, want);
        dp_ring_note_full(r, want, k);
        for (uint32_t i = 0; i < k; i++) {
            uint64_t *rec = dp_ring_prod_slot(r, i);
            memcpy(rec, tmpl, rec_len);
            rec[0] = seq + i;
            rec[1] = ~(seq + i);
            if (rec_len > 16)
                ((uint8_t *)rec)[rec_len - 1] = (uint8_t)(seq + i);
        }
        if (k) {
            dp_ring_prod_commit(r, k);
            seq += k;
        } else {
            relax();
            if ((++spins & 1023) == 0 && now_ns() > deadline)
                break;
        }
    }
    return seq - first;
}

uint64_t dp_seq_consume(struct dp_ring *r, uint64_t first, uint64_t n, uint32_t burst, uint32_t rec_len,
                        uint64_t timeout_ns, uint64_t *errors)
{
    uint64_t deadline = now_ns() + timeout_ns, expect = first, end = first + n;
    uint64_t out[DP_SEQ_MAX_REC / 8];
    *errors = 0;
    if (rec_len < 16 || rec_len > r->h->slot_size || rec_len > sizeof(out))
        return 0;
    while (expect < end) {
        uint32_t k = dp_ring_cons_peek(r, burst);
        if (!k) {
            k = dp_ring_wait(r, 1000000);
            if (!k && now_ns() > deadline)
                break;
            continue;
        }
        if (k > end - expect)
            k = (uint32_t)(end - expect);
        for (uint32_t i = 0; i < k; i++) {
            uint64_t want = expect + i;
            memcpy(out, dp_ring_cons_slot(r, i), rec_len);
            if (out[0] != want || out[1] != ~want ||
                (rec_len > 16 && ((const uint8_t *)out)[rec_len - 1] != (uint8_t)want))
                (*errors)++;
        }
        dp_ring_cons_release(r, k);
        expect += k;
    }
    return expect - first;
}

/* Commits of 1..7 records, each record its commit's size and its place in it; the consumer peeks
 * everything readable and counts the peeks that end inside a commit (torn: a batch seen in part,
 * which dp_lane_recv would hand on as two). Returns the commits the consumer saw end. */
uint64_t dp_whole_produce(struct dp_ring *r, uint64_t commits, uint64_t timeout_ns)
{
    uint64_t deadline = now_ns() + timeout_ns, c;
    if (r->h->slot_size < 16 || r->h->capacity < 8)
        return 0;
    for (c = 0; c < commits; c++) {
        uint32_t size = 1 + (uint32_t)(c % 7);
        unsigned spins = 0;
        while (dp_ring_prod_reserve(r, size) < size) {
            relax();
            if ((++spins & 1023) == 0 && now_ns() > deadline)
                return c;
        }
        for (uint32_t i = 0; i < size; i++) {
            uint64_t *rec = dp_ring_prod_slot(r, i);
            rec[0] = size;
            rec[1] = i;
        }
        dp_ring_prod_commit(r, size);
    }
    return c;
}

uint64_t dp_whole_consume(struct dp_ring *r, uint64_t commits, uint64_t timeout_ns, uint64_t *torn)
{
    uint64_t deadline = now_ns() + timeout_ns, ended = 0;
    unsigned spins = 0;
    *torn = 0;
    while (ended < commits) {
        uint32_t k = dp_ring_cons_peek(r, UINT32_MAX);
        if (!k) {
            relax();
            if ((++spins & 4095) == 0 && now_ns() > deadline)
                break;
            continue;
        }
        const uint64_t *last = dp_ring_cons_slot(r, k - 1);
        if (last[1] != last[0] - 1)
            (*torn)++;
        for (uint32_t i = 0; i < k; i++) {
            const uint64_t *rec = dp_ring_cons_slot(r, i);
            ended += rec[1] == rec[0] - 1;
        }
        dp_ring_cons_release(r, k);
    }
    return ended;
}

/* What a producer killed inside a commit leaves (a commit publishes last to first, then moves
 * tail): n records reserved and written, the last `published` of their sequence words stored
 * (n: the whole commit, only tail's store missing), tail not moved. */
uint32_t dp_ring_torn_commit(struct dp_ring *r, uint32_t n, uint32_t published)
{
    if (n < 1 || published > n || dp_ring_prod_reserve(r, n) < n)
        return 0;
    for (uint32_t i = 0; i < n; i++)
        memset(dp_ring_prod_slot(r, i), 0xdd, r->h->slot_size);
    for (uint32_t i = n; i-- > n - published; )
        __atomic_store_n(dp_ring_seq(r, r->h->tail + i), r->h->tail + i + 1, __ATOMIC_RELEASE);
    return n;
}

/* The reference of the throughput above, on one core and without a ring: the same two copies of
 * each record (a template into a slot of a ring-sized buffer, the slot out again), ns per record. */
double dp_copy_ns(uint32_t rec_len, uint32_t slot_size, uint32_t slots, uint64_t n)
{
    uint8_t tmpl[DP_SEQ_MAX_REC], out[DP_SEQ_MAX_REC];
    if (rec_len < 16 || rec_len > slot_size || rec_len > sizeof(tmpl) || !slots)
        return -1;
    uint8_t *ring = malloc((size_t)slot_size * slots);
    if (!ring)
        return -1;
    memset(tmpl, 7, rec_len);
    uint64_t sum = 0, t = now_ns();
    for (uint64_t i = 0; i < n; i++) {
        uint8_t *slot = ring + (size_t)(i % slots) * slot_size;
        memcpy(tmpl, &i, sizeof(i));
        memcpy(slot, tmpl, rec_len);
        memcpy(out, slot, rec_len);
        sum += out[rec_len - 1] + out[0];
        __asm__ volatile("" : : "r"(sum) : "memory");   /* the copies are used: not optimised away */
    }
    double ns = (double)(now_ns() - t) / (double)n;
    free(ring);
    return ns;
}

double dp_ring_op_ns(struct dp_ring *r, uint32_t bulk, uint64_t items, uint32_t rec_len)
{
    uint8_t buf[64 * 1024];
    if (bulk == 0 || (uint64_t)bulk * r->h->slot_size > sizeof(buf) || bulk > r->h->capacity)
        return -1;
    memset(buf, 7, sizeof(buf));
    uint64_t t = now_ns(), done = 0;
    while (done < items) {
        uint32_t k = dp_ring_enqueue_burst(r, buf, bulk, rec_len, r->h->slot_size);
        done += dp_ring_dequeue_burst(r, buf, k);
    }
    return (double)(now_ns() - t) / (double)done;
}

/* Ping-pong on one shared cache line between two threads pinned to cpu_a and cpu_b: the
 * reference for a cross-core hand-off. The rounds run in PP_BLOCKS blocks, each timed; the
 * figure is the median block's one-way ns. The first block is not counted: it holds the
 * threads' start and pinning (timed from before the other side existed, a 200k-round run
 * read 219 ns against 29 ns), and the median keeps a descheduled block out. -1 on timeout.
 *
 * two_lines: A serves on one line and B returns on another, as a one-way hand-off's reader polls
 * the line its writer stores to. On one line each side stores to the line it has just read,
 * whose ownership came with it: a hop is one line transfer. On two, a side's store must first
 * take its line back from the other's polling, then the other's next read fetch it: two. */
#define PP_BLOCKS 33

struct pingpong {
    _Alignas(128) uint64_t ball;  /* odd: A served, even: B returned (on one line) */
    _Alignas(128) uint64_t back;  /* B's return, on two lines (128 B apart: not one prefetch pair) */
    _Alignas(128) uint64_t rounds;
    int cpu, stop, two_lines;
};

static void pin_self(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

static void *pong(void *arg)
{
    struct pingpong *p = arg;
    uint64_t *out = p->two_lines ? &p->back : &p->ball;
    pin_self(p->cpu);
    for (uint64_t r = 0; r < p->rounds; r++) {
        while (__atomic_load_n(&p->ball, __ATOMIC_ACQUIRE) != 2 * r + 1) {
            relax();
            if (__atomic_load_n(&p->stop, __ATOMIC_RELAXED))
                return NULL;
        }
        __atomic_store_n(out, 2 * r + 2, __ATOMIC_RELEASE);
    }
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double dp_pingpong_oneway_ns(uint64_t rounds, int cpu_a, int cpu_b, uint64_t timeout_ns, int two_lines)
{
    uint64_t per = rounds / PP_BLOCKS;
    double block[PP_BLOCKS], ns = -1;
    pthread_t t;
    /* not on this stack: a call's frame (the deadline's clock read) stored beside the ball */
    struct pingpong *p = aligned_alloc(128, sizeof(*p));
    if (!p)
        return -1;
    *p = (struct pingpong){ .ball = 0, .rounds = per * PP_BLOCKS, .cpu = cpu_b, .two_lines = two_lines };
    const uint64_t *in = two_lines ? &p->back : &p->ball;
    if (!per || pthread_create(&t, NULL, pong, p)) {
        free(p);
        return -1;
    }
    pin_self(cpu_a);
    uint64_t deadline = now_ns() + timeout_ns, r = 0;
    for (int b = 0; b < PP_BLOCKS; b++) {
        uint64_t t0 = now_ns();
        for (uint64_t end = r + per; r < end; r++) {
            unsigned spins = 0;
            __atomic_store_n(&p->ball, 2 * r + 1, __ATOMIC_RELEASE);
            while (__atomic_load_n(in, __ATOMIC_ACQUIRE) != 2 * r + 2) {
                relax();
                if ((++spins & 4095) == 0 && now_ns() > deadline) {
                    __atomic_store_n(&p->stop, 1, __ATOMIC_RELAXED);
                    goto out;
                }
            }
        }
        block[b] = (double)(now_ns() - t0) / (2.0 * (double)per);
    }
    qsort(block + 1, PP_BLOCKS - 1, sizeof(double), cmp_double);
    ns = block[1 + (PP_BLOCKS - 1) / 2];
out:
    pthread_join(t, NULL);
    free(p);
    return ns;
}

/* One-way latency: the producer stamps a record and commits it only when the
 * ring is empty (so no record waits behind another), the consumer stamps on
 * arrival and stores (arrival - stamp) in samples[]. */
uint64_t dp_latency_produce(struct dp_ring *r, uint64_t n, uint64_t gap_ns, uint64_t timeout_ns)
{
    uint64_t deadline = now_ns() + timeout_ns, i;
    for (i = 0; i < n; i++) {
        uint64_t t;
        while (__atomic_load_n(&r->h->head, __ATOMIC_ACQUIRE) != r->h->tail) {
            relax();
            if (now_ns() > deadline)
                return i;
        }
        t = now_ns() + gap_ns;
        while (now_ns() < t)
            relax();
        /* stamped before the first store to the record's line, as the reference is: a store
         * before the clock began the line's transfer outside the sample (~11% of it) */
        uint64_t sent = now_ns();
        if (dp_ring_prod_reserve(r, 1) != 1)
            return i;
        uint64_t *rec = dp_ring_prod_slot(r, 0);
        rec[0] = sent;
        rec[1] = i;
        dp_ring_prod_commit(r, 1);
    }
    return i;
}

/* The reference for the two above, the same steps without the ring: the producer waits for the
 * consumer's ack of the last record (the ring's "empty"), stamps and publishes on one line; the
 * consumer stamps on arrival. Both pay the clock reads the ring's samples pay, which a ping-pong's
 * round trip over two does not (its one-way is no stamped sample). */
struct handoff {
    _Alignas(64) uint64_t stamp;         /* the record: one line, seq written last */
    uint64_t seq;
    _Alignas(64) uint64_t ack;           /* the consumer's: records taken */
};
_Static_assert(sizeof(struct handoff) == DP_HANDOFF_BYTES, "one line each");

uint64_t dp_handoff_produce(void *shared, uint64_t n, uint64_t gap_ns, uint64_t timeout_ns)
{
    struct handoff *h = shared;
    uint64_t deadline = now_ns() + timeout_ns, i;
    for (i = 0; i < n; i++) {
        while (__atomic_load_n(&h->ack, __ATOMIC_ACQUIRE) != i) {
            relax();
            if (now_ns() > deadline)
                return i;
        }
        uint64_t t = now_ns() + gap_ns;
        while (now_ns() < t)
            relax();
        h->stamp = now_ns();
        __atomic_store_n(&h->seq, i + 1, __ATOMIC_RELEASE);
    }
    return i;
}

uint64_t dp_handoff_consume(void *shared, uint64_t n, uint64_t *samples, uint64_t timeout_ns)
{
    struct handoff *h = shared;
    uint64_t deadline = now_ns() + timeout_ns, i = 0;
    unsigned spins = 0;
    while (i < n) {
        if (__atomic_load_n(&h->seq, __ATOMIC_ACQUIRE) != i + 1) {
            relax();
            if ((++spins & 4095) == 0 && now_ns() > deadline)
                break;
            continue;
        }
        uint64_t sent = h->stamp;        /* the record read, then the clock: as the ring's sample */
        samples[i++] = now_ns() - sent;
        __atomic_store_n(&h->ack, i, __ATOMIC_RELEASE);
    }
    return i;
}

uint64_t dp_latency_consume(struct dp_ring *r, uint64_t n, uint64_t *samples, uint64_t timeout_ns)
{
    uint64_t deadline = now_ns() + timeout_ns, i = 0;
    unsigned spins = 0;
    while (i < n) {
        if (!dp_ring_cons_peek(r, 1)) {
            relax();
            if ((++spins & 4095) == 0 && now_ns() > deadline)
                break;
            continue;
        }
        /* the record read before the clock: its line's transfer from the producer's core is part
         * of the hand-off (stamped at the index alone, it was not: the line came after the clock) */
        uint64_t sent = __atomic_load_n((const uint64_t *)dp_ring_cons_slot(r, 0), __ATOMIC_RELAXED);
        samples[i++] = now_ns() - sent;
        dp_ring_cons_release(r, 1);
    }
    return i;
}
