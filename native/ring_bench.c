/* ring_bench.c - C loops over the ring for the tests and `python -m bench ring`.
 *
 * Python starts the processes and reads the results; every record is moved
 * and checked here, so the figures are the ring's, not the interpreter's.
 * Every loop is bounded by a count and a deadline.
 */
#define _GNU_SOURCE
#include "ring_bench.h"

#include <time.h>

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static void relax(void)
{
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

uint64_t dp_seq_produce(struct dp_ring *r, uint64_t first, uint64_t n, uint32_t burst, uint32_t rec_len,
                        uint64_t timeout_ns)
{
    uint64_t deadline = now_ns() + timeout_ns, seq = first, end = first + n;
    unsigned spins = 0;
    if (rec_len < 16 || rec_len > r->h->slot_size)
        return 0;
    while (seq < end) {
        uint32_t want = end - seq < burst ? (uint32_t)(end - seq) : burst;
        uint32_t k = dp_ring_prod_reserve(r, want);
        dp_ring_note_full(r, want, k);
        for (uint32_t i = 0; i < k; i++) {
            uint64_t *rec = dp_ring_prod_slot(r, i);
            rec[0] = seq + i;
            rec[1] = ~(seq + i);            /* a second word catches torn records */
            if (rec_len > 16)               /* and the last byte, a short copy */
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
    *errors = 0;
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
            const uint64_t *rec = dp_ring_cons_slot(r, i);
            uint64_t want = expect + i;
            if (rec[0] != want || rec[1] != ~want ||
                (rec_len > 16 && ((const uint8_t *)rec)[rec_len - 1] != (uint8_t)want))
                (*errors)++;
        }
        dp_ring_cons_release(r, k);
        expect += k;
    }
    return expect - first;
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

/* Ping-pong on one shared cache line: the reference for a cross-core hand-off.
 * role 0 serves first; returns the mean one-way ns measured by role 1. */
double dp_pingpong(volatile uint64_t *line, int role, uint64_t iters, uint64_t timeout_ns)
{
    uint64_t deadline = now_ns() + timeout_ns, t0 = now_ns();
    for (uint64_t i = 0; i < iters; i++) {
        uint64_t want = 2 * i + (uint64_t)role;
        unsigned spins = 0;
        while (__atomic_load_n(line, __ATOMIC_ACQUIRE) != want) {
            relax();
            if ((++spins & 4095) == 0 && now_ns() > deadline)
                return -1;
        }
        __atomic_store_n(line, want + 1, __ATOMIC_RELEASE);
    }
    return (double)(now_ns() - t0) / (2.0 * (double)iters);
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
        if (dp_ring_prod_reserve(r, 1) != 1)
            return i;
        uint64_t *rec = dp_ring_prod_slot(r, 0);
        rec[1] = i;
        rec[0] = now_ns();
        dp_ring_prod_commit(r, 1);
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
        uint64_t t = now_ns();
        const uint64_t *rec = dp_ring_cons_slot(r, 0);
        samples[i++] = t - rec[0];
        dp_ring_cons_release(r, 1);
    }
    return i;
}
