"""KV deltas: sizes follow the formula, lossless codecs round-trip exactly, int8 is bounded, corruption is caught."""
import numpy as np
import pytest

from datapath.serving import kvdelta
from datapath.serving.kvdelta import CODECS, DeltaError
from datapath.serving.model import KVCache, Model, ModelConfig

LOSSLESS = [n for n, c in CODECS.items() if c.lossless]


@pytest.fixture(scope="module")
def model():
    return Model(ModelConfig(), seed=0)


@pytest.fixture(scope="module")
def session(model):
    """A session with a 200-token prompt snapshotted, then 1 decode step."""
    cache = KVCache(model.config)
    model.prefill(cache, np.random.default_rng(4).integers(0, 512, 200))
    cache.snapshot_len = cache.length
    model.decode(cache, 17)
    return cache


def test_raw_sizes_match_the_formula(model, session):
    per_token = model.config.kv_bytes_per_token
    step = kvdelta.encode(kvdelta.export_delta(session), model.config, "raw")
    chunk = kvdelta.encode(kvdelta.export_delta(session, 0, 128), model.config, "raw")
    assert len(step) == kvdelta.HEADER_LEN + 1 * per_token <= 4096
    assert len(chunk) == kvdelta.HEADER_LEN + 128 * per_token
    assert kvdelta.header(step)["token_start"] == 200 and kvdelta.header(step)["token_end"] == 201


@pytest.mark.parametrize("codec", list(CODECS))
def test_round_trip(model, session, codec):
    delta = kvdelta.export_delta(session, 0, session.length)
    blob = kvdelta.encode(delta, model.config, codec)
    back = kvdelta.decode(blob, model.config)
    assert (back.token_start, back.token_end) == (0, 201)
    assert kvdelta.header(blob)["codec"] == codec
    if CODECS[codec].lossless:
        assert np.array_equal(back.k, delta.k) and np.array_equal(back.v, delta.v)
    else:
        # per-channel int8: error at most half a quantization step of that channel (+ fp16 rounding)
        for got, want in ((back.k, delta.k), (back.v, delta.v)):
            want32 = want.astype(np.float32)
            step = np.abs(want32).max(axis=2, keepdims=True) / 127
            assert np.all(np.abs(got.astype(np.float32) - want32) <= step * 0.51 + np.abs(want32) * 1e-3 + 1e-6)
            assert not np.array_equal(got, want)


def test_int8_keeps_values_at_the_ends_of_fp16_and_a_non_finite_value_to_itself(model):
    """Found by review: a scale rounded up to fp16 took values near 65504 to inf, and one inf or
    NaN made its whole channel decode non-finite. Now the largest come back finite, a non-finite
    value goes to its end of the range (NaN: 0) without touching its channel's other tokens, and
    a delta of no tokens encodes."""
    shape = (model.config.n_layers, model.config.n_kv_heads, 4, model.config.head_dim)
    k = np.full(shape, 1.0, np.float16)
    k[0, 0, :, 0] = [65504, -65504, 60000, 1]
    k[0, 0, :, 1] = [np.inf, 2.0, -4.0, np.nan]
    v = k.copy()
    back = kvdelta.decode(kvdelta.encode(kvdelta.KVDelta(0, 4, k, v), model.config, "int8_zstd"), model.config)
    got = back.k.astype(np.float32)
    assert np.isfinite(got).all()
    assert np.allclose(got[0, 0, :, 0], [65504, -65504, 60000, 0], atol=65504 / 254 + 1)
    assert np.allclose(got[0, 0, 1:3, 1], [2.0, -4.0], atol=4 / 254 + 1e-3) and got[0, 0, 0, 1] == 4.0
    assert got[0, 0, 3, 1] == 0 and np.array_equal(back.v, back.k)
    empty = np.zeros(shape[:2] + (0, shape[3]), np.float16)
    none = kvdelta.decode(kvdelta.encode(kvdelta.KVDelta(7, 7, empty, empty), model.config, "int8_zstd"),
                          model.config)
    assert none.k.shape == empty.shape and (none.token_start, none.token_end) == (7, 7)


@pytest.mark.parametrize("codec", LOSSLESS)
def test_chain_restore_is_exact(model, session, codec):
    chain = [kvdelta.encode(kvdelta.export_delta(session, a, b), model.config, codec)
             for a, b in ((0, 128), (128, 200), (200, 201))]
    cache = kvdelta.restore(chain, model.config)
    assert cache.length == cache.snapshot_len == 201
    assert np.array_equal(cache.k[:, :, :201], session.k[:, :, :201])
    assert np.array_equal(cache.v[:, :, :201], session.v[:, :, :201])
    with pytest.raises(DeltaError, match="missing or out of order"):
        kvdelta.restore([chain[0], chain[2]], model.config)


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("where", ["payload", "header", "crc"])
def test_corruption_fails_with_a_clear_error(model, session, codec, where):
    blob = bytearray(kvdelta.encode(kvdelta.export_delta(session, 0, 64), model.config, codec))
    pos = {"payload": len(blob) - 10, "header": 34, "crc": kvdelta.CRC_OFFSET}[where]
    blob[pos] ^= 0x40
    with pytest.raises(DeltaError, match="corrupted: CRC-32"):
        kvdelta.decode(bytes(blob), model.config)


@pytest.mark.parametrize("mangle,message", [
    (lambda b: b[:-1], "truncated"),
    (lambda b: b[:20], "shorter than its 64-byte header"),
    (lambda b: b"XXXX" + b[4:], "not a KV delta"),
])
def test_malformed_deltas(model, session, mangle, message):
    blob = kvdelta.encode(kvdelta.export_delta(session, 0, 8), model.config, "zstd")
    with pytest.raises(DeltaError, match=message):
        kvdelta.decode(mangle(blob), model.config)


def test_the_request_id_and_send_stamp_travel_and_formats_1_and_2_are_still_read(model, session):
    import struct
    import zlib
    blob = kvdelta.encode(kvdelta.export_delta(session, 0, 8), model.config, "zstd", request_id=2**63 + 5,
                          sent_ns=2**62 + 7)
    h = kvdelta.header(blob)
    assert (h["request_id"], h["sent_ns"]) == (2**63 + 5, 2**62 + 7) and len(blob) == 64 + h["payload_len"]
    f = list(kvdelta.HEADER.unpack_from(blob))
    payload = blob[kvdelta.HEADER_LEN:]
    for fmt, old in ((1, kvdelta.HEADER_V1.pack(*f[:1], 1, *f[2:11], 0)),     # no request id
                     (2, kvdelta.HEADER_V2.pack(*f[:1], 2, *f[2:12], 0))):    # no send stamp
        crc = zlib.crc32(payload, zlib.crc32(old))
        before = old[:-4] + struct.pack("<I", crc) + payload
        h = kvdelta.header(before)
        assert (h["request_id"], h["sent_ns"]) == ((0 if fmt == 1 else 2**63 + 5), 0)
        back = kvdelta.decode(before, model.config)
        assert np.array_equal(back.k, session.k[:, :, :8]) and (back.token_start, back.token_end) == (0, 8)
    with pytest.raises(DeltaError, match="format 5 is not supported"):
        kvdelta.header(blob[:4] + struct.pack("<H", 5) + blob[6:])


def test_a_delta_that_begins_a_chain_again_carries_the_session_s_answered_requests(model, session):
    """Format 4: a whole re-put or a turn taken back names no request, and with the turns it
    replaced went the ids a verbatim repeat is refused 409 by (found by review: a resend of an
    answered request ran again after a failover's take-back). Its list travels under the CRC;
    without one the delta is format 3, as before."""
    import struct
    answered = ((5, 1_000), (2**64 - 1, 2**63 + 3))
    blob = kvdelta.encode(kvdelta.export_delta(session, 0, 8), model.config, "lz4", answered=answered)
    h = kvdelta.header(blob)
    assert h["answered"] == answered and h["request_id"] == 0 and h["header_len"] == 64 + 32
    assert struct.unpack_from("<H", blob, 4) == (4,) and len(blob) == 96 + h["payload_len"]
    back = kvdelta.decode(blob, model.config)
    assert np.array_equal(back.k, session.k[:, :, :8]) and np.array_equal(back.v, session.v[:, :, :8])
    plain = kvdelta.encode(kvdelta.export_delta(session, 0, 8), model.config, "lz4", request_id=9, sent_ns=3)
    assert struct.unpack_from("<H", plain, 4) == (3,) and kvdelta.header(plain)["answered"] == ()
    bad = bytearray(blob)
    bad[70] ^= 1                                      # a bit of the list
    with pytest.raises(DeltaError, match="corrupted"):
        kvdelta.decode(bytes(bad), model.config)
    for n, size in ((0, len(blob)), (9, len(blob)), (2, 64 + 20)):   # none, too many, a list cut short
        with pytest.raises(DeltaError, match="lists"):
            kvdelta.header((blob[:30] + struct.pack("<H", n) + blob[32:])[:size])
    with pytest.raises(ValueError, match="at most 8"):
        kvdelta.encode(kvdelta.export_delta(session, 0, 8), model.config, "lz4", answered=((1, 1),) * 9)


def test_delta_for_another_model_is_refused(model, session):
    blob = kvdelta.encode(kvdelta.export_delta(session, 0, 8), model.config, "raw")
    other = ModelConfig(n_layers=2)
    with pytest.raises(DeltaError, match="4 layers x 2 KV heads x 32 dims, this one has 2 x 2 x 32"):
        kvdelta.decode(blob, other)


def test_unknown_codec():
    with pytest.raises(ValueError, match="unknown KV codec 'gzip'"):
        kvdelta.encode(None, ModelConfig(), "gzip")


def test_int8_restore_bounds_logit_error(model, session):
    """Continue from an int8-restored cache: logits stay close to the exact cache's."""
    chain = [kvdelta.encode(kvdelta.export_delta(session, 0, 201), model.config, "int8_zstd")]
    lossy, exact = kvdelta.restore(chain, model.config), session.clone()
    a, b = model.decode(exact, 99), model.decode(lossy, 99)
    err = np.abs(a - b).max()
    assert 0 < err < 0.25, err  # logits spread ~4; measured ~0.02 here
