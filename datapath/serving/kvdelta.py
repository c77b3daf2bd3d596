"""KV deltas: the K/V entries a session gained since its last snapshot, and their codecs.

A delta covers tokens [token_start, token_end) of one session, for every layer
and KV head, and names the request that wrote it. Its stored form is a 64-byte
header and a codec payload:

  off  field            off  field
    0  magic "ZLKD"      24  n_layers u16, n_kv_heads u16
    4  format u16 = 3|4  28  head_dim u16, n_answered u16 (format 3: 0)
    6  codec_version u16 32  token_start u32
    8  codec name 16s    36  token_end u32
                         40  payload_len u32
                         44  request_id u64 (0: none)
                         52  sent_ns u64 (the request's client send stamp; 0: none)
                         60  crc32 u32 (zlib CRC-32 of the header with this field 0, then the
                             answered list, then the payload)
   64  format 4 only: n_answered x (request_id u64, sent_ns u64), oldest first

Little-endian. The checksum lets a corrupted delta fail at import with a clear
error; the snapshot store adds its own record checksum around it. The request id
and its send stamp let a worker that replays a request after a failover see that
its turn is already in the store (worker.py, _restore): the id alone matched an
earlier request of the session that reused it. A delta that begins a chain again
from token 0 (a whole re-put, a turn taken back out) names no request; it carries
the session's last answered requests instead (format 4, at most 8), which the
turns it replaces named, so a verbatim repeat of one is still refused 409. Format 3
is written when there are none. Formats 1 (48 bytes, no request id) and 2 (56
bytes, no send stamp) are still read.

Codecs (name, version):
  raw 1        K then V, fp16, (layers, KV heads, tokens, head dim) order
  zstd 1       raw compressed with zstandard level 3
  lz4 1        raw compressed with lz4.frame
  int8_zstd 1  lossy: per-channel int8 (one fp16 scale per layer, KV head and
               head-dim channel over the delta's tokens, for K and V), then zstd
"""
from __future__ import annotations

import struct
import zlib
from typing import Protocol
from dataclasses import dataclass

import lz4.frame
import numpy as np
import zstandard

from .model import KV_DTYPE, KVCache, ModelConfig

MAGIC = b"ZLKD"
FORMAT = 4                # (3 when it carries no answered requests)
HEADER = struct.Struct("<4sHH16sHHHHIIIQQI")
HEADER_LEN = HEADER.size  # 64: format 4's answered list follows
CRC_OFFSET = HEADER_LEN - 4
FP16_MAX = float(np.finfo(np.float16).max)
ANSWERED = struct.Struct("<QQ")   # format 4: one answered request, (id, send stamp)
MAX_ANSWERED = 8
HEADER_V1 = struct.Struct("<4sHH16sHHHHIIII")   # format 1: no request id
HEADER_V2 = struct.Struct("<4sHH16sHHHHIIIQI")  # format 2: no send stamp


class DeltaError(ValueError):
    """A delta that cannot be imported: corrupted, for another model, or out of order."""


@dataclass
class KVDelta:
    token_start: int
    token_end: int
    k: np.ndarray  # (layers, KV heads, n, head dim) fp16
    v: np.ndarray

    @property
    def n_tokens(self) -> int:
        return self.token_end - self.token_start


class Codec(Protocol):
    """What every codec provides (RawCodec and Int8ZstdCodec below)."""
    name: str
    version: int
    lossless: bool

    def encode(self, k: np.ndarray, v: np.ndarray) -> bytes: ...

    def decode(self, payload: bytes, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]: ...


def _split_raw(raw: bytes, shape) -> tuple[np.ndarray, np.ndarray]:
    n = int(np.prod(shape)) * KV_DTYPE.itemsize
    if len(raw) != 2 * n:
        raise DeltaError(f"KV delta payload decodes to {len(raw)} bytes, its header implies {2 * n}")
    kv = np.frombuffer(raw, KV_DTYPE)
    return kv[:n // 2].reshape(shape).copy(), kv[n // 2:].reshape(shape).copy()


class RawCodec(Codec):
    name, version, lossless = "raw", 1, True

    def encode(self, k, v):
        return np.ascontiguousarray(k, KV_DTYPE).tobytes() + np.ascontiguousarray(v, KV_DTYPE).tobytes()

    def decode(self, payload, shape):
        return _split_raw(payload, shape)


class ZstdCodec(RawCodec):
    name, version, lossless = "zstd", 1, True
    level = 3

    def encode(self, k, v):
        return zstandard.ZstdCompressor(level=self.level).compress(super().encode(k, v))

    def decode(self, payload, shape):
        try:
            raw = zstandard.ZstdDecompressor().decompress(payload)
        except zstandard.ZstdError as e:
            raise DeltaError(f"KV delta payload is not valid zstd: {e}") from None
        return _split_raw(raw, shape)


class Lz4Codec(RawCodec):
    name, version, lossless = "lz4", 1, True

    def encode(self, k, v):
        return lz4.frame.compress(super().encode(k, v))

    def decode(self, payload, shape):
        try:
            raw = lz4.frame.decompress(payload)
        except RuntimeError as e:
            raise DeltaError(f"KV delta payload is not valid lz4: {e}") from None
        return _split_raw(raw, shape)


class Int8ZstdCodec(Codec):
    name, version, lossless = "int8_zstd", 1, False

    @staticmethod
    def _quantize(x):
        x = x.astype(np.float32)
        # One scale per (layer, head, channel) over the delta's tokens; rounded to fp16 first
        # so encoder and decoder use the same scale. Over the finite values only: one inf or NaN
        # made its channel's scale non-finite, and every token of the channel decoded to NaN or
        # inf (found by review); such a value goes to the nearest end of the range (NaN: 0).
        finite = np.where(np.isfinite(x), np.abs(x), 0)
        peak = finite.max(axis=2, keepdims=True, initial=0.0)   # (initial: a delta of no tokens)
        scale = (peak / 127.0).astype(np.float16)
        safe = np.where(scale == 0, np.float16(1), scale).astype(np.float32)
        q = np.clip(np.nan_to_num(np.rint(x / safe), nan=0.0, posinf=127, neginf=-127), -127, 127).astype(np.int8)
        return scale.tobytes() + q.tobytes()

    def encode(self, k, v):
        return zstandard.ZstdCompressor(level=3).compress(self._quantize(k) + self._quantize(v))

    def decode(self, payload, shape):
        try:
            raw = zstandard.ZstdDecompressor().decompress(payload)
        except zstandard.ZstdError as e:
            raise DeltaError(f"KV delta payload is not valid zstd: {e}") from None
        L, H, n, D = shape
        n_scale, n_q = L * H * D * 2, L * H * n * D
        if len(raw) != 2 * (n_scale + n_q):
            raise DeltaError(f"int8 KV delta payload decodes to {len(raw)} bytes, its header implies "
                             f"{2 * (n_scale + n_q)}")
        out = []
        for off in (0, n_scale + n_q):
            scale = np.frombuffer(raw, np.float16, L * H * D, off).reshape(L, H, 1, D).astype(np.float32)
            q = np.frombuffer(raw, np.int8, n_q, off + n_scale).reshape(shape)
            # (clipped: a scale rounded up to fp16 took values near its largest, 65504, to inf)
            out.append(np.clip(q * scale, -FP16_MAX, FP16_MAX).astype(KV_DTYPE))
        return out[0], out[1]


CODECS: dict[str, Codec] = {c.name: c for c in (RawCodec(), ZstdCodec(), Lz4Codec(), Int8ZstdCodec())}


def export_delta(cache: KVCache, start: int | None = None, end: int | None = None) -> KVDelta:
    """The entries since the last snapshot (or [start, end)), for every layer."""
    start = cache.snapshot_len if start is None else start
    end = cache.length if end is None else end
    k, v = cache.entries(start, end)
    return KVDelta(start, end, k, v)


def encode(delta: KVDelta, config: ModelConfig, codec: str = "zstd", request_id: int = 0, sent_ns: int = 0,
           answered: tuple = ()) -> bytes:
    """answered: the session's last answered requests, (id, send stamp) oldest first, that a delta
    beginning its chain again carries (format 4)."""
    if codec not in CODECS:
        raise ValueError(f"unknown KV codec {codec!r}: choose one of {', '.join(CODECS)}")
    if len(answered) > MAX_ANSWERED:
        raise ValueError(f"a delta carries at most {MAX_ANSWERED} answered requests, not {len(answered)}")
    c = CODECS[codec]
    payload = c.encode(delta.k, delta.v)
    listed = b"".join(ANSWERED.pack(rid, sent) for rid, sent in answered)
    hdr = HEADER.pack(MAGIC, FORMAT if answered else 3, c.version, c.name.encode(), config.n_layers,
                      config.n_kv_heads, config.head_dim, len(answered), delta.token_start, delta.token_end,
                      len(payload), request_id, sent_ns, 0)
    crc = zlib.crc32(payload, zlib.crc32(listed, zlib.crc32(hdr)))
    return hdr[:CRC_OFFSET] + struct.pack("<I", crc) + listed + payload


def header(buf: bytes) -> dict:
    """The header's fields, checked for magic and format only (no checksum)."""
    if len(buf) < HEADER_V1.size:
        raise DeltaError(f"KV delta is {len(buf)} bytes, shorter than its {HEADER_LEN}-byte header")
    magic, fmt = struct.unpack_from("<4sH", buf)
    if magic != MAGIC:
        raise DeltaError(f"not a KV delta: magic {magic!r}, expected {MAGIC!r}")
    rid = sent = 0
    answered: tuple = ()
    if fmt == 1:
        _, _, cver, name, L, H, D, _, start, end, plen, crc = HEADER_V1.unpack_from(buf)
        hlen = HEADER_V1.size
    elif fmt in (2, 3, FORMAT):
        hlen = (HEADER_V2 if fmt == 2 else HEADER).size
        if len(buf) < hlen:
            raise DeltaError(f"KV delta is {len(buf)} bytes, shorter than its {hlen}-byte header")
        if fmt == 2:
            _, _, cver, name, L, H, D, _, start, end, plen, rid, crc = HEADER_V2.unpack_from(buf)
        else:
            _, _, cver, name, L, H, D, n, start, end, plen, rid, sent, crc = HEADER.unpack_from(buf)
            if fmt == FORMAT:
                if not 1 <= n <= MAX_ANSWERED or len(buf) < hlen + n * ANSWERED.size:
                    raise DeltaError(f"KV delta format 4 lists {n} answered requests: 1 to {MAX_ANSWERED}, "
                                     f"in {len(buf) - hlen} bytes after its header")
                answered = tuple(ANSWERED.unpack_from(buf, hlen + i * ANSWERED.size) for i in range(n))
                hlen += n * ANSWERED.size
    else:
        raise DeltaError(f"KV delta format {fmt} is not supported (this build reads formats 1 to {FORMAT})")
    return dict(codec=name.rstrip(b"\0").decode(errors="replace"), codec_version=cver, n_layers=L,
                n_kv_heads=H, head_dim=D, token_start=start, token_end=end, payload_len=plen, request_id=rid,
                sent_ns=sent, answered=answered, crc32=crc, header_len=hlen,
                crc_offset=CRC_OFFSET if fmt >= 3 else hlen - 4)


def decode(buf: bytes, config: ModelConfig) -> KVDelta:
    """Verify and decode a stored delta; DeltaError says what is wrong with it."""
    h = header(buf)
    hlen = h["header_len"]
    if len(buf) != hlen + h["payload_len"]:
        raise DeltaError(f"KV delta is {len(buf)} bytes, its header says {hlen + h['payload_len']}: truncated or padded")
    off = h["crc_offset"]
    zeroed = bytes(buf[:off]) + b"\0\0\0\0" + bytes(buf[off + 4:hlen])   # (format 4: the list after it)
    crc = zlib.crc32(memoryview(buf)[hlen:], zlib.crc32(zeroed))
    if crc != h["crc32"]:
        raise DeltaError(f"KV delta for tokens {h['token_start']}..{h['token_end']} is corrupted: "
                         f"CRC-32 {crc:#010x}, header says {h['crc32']:#010x}")
    shape_here = (config.n_layers, config.n_kv_heads, config.head_dim)
    if (h["n_layers"], h["n_kv_heads"], h["head_dim"]) != shape_here:
        raise DeltaError(f"KV delta is for a model with {h['n_layers']} layers x {h['n_kv_heads']} KV heads x "
                         f"{h['head_dim']} dims, this one has {shape_here[0]} x {shape_here[1]} x {shape_here[2]}")
    codec = CODECS.get(h["codec"])
    if codec is None or codec.version != h["codec_version"]:
        raise DeltaError(f"KV delta uses codec {h['codec']} v{h['codec_version']}, which this build cannot decode")
    if h["token_end"] < h["token_start"]:
        raise DeltaError(f"KV delta token range {h['token_start']}..{h['token_end']} is reversed")
    shape = (config.n_layers, config.n_kv_heads, h["token_end"] - h["token_start"], config.head_dim)
    k, v = codec.decode(bytes(memoryview(buf)[hlen:]), shape)
    return KVDelta(h["token_start"], h["token_end"], k, v)


def import_delta(cache: KVCache, delta: KVDelta):
    """Append a delta that starts where the cache ends; the entries count as snapshotted."""
    if delta.token_start != cache.length:
        raise DeltaError(f"KV delta starts at token {delta.token_start} but the session has {cache.length}: "
                         "a delta of the chain is missing or out of order")
    cache.append(delta.k, delta.v)
    cache.snapshot_len = cache.length


def restore(chain: list[bytes], config: ModelConfig) -> KVCache:
    """A session's cache rebuilt from its chain of stored deltas, oldest first."""
    deltas = [decode(buf, config) for buf in chain]  # every checksum verified before any allocation
    total = sum(d.n_tokens for d in deltas)
    cache = KVCache(config, capacity=min(max(total, 128), config.max_context))
    for d in deltas:
        import_delta(cache, d)
    return cache
