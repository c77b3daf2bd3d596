/* steer_maps.h - the steering program's maps (bcc declarations), by role.
 *
 * Map methods (x.lookup, x.ringbuf_reserve) are called only from steer.bpf.c:
 * bcc rewrites them in the main file, not in included headers.
 *
 * Tunables arrive as -D cflags from datapath/ingress.py:
 *   DP_QUEUES      ring buffers, one per queue (1..DP_MAX_QUEUES)
 *   DP_RING_PAGES  pages per ring buffer (a power of two)
 *   DP_PORT        the UDP port the program owns
 */
#ifndef DP_STEER_MAPS_H
#define DP_STEER_MAPS_H

#include "steer.h"

#ifndef DP_QUEUES
#define DP_QUEUES 4
#endif
#ifndef DP_RING_PAGES
#define DP_RING_PAGES 256
#endif
#ifndef DP_PORT
#define DP_PORT DP_DEFAULT_PORT
#endif
#if DP_QUEUES < 1 || DP_QUEUES > DP_MAX_QUEUES
#error "DP_QUEUES must be 1..DP_MAX_QUEUES"
#endif

/* counters, read by name from Python */
BPF_PERCPU_ARRAY(drops, __u64, DP_DROP_MAX);
BPF_PERCPU_ARRAY(events, __u64, DP_EV_MAX);
BPF_PERCPU_ARRAY(queue_pkts, __u64, DP_QUEUES);

/* XDP-to-consumer latency, log2 ns: the C consumer mmaps this array and counts
 * into it with plain stores, so `datapath ingress stats` in another process
 * reads it like the counters. The program itself never touches it. */
BPF_F_TABLE("array", __u32, __u64, lat_hist, DP_LAT_BUCKETS, BPF_F_MMAPABLE);

/* control, rewritten by Python while traffic flows */
BPF_ARRAY(policy, struct dp_policy, 1);
BPF_HASH(pins, __u64, __u32, 65536);          /* session_id -> queue */
BPF_HASH(tenant_queue, __u32, __u32, 4096);   /* tenant -> queue */
/* not preallocated: a bucket set_rate replaces is freed after an RCU grace period, so a CPU still
 * holding it spends into the old one; preallocated, the element went straight back to the free
 * list, and another tenant's new bucket could take it under that CPU's compare-and-swap */
BPF_F_TABLE("hash", __u32, struct dp_bucket, buckets, 4096, BPF_F_NO_PREALLOC);
BPF_HASH(tenant_keys, __u32, struct dp_tenant_key, 65536);   /* tenant -> its tag key (require_tags) */
/* this host's own IPv4 addresses and broadcasts (network order -> 1), refused as a source: the
 * kernel's input drops them, and a request from one would be answered to a local port
 * (Ingress.refuse_sources; looked up only for a source whose bit policy.host_source_bits has) */
BPF_HASH(host_sources, __u32, __u8, DP_MAX_HOST_ADDRS);
/* the one bucket every tenant without a bucket of its own shares (ns_per_token 0: none), so made-up
 * tenant ids are not a way past the limits */
BPF_ARRAY(others_bucket, struct dp_bucket, 1);
BPF_TABLE("lru_hash", struct dp_cut_key, struct dp_cut, cuts, DP_CUTS);   /* requests the bucket cut (chunk.h, dp_cut_key) */

/* the queues: one ring buffer each (bcc needs one declaration per map) */
BPF_RINGBUF_OUTPUT(ring0, DP_RING_PAGES);
#if DP_QUEUES > 1
BPF_RINGBUF_OUTPUT(ring1, DP_RING_PAGES);
#endif
#if DP_QUEUES > 2
BPF_RINGBUF_OUTPUT(ring2, DP_RING_PAGES);
#endif
#if DP_QUEUES > 3
BPF_RINGBUF_OUTPUT(ring3, DP_RING_PAGES);
#endif
#if DP_QUEUES > 4
BPF_RINGBUF_OUTPUT(ring4, DP_RING_PAGES);
#endif
#if DP_QUEUES > 5
BPF_RINGBUF_OUTPUT(ring5, DP_RING_PAGES);
#endif
#if DP_QUEUES > 6
BPF_RINGBUF_OUTPUT(ring6, DP_RING_PAGES);
#endif
#if DP_QUEUES > 7
BPF_RINGBUF_OUTPUT(ring7, DP_RING_PAGES);
#endif

#endif /* DP_STEER_MAPS_H */
