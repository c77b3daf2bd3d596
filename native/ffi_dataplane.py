"""cffi builder for datapath._dataplane: the shared-memory ring (and, as they land,
the router and its policies). This file is the one place their cdefs live."""
import pathlib

from cffi import FFI

NATIVE = pathlib.Path(__file__).resolve().parent
BPF = NATIVE.parent / "bpf"

CDEF = """
enum dp_wait { DP_WAIT_SPIN = 0, DP_WAIT_YIELD = 1, DP_WAIT_SLEEP = 2 };
enum dp_role { DP_ROLE_OBSERVER = 0, DP_ROLE_PRODUCER = 1, DP_ROLE_CONSUMER = 2 };
struct dp_ring;
struct dp_ring_stats {
    uint64_t capacity, slot_size, enqueued, dequeued, depth, full_events, refused, sleeps;
    int64_t producer_pid, consumer_pid;
};
struct dp_ring *dp_ring_create(const char *name, uint32_t slot_size, uint32_t capacity, int wait_mode, int *err);
struct dp_ring *dp_ring_attach(const char *name, int role, int *err);
int dp_ring_claim(struct dp_ring *r, int role);
void dp_ring_close(struct dp_ring *r);
int dp_ring_unlink(const char *name);
void dp_ring_get_stats(const struct dp_ring *r, struct dp_ring_stats *s);
uint32_t dp_ring_wait(struct dp_ring *r, int64_t timeout_ns);
uint32_t dp_ring_enqueue_burst(struct dp_ring *r, const void *recs, uint32_t n, uint32_t rec_len, uint32_t stride);
uint32_t dp_ring_dequeue_burst(struct dp_ring *r, void *out, uint32_t max);

uint64_t dp_seq_produce(struct dp_ring *r, uint64_t first, uint64_t n, uint32_t burst, uint32_t rec_len,
                        uint64_t timeout_ns);
uint64_t dp_seq_consume(struct dp_ring *r, uint64_t first, uint64_t n, uint32_t burst, uint32_t rec_len,
                        uint64_t timeout_ns, uint64_t *errors);
double dp_ring_op_ns(struct dp_ring *r, uint32_t bulk, uint64_t items, uint32_t rec_len);
double dp_pingpong(volatile uint64_t *line, int role, uint64_t iters, uint64_t timeout_ns);
uint64_t dp_latency_produce(struct dp_ring *r, uint64_t n, uint64_t gap_ns, uint64_t timeout_ns);
uint64_t dp_latency_consume(struct dp_ring *r, uint64_t n, uint64_t *samples, uint64_t timeout_ns);
"""

SOURCES = ["ring.c", "ring_bench.c"]

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "datapath._dataplane",
    '#include "ring.h"\n#include "ring_bench.h"\n',
    sources=[f"native/{s}" for s in SOURCES],  # relative: setuptools refuses absolute paths
    include_dirs=[str(NATIVE), str(BPF)],
    extra_compile_args=["-O2", "-Wall", "-std=gnu11"],
    libraries=["rt"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
