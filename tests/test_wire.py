"""The Python codec: round trips, and every malformed buffer names its field."""
import struct

import pytest
from hypothesis import given, strategies as st

from datapath import wire
from datapath.wire import WireError

u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, (1 << 64) - 1)


@st.composite
def requests(draw):
    kind = draw(st.sampled_from(sorted(wire.REQUEST_KINDS)))
    count = draw(st.integers(1, 0xFFFF))
    n = draw(st.integers(1, wire.MAX_CHUNK_TOKENS)) if kind in wire.KINDS_WITH_TOKENS else 0
    return wire.Request(kind=kind, tenant=draw(u32), session_id=draw(u64), request_id=draw(u64),
                        chunk_index=draw(st.integers(0, count - 1)), chunk_count=count,
                        tokens=tuple(draw(st.lists(u32, min_size=n, max_size=n))),
                        max_output_tokens=draw(u32), flags=draw(st.sampled_from([0, wire.FLAG_TRACE])),
                        send_ns=draw(u64))


@st.composite
def responses(draw):
    traced = draw(st.booleans())
    trace = {name: draw(st.integers(0, (1 << (8 * struct.calcsize(code))) - 1)) for name, code in wire.TRACE_FIELDS
             if name != "reserved"} | {"reserved": 0} if traced else None
    return wire.Response(tenant=draw(u32), session_id=draw(u64), request_id=draw(u64),
                         status=draw(st.sampled_from(wire.STATUSES)),
                         body=draw(st.binary(max_size=wire.MAX_RESP_BODY - (wire.RESP_TRACE_LEN if traced else 0))),
                         flags=wire.FLAG_TRACE if traced else 0, send_ns=draw(u64), trace=trace)


def test_a_trace_flag_without_room_for_the_trace_names_the_body():
    buf = bytearray(wire.encode_response(wire.Response(tenant=1, session_id=2, request_id=3, status=200, body=b"x")))
    buf[6:8] = struct.pack("<H", wire.FLAG_TRACE)
    with pytest.raises(WireError, match="body"):
        wire.decode_response(bytes(buf))


@given(requests())
def test_request_round_trip(req):
    buf = wire.encode_request(req)
    assert len(buf) == wire.REQ_HDR_LEN + 4 * req.n_tokens
    assert wire.decode_request(buf) == req
    assert wire.decode_request(bytearray(buf)) == req
    assert wire.decode_request(memoryview(buf)) == req


@given(responses())
def test_response_round_trip(resp):
    buf = wire.encode_response(resp)
    assert wire.decode_response(buf) == resp


def chunk(**kw):
    fields = dict(kind=wire.KIND_CHUNK, tenant=1, session_id=2, request_id=3, tokens=(5, 6, 7))
    fields.update(kw)
    return wire.encode_request(wire.Request(**fields))


def patch(buf: bytes, field: str, value: int, offsets=wire.REQ_OFFSETS, fields=wire.REQ_FIELDS) -> bytes:
    off, _ = offsets[field]
    code = dict(fields)[field]
    return buf[:off] + struct.pack("<" + code, value) + buf[off + struct.calcsize("<" + code):]


def test_truncated_at_every_byte_names_the_cut_field():
    buf = chunk()
    for n in range(wire.REQ_HDR_LEN):
        with pytest.raises(WireError) as e:
            wire.decode_request(buf[:n])
        off, size = wire.REQ_OFFSETS[e.value.field]
        assert off <= n < off + size, (n, e.value)
        assert "truncated" in e.value.reason
    for n in range(wire.REQ_HDR_LEN, len(buf)):  # cut inside the tokens
        with pytest.raises(WireError) as e:
            wire.decode_request(buf[:n])
        assert e.value.field == "tokens"


def test_response_truncated_at_every_byte():
    buf = wire.encode_response(wire.Response(tenant=1, session_id=2, request_id=3, status=200, body=b"hi"))
    for n in range(len(buf)):
        with pytest.raises(WireError) as e:
            wire.decode_response(buf[:n])
        if n < wire.RESP_HDR_LEN:
            off, size = wire.RESP_OFFSETS[e.value.field]
            assert off <= n < off + size
        else:
            assert e.value.field == "body"


# (name, field patched, value, field the error must name)
MALFORMED = [
    ("bad magic", "magic", 0xDEADBEEF, "magic"),
    ("bad version", "version", 1, "version"),
    ("version zero", "version", 0, "version"),
    ("unknown kind", "kind", 9, "kind"),
    ("response kind in a request", "kind", wire.KIND_RESPONSE, "kind"),
    ("unknown flag", "flags", 0x8000, "flags"),
    ("reserved set", "reserved", 1, "reserved"),
    ("zero chunk count", "chunk_count", 0, "chunk_count"),
    ("index past count", "chunk_index", 1, "chunk_index"),
    ("token count 0", "n_tokens", 0, "n_tokens"),
    ("token count 129", "n_tokens", 129, "n_tokens"),
    ("token count claims more than sent", "n_tokens", 4, "tokens"),
    ("token count claims fewer than sent", "n_tokens", 2, "tokens"),
]


@pytest.mark.parametrize("name,field,value,named", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_request_names_field(name, field, value, named):
    with pytest.raises(WireError) as e:
        wire.decode_request(patch(chunk(), field, value))
    assert e.value.field == named
    assert named in str(e.value)


def test_token_count_129_with_matching_length_still_rejected():
    raw = wire.pack_request_raw(tokens=tuple(range(129)))
    with pytest.raises(WireError) as e:
        wire.decode_request(raw)
    assert e.value.field == "n_tokens"


def test_open_and_close_carry_no_tokens():
    raw = wire.pack_request_raw(kind=wire.KIND_OPEN, tokens=(1,))
    with pytest.raises(WireError) as e:
        wire.decode_request(raw)
    assert e.value.field == "n_tokens"
    ok = wire.decode_request(wire.pack_request_raw(kind=wire.KIND_OPEN, chunk_count=3, max_output_tokens=9))
    assert ok.kind == wire.KIND_OPEN and ok.chunk_count == 3 and ok.tokens == ()


def test_trailing_bytes_rejected():
    with pytest.raises(WireError) as e:
        wire.decode_request(chunk() + b"\0")
    assert e.value.field == "tokens"


def test_encoder_refuses_what_decoder_would_reject():
    with pytest.raises(WireError) as e:
        chunk(tokens=tuple(range(129)))
    assert e.value.field == "n_tokens"
    with pytest.raises(WireError) as e:
        chunk(tokens=())
    assert e.value.field == "n_tokens"
    with pytest.raises(WireError):
        chunk(tenant=1 << 32)
    with pytest.raises(WireError) as e:
        wire.encode_response(wire.Response(tenant=1, session_id=2, request_id=3, status=201))
    assert e.value.field == "status"


@pytest.mark.parametrize("field,value,named", [
    ("magic", 1, "magic"), ("kind", wire.KIND_CHUNK, "kind"), ("status", 204, "status"),
    ("body_len", wire.MAX_RESP_BODY + 1, "body_len"), ("body_len", 3, "body"),
])
def test_malformed_response_names_field(field, value, named):
    buf = wire.encode_response(wire.Response(tenant=1, session_id=2, request_id=3, status=429, body=b"xy"))
    with pytest.raises(WireError) as e:
        wire.decode_response(patch(buf, field, value, wire.RESP_OFFSETS, wire.RESP_FIELDS))
    assert e.value.field == named


# --- tags ---------------------------------------------------------------------------------------

def test_siphash_matches_the_paper_s_test_vectors():
    key = bytes(range(16))
    assert wire.siphash24(key, b"") == 0x726FDB47DD0E0E31           # vectors.h, length 0
    assert wire.siphash24(key, bytes(range(15))) == 0xA129CA6149BE45E5  # the paper's appendix A
    assert wire.siphash24(key, bytes(range(8))) == 0x93F5F5799A932462    # vectors.h, length 8
    assert wire.siphash24(key, bytes(range(48))) == 0xE612A3CB9ECBA951   # vectors.h, length 48: a header's


@given(st.binary(min_size=wire.REQ_HDR_LEN, max_size=wire.REQ_HDR_LEN), st.binary(min_size=16, max_size=16))
def test_the_c_tag_is_the_python_tag(header, key):
    from datapath._ingress import lib
    assert lib.dp_req_tag_of(header, key) == wire.request_tag(key, header)


@given(requests(), st.binary(min_size=16, max_size=16))
def test_a_request_encoded_with_a_key_carries_its_header_s_tag(req, key):
    buf = wire.encode_request(req, key)
    got = wire.decode_request(buf)
    assert got.tag == wire.request_tag(key, buf) and got == wire.Request(**{**req.__dict__, "tag": got.tag})
    assert wire.decode_request(wire.encode_request(req)).tag == 0


def test_tenant_keys_are_the_master_s_and_differ_per_tenant():
    master = b"m" * 32
    keys = {wire.tenant_key(master, t) for t in range(100)}
    assert len(keys) == 100 and all(len(k) == wire.TAG_KEY_LEN for k in keys)
    assert wire.tenant_key(master, 5) == wire.tenant_key(master, 5) != wire.tenant_key(b"n" * 32, 5)
    with pytest.raises(ValueError):
        wire.tenant_key(b"short", 1)


def test_a_trace_out_of_range_or_with_reserved_bits_is_a_wire_error():
    """A worker past 16 bits raised a bare struct.error at encoding; a trace whose reserved field
    was not zero decoded (bpf/wire.h: reserved fields are zero). A review's probe."""
    resp = dict(tenant=1, session_id=2, request_id=3, status=200, body=b"{}")
    with pytest.raises(WireError, match="trace"):
        wire.encode_response(wire.Response(**resp, trace={"worker": 70000}))
    with pytest.raises(WireError, match="trace"):
        wire.encode_response(wire.Response(**resp, trace={"reserved": 1}))
    buf = bytearray(wire.encode_response(wire.Response(**resp, trace={"worker": 3})))
    struct.pack_into("<I", buf, len(buf) - 4, 0xDEADBEEF)
    with pytest.raises(WireError, match="reserved"):
        wire.decode_response(bytes(buf))
