/* wire.h - the request and response packets (UDP payloads), defined once.
 *
 * Every other side is generated from or checked against this file:
 *   - BPF programs and native C include it;
 *   - the cffi layout extension (native/ffi_wire.py) takes the text between
 *     the LAYOUT markers verbatim as its cdef;
 *   - datapath/wire.py's struct formats are proven equal, field by field,
 *     by tests/test_wire_layout.py.
 *
 * Byte order: little-endian for every multi-byte field (x86-64 and arm64
 * hosts read it natively; the XDP program never swaps). Fields sit at their
 * natural alignment, so the structs have no implicit padding; reserved
 * fields must be zero.
 */
#ifndef DP_WIRE_H
#define DP_WIRE_H

#ifndef __DP_CFFI__
#include <linux/types.h>
#endif

/* LAYOUT BEGIN */
#define DP_WIRE_MAGIC 0x31575044        /* "DPW1" read as little-endian bytes */
#define DP_WIRE_VERSION 2              /* 2: the request header ends with a tag */
#define DP_MAX_CHUNK_TOKENS 128          /* a chunk never carries more */
#define DP_MAX_RESP_BODY 1024            /* response body fits one MTU-1500 frame */
#define DP_DEFAULT_PORT 7878             /* UDP port the ingress listens on */
#define DP_REQ_TAGGED_LEN 48             /* the request header bytes its tag covers: those before it */
#define DP_TAG_KEY_LEN 16                /* a tenant's tag key (SipHash-2-4: 128 bits) */

/* kind */
#define DP_KIND_OPEN 1           /* announces a request: chunk_count, max_output_tokens */
#define DP_KIND_CHUNK 2          /* carries 1..128 prompt tokens */
#define DP_KIND_CLOSE 3          /* client is done with the session */
#define DP_KIND_COUNT_TOKENS 4   /* price the tokens, do not run them */
#define DP_KIND_RESPONSE 5       /* server to client */

/* flags */
#define DP_FLAG_TRACE 0x0001       /* request: carry per-stage stamps back; response: the body ends with a
                                      struct dp_resp_trace (absent if the body had no room for it) */
#define DP_FLAGS_KNOWN 0x0001      /* any other bit is invalid */

/* status (HTTP meanings) */
#define DP_STATUS_OK 200
#define DP_STATUS_BAD_REQUEST 400
#define DP_STATUS_CONFLICT 409     /* the request already ran on its session: a duplicate, not run again */
#define DP_STATUS_TOO_LARGE 413
#define DP_STATUS_UNPROCESSABLE 422
#define DP_STATUS_RATE_LIMITED 429
#define DP_STATUS_UNAVAILABLE 503
#define DP_N_STATUSES 7            /* answers counted by status: one slot each, in this order */

/* Request header: 56 bytes, then n_tokens uint32 token ids. tag: SipHash-2-4 of the 48 bytes
 * before it under the tenant's key (bpf/siphash.h), checked by the ingress when it requires
 * tags (Ingress.require_tags); any value otherwise. */
struct dp_req_hdr {
    __u32 magic;              /*  0 DP_WIRE_MAGIC */
    __u8  version;            /*  4 DP_WIRE_VERSION */
    __u8  kind;               /*  5 DP_KIND_* */
    __u16 flags;              /*  6 DP_FLAG_* */
    __u32 tenant;             /*  8 API key id */
    __u32 max_output_tokens;  /* 12 declared by the client */
    __u64 session_id;         /* 16 */
    __u64 request_id;         /* 24 */
    __u16 chunk_index;        /* 32 0-based, < chunk_count */
    __u16 chunk_count;        /* 34 >= 1 */
    __u16 n_tokens;           /* 36 CHUNK, COUNT_TOKENS: 1..128; OPEN, CLOSE: 0 */
    __u16 reserved;           /* 38 zero */
    __u64 send_ns;            /* 40 client's CLOCK_MONOTONIC stamp at send */
    __u64 tag;                /* 48 SipHash-2-4(tenant key, bytes 0..47) */
};

/* Response header: 40 bytes, then body_len bytes of body. */
struct dp_resp_hdr {
    __u32 magic;              /*  0 DP_WIRE_MAGIC */
    __u8  version;            /*  4 DP_WIRE_VERSION */
    __u8  kind;               /*  5 DP_KIND_RESPONSE */
    __u16 flags;              /*  6 DP_FLAG_* */
    __u32 tenant;             /*  8 */
    __u16 status;             /* 12 DP_STATUS_* */
    __u16 body_len;           /* 14 <= DP_MAX_RESP_BODY */
    __u64 session_id;         /* 16 */
    __u64 request_id;         /* 24 */
    __u64 send_ns;            /* 32 echoed from the request */
};

/* With DP_FLAG_TRACE in a response's flags, the last 40 bytes of its body:
 * where the request's time went (CLOCK_MONOTONIC ns, the client's clock when
 * client and server share a host). */
struct dp_resp_trace {
    __u64 t_xdp;              /*  0 its first chunk at the XDP program (0: the UDP ingress) */
    __u64 t_first_lane;       /*  8 its first piece placed in a worker's lane (0: never ran) */
    __u64 t_done;             /* 16 the router saw its last completion, or decided to refuse it */
    __u64 t_egress;           /* 24 the responder built this packet */
    __u16 worker;             /* 32 0xffff: none */
    __u16 pool;               /* 34 0xffff: none */
    __u32 reserved;           /* 36 zero */
};
/* LAYOUT END */

#define DP_REQ_HDR_LEN 56
#define DP_RESP_TRACE_LEN 40
#define DP_RESP_HDR_LEN 40
_Static_assert(sizeof(struct dp_req_hdr) == DP_REQ_HDR_LEN, "request header is 56 bytes");
_Static_assert(sizeof(struct dp_resp_hdr) == DP_RESP_HDR_LEN, "response header is 40 bytes");
_Static_assert(sizeof(struct dp_resp_trace) == DP_RESP_TRACE_LEN, "response trace is 40 bytes");
_Static_assert(__builtin_offsetof(struct dp_req_hdr, send_ns) == 40, "send_ns at 40");
_Static_assert(__builtin_offsetof(struct dp_req_hdr, tag) == DP_REQ_TAGGED_LEN, "the tag follows what it covers");
_Static_assert(__builtin_offsetof(struct dp_resp_hdr, send_ns) == 32, "send_ns at 32");

/* A status's count slot (by_status[DP_N_STATUSES]): 200 400 409 413 422 429 503, any other as 503's. */
static inline int dp_status_slot(__u16 status)
{
    switch (status) {
    case DP_STATUS_OK: return 0;
    case DP_STATUS_BAD_REQUEST: return 1;
    case DP_STATUS_CONFLICT: return 2;
    case DP_STATUS_TOO_LARGE: return 3;
    case DP_STATUS_UNPROCESSABLE: return 4;
    case DP_STATUS_RATE_LIMITED: return 5;
    default: return 6;
    }
}

/* One of the statuses above (the last slot takes any other too). */
static inline int dp_status_known(__u16 status)
{
    return status == DP_STATUS_UNAVAILABLE || dp_status_slot(status) != DP_N_STATUSES - 1;
}

#endif /* DP_WIRE_H */
