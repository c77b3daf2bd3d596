/* chunk.h - the chunk record that travels from ingress to the workers, defined once.
 *
 * Types are the kernel's (__u32...) so BPF programs can include it too.
 *
 * One record per chunk of at most DP_MAX_CHUNK_TOKENS tokens. The ingress
 * consumer fills it from the wire header (bpf/wire.h) and the XDP stamp; the
 * router stamps it and groups records into micro-batches; a lane carries a
 * micro-batch as consecutive records; the worker reads them in place.
 * Stamps are CLOCK_MONOTONIC ns (bpf_ktime_get_ns() is the same clock), 0 if
 * a stage did not run.
 */
#ifndef DP_CHUNK_H
#define DP_CHUNK_H

#include "wire.h"

/* LAYOUT BEGIN */
#define DP_CHUNK_HDR_LEN 96
#define DP_CHUNK_LEN 608                  /* header + DP_MAX_CHUNK_TOKENS tokens */
#define DP_KIND_DECODE 6                  /* router -> worker: one decode step, no tokens */
#define DP_CHUNK_F_FINAL 0x8000           /* last prefill piece of its request: sample after it */
#define DP_CHUNK_F_MOVED 0x4000           /* its session last ran on another worker (or the router does not
                                             know where): a copy this worker holds may be stale */
#define DP_CHUNK_F_REPLAY 0x2000          /* failover replays its request: its own turn may be in the store */
#define DP_CHUNK_F_RETAKE 0x1000          /* with REPLAY, on the first record of a client's retry of a try lost
                                             in a failover (router.c, lost_retake), sent under that try's stamp:
                                             the request begins again here, whatever of that try a worker holds */
#define DP_MAX_BATCH_CHUNKS 64            /* records in one micro-batch, at most */
#define DP_MAX_OUTPUT_TOKENS 256          /* output tokens a response carries (1 KiB body) */
#define DP_CE_EOS 1                       /* completion entry: the model ended the sequence */
#define DP_CE_KV_FULL 2                   /* ... with 503: a worker without a store, its KV full, took no new session */
#define DP_CE_NO_STORE 4                  /* ... from a worker without a snapshot store: what it runs of a
                                             session lives only there (the router's kv_homes, failover) */
#define DP_CE_STORE 8                     /* ... with 503: the worker's snapshot store failed on the session */
#define DP_CE_KV_LOST 16                  /* ... with 503: the session's stored KV cannot be used (a corrupt or
                                             foreign delta, a damaged record, a chain too large for a record) */
#define DP_CE_UNANSWERED 0x8000           /* the router's own: an entry a completion did not cover (no worker
                                             sets it) */

struct dp_chunk {
    __u64 session_id;          /*  0 */
    __u64 request_id;          /*  8 */
    __u32 tenant;              /* 16 */
    __u32 max_output_tokens;   /* 20 */
    __u16 chunk_index;         /* 24 the client chunk its tokens come from (re-chunked pieces share it) */
    __u16 chunk_count;         /* 26 */
    __u16 n_tokens;            /* 28 1..DP_MAX_CHUNK_TOKENS (0 for open/close) */
    __u8   kind;                /* 30 DP_KIND_* */
    __u8   queue;               /* 31 ingress queue it arrived on */
    __u32 batch_seq;           /* 32 micro-batch number on its lane (router) */
    __u16 batch_len;           /* 36 chunks in that micro-batch */
    __u16 batch_pos;           /* 38 position in it */
    __u64 t_send;              /* 40 client send stamp (from the wire) */
    __u64 t_xdp;               /* 48 XDP program */
    __u64 t_consumer;          /* 56 ring-buffer consumer */
    __u64 t_router;            /* 64 router dequeued it */
    __u64 t_lane;              /* 72 placed in its worker's lane */
    __u64 t_xdp_in;            /* 80 XDP: the request validated, before its steering and its ring-buffer write */
    __u16 flags;               /* 88 DP_FLAG_* from the wire, DP_CHUNK_F_* */
    __u16 client_port;         /* 90 the client's UDP port (network order): where the response goes */
    __u32 client_ip;           /* 92 the client's IPv4 address (network order), 0 if unknown */
    __u32 tokens[DP_MAX_CHUNK_TOKENS]; /* 96 */
};

/* Worker -> router, one per micro-batch: entry i answers the batch's record i. */
struct dp_completion_entry {
    __u64 request_id;          /*  0 */
    __u32 token;               /*  8 token sampled after this record (final prefill, decode) */
    __u16 status;              /* 12 DP_STATUS_* */
    __u16 flags;               /* 14 DP_CE_* */
};

struct dp_completion {
    __u32 batch_seq;           /*  0 */
    __u16 worker;              /*  4 */
    __u16 n;                   /*  6 entries used */
    __u64 t_start;             /*  8 worker step start */
    __u64 t_end;               /* 16 worker step end */
    __u64 kv_bytes;            /* 24 KV cache bytes resident after the step */
    struct dp_completion_entry e[DP_MAX_BATCH_CHUNKS]; /* 32 */
};

/* Router -> egress, one per finished (or refused) request. */
struct dp_response_rec {
    __u64 request_id;          /*  0 */
    __u64 session_id;          /*  8 */
    __u32 tenant;              /* 16 */
    __u16 status;              /* 20 DP_STATUS_* */
    __u16 n_out;               /* 22 output tokens in tokens[] */
    __u64 t_send;              /* 24 client stamp of the first chunk */
    __u64 t_xdp;               /* 32 first chunk at XDP */
    __u64 t_first_lane;        /* 40 first piece placed in a lane */
    __u64 t_done;              /* 48 router wrote the response (after the last completion; a full
                                *    egress ring's wait included) */
    __u16 worker;              /* 56 */
    __u16 client_port;         /* 58 copied from the request's first chunk */
    __u32 client_ip;           /* 60 */
    __u16 body_len;            /* 64 bytes of body[] when n_out is 0 (admission's JSON), else unused */
    __u16 pool;                /* 66 the worker pool it ran on (0xffff: none) */
    __u16 flags;               /* 68 DP_FLAG_TRACE if the request asked for it */
    __u16 reserved;            /* 70 zero */
    union {                    /* 72 the response body: output tokens, or a JSON document */
        __u32 tokens[DP_MAX_OUTPUT_TOKENS];
        __u8 body[DP_MAX_RESP_BODY];
    };
};

/* Key of the steering program's `cuts` LRU map (value: struct dp_cut), written by XDP, read by
 * the router: a request of several chunks whose chunk, or OPEN, the tenant's bucket refused. That
 * record is answered 429; the request's later chunks, for DP_CUT_TTL_NS, are dropped uncharged
 * and unanswered, but for a client's retry of it; and the router, finding the key when what did
 * pass of it expires, drops that without a 400 (router.c, expire_stalled). The router writes
 * cuts too, for a request it answered before all its chunks came (router.c, cut_at_xdp). */
struct dp_cut_key {
    __u64 session_id;
    __u64 request_id;
    __u32 tenant;
    __u32 pad;                   /* 0: the key is hashed as bytes */
};
struct dp_cut {
    __u64 t_cut;                 /* CLOCK_MONOTONIC of the cut (bpf_ktime_get_ns) */
    __u64 try_sent;              /* the try it cut: the client's send stamp of its record (XDP) or of
                                  * its first (the router), the low bit 1 if that record was an OPEN */
    __u64 retry_sent;            /* 0, or the send stamp (even) of the retry that passed: a record that
                                  * opens the request again, sent later than the try (an OPEN; or,
                                  * unless the try began with one, a first chunk). The retry's records,
                                  * sent from then on, pass; the try's stragglers are still dropped */
};
#define DP_CUTS 16384            /* cut requests remembered; the oldest go first */
#define DP_CUT_TTL_NS 2000000000ull   /* how long a cut stands: past it, the same ids are a new request */
/* LAYOUT END */

/* A client's try of a request, as the router's done cache and the cuts keep it: its first record's
 * send stamp (to the even ns), the low bit 1 if that record was an OPEN. */
#define DP_TRY_OF(sent, by_open) (((sent) & ~1ull) | (__u64)!!(by_open))
/* Does a record (kind, chunk_index, send stamp) open again the request whose try is `try`, sent
 * later: a client's retry under the same ids, not one of the try's stragglers or repeats? An OPEN
 * does; a first chunk or a CLOSE unless the try began with an OPEN (whose own first chunk follows
 * it). A client that stamps nothing (0) cannot retry so. One rule, which the router's done cache
 * and live requests and the steering program's cuts all ask. */
#define DP_REOPENS(kind, chunk_index, sent, try)                                                       \
    (((kind) == DP_KIND_OPEN ||                                                                       \
      (!((try) & 1) && ((kind) == DP_KIND_CLOSE || ((kind) == DP_KIND_CHUNK && !(chunk_index))))) && \
     ((sent) & ~1ull) > ((try) & ~1ull))

/* A request whose refusal at XDP cuts it (dp_cut_key): one of several chunks, refused at a chunk or
 * its OPEN; a CLOSE or a COUNT_TOKENS never is. The steering program and the router both ask. */
#define DP_CUTTABLE(kind, chunk_count) \
    ((chunk_count) > 1 && ((kind) == DP_KIND_CHUNK || (kind) == DP_KIND_OPEN))

_Static_assert(sizeof(struct dp_chunk) == DP_CHUNK_LEN, "chunk record size");
_Static_assert(__builtin_offsetof(struct dp_chunk, tokens) == DP_CHUNK_HDR_LEN, "tokens follow the header");
_Static_assert(DP_CHUNK_HDR_LEN % 32 == 0, "header is a whole number of half cache lines");
_Static_assert(sizeof(struct dp_completion) == 32 + 16 * DP_MAX_BATCH_CHUNKS, "completion record size");
_Static_assert(sizeof(struct dp_response_rec) == 72 + DP_MAX_RESP_BODY, "response record size");
_Static_assert(4 * DP_MAX_OUTPUT_TOKENS == DP_MAX_RESP_BODY, "output tokens fill the body exactly");

#endif /* DP_CHUNK_H */
