"""Build Ethernet frames around a UDP payload, for BPF_PROG_TEST_RUN tables and tests.

Real traffic goes through sockets; these frames feed the XDP program in the
kernel's test runner, where every variant (VLAN, IPv6, IP options, fragments)
must be reachable on purpose.
"""
from __future__ import annotations

import ipaddress
import struct

ETH_P_IP, ETH_P_IPV6, ETH_P_8021Q = 0x0800, 0x86DD, 0x8100
IPPROTO_UDP, IPPROTO_TCP = 17, 6
SRC_MAC = bytes.fromhex("020000000002")
DST_MAC = bytes.fromhex("020000000001")
V6_CLIENT, V6_SERVICE = "2001:2::2", "2001:2::1"   # the IPv6 frames' default source and destination


def checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def ethernet(ethertype: int, payload: bytes, vlan: int | None = None) -> bytes:
    head = DST_MAC + SRC_MAC
    if vlan is not None:
        head += struct.pack("!HH", ETH_P_8021Q, vlan & 0x0FFF)
    return head + struct.pack("!H", ethertype) + payload


def ipv4(proto: int, payload: bytes, src="198.18.0.2", dst="198.18.0.1",
         options: bytes = b"", frag_off: int = 0, mf: bool = False, ttl: int = 64, tos: int = 0) -> bytes:
    if len(options) % 4:
        raise ValueError("IPv4 options must be a multiple of 4 bytes")
    ihl = 5 + len(options) // 4
    flags_frag = (0x2000 if mf else 0) | (frag_off & 0x1FFF)
    hdr = struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, tos, ihl * 4 + len(payload), 1, flags_frag, ttl, proto, 0,
                      ipaddress.IPv4Address(src).packed, ipaddress.IPv4Address(dst).packed) + options
    return hdr[:10] + struct.pack("!H", checksum(hdr)) + hdr[12:] + payload


def ipv6(nexthdr: int, payload: bytes, src=V6_CLIENT, dst=V6_SERVICE, hop_limit: int = 64) -> bytes:
    return struct.pack("!IHBB16s16s", 6 << 28, len(payload), nexthdr, hop_limit,
                       ipaddress.IPv6Address(src).packed, ipaddress.IPv6Address(dst).packed) + payload


def udp(payload: bytes, dport: int, sport: int = 40000, length: int | None = None, check: int = 0) -> bytes:
    # checksum 0: "none", legal over IPv4 only; the XDP programs do not verify a non-zero one
    return struct.pack("!HHHH", sport, dport, 8 + len(payload) if length is None else length, check) + payload


def udp6_checksum(seg: bytes, src: str, dst: str) -> int:
    """UDP's checksum over IPv6 (mandatory there): the pseudo header, then the segment; 0 sent as 0xffff."""
    pseudo = (ipaddress.IPv6Address(src).packed + ipaddress.IPv6Address(dst).packed +
              struct.pack("!IxxxB", len(seg), IPPROTO_UDP))
    return checksum(pseudo + seg) or 0xFFFF


def udp_frame(payload: bytes, dport: int, *, v6: bool = False, vlan: int | None = None,
              ip_options: bytes = b"", frag_off: int = 0, mf: bool = False, udp_len: int | None = None,
              src: str | None = None, dst: str | None = None, ttl: int = 64, tos: int = 0) -> bytes:
    """An Ethernet frame carrying `payload` in UDP to `dport`, over IPv4 (or IPv6), from `src` to
    `dst` (the default client and service addresses if None)."""
    seg = udp(payload, dport, length=udp_len)
    addrs = {k: v for k, v in (("src", src), ("dst", dst)) if v}
    if v6:
        seg = udp(payload, dport, length=udp_len,
                  check=udp6_checksum(seg, src or V6_CLIENT, dst or V6_SERVICE))
        return ethernet(ETH_P_IPV6, ipv6(IPPROTO_UDP, seg, **addrs, hop_limit=ttl), vlan)
    return ethernet(ETH_P_IP, ipv4(IPPROTO_UDP, seg, **addrs, options=ip_options, frag_off=frag_off, mf=mf,
                                   ttl=ttl, tos=tos), vlan)
