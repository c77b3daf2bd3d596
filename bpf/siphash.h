/* siphash.h - a request header's tag: SipHash-2-4 (Aumasson and Bernstein, 2012) of its first
 * DP_REQ_TAGGED_LEN bytes under its tenant's 128-bit key, defined once for the XDP program
 * (steer.bpf.c) and native C (loadgen.c); datapath/wire.py's request_tag is its Python twin,
 * and tests/test_wire.py checks the three against each other and the paper's test vector.
 *
 * The message is always 48 bytes (six little-endian words, no partial block), so the loop has a
 * constant bound the verifier unrolls and no tail handling is needed.
 */
#ifndef DP_SIPHASH_H
#define DP_SIPHASH_H

#include "wire.h"

#ifndef __always_inline
#define __always_inline inline __attribute__((always_inline))
#endif

#define DP_SIP_ROTL(x, b) (((x) << (b)) | ((x) >> (64 - (b))))
#define DP_SIP_ROUND(v0, v1, v2, v3) do {                                              \
        v0 += v1; v1 = DP_SIP_ROTL(v1, 13); v1 ^= v0; v0 = DP_SIP_ROTL(v0, 32);        \
        v2 += v3; v3 = DP_SIP_ROTL(v3, 16); v3 ^= v2;                                  \
        v0 += v3; v3 = DP_SIP_ROTL(v3, 21); v3 ^= v0;                                  \
        v2 += v1; v1 = DP_SIP_ROTL(v1, 17); v1 ^= v2; v2 = DP_SIP_ROTL(v2, 32);        \
    } while (0)

/* w: the header's first DP_REQ_TAGGED_LEN bytes as six words (a packet pointer in XDP, already
 * bounds-checked; an aligned copy in C); k0, k1: the key's two little-endian halves */
static __always_inline __u64 dp_req_tag(const __u64 *w, __u64 k0, __u64 k1)
{
    __u64 v0 = k0 ^ 0x736f6d6570736575ULL, v1 = k1 ^ 0x646f72616e646f6dULL;
    __u64 v2 = k0 ^ 0x6c7967656e657261ULL, v3 = k1 ^ 0x7465646279746573ULL;
    const __u64 last = (__u64)DP_REQ_TAGGED_LEN << 56;   /* the length byte; no bytes left over */

#ifdef __clang__
#pragma unroll
#endif
    for (int i = 0; i < DP_REQ_TAGGED_LEN / 8; i++) {
        __u64 m = w[i];
        v3 ^= m;
        DP_SIP_ROUND(v0, v1, v2, v3);
        DP_SIP_ROUND(v0, v1, v2, v3);
        v0 ^= m;
    }
    v3 ^= last;
    DP_SIP_ROUND(v0, v1, v2, v3);
    DP_SIP_ROUND(v0, v1, v2, v3);
    v0 ^= last;
    v2 ^= 0xff;
    DP_SIP_ROUND(v0, v1, v2, v3);
    DP_SIP_ROUND(v0, v1, v2, v3);
    DP_SIP_ROUND(v0, v1, v2, v3);
    DP_SIP_ROUND(v0, v1, v2, v3);
    return v0 ^ v1 ^ v2 ^ v3;
}

#endif /* DP_SIPHASH_H */
