/* steer.h - what the steering program and user space share: drop reasons,
 * policy modes and the control-map values (libbpf-bootstrap's x.h).
 *
 * The ingress cffi extension (native/ffi_ingress.py) takes the text between
 * the LAYOUT markers verbatim as its cdef, so Python reads the reason names
 * and the struct layouts from here; there is no second list to drift.
 * The ring-buffer record is struct dp_chunk (native/chunk.h) cut after its
 * tokens, rounded up to 16, 32, 64 or 128: XDP fills the header fields it
 * knows and the tokens, the consumer stamps t_consumer and copies the header
 * and the n_tokens tokens downstream.
 */
#ifndef DP_STEER_H
#define DP_STEER_H

#ifndef __DP_CFFI__
#include <linux/types.h>
#endif

/* LAYOUT BEGIN */
#define DP_MAX_QUEUES 8          /* ring buffers the program can declare */
#define DP_MAX_LOCAL_ADDRS 4     /* the service's IPv4 addresses (dp_policy.local_addrs) */
#define DP_MAX_HOST_ADDRS 256    /* the host's own IPv4 addresses refused as a source (host_sources) */
#define DP_LAT_BUCKETS 65        /* log2 buckets: 0, then 2^(b-1) .. 2^b - 1 ns */

/* Why a packet to the data path's port was dropped (index of the `drops` per-CPU array). */
enum dp_drop {
    DP_DROP_TRUNCATED = 0,       /* shorter than the request header, or than UDP or IP claims */
    DP_DROP_BAD_MAGIC = 1,
    DP_DROP_BAD_VERSION = 2,
    DP_DROP_BAD_KIND = 3,
    DP_DROP_BAD_FLAGS = 4,       /* unknown flag bits or reserved != 0 */
    DP_DROP_BAD_CHUNK = 5,       /* chunk_count 0 or chunk_index >= chunk_count */
    DP_DROP_BAD_TOKENS = 6,      /* n_tokens outside 1..128 (chunk) or != 0 (open/close) */
    DP_DROP_LENGTH = 7,          /* UDP length != header + 4 * n_tokens, or more than the IP length */
    DP_DROP_FRAGMENT = 8,        /* an IP fragment of a datagram to our port */
    DP_DROP_RATE_LIMITED = 9,    /* over the tenant's token bucket (answered 429 by XDP_TX) */
    DP_DROP_RING_FULL = 10,      /* the queue's ring buffer had no room */
    DP_DROP_CUT_REQUEST = 11,    /* a later chunk of a request the bucket already cut (answered 429 once) */
    DP_DROP_IPV6 = 12,           /* a valid request over IPv6: answered 400 by XDP_TX, since a response goes
                                  * to the IPv4 address its chunks carry (chunk.h client_ip) */
    DP_DROP_UNKNOWN_TENANT = 13, /* tags required and the tenant has no key (tenant_keys): never answered */
    DP_DROP_BAD_TAG = 14,        /* tags required and the tag is not the header's under the tenant's key */
    DP_DROP_BAD_CHECKSUM = 15,   /* the IPv4 header's checksum is wrong, or an IPv6 UDP checksum is 0 */
    DP_DROP_IP_OPTIONS = 16,     /* an IPv4 request with options (a request never needs them) */
    DP_DROP_BAD_SOURCE = 17,     /* an IPv4 source no answer may go to: 0/8, 127/8, 224/3, the destination */
    DP_DROP_MAX = 18
};

/* Other events (index of the `events` per-CPU array). Records queued are
 * counted per queue only (`queue_pkts`): one counter less per chunk. */
enum dp_event {
    DP_EV_PASS = 0,              /* not ours: XDP_PASS, untouched */
    DP_EV_REPLY_429 = 1,         /* a 429 went back to the client with XDP_TX */
    DP_EV_MAX = 2
};

/* Queue choice (policy[0].mode). Pins and tenant routes fall back to the hash. */
enum dp_policy_mode {
    DP_POLICY_SESSION_HASH = 0,  /* hash of session_id: a session stays on one queue */
    DP_POLICY_SESSION_PIN = 1,   /* the `pins` map: session_id -> queue */
    DP_POLICY_TENANT = 2         /* the `tenant_queue` map: tenant -> queue */
};

struct dp_policy {
    __u32 mode;                  /* enum dp_policy_mode */
    __u32 rate_limits;           /* buckets set (the others' counts one); 0 skips the bucket lookup (~40 ns) */
    __u32 stamp_validated;       /* stamp t_xdp_in, the request validated (tracing: a clock read, ~30 ns) */
    __u32 require_tags;          /* drop a request whose tag is not its tenant's (tenant_keys): ~65 ns */
    __u32 local_only;            /* n > 0: take only IPv4 datagrams to one of the n local_addrs
                                    (Ingress.accept_only); the rest, and IPv6, pass to the kernel:
                                    transit traffic is not ours */
    __u32 local_addrs[DP_MAX_LOCAL_ADDRS];    /* network order; in the policy, not a map: compared, not looked up (a
                                                 hash map's lookup cost ~26 ns a chunk) */
    __u32 pad;                   /* 0 (the mask below is 8-byte aligned) */
    __u64 host_source_bits;      /* a bit for each address in the host_sources map (refused as a
                                    source: the host's own; Ingress.attach reads them from its
                                    interface's namespace), DP_SOURCE_BIT's: a source without its bit
                                    set is none of them, not looked up (the lookup costs ~16-21 ns) */
};

/* A tenant's 128-bit tag key (tenant_keys), as the two little-endian halves SipHash reads. */
struct dp_tenant_key {
    __u64 k0;
    __u64 k1;
};

/* Per-tenant token bucket as GCRA (a virtual clock), so XDP never divides:
 * a chunk of n tokens is admitted if tat - burst_ns <= now, then
 * tat = max(tat, now) + n * ns_per_token. Python sets ns_per_token =
 * 60e9 / tokens_per_minute and burst_ns = burst_tokens * ns_per_token. */
struct dp_bucket {
    __u64 ns_per_token;
    __u64 burst_ns;
    __u64 tat;                   /* theoretical arrival time, ns CLOCK_MONOTONIC */
};

#define DP_SESSION_HASH_MUL 0x9E3779B97F4A7C15   /* (hex: unsigned 64-bit) queue = (sid * MUL >> 32) % queues */
#define DP_SOURCE_HASH_MUL 0x9E3779B1             /* (hex: unsigned 32-bit) an IPv4 address's bit in
                                                     host_source_bits: (addr * MUL) >> 26, the address
                                                     in network order read as a u32 */
/* LAYOUT END */

#endif /* DP_STEER_H */
