/* ring_bench.h - C loops for ring tests and benchmarks (see ring_bench.c). */
#ifndef DP_RING_BENCH_H
#define DP_RING_BENCH_H
#include "ring.h"

/* CDEF BEGIN */

#define DP_SEQ_MAX_REC 4096        /* the largest record dp_seq_produce/consume and dp_copy_ns move */
uint64_t dp_seq_produce(struct dp_ring *r, uint64_t first, uint64_t n, uint32_t burst, uint32_t rec_len,
                        uint64_t timeout_ns);
uint64_t dp_seq_consume(struct dp_ring *r, uint64_t first, uint64_t n, uint32_t burst, uint32_t rec_len,
                        uint64_t timeout_ns, uint64_t *errors);
/* commits of 1..7 records; the consumer counts peeks that show a commit in part (torn) */
uint64_t dp_whole_produce(struct dp_ring *r, uint64_t commits, uint64_t timeout_ns);
uint64_t dp_whole_consume(struct dp_ring *r, uint64_t commits, uint64_t timeout_ns, uint64_t *torn);
/* a producer killed inside a commit of n records, the last `published` of them published: what it
 * leaves in the ring (then exit, unclosed) */
uint32_t dp_ring_torn_commit(struct dp_ring *r, uint32_t n, uint32_t published);
double dp_ring_op_ns(struct dp_ring *r, uint32_t bulk, uint64_t items, uint32_t rec_len);
double dp_copy_ns(uint32_t rec_len, uint32_t slot_size, uint32_t slots, uint64_t n);
/* one-way ns of a cache-line ping-pong between two threads pinned to cpu_a and cpu_b (median block);
 * two_lines: each side polls one line and stores to the other, as a one-way hand-off's two ends */
double dp_pingpong_oneway_ns(uint64_t rounds, int cpu_a, int cpu_b, uint64_t timeout_ns, int two_lines);
uint64_t dp_latency_produce(struct dp_ring *r, uint64_t n, uint64_t gap_ns, uint64_t timeout_ns);
uint64_t dp_latency_consume(struct dp_ring *r, uint64_t n, uint64_t *samples, uint64_t timeout_ns);
/* The same stamped one-way hand-off on a bare cache line (shared: DP_HANDOFF_BYTES, zeroed, shared by
 * the two processes): the reference the ring's one-way latency is measured against, same method. */
#define DP_HANDOFF_BYTES 128
uint64_t dp_handoff_produce(void *shared, uint64_t n, uint64_t gap_ns, uint64_t timeout_ns);
uint64_t dp_handoff_consume(void *shared, uint64_t n, uint64_t *samples, uint64_t timeout_ns);
/* CDEF END */
#endif
