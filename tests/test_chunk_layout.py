"""native/chunk.h and datapath/chunk.py agree byte for byte.

datapath._chunk_layout is compiled from the header itself (its cdef is the
header's LAYOUT section), so ffi.offsetof/sizeof are the C compiler's answers.
"""
from datapath import chunk
from datapath._chunk_layout import ffi, lib


def test_every_field_offset_and_size():
    ctype = ffi.typeof("struct dp_chunk")
    c_fields = [name for name, _ in ctype.fields]
    assert c_fields == list(chunk.CHUNK_DTYPE.names), "same fields in the same order"
    for name, cfield in ctype.fields:
        dt, off = chunk.CHUNK_DTYPE.fields[name]
        assert off == ffi.offsetof("struct dp_chunk", name), name
        assert dt.itemsize == ffi.sizeof(cfield.type), name
    assert chunk.CHUNK_DTYPE.itemsize == ffi.sizeof("struct dp_chunk") == lib.DP_CHUNK_LEN == chunk.CHUNK_LEN
    assert ffi.offsetof("struct dp_chunk", "tokens") == lib.DP_CHUNK_HDR_LEN == chunk.CHUNK_HDR_LEN


def test_bytes_identical_to_c_struct():
    c = ffi.new("struct dp_chunk *")
    values = dict(session_id=0x1122334455667788, request_id=0x99AABBCCDDEEFF00, tenant=7, max_output_tokens=64,
                  chunk_index=2, chunk_count=5, kind=lib.DP_KIND_CHUNK, queue=3, batch_seq=0x01020304,
                  t_send=11, t_xdp=12, t_consumer=13, t_router=14, t_lane=15, t_worker=16, flags=1)
    for k, v in values.items():
        setattr(c, k, v)
    c.n_tokens = 3
    c.tokens[0:3] = [5, 6, 0xFFFFFFFF]
    py = chunk.make_batch([dict(values, tokens=[5, 6, 0xFFFFFFFF])], batch_seq=0x01020304)
    c.batch_len, c.batch_pos = 1, 0
    assert py.tobytes() == bytes(ffi.buffer(c))
    back = chunk.batch_from_bytes(bytes(ffi.buffer(c)))
    assert back[0]["session_id"] == values["session_id"] and list(back[0]["tokens"][:3]) == [5, 6, 0xFFFFFFFF]


def test_partial_record_is_refused():
    import pytest
    with pytest.raises(ValueError, match="whole number of 608-byte"):
        chunk.batch_from_bytes(b"\0" * 700)
