"""LogStore's index: the log's records and the sessions' chains, packed in native memory
(native/snapindex.h says how), here with a lock and Python values.

Every call on the index holds its own lock: the C code runs without the GIL, and a put reads its
chain without the store's lock (so writers queue up while a flush is in progress) while
another thread's batch may be growing the tables under it.

Records join the index by their headers as the device holds them: one rule, in C
(six_apply_header), for a record a put stages (stage: six_stage lays it out and links it in one
call) and one recovery finds (Scan). append and apply are that rule's single steps, which
tests/test_snapshot_index.py drives op by op against its model.
"""
from __future__ import annotations

import os
import struct
import threading
from typing import Iterator, NamedTuple

from ._snapindex import ffi, lib
from .format import CODEC_LEN, HEADER_SIZE, KEY_LEN

assert (lib.SIX_KEY_LEN, lib.SIX_CODEC_LEN, lib.SIX_HEADER_SIZE) == (KEY_LEN, CODEC_LEN, HEADER_SIZE)


def _layout(ctype: str, names: tuple[str, ...]) -> struct.Struct:
    """The C struct ctype (snapindex.h defines it) as a struct.Struct, read from cffi: one call
    unpacks what field by field through cffi cost ~35 ns a field. names: its fields in order,
    as the caller unpacks them."""
    fields = ffi.typeof(ctype).fields
    assert tuple(n for n, _ in fields) == names, f"{ctype}'s fields moved: {fields}"
    codes = {"uint64_t": "Q", "uint32_t": "I", "uint16_t": "H", "uint8_t": "B"}
    fmt, at = "=", 0
    for _, f in fields:
        fmt += "x" * (f.offset - at) + codes[f.type.cname]
        at = f.offset + ffi.sizeof(f.type)
    return struct.Struct(fmt + "x" * (ffi.sizeof(ctype) - at))


_CHAIN = _layout("struct six_chain", ("last_seq", "sid", "gen", "nrec", "token_start", "token_end", "raw_len",
                                      "codec", "layer_start", "layer_end"))
_PART = _layout("struct six_part", ("off", "len", "flags", "kind", "reserved"))


class Rec(NamedTuple):
    """A record of the log as the index holds it."""
    rid: int            # its place in the log: records appended before it since the store opened
    lpos: int
    seq: int
    nblocks: int
    kind: int
    live: bool


class Chain(NamedTuple):
    """A session's chain as the index holds it: what a put or a restore must know without reading it."""
    sid: int            # its session's slot
    gen: int            # this chain's own number: another one under the same key has another
    records: int
    tokens: tuple[int, int]
    layers: tuple[int, int]
    raw_len: int        # its records' payload bytes before compression
    codec: str
    last_seq: int


class Index:
    def __init__(self):
        ix = lib.six_new()
        if ix == ffi.NULL:
            raise MemoryError("no memory for the snapshot store's index")
        self._ix = ffi.gc(ix, lib.six_free)
        self._lock = threading.Lock()
        self._codec_names: list[str] = []       # six.codec's names, decoded once
        # six_read_chain's outputs, kept (under the lock) rather than allocated for each restore
        self._at, self._err = ffi.new("uint64_t *"), ffi.new("int *")
        self._parts_room(16)
        self._buf = self._cbuf = None        # the last read buffer and its cffi view
        self._found = ffi.new("struct six_chain *")     # six_lookup's answer
        self._found_bytes = ffi.buffer(self._found)

    # --- counts (fields of the fixed struct: read without the lock) -------------------------

    head = property(lambda self: self._ix.head)                 # rids [head, tail) are the log's
    tail = property(lambda self: self._ix.tail)
    sessions = property(lambda self: self._ix.sessions)
    live_records = property(lambda self: self._ix.live_records)
    live_blocks = property(lambda self: self._ix.live_blocks)

    def __len__(self) -> int:
        """Records in the log, dead ones and pads too."""
        return self._ix.tail - self._ix.head

    @property
    def nbytes(self) -> int:
        """What the index has allocated: native memory, outside Python's heap."""
        with self._lock:
            return lib.six_bytes(self._ix)

    # --- the log ------------------------------------------------------------------------------

    def append(self, lpos: int, seq: int, nblocks: int, kind: int) -> int:
        """A record placed at the log's tail; its rid."""
        with self._lock:
            if lib.six_append(self._ix, lpos, seq, nblocks, kind):
                raise MemoryError("no memory to grow the snapshot store's index")
            return self._ix.tail - 1

    def pop(self):
        """The head record, dead, leaves the log."""
        with self._lock:
            lib.six_pop(self._ix)

    def rec(self, rid: int) -> Rec:
        with self._lock:
            if not self._ix.head <= rid < self._ix.tail:
                raise IndexError(f"record {rid} is not in the log [{self._ix.head}, {self._ix.tail})")
            return self._rec(rid)

    def _rec(self, rid: int) -> Rec:
        r = lib.six_rec(self._ix, rid)
        return Rec(rid, r.lpos, r.seq, r.nblocks, r.kind, bool(r.live))

    # --- the sessions -----------------------------------------------------------------------

    def find(self, key: bytes) -> Chain | None:
        with self._lock:
            return self._lookup(key, False)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return lib.six_find(self._ix, key) != lib.SIX_NONE

    def gen(self, key: bytes) -> int:
        """key's chain's number; 0: none."""
        with self._lock:
            s = lib.six_find(self._ix, key)
            return 0 if s == lib.SIX_NONE else self._ix.sess[s].gen

    def _lookup(self, key: bytes, touch: bool) -> Chain | None:
        if lib.six_lookup(self._ix, key, touch, self._found) == lib.SIX_NONE:
            return None
        return self._found_chain()

    def _found_chain(self) -> Chain:
        """The Chain of the struct six_chain six_lookup or six_restore last filled in."""
        last, sid, gen, nrec, t0, t1, raw_len, codec, l0, l1 = _CHAIN.unpack(self._found_bytes)
        return Chain(sid, gen, nrec, (t0, t1), (l0, l1), raw_len, self._codec_name(codec), last)

    def _codec_name(self, n: int) -> str:
        names = self._codec_names
        while len(names) <= n:   # as format.unpack_header decodes it
            raw = bytes(ffi.buffer(self._ix.codec[len(names)], CODEC_LEN))
            names.append(raw.rstrip(b"\0").decode("ascii", "replace"))
        return names[n]

    def first_seq(self, chain: Chain) -> int:
        with self._lock:
            e = self._ix.sess[chain.sid]
            return lib.six_rec(self._ix, lib.six_rid(self._ix, e.first)).seq if e.nrec else 0

    def records(self, chain: Chain) -> list[Rec]:
        """The chain's records, oldest first."""
        with self._lock:
            e = self._ix.sess[chain.sid]
            out, low = [], e.first
            for _ in range(e.nrec):
                rid = lib.six_rid(self._ix, low)
                out.append(self._rec(rid))
                low = lib.six_rec(self._ix, rid).next
            return out

    def read_chain(self, chain: Chain, fd: int, log_start: int, log_blocks: int, block_size: int,
                   buf) -> tuple[int, int, int, list[tuple[int, int, int, int, int]]]:
        """Restore's read of chain from fd into the aligned buf, in C (six_read_chain): (rc, at,
        err, parts), parts (offset in buf, stored length, flags, kind, 0) per record, oldest first,
        when rc is the record count; else rc a SIX_READ_* code, at and err what it says."""
        with self._lock:
            return self._read(chain.sid, self._ix.sess[chain.sid].nrec, fd, log_start, log_blocks, block_size, buf)

    def find_and_read(self, key: bytes, fd: int, log_start: int, log_blocks: int, block_size: int, buf):
        """A restore's whole index work in one C call under one hold of the lock (six_restore):
        key's chain (None: not held), made the most recently used, and read_chain's answer for it."""
        with self._lock:
            parts = self._parts
            rc = lib.six_restore(self._ix, key, self._found, fd, log_start, log_blocks, block_size, self._c(buf),
                                 len(buf), parts, len(parts), self._at, self._err)
            if rc == lib.SIX_READ_NONE:
                return None, 0, 0, 0, []
            chain = self._found_chain()
            if rc == SIX_READ_ROOM and chain.records > len(parts):
                return (chain, *self._read(chain.sid, chain.records, fd, log_start, log_blocks, block_size, buf))
            return chain, rc, self._at[0], self._err[0], self._found_parts(rc)

    def _read(self, s: int, nrec: int, fd: int, log_start: int, log_blocks: int, block_size: int, buf):
        if len(self._parts) < nrec:
            self._parts_room(nrec)
        rc = lib.six_read_chain(self._ix, s, fd, log_start, log_blocks, block_size, self._c(buf), len(buf),
                                self._parts, len(self._parts), self._at, self._err)
        return rc, self._at[0], self._err[0], self._found_parts(rc)

    def _c(self, buf):
        """buf's cffi view: the store's read buffer, the same one but when it grows."""
        if buf is not self._buf:
            self._buf, self._cbuf = buf, ffi.from_buffer(buf)
        return self._cbuf

    def _parts_room(self, n: int):
        self._parts = ffi.new("struct six_part[]", n)
        self._parts_bytes = memoryview(ffi.buffer(self._parts))   # kept: a restore makes no view of its own

    def _found_parts(self, rc: int) -> list[tuple[int, int, int, int, int]]:
        return list(_PART.iter_unpack(self._parts_bytes[:rc * _PART.size])) if rc > 0 else []

    def key_of(self, rec: Rec) -> bytes:
        """The session key of a live record."""
        with self._lock:
            return bytes(ffi.buffer(self._ix.sess[lib.six_rec(self._ix, rec.rid).sess].key))

    def keys(self) -> list[bytes]:
        """Every session's key, least recently used first."""
        with self._lock:
            out, s = [], self._ix.lru_first
            while s != lib.SIX_NONE:
                out.append(bytes(ffi.buffer(self._ix.sess[s].key)))
                s = self._ix.sess[s].lru_next
            return out

    def least_recent(self, protect: set) -> bytes | None:
        """The least recently used session's key, one not in protect if there is one."""
        with self._lock:
            s, first = self._ix.lru_first, None
            while s != lib.SIX_NONE:
                key = bytes(ffi.buffer(self._ix.sess[s].key))
                if key not in protect:
                    return key
                first = first or key
                s = self._ix.sess[s].lru_next
            return first

    def drop(self, chain: Chain):
        with self._lock:
            lib.six_drop(self._ix, chain.sid)

    def touch(self, chain: Chain):
        with self._lock:
            lib.six_touch(self._ix, chain.sid)

    def apply(self, rid: int, header) -> int:
        """The record rid, whose header (packed as on the device) is in the buffer header,
        applied to its chain (six_apply_header): lib.SIX_LINKED, SIX_UNLINKED or SIX_DAMAGED."""
        if len(header) < HEADER_SIZE:
            raise ValueError(f"a record header is {HEADER_SIZE} bytes, not {len(header)}")
        with self._lock:
            r = lib.six_apply_header(self._ix, rid, ffi.from_buffer("struct six_hdr *", header))
        if r == lib.SIX_NOMEM:
            raise MemoryError("no memory to grow the snapshot store's index")
        return r

    # --- staging (six_stage): a put's records at the log's tail ---------------------------------

    @staticmethod
    def new_tail() -> "ffi.CData":
        """A log's tail for six_stage to move (struct six_tail): the store sets its fields."""
        return ffi.new("struct six_tail *")

    @staticmethod
    def new_room() -> "ffi.CData":
        """What a store's put must respect, for six_put (struct six_room): the store sets its fields."""
        return ffi.new("struct six_room *")

    @staticmethod
    def from_buffer(buf) -> "ffi.CData":
        """buf's cffi view, for a pointer field (six_room.sbuf): hold it as long as the field."""
        return ffi.from_buffer("uint8_t[]", buf)

    @staticmethod
    def tail_buffer(t, buf) -> "ffi.CData":
        """buf, aligned, becomes t's write buffer (what is staged in it kept by the caller); the
        cffi view returned keeps it exported while t points into it: hold it as long."""
        view = Index.from_buffer(buf)
        t.wbuf, t.wcap = view, len(buf)
        return view

    def stage(self, t, kind: int, flags: int, key: bytes, payload: bytes, raw_len: int, tokens: tuple[int, int],
              layers: tuple[int, int], codec: str, fresh: bool, expect: int) -> int:
        """The record staged at t's tail and linked to key's chain, if that chain is still numbered
        expect (six_stage): its rid, or STAGE_CHANGED, STAGE_ROOM (t.need: the bytes the write
        buffer must hold) or STAGE_REFUSED (a bug)."""
        with self._lock:
            rid = lib.six_stage(self._ix, t, kind, flags, key, payload, len(payload), raw_len, tokens[0], tokens[1],
                                layers[0], layers[1], codec.encode("ascii").ljust(CODEC_LEN, b"\0"), fresh, expect)
        if rid == lib.SIX_NOMEM:
            raise MemoryError("no memory to grow the snapshot store's index")
        return rid

    def put(self, t, room, key: bytes, payload: bytes, tokens: tuple[int, int], layers: tuple[int, int], codec: str,
            fresh: bool) -> int:
        """key's delta put whole, durable on return (six_put): its rid, or PUT_DECLINED (nothing
        done: the store's own path takes it). MemoryError, or OSError for a write or a sync that
        failed (the record staged, not durable)."""
        with self._lock:
            rid = lib.six_put(self._ix, t, room, key, payload, len(payload), tokens[0], tokens[1], layers[0], layers[1],
                              codec.encode("ascii").ljust(CODEC_LEN, b"\0"), fresh, self._err)
        if rid >= 0 or rid == PUT_DECLINED:
            return rid
        if rid == lib.SIX_PUT_IO:
            err = self._err[0]
            raise OSError(err, os.strerror(err)) if err else OSError("a short write")
        if rid == lib.SIX_NOMEM:
            raise MemoryError("no memory to grow the snapshot store's index")
        raise RuntimeError(f"the index did not take the record six_put staged ({rid}): a bug")

    def stage_copy(self, t, record) -> int:
        """A copy of record (header and payload as read) staged at t's tail (six_stage_copy), not
        yet in its chain (swap): its rid, or STAGE_ROOM or STAGE_REFUSED (its sizes do not fit)."""
        with self._lock:
            rid = lib.six_stage_copy(self._ix, t, ffi.from_buffer(record), len(record))
        if rid == lib.SIX_NOMEM:
            raise MemoryError("no memory to grow the snapshot store's index")
        return rid

    def scan(self, *, store_id: int, generation: int, log_blocks: int, head: int, block_size: int,
             tail: int, tail_epoch: int) -> "Scan":
        return Scan(self, store_id, generation, log_blocks, head, block_size, tail, tail_epoch)

    def swap(self, old: int, new: int):
        """The live record old is replaced in its chain by its copy new."""
        with self._lock:
            lib.six_swap(self._ix, old, new)

    def chains(self) -> Iterator[tuple[bytes, Chain]]:
        for key in self.keys():
            chain = self.find(key)
            if chain is not None:
                yield key, chain


SCAN_END, SCAN_MORE, SCAN_BAD = lib.SIX_SCAN_END, lib.SIX_SCAN_MORE, lib.SIX_SCAN_BAD
SIX_READ_ROOM, SIX_READ_IO, SIX_READ_DAMAGED = lib.SIX_READ_ROOM, lib.SIX_READ_IO, lib.SIX_READ_DAMAGED
STAGE_ROOM, STAGE_REFUSED, STAGE_CHANGED = lib.SIX_STAGE_ROOM, lib.SIX_STAGE_REFUSED, lib.SIX_STAGE_CHANGED
PUT_DECLINED = lib.SIX_PUT_DECLINED


class Scan:
    """Recovery's scan of the log into the index (native/snapindex.h, six_scan): run() it over
    windows of the log, act on the bad records it stops at, then link(). A context manager:
    what it found is freed at the end."""

    def __init__(self, index: Index, store_id, generation, log_blocks, head, block_size, tail, tail_epoch):
        self._index = index
        self.state = st = ffi.new("struct six_scan *")
        st.store_id, st.generation, st.log_blocks, st.head = store_id, generation, log_blocks, head
        st.tail, st.tail_epoch = tail, tail_epoch
        st.block_size, st.pos = block_size, head

    def run(self, view, pos: int, nblocks: int) -> int:
        """Scan the window view (nblocks from the log's block pos) on from state.pos:
        SCAN_END, SCAN_MORE or SCAN_BAD (see state for which record)."""
        buf = ffi.from_buffer("uint8_t[]", view) if view is not None else ffi.NULL
        with self._index._lock:
            r = lib.six_scan(self._index._ix, self.state, buf, pos, nblocks if view is not None else 0)
        if r == lib.SIX_NOMEM:
            raise MemoryError("no memory for the snapshot store's index")
        return r

    @property
    def bad_key(self) -> bytes:
        return bytes(ffi.buffer(self.state.bad_key))

    def link(self):
        with self._index._lock:
            if lib.six_scan_link(self._index._ix, self.state) == lib.SIX_NOMEM:
                raise MemoryError("no memory for the snapshot store's index")

    def dropped(self) -> list[bytes]:
        """The keys whose chains link() dropped as damaged (a delta not following its chain's end)."""
        keys, i, key = [], ffi.new("uint64_t *"), ffi.new(f"uint8_t[{KEY_LEN}]")
        while lib.six_scan_dropped(self.state, i, key):
            keys.append(bytes(key))
        return keys

    def linked_under(self, seq: int, key: bytes) -> bool:
        """Is key's the record linked under seq? (After link.)"""
        return bool(lib.six_scan_has(self.state, seq, key))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        lib.six_scan_done(self.state)
