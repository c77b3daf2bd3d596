/* ring_floor.bpf.c - the least a program that steers into a BPF ring buffer pays.
 *
 * count.bpf.c's parse, then, for a packet to the data path's port, the fixed
 * costs steer.bpf.c cannot do without: a record of the 16-token size reserved
 * in ring0, stamped with one clock read (t_xdp), submitted, and counted in
 * queue_pkts. No validation, no tokens, no policy or bucket. With steer.bpf.c's
 * maps (steer_maps.h), so its consumer and counters (datapath.ingress) drain
 * and read it. bench ingress measures it beside steer_ns: steer_ns minus this
 * is the steering program's own work; this minus xdp_count_ns is the kernel's
 * ring buffer and clock.
 * Tunables (-D): as steer.bpf.c.
 */
#include <uapi/linux/bpf.h>
#include "wire.h"
#include "chunk.h"
#include "parsing_helpers.h"
#include "steer_maps.h"

int xdp_ring_floor(struct xdp_md *ctx)
{
    struct hdr_cursor c = { .pos = (void *)(long)ctx->data };
    struct dp_chunk *rec;
    __u32 q = 0, reason = DP_DROP_RING_FULL;
    __u64 *n;

    if (!udp_to_port(&c, (void *)(long)ctx->data_end, bpf_htons(DP_PORT)))
        return XDP_PASS;

    rec = ring0.ringbuf_reserve(DP_CHUNK_HDR_LEN + 16 * 4);
    if (!rec) {
        n = drops.lookup(&reason);
        if (n)
            *n += 1;
        return XDP_DROP;
    }
    /* what the consumer reads: no tokens, no send stamp */
    rec->n_tokens = 0;
    rec->queue = 0;
    rec->t_send = 0;
    rec->t_xdp = bpf_ktime_get_ns();
    ring0.ringbuf_submit(rec, BPF_RB_NO_WAKEUP);
    n = queue_pkts.lookup(&q);
    if (n)
        *n += 1;
    return XDP_DROP;
}
