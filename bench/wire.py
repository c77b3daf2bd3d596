"""bench wire: the Python codec's cost per 128-token chunk, against bare struct packing.

The codec runs per request on the control path (tests, the load generator's
setup, the Python ingress baseline), never per chunk on the fast path; this
suite shows what validation costs over the struct module doing the same bytes.
  references.struct_pack_chunk128_ns / struct_unpack_chunk128_ns: struct alone
  metrics.encode_chunk128_ns / decode_chunk128_ns: datapath.wire with validation
  metrics.encode_tagged_chunk128_ns: encode with the tenant's tag (SipHash-2-4 in pure Python)
"""
from __future__ import annotations

import struct
import time

from datapath import wire


def _per_call_ns(fn, n: int) -> float:
    best = float("inf")
    for _ in range(5):  # best of 5: the floor is the cost, the rest is the noisy neighbour
        t = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t) / n)
    return best


def run(report, args):
    n = 2_000 if args.quick else 20_000
    tokens = tuple(range(1000, 1128))
    req = wire.Request(kind=wire.KIND_CHUNK, tenant=7, session_id=1 << 40, request_id=99,
                       chunk_index=0, chunk_count=1, tokens=tokens, max_output_tokens=64)
    buf = wire.encode_request(req)
    fmt = struct.Struct(wire.REQ_HDR.format + "128I")
    fields = (wire.MAGIC, wire.VERSION, wire.KIND_CHUNK, 0, 7, 64, 1 << 40, 99, 0, 1, 128, 0, 0, 0, *tokens)
    key = bytes(range(16))

    report.reference("struct_pack_chunk128_ns", _per_call_ns(lambda: fmt.pack(*fields), n), "ns")
    report.reference("struct_unpack_chunk128_ns", _per_call_ns(lambda: fmt.unpack(buf), n), "ns")
    report.metric("encode_chunk128_ns", _per_call_ns(lambda: wire.encode_request(req), n), "ns")
    report.metric("decode_chunk128_ns", _per_call_ns(lambda: wire.decode_request(buf), n), "ns")
    # tagged in Python (SipHash in pure Python: tests and one-off clients; the load generator tags in C)
    report.metric("encode_tagged_chunk128_ns", _per_call_ns(lambda: wire.encode_request(req, key), n), "ns")
    report.ratio("encode_chunk128_ns", "struct_pack_chunk128_ns")
    report.ratio("decode_chunk128_ns", "struct_unpack_chunk128_ns")
