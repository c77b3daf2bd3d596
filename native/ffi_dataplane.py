"""cffi builder for datapath._dataplane: the shared-memory ring (and, as they land,
the router and its policies). This file is the one place their cdefs live."""
import pathlib

from cffi import FFI

NATIVE = pathlib.Path(__file__).resolve().parent
BPF = NATIVE.parent / "bpf"

def layout(path: pathlib.Path) -> str:
    """A header's LAYOUT section, verbatim: the records have one definition."""
    return path.read_text().split("/* LAYOUT BEGIN */", 1)[1].split("/* LAYOUT END */", 1)[0]


CDEF = "typedef uint8_t __u8; typedef uint16_t __u16; typedef uint32_t __u32; typedef uint64_t __u64;"
CDEF += layout(BPF / "wire.h") + layout(NATIVE / "chunk.h") + """
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

enum dp_batching { DP_BATCH_DYNAMIC = 0, DP_BATCH_STATIC = 1 };
struct dp_router_config {
    uint32_t batching, token_budget, max_chunks, max_batch_size;
    uint64_t batch_timeout_ns;
    uint32_t max_requests, pool_chunks;
    uint64_t seed;
};
struct dp_worker_stats {
    uint64_t batches, records, tokens, decode_steps, completions;
    uint32_t depth, busy, decoding, up;
    uint64_t lane_depth, lane_full_events;
};
struct dp_router_stats {
    uint64_t chunks_in, requests_in, control_in, bad_chunks, duplicate_chunks, table_full;
    uint64_t batches, records_out, tokens_out, decode_out, splits;
    uint64_t completions, responses, egress_stalls, input_stalls, loops;
    uint32_t active_requests, pool_free;
};
struct dp_router;
struct dp_router *dp_router_create(const struct dp_router_config *cfg, const char *policy, double policy_param,
                                   int *err);
void dp_router_destroy(struct dp_router *rt);
int dp_router_add_input(struct dp_router *rt, struct dp_ring *in);
int dp_router_add_worker(struct dp_router *rt, struct dp_ring *lane, struct dp_ring *done, uint32_t weight);
int dp_router_add_zmq_worker(struct dp_router *rt, const char *endpoint, uint32_t weight);
int dp_router_set_egress(struct dp_router *rt, struct dp_ring *egress);
int dp_router_set_policy(struct dp_router *rt, const char *policy, double param);
int dp_router_set_weight(struct dp_router *rt, uint32_t worker, uint32_t weight);
int dp_router_set_up(struct dp_router *rt, uint32_t worker, int up);
int dp_router_set_batching(struct dp_router *rt, uint32_t batching, uint32_t token_budget, uint32_t max_chunks,
                           uint32_t max_batch_size, uint64_t batch_timeout_ns);
uint32_t dp_router_poll(struct dp_router *rt);
int dp_router_start(struct dp_router *rt, int cpu);
void dp_router_stop(struct dp_router *rt);
void dp_router_get_stats(struct dp_router *rt, struct dp_router_stats *s);
int dp_router_worker_stats(struct dp_router *rt, uint32_t worker, struct dp_worker_stats *s);
double dp_policy_bench(const char *policy, uint32_t n_workers, uint64_t decisions);
const char *dp_policy_name(unsigned i);
#define DP_MAX_WORKERS 256
struct dp_workers {
    uint32_t n, total_depth;
    uint64_t generation;
    uint32_t depth[256], weight[256];
    uint8_t up[256];
};
int dp_policy_map(const char *policy, double param, uint64_t seed, const struct dp_workers *w,
                  const uint64_t *sessions, int32_t *out, uint32_t n);
"""

SOURCES = ["ring.c", "ring_bench.c", "router.c", "policies/registry.c", "policies/round_robin.c",
           "policies/least_loaded.c", "policies/power_of_two.c", "policies/affinity.c", "policies/weighted.c"]

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "datapath._dataplane",
    '#include "ring.h"\n#include "ring_bench.h"\n#include "router.h"\n',
    sources=[f"native/{s}" for s in SOURCES],  # relative: setuptools refuses absolute paths
    include_dirs=[str(NATIVE), str(BPF)],
    extra_compile_args=["-O2", "-Wall", "-std=gnu11"],
    libraries=["rt", "pthread", "zmq"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
