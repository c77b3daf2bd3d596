/* parsing_helpers.h - packet header parsing for XDP, in the xdp-tutorial style.
 *
 * A cursor walks the packet; each parse_* checks its header against data_end,
 * advances the cursor and returns the next protocol (or -1). Bounds checks
 * read the same everywhere: if ((void *)(h + 1) > data_end) return -1;
 * Only UAPI headers are used, so bcc compiles this with any headers package.
 */
#ifndef DP_PARSING_HELPERS_H
#define DP_PARSING_HELPERS_H

#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/udp.h>
#include <linux/in.h>

#ifndef __always_inline
#define __always_inline inline __attribute__((always_inline))
#endif

struct hdr_cursor {
    void *pos;
};

struct vlan_hdr {
    __be16 h_vlan_TCI;
    __be16 h_vlan_encapsulated_proto;
};

static __always_inline int proto_is_vlan(__u16 h_proto)
{
    return h_proto == bpf_htons(ETH_P_8021Q) || h_proto == bpf_htons(ETH_P_8021AD);
}

/* Ethernet plus at most one VLAN tag; returns the inner EtherType (network order). */
static __always_inline int parse_ethhdr(struct hdr_cursor *c, void *data_end, struct ethhdr **ethhdr)
{
    struct ethhdr *eth = c->pos;
    struct vlan_hdr *vlh;
    __u16 h_proto;

    if ((void *)(eth + 1) > data_end)
        return -1;
    c->pos = eth + 1;
    *ethhdr = eth;
    h_proto = eth->h_proto;
    if (proto_is_vlan(h_proto)) {
        vlh = c->pos;
        if ((void *)(vlh + 1) > data_end)
            return -1;
        c->pos = vlh + 1;
        h_proto = vlh->h_vlan_encapsulated_proto;
    }
    return h_proto;
}

/* IPv4 with options; returns the L4 protocol. *frag is set for any fragment. */
static __always_inline int parse_iphdr(struct hdr_cursor *c, void *data_end, struct iphdr **iphdr, int *frag)
{
    struct iphdr *iph = c->pos;
    int hdrsize;

    if ((void *)(iph + 1) > data_end)
        return -1;
    hdrsize = iph->ihl * 4;
    if (hdrsize < (int)sizeof(*iph))
        return -1;
    if (c->pos + hdrsize > data_end)
        return -1;
    c->pos += hdrsize;
    *iphdr = iph;
    /* MF set or a non-zero offset: a fragment (0x3fff = MF | offset mask) */
    *frag = (iph->frag_off & bpf_htons(0x3fff)) != 0;
    return iph->protocol;
}

/* IPv6 without extension headers (a fragment header shows as NEXTHDR 44). */
static __always_inline int parse_ip6hdr(struct hdr_cursor *c, void *data_end, struct ipv6hdr **ip6hdr)
{
    struct ipv6hdr *ip6h = c->pos;

    if ((void *)(ip6h + 1) > data_end)
        return -1;
    c->pos = ip6h + 1;
    *ip6hdr = ip6h;
    return ip6h->nexthdr;
}

/* UDP; returns the payload length the UDP header claims, or -1. */
static __always_inline int parse_udphdr(struct hdr_cursor *c, void *data_end, struct udphdr **udphdr)
{
    struct udphdr *h = c->pos;
    int len;

    if ((void *)(h + 1) > data_end)
        return -1;
    c->pos = h + 1;
    *udphdr = h;
    len = bpf_ntohs(h->len) - (int)sizeof(*h);
    if (len < 0)
        return -1;
    return len;
}

/* Ethernet (+VLAN) / IPv4 or IPv6 / UDP to port, not a fragment: the UDP header, else NULL (the
 * count program's whole parse, and the ring floor's). */
static __always_inline struct udphdr *udp_to_port(struct hdr_cursor *c, void *data_end, __be16 port)
{
    struct ethhdr *eth;
    struct iphdr *iph;
    struct ipv6hdr *ip6h;
    struct udphdr *udph;
    int proto, frag = 0;

    proto = parse_ethhdr(c, data_end, &eth);
    if (proto == bpf_htons(ETH_P_IP))
        proto = parse_iphdr(c, data_end, &iph, &frag);
    else if (proto == bpf_htons(ETH_P_IPV6))
        proto = parse_ip6hdr(c, data_end, &ip6h);
    else
        proto = -1;
    if (proto == IPPROTO_UDP && !frag && parse_udphdr(c, data_end, &udph) >= 0 && udph->dest == port)
        return udph;
    return NULL;
}

#endif /* DP_PARSING_HELPERS_H */
