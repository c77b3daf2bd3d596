/* chunk.h - the chunk record that travels from ingress to the workers, defined once.
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

#include <stdint.h>
#include "wire.h"

/* LAYOUT BEGIN */
#define DP_CHUNK_HDR_LEN 96
#define DP_CHUNK_LEN 608                  /* header + DP_MAX_CHUNK_TOKENS tokens */

struct dp_chunk {
    uint64_t session_id;          /*  0 */
    uint64_t request_id;          /*  8 */
    uint32_t tenant;              /* 16 */
    uint32_t max_output_tokens;   /* 20 */
    uint16_t chunk_index;         /* 24 index in the request after re-chunking */
    uint16_t chunk_count;         /* 26 */
    uint16_t n_tokens;            /* 28 1..DP_MAX_CHUNK_TOKENS (0 for open/close) */
    uint8_t  kind;                /* 30 DP_KIND_* */
    uint8_t  queue;               /* 31 ingress queue it arrived on */
    uint32_t batch_seq;           /* 32 micro-batch number on its lane (router) */
    uint16_t batch_len;           /* 36 chunks in that micro-batch */
    uint16_t batch_pos;           /* 38 position in it */
    uint64_t t_send;              /* 40 client send stamp (from the wire) */
    uint64_t t_xdp;               /* 48 XDP program */
    uint64_t t_consumer;          /* 56 ring-buffer consumer */
    uint64_t t_router;            /* 64 router dequeued it */
    uint64_t t_lane;              /* 72 placed in its worker's lane */
    uint64_t t_worker;            /* 80 worker picked the batch up */
    uint32_t flags;               /* 88 DP_FLAG_* from the wire */
    uint32_t reserved;            /* 92 */
    uint32_t tokens[DP_MAX_CHUNK_TOKENS]; /* 96 */
};
/* LAYOUT END */

_Static_assert(sizeof(struct dp_chunk) == DP_CHUNK_LEN, "chunk record size");
_Static_assert(__builtin_offsetof(struct dp_chunk, tokens) == DP_CHUNK_HDR_LEN, "tokens follow the header");
_Static_assert(DP_CHUNK_HDR_LEN % 32 == 0, "header is a whole number of half cache lines");

#endif /* DP_CHUNK_H */
