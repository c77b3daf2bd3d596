"""bpf/wire.h and datapath/wire.py agree byte for byte.

The cffi extension datapath._wire_layout is compiled from the header itself
(its cdef is the header's LAYOUT section), so ffi.offsetof/sizeof are the C
compiler's answers.
"""
import re
import struct

import pytest

from datapath import wire
from datapath._wire_layout import ffi, lib
from datapath.xdp import BPF_DIR

STRUCTS = [("struct dp_req_hdr", wire.REQ_FIELDS, wire.REQ_OFFSETS, wire.REQ_HDR_LEN),
           ("struct dp_resp_hdr", wire.RESP_FIELDS, wire.RESP_OFFSETS, wire.RESP_HDR_LEN),
           ("struct dp_resp_trace", wire.TRACE_FIELDS, wire.TRACE_OFFSETS, wire.RESP_TRACE_LEN)]


@pytest.mark.parametrize("cname,fields,offsets,size", STRUCTS, ids=["request", "response", "trace"])
def test_every_field_size_and_offset(cname, fields, offsets, size):
    ctype = ffi.typeof(cname)
    c_fields = [name for name, _ in ctype.fields]
    assert c_fields == [name for name, _ in fields], "same fields in the same order"
    for name, (off, fsize) in offsets.items():
        assert ffi.offsetof(cname, name) == off, name
        assert ffi.sizeof(dict(ctype.fields)[name].type) == fsize, name
    assert ffi.sizeof(cname) == size


def test_every_constant_matches():
    header = (BPF_DIR / "wire.h").read_text()
    names = re.findall(r"#define (DP_[A-Z0-9_]+)[ \t]", header.split("/* LAYOUT END */")[0])
    assert len(names) > 15
    py_names = {n: n.removeprefix("DP_").removeprefix("WIRE_") for n in names}
    for cname, pyname in py_names.items():
        assert getattr(wire, pyname) == getattr(lib, cname), cname


def test_bytes_identical_to_c_struct():
    c = ffi.new("struct dp_req_hdr *")
    values = dict(magic=lib.DP_WIRE_MAGIC, version=lib.DP_WIRE_VERSION, kind=lib.DP_KIND_CHUNK,
                  flags=lib.DP_FLAG_TRACE, tenant=0x01020304, max_output_tokens=0x0A0B0C0D,
                  session_id=0x1122334455667788, request_id=0x99AABBCCDDEEFF00, chunk_index=3,
                  chunk_count=9, n_tokens=2, reserved=0, send_ns=0x0102030405060708)
    for k, v in values.items():
        setattr(c, k, v)
    c_bytes = bytes(ffi.buffer(c))
    py = wire.encode_request(wire.Request(kind=wire.KIND_CHUNK, tenant=0x01020304, session_id=0x1122334455667788,
                                          request_id=0x99AABBCCDDEEFF00, chunk_index=3, chunk_count=9,
                                          tokens=(7, 8), max_output_tokens=0x0A0B0C0D, flags=wire.FLAG_TRACE,
                                          send_ns=0x0102030405060708))
    assert py[:wire.REQ_HDR_LEN] == c_bytes
    assert py[wire.REQ_HDR_LEN:] == struct.pack("<2I", 7, 8)


def test_response_bytes_identical_to_c_struct():
    c = ffi.new("struct dp_resp_hdr *")
    for k, v in dict(magic=lib.DP_WIRE_MAGIC, version=lib.DP_WIRE_VERSION, kind=lib.DP_KIND_RESPONSE, flags=0, tenant=5,
                     status=lib.DP_STATUS_RATE_LIMITED, body_len=3, session_id=6, request_id=7, send_ns=8).items():
        setattr(c, k, v)
    py = wire.encode_response(wire.Response(tenant=5, session_id=6, request_id=7, status=429, body=b"abc", send_ns=8))
    assert py == bytes(ffi.buffer(c)) + b"abc"


def test_each_status_counts_in_the_slot_python_reads_it_from():
    """by_status (the load generator's, the egress's) is read in wire.STATUSES' order: each status's
    slot is its place there, and any other status is no known one (the last slot takes it, as 503)."""
    assert [lib.dp_status_slot(s) for s in wire.STATUSES] == list(range(len(wire.STATUSES)))
    assert all(lib.dp_status_known(s) for s in wire.STATUSES)
    assert not any(lib.dp_status_known(s) for s in (0, 201, 299, 500, 0xFFFF))
