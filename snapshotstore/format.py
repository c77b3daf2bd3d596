"""The snapshot store's on-device format, defined once (little-endian).

    block 0, block 1   the superblock, two copies; a head move writes both
                       (each synced), a flush's checkpoint goes to copy
                       generation % 2, so a torn superblock write leaves the
                       other copy; open takes the valid copy with the
                       highest generation
    block 2 ...        the log: block-aligned records, append-only, circular

A record is a header followed by its payload, padded to whole blocks; one
CRC32C covers the header (with its crc field zero) and the payload. A record
whose header and payload fit one block is written as one block (one LBA: an
atomic write on NVMe). Positions in the log are logical block numbers that
only grow (lpos); the physical block is LOG_START + lpos % log_blocks. Every
record carries its lpos, the store id and the epoch (the superblock
generation when the store was opened), so a stale block from an earlier lap,
an earlier format or an earlier crashed session never passes for a live one;
the superblock carries its writer's epoch, which every record from its tail
on has or exceeds (what a recovery that resyncs past damage checks).

tests/test_snapshot_format.py pins every offset below.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import crc32c as _crc32c

SB_MAGIC = b"ZLSNAPSB"
RECORD_MAGIC = b"ZLR1"
VERSION = 2                    # 2: the superblock records its writer's epoch (1 is read too)
SB_COPIES = 2
LOG_START = SB_COPIES          # first log block
MIN_LOG_BLOCKS = 64            # a store's log is at least this long (format_device)
# the index links a chain's records by their numbers' low 32 bits (native/snapindex.h), unique
# while the log holds fewer than 2^32 records: each takes a block at least
MAX_LOG_BLOCKS = (1 << 32) - 1
KEY_LEN = 32                   # HMAC-SHA256 of the session id
CODEC_LEN = 16                 # codec name, ASCII, NUL-padded
FILE_BLOCK_SIZE = 4096         # block size of a regular-file device

KIND_DELTA = 1      # one KV delta, parent = the previous record of the chain
KIND_BASE = 2       # a whole chain merged into one record (compaction); parent 0; payload: pack_parts
KIND_TOMBSTONE = 3  # the key was deleted: drop its chain
KIND_PAD = 4        # fills the log to the end of the lap, written whole: a header, then zeros
KIND_NAMES = {KIND_DELTA: "delta", KIND_BASE: "base", KIND_TOMBSTONE: "tombstone", KIND_PAD: "pad"}

FLAG_ZLIB = 1       # payload is zlib-compressed; raw_len is the length after inflating


def crc32c(data, value: int = 0) -> int:
    return _crc32c.crc32c(data, value)


_U32 = struct.Struct("<I")


def pack_parts(parts: list[bytes]) -> bytes:
    """A base record's payload: u32 count, count u32 lengths, then the deltas it merged, in
    order, so that a restore can still hand them back one by one."""
    return struct.pack(f"<I{len(parts)}I", len(parts), *map(len, parts)) + b"".join(parts)


def unpack_parts(payload: bytes) -> list[bytes]:
    n = _U32.unpack_from(payload)[0]
    lens = struct.unpack_from(f"<{n}I", payload, 4)
    out, off = [], 4 + 4 * n
    for ln in lens:
        out.append(payload[off:off + ln])
        off += ln
    if off != len(payload):
        raise ValueError("a base record's parts do not add up to its payload")
    return out


class Layout:
    """A little-endian struct given as (name, format) fields, with each field's offset."""

    def __init__(self, fields: tuple[tuple[str, str], ...]):
        self.fields = fields
        self.struct = struct.Struct("<" + "".join(f for _, f in fields))
        self.size = self.struct.size
        self.offsets, off = {}, 0
        for name, fmt in fields:
            self.offsets[name] = off
            off += struct.calcsize("<" + fmt)
        assert off == self.size, "implicit padding in a layout"


SUPERBLOCK = Layout((
    ("magic", "8s"),
    ("version", "I"),
    ("block_size", "I"),
    ("store_id", "Q"),          # random at format: records of an earlier format never match
    ("capacity_blocks", "Q"),   # blocks of the device the store uses
    ("log_start", "Q"),
    ("log_blocks", "Q"),
    ("head", "Q"),              # lpos of the oldest record kept; everything before is reclaimed
    ("tail", "Q"),              # lpos at the checkpoint: everything before it was durable
    ("generation", "Q"),        # +1 on every superblock write
    ("last_seq", "Q"),          # sequence numbers never go back, even when the log is empty
    ("epoch", "Q"),             # the writing open's: every record from tail on carries it or a newer one
    ("checksum", "I"),          # CRC32C of every byte before it
    ("reserved", "I"),
))

# Version 1 (before session 30): the same superblock without the epoch. Read as epoch 0 (no
# floor: the check it lacked), and the first read-write open writes version 2; records are alike.
SUPERBLOCK_V1 = Layout(tuple(f for f in SUPERBLOCK.fields if f[0] != "epoch"))

RECORD = Layout((
    ("magic", "4s"),
    ("kind", "B"),
    ("flags", "B"),
    ("reserved0", "H"),
    ("store_id", "Q"),
    ("lpos", "Q"),              # where the record was written: a block from an earlier lap differs
    ("epoch", "Q"),             # generation at open: non-decreasing along the log
    ("seq", "Q"),
    ("parent_seq", "Q"),        # 0: starts a chain
    ("key", f"{KEY_LEN}s"),
    ("token_start", "I"),
    ("token_end", "I"),
    ("layer_start", "H"),
    ("layer_end", "H"),
    ("nblocks", "I"),           # blocks the record occupies in the log
    ("raw_len", "I"),
    ("stored_len", "I"),
    ("codec", f"{CODEC_LEN}s"),
    ("crc", "I"),               # CRC32C over the header with crc = 0, then the stored payload
    ("reserved1", "I"),
))
HEADER_SIZE = RECORD.size
_CRC_OFF = RECORD.offsets["crc"]
_SB_CRC_OFF = SUPERBLOCK.offsets["checksum"]
_SB_V1_CRC_OFF = SUPERBLOCK_V1.offsets["checksum"]


class Superblock(NamedTuple):
    block_size: int
    store_id: int
    capacity_blocks: int
    log_start: int
    log_blocks: int
    head: int
    tail: int
    generation: int
    last_seq: int
    epoch: int


class RecordHeader(NamedTuple):
    kind: int
    flags: int
    store_id: int
    lpos: int
    epoch: int
    seq: int
    parent_seq: int
    key: bytes
    token_start: int
    token_end: int
    layer_start: int
    layer_end: int
    nblocks: int
    raw_len: int
    stored_len: int
    codec: str
    crc: int


def pack_superblock(sb: Superblock) -> bytes:
    body = SUPERBLOCK.struct.pack(SB_MAGIC, VERSION, sb.block_size, sb.store_id, sb.capacity_blocks,
                                  sb.log_start, sb.log_blocks, sb.head, sb.tail, sb.generation,
                                  sb.last_seq, sb.epoch, 0, 0)
    crc = crc32c(body[:_SB_CRC_OFF])
    return body[:_SB_CRC_OFF] + struct.pack("<I", crc) + body[_SB_CRC_OFF + 4:]


def unpack_superblock(buf) -> Superblock | None:
    """The superblock in buf, or None if it is not a valid one (magic, version, checksum)."""
    f = SUPERBLOCK.struct.unpack_from(buf)
    if f[0] == SB_MAGIC and f[1] == 1:
        f = SUPERBLOCK_V1.struct.unpack_from(buf)
        if f[11] != crc32c(bytes(buf[:_SB_V1_CRC_OFF])):
            return None
        return Superblock(*f[2:11], epoch=0)
    if f[0] != SB_MAGIC or f[1] != VERSION or f[12] != crc32c(bytes(buf[:_SB_CRC_OFF])):
        return None
    return Superblock(*f[2:12])


def superblock_version(buf) -> int | None:
    """The format version a block with the superblock's magic says it was written in, else None:
    how a store of another version is told from no store at all."""
    magic, version = SUPERBLOCK.struct.unpack_from(buf)[:2]
    return version if magic == SB_MAGIC else None


def record_blocks(stored_len: int, block_size: int) -> int:
    return -(-(HEADER_SIZE + stored_len) // block_size)


def pack_record_into(buf, off: int, h: RecordHeader, payload) -> None:
    """Write header + payload at buf[off:], crc computed here (h.crc is ignored)."""
    codec = h.codec.encode("ascii")
    RECORD.struct.pack_into(buf, off, RECORD_MAGIC, h.kind, h.flags, 0, h.store_id, h.lpos, h.epoch,
                            h.seq, h.parent_seq, h.key, h.token_start, h.token_end, h.layer_start,
                            h.layer_end, h.nblocks, h.raw_len, h.stored_len, codec, 0, 0)
    end = off + HEADER_SIZE + len(payload)
    buf[off + HEADER_SIZE:end] = payload
    view = memoryview(buf)
    crc = crc32c(view[off:end])
    struct.pack_into("<I", buf, off + _CRC_OFF, crc)


def unpack_header(buf, off: int = 0) -> RecordHeader | None:
    """The header at buf[off:], or None if the magic is wrong (the CRC is checked by record_crc_ok)."""
    f = RECORD.struct.unpack_from(buf, off)
    if f[0] != RECORD_MAGIC:
        return None
    return RecordHeader(f[1], f[2], *f[4:17], f[17].rstrip(b"\0").decode("ascii", "replace"), f[18])


def record_crc_ok(buf, off: int, h: RecordHeader) -> bool:
    """CRC32C of header (crc zeroed) + payload equals the stored crc."""
    view = memoryview(buf)
    crc = crc32c(view[off:off + _CRC_OFF])
    crc = crc32c(b"\0\0\0\0", crc)
    crc = crc32c(view[off + _CRC_OFF + 4:off + HEADER_SIZE + h.stored_len], crc)
    return crc == h.crc


def read_record(buf, lpos: int, seq: int, key: bytes) -> tuple[RecordHeader, bytes] | None:
    """The header and stored payload of the record at buf[0:] if it is the record the index
    expects there (magic, position, sequence, key) and its CRC holds; else None (restore's path)."""
    h = unpack_header(buf)
    if h is None or h.lpos != lpos or h.seq != seq or h.key != key or not record_crc_ok(buf, 0, h):
        return None
    return h, bytes(memoryview(buf)[HEADER_SIZE:HEADER_SIZE + h.stored_len])
