/* steer.bpf.c - the XDP ingress: parse, validate, rate-limit and steer request
 * chunks into per-queue BPF ring buffers.
 *
 * Ethernet (+1 VLAN) / IPv4 (options) or IPv6 / UDP to DP_PORT, then the
 * request header of bpf/wire.h. Anything else is XDP_PASS, untouched, so the
 * host's other traffic keeps working. A request that fails validation is
 * dropped and counted under its reason (enum dp_drop). A valid one is written
 * as a struct dp_chunk (native/chunk.h), cut after its tokens, into its
 * queue's ring buffer with an XDP stamp, then the packet is dropped: the
 * consumer has everything.
 * A record over its tenant's token bucket (a chunk, an OPEN or a COUNT_TOKENS:
 * each costs its tokens, one at least; a CLOSE one token, with a burst more of
 * room), or over the bucket the
 * tenants without one share, never reaches user space: the packet is rewritten in place into a 429 response and sent back
 * (XDP_TX);
 * a valid request over IPv6 is answered 400 the same way (responses go to
 * the IPv4 address a chunk carries);
 * with tags required (policy.require_tags), a request whose tag is not the
 * SipHash of its header under its tenant's key (tenant_keys) is dropped
 * before any of that, unanswered;
 * the rest of its request, if it has more chunks, is dropped (the `cuts` map).
 * Tunables (-D): DP_QUEUES, DP_RING_PAGES, DP_PORT (see steer_maps.h).
 */
#include <uapi/linux/bpf.h>
#include "wire.h"
#include "chunk.h"
#include "parsing_helpers.h"
#include "siphash.h"
#include "steer_maps.h"

#define IPPROTO_FRAGMENT_V6 44

struct frag6_hdr {
    __u8 nexthdr;
    __u8 reserved;
    __be16 frag_off;   /* offset << 3 | M */
    __be32 id;
};

static __always_inline int drop(__u32 reason)
{
    __u64 *n = drops.lookup(&reason);
    if (n)
        *n += 1;
    return XDP_DROP;
}

static __always_inline void event(__u32 ev)
{
    __u64 *n = events.lookup(&ev);
    if (n)
        *n += 1;
}

/* A record slot of `size` bytes in queue q's ring buffer, or NULL when it is full.
 * Inlined at each call with a constant size, as ringbuf_reserve requires. */
static __always_inline struct dp_chunk *reserve_record(__u32 q, const __u32 size)
{
    struct dp_chunk *rec = NULL;

    /* an if chain, not a switch: clang would emit a jump table BPF cannot run */
    if (q == 0)
        rec = ring0.ringbuf_reserve(size);
#if DP_QUEUES > 1
    if (q == 1)
        rec = ring1.ringbuf_reserve(size);
#endif
#if DP_QUEUES > 2
    if (q == 2)
        rec = ring2.ringbuf_reserve(size);
#endif
#if DP_QUEUES > 3
    if (q == 3)
        rec = ring3.ringbuf_reserve(size);
#endif
#if DP_QUEUES > 4
    if (q == 4)
        rec = ring4.ringbuf_reserve(size);
#endif
#if DP_QUEUES > 5
    if (q == 5)
        rec = ring5.ringbuf_reserve(size);
#endif
#if DP_QUEUES > 6
    if (q == 6)
        rec = ring6.ringbuf_reserve(size);
#endif
#if DP_QUEUES > 7
    if (q == 7)
        rec = ring7.ringbuf_reserve(size);
#endif
    return rec;
}

/* n (1..max) tokens from the packet into the record, eight bytes at a time: bpf_xdp_load_bytes
 * cost ~120 ns for 64 tokens against ~20 for this loop (test runs, the ring drained on the same
 * core). -1 if the packet ends first, which the length checks before rule out: the bounds here
 * are the verifier's. */
static __always_inline int copy_tokens(__u32 *dst, const __u32 *src, __u32 n, const __u32 max, void *data_end)
{
    const __u64 *s = (const void *)src;
    __u64 *d = (void *)dst;
    __u32 last = n - 1;

    for (__u32 i = 0; i < max / 2; i++) {
        if (i >= n / 2)
            break;
        if ((void *)(s + i + 1) > data_end)
            return -1;
        d[i] = s[i];
    }
    if (n & 1) {
        /* n <= max already, but clang would fold the mask away if it saw that: the verifier
         * needs it on the index it checks */
        asm volatile("" : "+r"(last));
        last &= max - 1;
        if ((void *)(src + last + 1) > data_end)
            return -1;
        dst[last] = src[last];
    }
    return 0;
}

/* The record for n tokens: its header and the tokens, in the smallest of four sizes that holds
 * them (ringbuf_reserve takes a constant size: one inlined reserve per size). With every
 * record 608 bytes a ring held 3.6x fewer 16-token chunks, spread over more lines and pages;
 * writing one cost ~50 ns more when the ring was drained on the same core (within noise when
 * the other core drains it, as in bench ingress). NULL: the ring is full, or (*truncated) the packet
 * ended before its tokens did. */
#define DP_REC_SIZE(tokens) (DP_CHUNK_HDR_LEN + (tokens) * 4)
static __always_inline struct dp_chunk *record_with_tokens(__u32 q, const __u32 *src, __u32 n, void *data_end,
                                                           int *truncated)
{
    struct dp_chunk *rec;
    int err = 0;

    if (n <= 16) {
        rec = reserve_record(q, DP_REC_SIZE(16));
        if (rec && n)
            err = copy_tokens(rec->tokens, src, n, 16, data_end);
    } else if (n <= 32) {
        rec = reserve_record(q, DP_REC_SIZE(32));
        if (rec)
            err = copy_tokens(rec->tokens, src, n, 32, data_end);
    } else if (n <= 64) {
        rec = reserve_record(q, DP_REC_SIZE(64));
        if (rec)
            err = copy_tokens(rec->tokens, src, n, 64, data_end);
    } else {
        rec = reserve_record(q, DP_REC_SIZE(DP_MAX_CHUNK_TOKENS));
        if (rec)
            err = copy_tokens(rec->tokens, src, n, DP_MAX_CHUNK_TOKENS, data_end);
    }
    if (rec && err) {
        ring0.ringbuf_discard(rec, 0);   /* (any ring's discard: the record knows its ring) */
        *truncated = 1;
        return NULL;
    }
    return rec;
}

static __always_inline int pass(void)
{
    event(DP_EV_PASS);
    return XDP_PASS;
}

static __always_inline __u32 pick_queue(struct dp_req_hdr *req, __u32 mode)
{
    __u32 *q = NULL;
    __u64 sid = req->session_id;
    __u32 tenant = req->tenant;

    if (mode == DP_POLICY_SESSION_PIN)
        q = pins.lookup(&sid);
    else if (mode == DP_POLICY_TENANT)
        q = tenant_queue.lookup(&tenant);
    if (q)
        return *q % DP_QUEUES;   /* a bad value from user space stays in range */
    return (__u32)((sid * DP_SESSION_HASH_MUL) >> 32) % DP_QUEUES;
}

/* GCRA: the virtual clock after n more tokens, from its value old */
static __always_inline __u64 gcra_tat(struct dp_bucket *b, __u64 old, __u32 n, __u64 now)
{
    return (old > now ? old : now) + n * b->ns_per_token;
}

/* GCRA, looked at: would n tokens fit now, slack ns past the burst? (Refused here, a record is
 * never reserved for them.) */
static __always_inline int has_room(struct dp_bucket *b, __u32 n, __u64 now, __u64 slack)
{
    return gcra_tat(b, b->tat, n, now) <= now + b->burst_ns + slack;
}

/* GCRA: admit n tokens if the bucket has room (slack ns past the burst), and charge them. */
static __always_inline int over_limit(struct dp_bucket *b, __u32 n, __u64 now, __u64 slack)
{
    __u64 tat;

    /* compare-and-swap: two CPUs admitting one tenant's chunks at once cannot both take the same
     * room (a plain store let both pass, up to one rate per CPU); the loser retries against the
     * winner's tat, and one that loses 4 times running is refused, never let through */
#pragma unroll
    for (int i = 0; i < 4; i++) {
        __u64 old = b->tat;
        tat = gcra_tat(b, old, n, now);
        if (tat > now + b->burst_ns + slack)
            return 1;
        if (__sync_val_compare_and_swap(&b->tat, old, tat) == old)
            return 0;
    }
    return 1;
}

static __always_inline __u16 dp_csum_fold(__u32 sum)
{
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    return ~sum;
}

/* Is the IPv4 header's checksum right (the ones' complement sum of its 16-bit words, options and
 * all, 0xffff: dp_csum_fold returns its complement, 0)? The kernel's IP input drops a packet whose
 * sum is not; taken here before it, such a packet (an address or a length damaged on the way)
 * passed for a request and could be answered. Summed in 32-bit words, byte order unswapped: a
 * ones' complement sum is the same either way. */
static __always_inline int ipv4_csum_ok(const struct iphdr *iph, const void *data_end)
{
    const __u32 *w = (const __u32 *)iph;
    __u64 sum = 0;

#pragma unroll
    for (int i = 0; i < 15; i++) {
        if (i >= iph->ihl)
            break;
        if ((const void *)(w + i + 1) > data_end)
            return 0;
        sum += w[i];
    }
    sum = (sum & 0xffffffff) + (sum >> 32);
    sum = (sum & 0xffffffff) + (sum >> 32);
    return dp_csum_fold((__u32)sum) == 0;
}

/* An IPv6 address a host may have: not the unspecified one (::) nor loopback (::1). */
static __always_inline int ip6_host(const __u32 *a)
{
    return (a[0] | a[1] | a[2]) || (a[3] && a[3] != bpf_htonl(1));
}

/* May the request be answered from here? Never to or from a group address (a broadcast or
 * multicast MAC or IP: a forged request answered to a whole segment, or a reply from an address
 * no host sends from), never to a source no host has (IPv6's unspecified, loopback or multicast;
 * an IPv4 one, or IPv4 options, was dropped before: DP_DROP_BAD_SOURCE, DP_DROP_IP_OPTIONS) nor
 * from such a destination. The refusal is counted all the same. */
static __always_inline int may_reply(const struct ethhdr *eth, const struct iphdr *iph,
                                     const struct ipv6hdr *ip6h, int v6)
{
    if ((eth->h_dest[0] | eth->h_source[0]) & 1)
        return 0;
    if (!v6) {
        __u32 dst = bpf_ntohl(iph->daddr);
        /* the destination is the reply's source: not 0/8, loopback, multicast or above */
        return dst >> 24 && dst >> 24 != 127 && dst < 0xe0000000u;
    }
    return ip6h->saddr.in6_u.u6_addr8[0] != 0xff && ip6h->daddr.in6_u.u6_addr8[0] != 0xff &&
           ip6_host(ip6h->saddr.in6_u.u6_addr32) && ip6_host(ip6h->daddr.in6_u.u6_addr32);
}

/* Is this record, under a live cut, a client's retry of the cut request, or one of the retry's
 * records? The rule is the router's (chunk.h, DP_REOPENS), against the try the cut keeps. A
 * retry's records pass from its stamp on; the try's stragglers, sent before, are still dropped.
 * Before, a retry that a 429's retry_after or a 503's "retry" asked for was dropped, unanswered,
 * for DP_CUT_TTL_NS (found by review). */
static __always_inline int cut_retry(struct dp_cut *cut, const struct dp_req_hdr *req, __u8 kind)
{
    __u64 sent = req->send_ns & ~1ull, retry = cut->retry_sent;
    if (retry && sent >= retry)
        return 1;
    if (!DP_REOPENS(kind, req->chunk_index, sent, cut->try_sent))
        return 0;
    cut->retry_sent = sent;   /* (another CPU's retry of it may race: either stamp lets the later records by) */
    return 1;
}

/* Turn the request in place into a response to its sender with this status and no body. */
static __always_inline int reply(struct xdp_md *ctx, struct ethhdr *eth, struct iphdr *iph, struct ipv6hdr *ip6h,
                                 int v6, struct udphdr *udph, struct dp_req_hdr *req, __u16 status)
{
    struct dp_resp_hdr *resp = (void *)req;   /* 40 bytes over the 56 already bounds-checked */
    __u32 tenant = req->tenant;
    __u64 sid = req->session_id, rid = req->request_id, sent = req->send_ns;
    __u8 mac[ETH_ALEN];
    __be16 port;
    int tail;

    __builtin_memcpy(mac, eth->h_dest, ETH_ALEN);
    __builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
    __builtin_memcpy(eth->h_source, mac, ETH_ALEN);
    port = udph->source;
    udph->source = udph->dest;
    udph->dest = port;
    udph->len = bpf_htons(sizeof(*udph) + DP_RESP_HDR_LEN);
    udph->check = 0;

    resp->magic = DP_WIRE_MAGIC;
    resp->version = DP_WIRE_VERSION;
    resp->kind = DP_KIND_RESPONSE;
    resp->flags = 0;                          /* no room for a trace here: DP_FLAG_TRACE is not echoed */
    resp->tenant = tenant;
    resp->status = status;
    resp->body_len = 0;
    resp->session_id = sid;
    resp->request_id = rid;
    resp->send_ns = sent;

    /* a constant flag, not `if (iph)`: the verifier cannot rule out a NULL test on a packet pointer */
    if (!v6) {
        __be32 a = iph->saddr;
        __be16 *tos_word = (__be16 *)iph, *ttl_word = (__be16 *)&iph->ttl;
        __be16 old_tos = *tos_word, old_ttl = *ttl_word, old = iph->tot_len;
        __be16 new = bpf_htons(iph->ihl * 4 + sizeof(*udph) + DP_RESP_HDR_LEN);
        iph->saddr = iph->daddr;
        iph->daddr = a;
        iph->tot_len = new;
        /* a fresh TTL and no ECN mark: the request's TTL 1 killed the reply at the first router,
         * and a CE mark echoed back was a false congestion signal */
        iph->ttl = 64;
        iph->tos &= ~3;
        /* RFC 1624 incremental update over the three changed words; swapping addresses leaves
         * the sum alone */
        iph->check = dp_csum_fold((__u16)~iph->check + (__u16)~old + (__u16)new + (__u16)~old_tos +
                                  (__u16)*tos_word + (__u16)~old_ttl + (__u16)*ttl_word);
        /* UDP checksum 0 = none, legal over IPv4 */
    } else {
        struct in6_addr a = ip6h->saddr;
        __be32 pseudo[2] = { bpf_htonl(sizeof(*udph) + DP_RESP_HDR_LEN), bpf_htonl(IPPROTO_UDP) };
        __s64 sum;
        ip6h->saddr = ip6h->daddr;
        ip6h->daddr = a;
        ip6h->payload_len = bpf_htons(sizeof(*udph) + DP_RESP_HDR_LEN);
        ip6h->hop_limit = 64;                 /* not the request's, which may be 1 */
        ip6h->flow_lbl[0] &= ~0x30;           /* and no ECN mark (the traffic class's low bits) */
        /* IPv6 requires the UDP checksum: pseudo header + UDP header + response */
        sum = bpf_csum_diff(0, 0, (__be32 *)&ip6h->saddr, 32, 0);
        sum = bpf_csum_diff(0, 0, pseudo, sizeof(pseudo), sum);
        sum = bpf_csum_diff(0, 0, (__be32 *)udph, sizeof(*udph) + DP_RESP_HDR_LEN, sum);
        udph->check = dp_csum_fold(sum) ?: 0xffff;
    }

    tail = (void *)(long)ctx->data_end - ((void *)resp + DP_RESP_HDR_LEN);
    if (tail > 0 && bpf_xdp_adjust_tail(ctx, -tail))
        return XDP_DROP;   /* counted under its drop reason already; no reply */
    if (status == DP_STATUS_RATE_LIMITED)
        event(DP_EV_REPLY_429);
    return XDP_TX;
}

int xdp_steer(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data;
    void *data_end = (void *)(long)ctx->data_end;
    struct hdr_cursor c = { .pos = data };
    struct ethhdr *eth;
    struct iphdr *iph = NULL;
    struct ipv6hdr *ip6h = NULL;
    struct udphdr *udph = NULL;
    struct dp_req_hdr *req;
    struct dp_chunk *rec;
    int proto, frag = 0, v6 = 0, udp_len;
    __u32 n, kind, q, len, limits, cost = 0, zero = 0;
    int truncated = 0, more_to_come = 0;
    struct dp_policy *pol;
    struct dp_bucket *b = NULL;
    struct dp_cut_key ck;        /* (set, and read, only with limits) */
    __u64 now, slack = 0, *cnt;

    proto = parse_ethhdr(&c, data_end, &eth);
    if (proto == bpf_htons(ETH_P_IP)) {
        proto = parse_iphdr(&c, data_end, &iph, &frag);
        if (frag && (iph->frag_off & bpf_htons(0x1fff)))
            return pass();   /* a later fragment has no UDP header to say whose it is */
    } else if (proto == bpf_htons(ETH_P_IPV6)) {
        proto = parse_ip6hdr(&c, data_end, &ip6h);
        v6 = 1;
        if (proto == IPPROTO_FRAGMENT_V6) {
            struct frag6_hdr *fh = c.pos;
            if ((void *)(fh + 1) > data_end || (fh->frag_off & bpf_htons(0xfff8)))
                return pass();
            c.pos = fh + 1;
            frag = 1;
            proto = fh->nexthdr;
        }
    } else {
        return pass();
    }
    if (proto != IPPROTO_UDP)
        return pass();
    udp_len = parse_udphdr(&c, data_end, &udph);
    if (!udph || udph->dest != bpf_htons(DP_PORT))
        return pass();
    pol = policy.lookup(&zero);
    if (!pol)
        return XDP_ABORTED;   /* an array always has index 0: unreachable */
    if (pol->local_only) {
        /* the operator named the service's addresses: a datagram to another (a router's, a
         * bridge port's or a container host's transit traffic) is not ours to take or answer */
        int ours = 0;
        if (!v6)
            for (int i = 0; i < DP_MAX_LOCAL_ADDRS; i++)
                ours |= i < pol->local_only && pol->local_addrs[i] == iph->daddr;
        if (!ours)
            return pass();
    }
    /* UDP's own checksum is not verified: a veth's sender leaves it partial (the offload's
     * pseudo-header sum, completed by no one on this path), which XDP cannot tell from a wrong one.
     * Over IPv6 it is mandatory, and 0 is refused as the kernel's UDP input would. */
    if (v6 ? !udph->check : !ipv4_csum_ok(iph, data_end))
        return drop(DP_DROP_BAD_CHECKSUM);
    if (frag)
        return drop(DP_DROP_FRAGMENT);
    if (udp_len < 0)
        return drop(DP_DROP_LENGTH);
    /* The IP header's own length must hold the whole UDP datagram, and its version match the
     * EtherType, as the kernel's IP input checks: otherwise bytes past the IP datagram (a frame
     * longer than it says) passed for the request. */
    if (v6 ? ip6h->version != 6 || bpf_ntohs(ip6h->payload_len) < bpf_ntohs(udph->len)
           : iph->version != 4 || bpf_ntohs(iph->tot_len) < iph->ihl * 4 + bpf_ntohs(udph->len))
        return drop(DP_DROP_LENGTH);
    /* ... and the frame must hold the IP datagram whole, as the kernel's IP input checks too */
    if (v6 ? (void *)(ip6h + 1) + bpf_ntohs(ip6h->payload_len) > data_end
           : (void *)iph + bpf_ntohs(iph->tot_len) > data_end)
        return drop(DP_DROP_TRUNCATED);
    if (!v6) {
        __u32 src = bpf_ntohl(iph->saddr);
        /* a request never needs IPv4 options: the kernel's input would refuse a source route or
         * a malformed one, which this program would have to walk them to tell */
        if (iph->ihl != 5)
            return drop(DP_DROP_IP_OPTIONS);
        /* the answer goes to the source (the egress's socket, later): never to one no host
         * sends from, 0/8, loopback (a forged request answered to a local port), multicast and
         * above (to a whole group), or this host's own address or a broadcast of its subnets,
         * which the kernel's input drops: the destination's, or any the host has (host_sources) */
        if (!(src >> 24) || src >> 24 == 127 || src >= 0xe0000000u || iph->saddr == iph->daddr)
            return drop(DP_DROP_BAD_SOURCE);
        __u32 saddr = iph->saddr;
        if ((pol->host_source_bits >> ((__u32)(saddr * DP_SOURCE_HASH_MUL) >> 26) & 1) &&
            host_sources.lookup(&saddr))
            return drop(DP_DROP_BAD_SOURCE);
    }

    /* validation, in the order of datapath/wire.py's decoder */
    req = c.pos;
    if ((void *)(req + 1) > data_end)
        return drop(DP_DROP_TRUNCATED);
    if (req->magic != DP_WIRE_MAGIC)
        return drop(DP_DROP_BAD_MAGIC);
    if (req->version != DP_WIRE_VERSION)
        return drop(DP_DROP_BAD_VERSION);
    if (req->flags & ~DP_FLAGS_KNOWN)
        return drop(DP_DROP_BAD_FLAGS);
    kind = req->kind;
    n = req->n_tokens;
    if (kind != DP_KIND_CHUNK && kind != DP_KIND_COUNT_TOKENS && kind != DP_KIND_OPEN && kind != DP_KIND_CLOSE)
        return drop(DP_DROP_BAD_KIND);
    if (req->reserved)
        return drop(DP_DROP_BAD_FLAGS);
    if (req->chunk_count == 0 || req->chunk_index >= req->chunk_count)
        return drop(DP_DROP_BAD_CHUNK);
    if (kind == DP_KIND_CHUNK || kind == DP_KIND_COUNT_TOKENS) {
        if (n < 1 || n > DP_MAX_CHUNK_TOKENS)
            return drop(DP_DROP_BAD_TOKENS);
    } else if (n) {
        return drop(DP_DROP_BAD_TOKENS);
    }
    len = n * sizeof(__u32);
    if (udp_len != DP_REQ_HDR_LEN + len)
        return drop(DP_DROP_LENGTH);
    if ((void *)req + DP_REQ_HDR_LEN + len > data_end)
        return drop(DP_DROP_TRUNCATED);

    limits = pol->rate_limits;   /* read once: user space may change it meanwhile */
    /* a clock read here only when needed: it cost ~30 ns a chunk (steer_ns); before the tag check,
     * so t_xdp - t_xdp_in (bench e2e's "xdp steer + ring write") counts it */
    now = limits || pol->stamp_validated ? bpf_ktime_get_ns() : 0;
    if (pol->require_tags) {
        /* before anything answers or charges: a sender without the tenant's key gets nothing back
         * (an answer would go to a source it may have forged) and costs the tenant nothing */
        __u32 tenant = req->tenant;
        struct dp_tenant_key *k = tenant_keys.lookup(&tenant);
        if (!k)
            return drop(DP_DROP_UNKNOWN_TENANT);
        if (dp_req_tag((const __u64 *)req, k->k0, k->k1) != req->tag)
            return drop(DP_DROP_BAD_TAG);
    }
    if (v6) {
        /* it would be run and charged, then its answer sent to no one (a chunk carries the
         * client's IPv4 address): refused at once, before its tokens are charged (found by review) */
        drop(DP_DROP_IPV6);
        if (!may_reply(eth, iph, ip6h, v6))
            return XDP_DROP;
        return reply(ctx, eth, iph, ip6h, v6, udph, req, DP_STATUS_BAD_REQUEST);
    }
    if (limits) {
        __u32 tenant = req->tenant;
        b = buckets.lookup(&tenant);
        if (!b) {
            /* a tenant without a bucket of its own shares the others' bucket, if one is set: made
             * up, a tenant id was a way past every limit here */
            b = others_bucket.lookup(&zero);
            if (b && !b->ns_per_token)
                b = NULL;
        }
        /* a request of several chunks is cut once: one 429, and its later chunks neither
         * charged nor answered again (the router drops what did pass: chunk.h, dp_cut_key).
         * One-chunk requests stay out of the map: a flood of them would push the others out.
         * An OPEN refused cuts its request of several chunks too; a COUNT_TOKENS never does
         * (a priced count's ids may be its request's). */
        ck = (struct dp_cut_key){ .session_id = req->session_id, .request_id = req->request_id,
                                  .tenant = tenant };
        more_to_come = DP_CUTTABLE(kind, req->chunk_count);
        struct dp_cut *cut = b && more_to_come ? cuts.lookup(&ck) : NULL;
        /* signed: a cut another CPU stamped after this one read its clock is live, not 2^64 ns old */
        if (cut && (__s64)(now - cut->t_cut) < (__s64)DP_CUT_TTL_NS && !cut_retry(cut, req, kind))
            return drop(DP_DROP_CUT_REQUEST);
        /* every other record costs its tokens, one at least: an OPEN or COUNT_TOKENS draws an
         * answer with a body, and free they let a sender past its rate (reflected, with a
         * forged source) */
        cost = n ? n : 1;
        /* a CLOSE costs its one token too, and has a burst more of room: a tenant over its rate
         * can still free what its sessions hold, but cannot flood the rings with CLOSEs (free, a
         * throttled tenant's filled a ring another tenant's chunks then missed: found by review) */
        slack = b && kind == DP_KIND_CLOSE ? b->burst_ns : 0;
        if (b && !has_room(b, cost, now, slack))
            goto over;
    }

    q = pick_queue(req, pol->mode);
    rec = record_with_tokens(q, (void *)req + DP_REQ_HDR_LEN, n, data_end, &truncated);
    if (!rec)
        return drop(truncated ? DP_DROP_TRUNCATED : DP_DROP_RING_FULL);
    /* charged only once it has its record: a chunk the full ring drops costs the tenant nothing
     * (it was charged and then dropped, its tokens spent on nothing) */
    if (b && over_limit(b, cost, now, slack)) {
        ring0.ringbuf_discard(rec, BPF_RB_NO_WAKEUP);   /* (another CPU took the room meanwhile) */
        goto over;
    }
    rec->session_id = req->session_id;
    rec->request_id = req->request_id;
    rec->tenant = req->tenant;
    rec->max_output_tokens = req->max_output_tokens;
    rec->chunk_index = req->chunk_index;
    rec->chunk_count = req->chunk_count;
    rec->n_tokens = n;
    rec->kind = kind;
    rec->queue = q;
    rec->batch_seq = 0;
    rec->batch_len = 0;
    rec->batch_pos = 0;
    rec->t_send = req->send_ns;
    rec->t_consumer = 0;
    rec->t_router = 0;
    rec->t_lane = 0;
    rec->t_xdp_in = now;   /* t_xdp - t_xdp_in: the live cost of steering and writing the record (0: not stamped) */
    rec->flags = req->flags;
    rec->client_ip = iph->saddr;   /* where the response goes (an IPv6 request was refused above) */
    rec->client_port = udph->source;
    /* stamped at the hand-off, not at entry: XDP-to-consumer then measures the queue,
     * and the program's own cost is steer_ns in the benchmark */
    rec->t_xdp = bpf_ktime_get_ns();
    /* no wakeup: the consumer busy-polls, nobody sleeps in epoll on these rings */
    ring0.ringbuf_submit(rec, BPF_RB_NO_WAKEUP);

    cnt = queue_pkts.lookup(&q);
    if (cnt)
        *cnt += 1;
    return XDP_DROP;

over:
    if (more_to_come) {
        struct dp_cut c = { .t_cut = now, .try_sent = DP_TRY_OF(req->send_ns, kind == DP_KIND_OPEN) };
        cuts.update(&ck, &c);
    }
    drop(DP_DROP_RATE_LIMITED);
    /* the OPEN of a one-chunk request draws no 429: its chunk, which follows it and carries the
     * request whole, gets the one answer (a 429, or run if the bucket has room by then); a 429
     * here was a second answer, one-chunk requests being out of `cuts` (found by review) */
    if ((kind == DP_KIND_OPEN && req->chunk_count == 1) || !may_reply(eth, iph, ip6h, v6))
        return XDP_DROP;
    return reply(ctx, eth, iph, ip6h, v6, udph, req, DP_STATUS_RATE_LIMITED);
}
