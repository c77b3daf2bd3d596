/* count.bpf.c - the minimal parse-and-count XDP program.
 *
 * Parses Ethernet/VLAN, IPv4/IPv6 and UDP, counts packets to the data path's
 * port and all others in a per-CPU array, and passes everything. It is the
 * reference the steering program is measured against (same parsing, no
 * work), doctor's trial compile, and the fixture tests' program.
 * Tunable: -DDP_PORT=<udp port> (default DP_DEFAULT_PORT).
 */
#include <uapi/linux/bpf.h>
#include "wire.h"
#include "parsing_helpers.h"

#ifndef DP_PORT
#define DP_PORT DP_DEFAULT_PORT
#endif

enum { COUNT_DP_PORT = 0, COUNT_OTHER = 1, COUNT_MAX = 2 };

BPF_PERCPU_ARRAY(counts, __u64, COUNT_MAX);

int xdp_count(struct xdp_md *ctx)
{
    struct hdr_cursor c = { .pos = (void *)(long)ctx->data };
    __u32 key = udp_to_port(&c, (void *)(long)ctx->data_end, bpf_htons(DP_PORT)) ? COUNT_DP_PORT : COUNT_OTHER;
    __u64 *n = counts.lookup(&key);

    if (n)
        *n += 1;
    return XDP_PASS;
}
