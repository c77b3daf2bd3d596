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

struct dp_chunk {
    __u64 session_id;          /*  0 */
    __u64 request_id;          /*  8 */
    __u32 tenant;              /* 16 */
    __u32 max_output_tokens;   /* 20 */
    __u16 chunk_index;         /* 24 index in the request after re-chunking */
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
    __u64 t_worker;            /* 80 worker picked the batch up */
    __u32 flags;               /* 88 DP_FLAG_* from the wire */
    __u32 reserved;            /* 92 */
    __u32 tokens[DP_MAX_CHUNK_TOKENS]; /* 96 */
};
/* LAYOUT END */

_Static_assert(sizeof(struct dp_chunk) == DP_CHUNK_LEN, "chunk record size");
_Static_assert(__builtin_offsetof(struct dp_chunk, tokens) == DP_CHUNK_HDR_LEN, "tokens follow the header");
_Static_assert(DP_CHUNK_HDR_LEN % 32 == 0, "header is a whole number of half cache lines");

#endif /* DP_CHUNK_H */
