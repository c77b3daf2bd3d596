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
    void *data_end = (void *)(long)ctx->data_end;
    struct hdr_cursor c = { .pos = (void *)(long)ctx->data };
    struct ethhdr *eth;
    struct iphdr *iph;
    struct ipv6hdr *ip6h;
    struct udphdr *udph;
    int proto, frag = 0;
    __u32 key = COUNT_OTHER;
    __u64 *n;

    proto = parse_ethhdr(&c, data_end, &eth);
    if (proto == bpf_htons(ETH_P_IP))
        proto = parse_iphdr(&c, data_end, &iph, &frag);
    else if (proto == bpf_htons(ETH_P_IPV6))
        proto = parse_ip6hdr(&c, data_end, &ip6h);
    else
        proto = -1;
    if (proto == IPPROTO_UDP && !frag && parse_udphdr(&c, data_end, &udph) >= 0 &&
        udph->dest == bpf_htons(DP_PORT))
        key = COUNT_DP_PORT;

    n = counts.lookup(&key);
    if (n)
        *n += 1;
    return XDP_PASS;
}
