"""LogStore: the snapshot store as an append-only circular log on one block device.

Writes. put() stages a record and joins a group commit: the first writer to
find no commit in progress becomes the leader, takes every queued record,
writes them with one pwritev per contiguous run of blocks and one fdatasync,
then wakes the others (leader/follower: a lone writer pays no thread
hand-off). group_commit_us makes the leader wait that long for more writers
first: latency traded for throughput. Puts to one key are serialized (a
chain is a sequence); puts to different keys share flushes.

Recovery. open() takes the superblock copy with the highest generation and
scans from its head. Before its checkpoint tail every record was durable, so
a bad block there is corruption: counted, skipped, and the scan resyncs on
the next block whose header names its own position. Past the checkpoint the
first bad record is the torn end of the last, unacknowledged batch: counted,
and the log ends there. A record must carry this store's id, its own
position and an epoch no older than the record before it and, from the
checkpoint on, than the superblock's writer (a resync past damage has no
record before it), so a stale block (an earlier lap, an earlier format, an
unacknowledged record left beyond a torn one by an earlier crash) never
passes for a live one. The records found
are then applied in sequence-number order, the order they were first written:
a copied record keeps its number, so it takes its old place in its chain
wherever it now lies.

Space. The log runs from head to tail. Before a record lands on reclaimed
blocks, the superblock (both copies) is written with the new head, so a
crash never leaves a head pointing at overwritten blocks. Reclaim pops dead
records at the head and relocates a live one found there: its whole chain
compacted into one base record at the tail when that fits (under "refuse":
leaving room for a copy), else the record alone, copied as it is, which the
head gives back as it passes the original. (Compaction alone costs a chain
to free one record: a run of chains spread over the log used up the free
room and stopped the head.) When live data alone would not leave room,
eviction="lru" drops the least recently used sessions (not logged: a crash
may bring an evicted session back whole, never half), eviction="refuse"
raises DeviceFull. Every chain fits one record (max_record_bytes), so a put
can always compact it.
"""
from __future__ import annotations

import collections
import errno
import os
import random
import sys
import threading
import time
import zlib

from . import format as fmt
from .api import Delta, Snapshot, check_delta, check_key
from .device import DEFAULT_IMAGE_SIZE, BlockDevice, aligned_buffer, create_image, default_image_path, open_device
from .errors import DamagedRecord, DeviceError, DeviceFull, FormatError, SessionChanged, SnapshotError, TooLarge
from .format import (HEADER_SIZE, KIND_BASE, KIND_DELTA, KIND_TOMBSTONE, RecordHeader,
                     Superblock, record_blocks)
from .index import (PUT_DECLINED, SCAN_END, SCAN_MORE, SIX_READ_DAMAGED, SIX_READ_IO, SIX_READ_ROOM, STAGE_CHANGED,
                    STAGE_REFUSED, STAGE_ROOM, Chain, Index, Rec)

RESERVE_BLOCKS = 8               # at least, and 1/32 of the log: kept for tombstones (deletes on a full log)
MAX_RECORD_BYTES = 16 << 20      # and at most 1/16 of the log
_CHAIN_CHANGED = "the session was evicted or deleted while this put was in flight: put its whole context again"
SCAN_WINDOW_BYTES = 1 << 20      # recovery reads the log in windows this large
FORMAT_CHECK_BYTES = 1 << 20     # format without force wants this much zeroed (or a store): a btrfs
                                 # superblock is at 64 KiB, ISO9660's at 32 KiB, and so on
KEY_LOCKS = 256
# The checkpoint follows the flushes at most this often: a superblock write per flush cost a
# put 1.2x -> 1.7x of a raw O_DIRECT write + fdatasync here (one more device round trip).
CHECKPOINT_EVERY_S = 0.01


class LogRecord:
    """One record of the log as entries() gives it (inspect, fsck): its header, and whether
    the index links it into a chain."""
    __slots__ = ("lpos", "nblocks", "kind", "key", "seq", "parent", "tokens", "layers",
                 "raw_len", "stored_len", "flags", "codec", "live")

    def __init__(self, h: RecordHeader, live: bool):
        self.lpos, self.nblocks, self.kind, self.key = h.lpos, h.nblocks, h.kind, h.key
        self.seq, self.parent = h.seq, h.parent_seq
        self.tokens, self.layers = (h.token_start, h.token_end), (h.layer_start, h.layer_end)
        self.raw_len, self.stored_len, self.flags, self.codec = h.raw_len, h.stored_len, h.flags, h.codec
        self.live = live


class _Window:
    """The log read a window at a time: a view of n blocks at a position, never across the
    lap's end (recovery's scan, entries())."""

    def __init__(self, store: "LogStore", read):
        self.store, self.read, self.pos, self.n, self.view = store, read, 0, 0, None
        self.size = max(1, SCAN_WINDOW_BYTES // store.block_size)

    def span(self, pos: int, n: int) -> int:
        """The blocks a window read at pos for n of them holds: a window at least, never past the
        lap's end (a damaged header that says a record crosses it is read short)."""
        return min(max(n, self.size), self.store.log_blocks - pos % self.store.log_blocks)

    def at(self, pos: int, n: int):
        if not (self.pos <= pos and pos + n <= self.pos + self.n):
            st, L = self.store, self.store.log_blocks
            count = self.span(pos, n)
            self.n = 0               # no window until a read succeeds: a failed one may have written part
            self.view = self.read(st._read_buf(count * st.block_size), st.log_start + pos % L, count)
            self.pos, self.n = pos, count
        return self.view, (pos - self.pos) * self.store.block_size


class _ReadAhead(_Window):
    """Recovery's _Window, reading the next window while the scan (C, without the GIL) checks this
    one, which hides part of the scan behind the reads (50,000 one-block records, opens in turn in
    one process: 66 ms against 86 ms, the raw reads 45). From the fourth window on, so a store whose
    log ends in its first two reads no more than before. A record across a window's end is
    carried: its blocks in this window are copied before the next one's (which is read past room
    kept for them), and one longer than that reads only the rest. A read-ahead that fails with EIO
    is read again as before, salvaged; any other error is the open's, as it was. The device is
    never read by both at once (close() waits for the read, Ctrl-C or not); with no thread to be
    had, windows are read as before."""

    def __init__(self, store: "LogStore", read):
        super().__init__(store, read)
        self._windows = 0
        self._bufs = [aligned_buffer(2 * self.size * store.block_size) for _ in range(2)]
        self._next = None                 # (position, blocks, buffer index) being read, by _pending
        self._pending = None              # the last read's future, until close() has seen it done
        self._pool = None
        self._no_thread = False           # none could be started: read as _Window does

    def at(self, pos: int, n: int):
        if self.pos <= pos and pos + n <= self.pos + self.n:
            return super().at(pos, n)
        if not self._take(pos, n):
            super().at(pos, n)
        self._windows += 1
        if self._windows >= 3 and not self._no_thread:
            self._read_next()
        return self.view, (pos - self.pos) * self.store.block_size

    def _take(self, pos: int, n: int) -> bool:
        """The window from the read-ahead, with this window's part of a record carried and, for a
        record longer than both, the rest read; False if it does not begin where the scan asks."""
        if self._next is None:
            return False
        start, count, b = self._next
        self._next = None
        try:
            self._pending.result()
        except OSError as e:
            if e.errno != errno.EIO:
                raise                     # not the medium: as the read would have said it
            return False                  # read again, salvaging the EIO as recovery always has
        st, bs, L = self.store, self.store.block_size, self.store.log_blocks
        carry = start - pos
        if not (0 <= carry <= self.size and (not carry or (self.pos <= pos and start % L))):
            return False
        off = (pos - self.pos) * bs
        if pos + n <= start + count:
            buf = self._bufs[b]           # (self.view is in the other buffer, or the store's)
            buf[(self.size - carry) * bs:self.size * bs] = self.view[off:off + carry * bs]
            self.view = memoryview(buf)[(self.size - carry) * bs:(self.size + count) * bs]
            self.pos, self.n = pos, carry + count
            return True
        # a record past the read-ahead: what is in memory kept, the rest read into the store's
        # buffer behind it, as much as _Window would read
        total = self.span(pos, n)
        have = carry + count
        if total <= have:
            return False
        # copied out first: self.view may lie in the store's buffer, which the read below fills
        kept = bytes(self.view[off:off + carry * bs]) + bytes(memoryview(self._bufs[b])[self.size * bs:
                                                                                      (self.size + count) * bs])
        self.n = 0                        # no window until the read succeeds
        buf = st._read_buf(total * bs)
        buf[:have * bs] = kept
        self.read(memoryview(buf)[have * bs:], st.log_start + (pos + have) % L, total - have)
        self.view = memoryview(buf)[:total * bs]
        self.pos, self.n = pos, total
        return True

    def _read_next(self):
        import concurrent.futures
        st, L = self.store, self.store.log_blocks
        start = self.pos + self.n
        count = min(self.size, L - start % L)
        b = 1 if self.view is not None and self.view.obj is self._bufs[0] else 0   # the one not in view
        dest = memoryview(self._bufs[b])[self.size * st.block_size:]
        try:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="recovery-read")
            self._pending = self._pool.submit(st.dev.read_into, dest, st.log_start + start % L, count)
            self._next = (start, count, b)
        except RuntimeError:              # no thread (a limit, or the interpreter shutting down)
            self._no_thread = True

    def close(self):
        """Once the last read is done (the device may close right after): waited for on its future,
        not by joining the thread, which a Ctrl-C can cut short for good."""
        import concurrent.futures
        interrupted = None
        while self._pending is not None:
            try:
                concurrent.futures.wait([self._pending])
                self._pending = None
            except BaseException as e:    # a Ctrl-C: waited out all the same, raised after
                interrupted = interrupted or e
        self._next = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)   # its thread has nothing left to do but exit
            self._pool = None
        if interrupted is not None:
            raise interrupted


class _Request:
    """A record on its way through the group commit."""
    __slots__ = ("kind", "key", "payload", "flags", "raw_len", "tokens", "layers", "codec",
                 "expect", "nblocks", "done", "error", "seq", "durable", "fresh")

    def __init__(self, kind, key, payload=b"", flags=0, raw_len=0, tokens=(0, 0), layers=(0, 0),
                 codec="", expect=0, block_size=4096):
        self.kind, self.key, self.payload, self.flags, self.raw_len = kind, key, payload, flags, raw_len
        self.tokens, self.layers, self.codec, self.expect = tokens, layers, codec, expect
        self.nblocks = record_blocks(len(payload), block_size)
        self.done, self.error, self.seq, self.durable = False, None, 0, False
        self.fresh = False                # a delta that begins the chain anew (put's replace)


def format_device(path: str, force: bool = False, block_size: int | None = None) -> Superblock:
    """Write an empty store (both superblock copies) on path. Unless force, refuses to erase a store,
    or any data in the first FORMAT_CHECK_BYTES: a mistyped path to a disk that holds a file system
    or a partition table is refused, not overwritten. block_size: other blocks than the default,
    a multiple of the device's logical block size (tests: a store as formatted before session 16).
    The default is the device's own blocks, 4 KiB at least (the LBAs an NVMe-oF namespace has):
    formatted in a loop device's 512-byte sectors, a store could not be opened through its image
    file, whose blocks are 4 KiB, and the error said to reformat it (found by review)."""
    dev = open_device(path)
    try:
        dev.lock(shared=False)
        if block_size is None and dev.block_size < fmt.FILE_BLOCK_SIZE:
            block_size = fmt.FILE_BLOCK_SIZE
        if block_size is not None:
            dev.set_block_size(block_size)
        buf = aligned_buffer(fmt.SB_COPIES * dev.block_size)
        if dev.blocks >= fmt.SB_COPIES and not force:
            view = dev.read_into(buf, 0, fmt.SB_COPIES)
            bs = dev.block_size
            if any(fmt.superblock_version(view[i * bs:(i + 1) * bs]) is not None for i in range(fmt.SB_COPIES)):
                raise FormatError(f"{path} already holds a snapshot store: pass --force to erase it")
            n = min(dev.blocks, FORMAT_CHECK_BYTES // bs)
            if dev.read_into(aligned_buffer(n * bs), 0, n).tobytes() != bytes(n * bs):
                raise FormatError(f"{path} holds data that is not a snapshot store (a file system? a "
                                  f"partition table?): pass --force to erase it")
        log_blocks = min(dev.blocks - fmt.LOG_START, fmt.MAX_LOG_BLOCKS)   # past it, unused
        if log_blocks < fmt.MIN_LOG_BLOCKS:
            raise DeviceError(f"{path} is too small: a store needs at least {fmt.MIN_LOG_BLOCKS + fmt.LOG_START} "
                              f"blocks of {dev.block_size} bytes")
        sb = Superblock(dev.block_size, random.getrandbits(64), dev.blocks, fmt.LOG_START, log_blocks,
                        head=0, tail=0, generation=1, last_seq=random.getrandbits(40), epoch=1)
        # (sequence numbers start at a random point: a worker holding a number of the store this
        # format erases (held(), the worker's stale-copy check) is unlikely to meet it again)
        # Both old copies go first: a crash between the new copies' writes left the old store's
        # copy 1 (a higher generation) to win, and the erased store came back whole. In any
        # block size up to 64 KiB: a store formatted in other blocks keeps its copy 1 elsewhere.
        erase = min(dev.blocks, max(fmt.SB_COPIES, (fmt.SB_COPIES << 16) // dev.block_size))
        zeros = aligned_buffer(erase * dev.block_size)
        dev.write_from(zeros, 0, 0, erase)
        dev.sync()
        _write_superblocks(dev, buf, sb)
        return sb
    finally:
        dev.close()


def _write_superblocks(dev: BlockDevice, buf, sb: Superblock) -> None:
    # Copy 0, sync, copy 1, sync: a torn write damages one copy, the other is the same or one older.
    for copy in range(fmt.SB_COPIES):
        _write_superblock_copy(dev, buf, sb, copy)
        dev.sync()


def _write_superblock_copy(dev: BlockDevice, buf, sb: Superblock, copy: int) -> None:
    _pack_superblock_block(buf, sb, dev.block_size)
    dev.write_from(buf, 0, copy, 1)


def _pack_superblock_block(buf, sb: Superblock, block_size: int) -> None:
    data = fmt.pack_superblock(sb)
    buf[:block_size] = data + bytes(block_size - len(data))


class LogStore:
    """The block-device snapshot store (implements snapshotstore.SnapshotStore)."""

    def __init__(self, path: str | None = None, *, readonly: bool = False, group_commit_us: float = 0,
                 compact_after: int = 16, eviction: str = "refuse", compress: bool = False,
                 image_size: int = DEFAULT_IMAGE_SIZE):
        if eviction not in ("refuse", "lru"):
            raise ValueError(f"eviction is 'refuse' or 'lru', not {eviction!r}")
        if compact_after < 1:
            raise ValueError("compact_after must be at least 1")
        if path is None:
            path = default_image_path()
            if not os.path.exists(path) and not readonly:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                create_image(path, image_size)
                format_device(path)
                print(f"snapshotstore: created {path} ({image_size >> 20} MiB sparse image)", file=sys.stderr)
        self.path, self.readonly = path, readonly
        self.group_commit_us, self.compact_after = group_commit_us, compact_after
        self.eviction, self.compress = eviction, compress
        self.dev = open_device(path, readonly)
        try:
            self.dev.lock(shared=readonly)
        except DeviceError:
            self.dev.close()
            raise
        self._lock = threading.Lock()            # the index, the log state, the device
        self._queue_lock = threading.Lock()      # the commit queue and the leader flag (held by
        self._cv = threading.Condition(self._queue_lock)    # itself: a Condition's `with` is Python)
        self._queue: list[_Request] = []
        self._leading = False
        self._waiting = 0                        # writers waiting in the queue (for the Condition)
        # writers about: the last group commit gathered several, so puts go through the queue (to
        # be gathered) until one finds itself alone
        self._crowded = False
        self._key_locks = [threading.Lock() for _ in range(KEY_LOCKS)]
        self._ix = Index()                       # the log's records and the sessions' chains, LRU first
        self._t = self._ix.new_tail()            # the log's tail, where six_stage lays records out
        self._room = self._ix.new_room()         # what a put must respect (six_put): head, floor, ...
        # sessions LRU eviction dropped from the index (not logged) whose records recovery would
        # still replay, each with its chain's first record (seq, lpos): a delete of one writes a
        # tombstone, or the next open would bring it back. Forgotten once the log supersedes it,
        # or once the superblock's head passes that first record (recovery starts there, and the
        # chain's later records no longer link up). A first record copied past later ones would
        # come back alone once the head passed those: the head writes the tombstone first (_bury),
        # when it reaches one of them (_halving: their rids, and their session's key).
        self._evicted: dict[bytes, tuple[int, int]] = {}
        self._dropped: set[bytes] = set()     # chains recovery dropped as damaged: their tombstones at open
        self._unreadable: set[int] = set()    # device blocks recovery could not read (EIO)
        self._halving: dict[int, bytes] = {}
        self._failed: BaseException | None = None
        self._closed = False
        self.counters = collections.Counter()
        try:
            self._open()
        except BaseException:
            self.dev.close()
            raise

    # The log's tail, the last flush's and the last sequence number handed out live in the tail's
    # struct, which six_stage moves as it lays records out (and six_put as it writes them); the
    # head and the superblocks' in the room's, which six_put reads.
    _tail = property(lambda self: self._t.tail, lambda self, v: setattr(self._t, "tail", v))
    _durable_tail = property(lambda self: self._t.durable, lambda self, v: setattr(self._t, "durable", v))
    _last_seq = property(lambda self: self._t.last_seq, lambda self, v: setattr(self._t, "last_seq", v))
    _head = property(lambda self: self._room.head, lambda self, v: setattr(self._room, "head", v))
    _sb_head = property(lambda self: self._room.sb_head, lambda self, v: setattr(self._room, "sb_head", v))

    # --- open and recovery ---------------------------------------------------------

    def _open(self):
        bs = self.dev.block_size
        self._sbuf = aligned_buffer(fmt.SB_COPIES * bs)
        blocks = [None] * fmt.SB_COPIES
        if self.dev.blocks >= fmt.SB_COPIES:
            blocks = [self._superblock_block(i) for i in range(fmt.SB_COPIES)]
        copies = [fmt.unpack_superblock(b) if b is not None else None for b in blocks]
        # a copy past the first is where it says only in its own block size: one of a store
        # formatted in other blocks is not this store's (a reformat left it; the 512e vm check)
        copies = [c if c is None or i == 0 or c.block_size == bs else None for i, c in enumerate(copies)]
        self.superblocks_valid = sum(c is not None for c in copies)
        if not self.superblocks_valid and self._larger_blocks():
            return self._open()
        if not self.superblocks_valid:
            newer = [v for b in blocks if b is not None and (v := fmt.superblock_version(b)) is not None
                     and v > fmt.VERSION]
            if newer:
                raise FormatError(f"{self.path} holds a snapshot store of format version {max(newer)}, written by a "
                                  f"newer version of zerolayer; this one reads versions 1 to {fmt.VERSION}: upgrade")
            if self.dev.blocks < fmt.SB_COPIES:   # (copy 0 may be whole: a truncated image, not a blank one)
                raise FormatError(f"{self.path} is {self.dev.size} bytes, under the {fmt.SB_COPIES} blocks a "
                                  f"store's superblocks take: truncated? (`snapshotstore format {self.path} "
                                  f"--size N` makes a new, empty one)")
            blank = all(b is not None and not any(b) for b in blocks)
            raise FormatError(f"{self.path} holds no snapshot store (both superblock copies are "
                              + ("zeros: never formatted): `snapshotstore format " + self.path
                                 + "` makes a new, empty one" if blank else
                                 f"missing or corrupt): `snapshotstore format {self.path} --force` makes a new, "
                                 f"empty one, erasing what is there"))
        sb = max((c for c in copies if c), key=lambda c: c.generation)
        # the one bad copy, read but not valid, is where the next checkpoint after the good one went:
        # a crash cut that write (the store opens on the other, one checkpoint older, and loses
        # nothing), or damage there, which reads the same and is repaired the same (the next
        # read-write open). fsck counted it as damage after every power cut (a review)
        cut = (sb.generation + 1) % fmt.SB_COPIES
        self.superblock_cut = self.superblocks_valid == fmt.SB_COPIES - 1 and copies[cut] is None \
            and blocks[cut] is not None
        smaller = sb.block_size == getattr(self.dev, "logical_block_size", None)
        if sb.block_size != bs and (smaller or sb.block_size % bs == 0) and hasattr(self.dev, "set_block_size"):
            # opened in the blocks it was formatted in. Smaller: (before session 16) the logical blocks
            # of a disk whose sectors are larger, a 512e disk: said once, not refused. Larger: formatted
            # on a device with larger blocks (an image file's 4 KiB, opened now through a loop device of
            # 512-byte sectors), whole multiples of this one's, so every I/O stays aligned and a torn
            # block fails its CRC as on any device (refused, it opened only where it was formatted: a
            # review)
            if smaller:
                print(f"snapshotstore: {self.path} was formatted with {sb.block_size}-byte blocks on a disk with "
                      f"{bs}-byte sectors: a torn write there can damage the record beside it; reformat it to "
                      f"use {bs}-byte blocks", file=sys.stderr)
            self.dev.set_block_size(sb.block_size)
            return self._open()
        if sb.block_size != bs:
            raise FormatError(f"{self.path} was formatted with {sb.block_size}-byte blocks but has "
                              f"{bs}-byte blocks now: reformat it")
        if sb.log_blocks > fmt.MAX_LOG_BLOCKS:
            raise FormatError(f"{self.path} has a log of {sb.log_blocks} blocks, more than the "
                              f"{fmt.MAX_LOG_BLOCKS} a store may have: not written by this version; reformat it")
        if sb.log_start + sb.log_blocks > self.dev.blocks:
            raise FormatError(f"{self.path} is smaller than when it was formatted: reformat it")
        self.block_size, self.store_id, self.capacity_blocks = bs, sb.store_id, sb.capacity_blocks
        self.log_start, self.log_blocks = sb.log_start, sb.log_blocks
        self.max_record_blocks = max(1, min(self.log_blocks // 16, MAX_RECORD_BYTES // bs))
        self.max_payload = self.max_record_blocks * bs - HEADER_SIZE
        self._reserve = max(RESERVE_BLOCKS, self.log_blocks // 32)
        # Under "refuse" a compaction must leave room for a copy of the largest record and its
        # pad, so the head always moves on (compactions taken at floor 0 left a large live
        # record fitting neither way: DeviceFull at 70 of 254 blocks live). Under "lru" it may
        # use all of it: a stuck head evicts instead, and compaction first wrote a third of the
        # blocks that copying did under a cache's churn (docs/snapshot-store.md).
        self._compaction_floor = 0 if self.eviction == "lru" else 2 * self.max_record_blocks - 1
        self._generation, self._last_seq = sb.generation, sb.last_seq
        self._rbuf = aligned_buffer(SCAN_WINDOW_BYTES)
        started = time.perf_counter()
        self._recover(sb)
        self.recovery_s = time.perf_counter() - started
        if not self.readonly:
            # the numbers of records a crash cut off the log's end (its torn batch, or what an
            # unreadable block hid: acknowledged records among them) are never handed out again:
            # a worker may hold one (held()), and the same number on another history at the same
            # length would pass its stale-copy check (found by review). Each record takes a
            # block at least, so a lap's worth of numbers covers them.
            self._last_seq += self.log_blocks
        self._durable_tail = self._tail
        self._epoch = self._generation + 1        # this open's: the generation of its first superblock
        t = self._t
        t.store_id, t.epoch, t.log_blocks, t.block_size = self.store_id, self._epoch, self.log_blocks, bs
        self._wbuf = aligned_buffer(1 << 20)      # the blocks [durable tail, tail), staged
        self._wbuf_view = self._ix.tail_buffer(t, self._wbuf)
        room, fd = self._room, getattr(self.dev, "fd", None)
        room.fd, room.log_start, room.floor = -1 if fd is None else fd, self.log_start, self._floor(KIND_DELTA)
        room.max_payload, room.compact_after = self.max_payload, min(self.compact_after, 0xFFFFFFFF)
        self._sbuf_view, room.checkpoint = self._ix.from_buffer(self._sbuf), -1
        room.sbuf = self._sbuf_view
        self._at_once = fd is not None           # a put may go in one C call (_put_at_once)
        if not self.readonly:
            self._write_superblock()              # the checkpoint: this session's epoch starts here
        self._checkpointed = time.monotonic()
        if not self.readonly:
            try:
                self._bury_dropped()
            except DeviceFull:                    # opened all the same: said once, here
                # not "delete sessions": dead records hold the room, and reclaim frees it
                print(f"snapshotstore: {self.path}: the tombstones of {len(self._dropped)} damaged sessions "
                      f"wait for room ({self._ix.live_blocks} of {self.log_blocks} blocks live): the next "
                      f"puts' reclaim writes them as it frees blocks", file=sys.stderr)

    def _larger_blocks(self) -> bool:
        """No valid copy at this device's block size: is this a store formatted in larger blocks
        (an image file's 4 KiB, through a loop device of 512-byte sectors) whose copy 0 is bad? Its
        copy 1 is at its own block size, which the read at this one missed: looked for at each
        larger power of two up to 64 KiB, and if found there the device takes those blocks. Else
        a torn copy 0 read as "no store", with `format --force` advised (a review)."""
        bs, size = self.dev.block_size, getattr(self.dev, "size", 0)
        if not hasattr(self.dev, "set_block_size"):
            return False
        for big in (bs << k for k in range(1, 8)):
            if big > 1 << 16 or fmt.SB_COPIES * big > size:
                break
            try:
                view = self.dev.read_into(self._sbuf, big // bs, 1)
            except OSError:
                continue
            c = fmt.unpack_superblock(bytes(view[:bs]))
            if c is not None and c.block_size == big:
                self.dev.set_block_size(big)
                return True
        return False

    def _superblock_block(self, i: int) -> bytes | None:
        """Copy i's block, or None if it cannot be read (EIO: a bad sector, which is what the second
        copy is for; one read of both made either copy's bad sector a store, and an fsck, that
        could not open: found by review)."""
        try:
            view = self.dev.read_into(self._sbuf, i, 1)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            self.counters["unreadable_blocks"] += 1
            return None
        return bytes(view[:self.dev.block_size])

    def _read_buf(self, nbytes: int):
        if len(self._rbuf) < nbytes:
            self._rbuf = aligned_buffer(nbytes)
        return self._rbuf

    def _recover(self, sb: Superblock):
        """The scan and the linking run in C (Index.scan); the rare bad record is handled here."""
        window = _ReadAhead(self, self._read_salvaging)
        try:
            self._scan(sb, window)
        finally:
            window.close()

    def _scan(self, sb: Superblock, window: _ReadAhead):
        ckpt = sb.tail
        holes = []                                # (key, seq, newest seq before it) of damaged records
        with self._ix.scan(store_id=self.store_id, generation=sb.generation, log_blocks=self.log_blocks,
                           head=sb.head, block_size=self.block_size, tail=ckpt, tail_epoch=sb.epoch) as scan:
            st = scan.state
            while True:
                status = scan.run(window.view, window.pos, window.n)
                if status == SCAN_MORE:
                    window.at(st.pos, st.need)
                    continue
                if status == SCAN_END:
                    break
                if st.pos < ckpt:                 # durable region: damage; resync on the next block
                    self.counters["corrupt_blocks_skipped"] += 1
                    if st.named:                  # its payload is bad: a hole
                        holes.append((scan.bad_key, st.bad_seq, st.newest))
                    st.pos += 1
                    continue
                if st.named:
                    self.counters["torn_records_skipped"] += 1
                if any((st.pos + i) % self.log_blocks + self.log_start in self._unreadable
                       for i in range(self.max_record_blocks)):
                    # a bad sector, not a torn write: read as the end, it cut off whatever followed
                    # it, acknowledged or not, and the next put writes over that (found by review)
                    self.counters["end_unreadable"] += 1
                    print(f"snapshotstore: {self.path}: the log's end (block {st.pos % self.log_blocks}) could "
                          f"not be read (EIO): records after it, acknowledged ones among them, are lost"
                          f"{'' if self.readonly else ' and will be written over'}; `snapshotstore fsck` "
                          f"reports it", file=sys.stderr)
                break                             # past the checkpoint: the torn end of the log
            self._last_seq = max(self._last_seq, st.newest)   # never back, even with the log empty
            self._head = self._ix.rec(self._ix.head).lpos if len(self._ix) else st.pos
            self._tail = st.pos
            self._sb_head = sb.head
            scan.link()
            self.counters["unlinked_records_skipped"] += st.unlinked
            self.counters["damaged_chains_dropped"] += st.damaged
            self._dropped = set(scan.dropped())  # the chains dropped, for their tombstones (_bury_dropped)
            for key, seq, before in holes:
                chain = self._ix.find(key)
                if chain is None or scan.linked_under(seq, key):
                    continue                      # nothing of it left, or another copy is whole
                start = self._ix.first_seq(chain)
                # The chain began before the damaged record (by its header's number, or because
                # the log held a newer record before it): that record was part of it, or ended it.
                # The header failed its CRC, so its number may be the damage: one newer than any
                # record the log holds is not taken (a bit flipped in a dead record's number made
                # it newer than an intact live chain, which was dropped for good; found by review).
                if (start < seq <= st.newest) or start <= before:
                    self._ix.drop(chain)          # the store never gives back a session with a hole
                    self.counters["damaged_chains_dropped"] += 1
                    self._dropped.add(key)

    def _bury_dropped(self, one: bool = False):
        """A durable tombstone for each chain recovery dropped as damaged (a read-write open). The
        drop was the index's alone: a record of the chain that reclaim had copied past the damaged
        one came back on a later open, once the head had passed the damage, as the whole session,
        with a turn missing; and a delete of it found nothing to delete (found by review). A
        session begun again since is left alone: its new chain supersedes those records. DeviceFull:
        those left wait in _dropped, tried again as reclaim frees blocks (_make_room). Each leaves
        the room a relocation needs, as a delete's tombstone does (_floor): written into it, more
        of them than the largest record's blocks left the head a live record it could neither
        compact nor copy, and every later put and delete DeviceFull, for good (found by review).
        Reclaim, whose head is on a dead record it then frees, writes one at a time (`one`), in any
        room."""
        for key in sorted(self._dropped):
            if key not in self._ix:
                floor = 0 if one else self._floor(KIND_TOMBSTONE)
                self._write_tombstone(key, "a damaged session", floor)
                self.counters["damaged_tombstones"] += 1
            self._dropped.discard(key)
            if one:
                return

    def _read_salvaging(self, buf, block: int, n: int) -> memoryview:
        """Recovery's read: a window that fails (EIO: a bad sector) is read again block by block, and
        a block that still cannot be read reads as zeros, so it counts as damage like a corrupt one
        (unreadable_blocks). Before, one bad sector made the store, and fsck, fail to open."""
        try:
            return self.dev.read_into(buf, block, n)
        except OSError as e:
            if e.errno != errno.EIO:
                raise                     # not the medium (a device gone): no reading past it
            bs, one = self.block_size, aligned_buffer(self.block_size)
            view = memoryview(buf)[:n * bs]
            for i in range(n):
                try:
                    view[i * bs:(i + 1) * bs] = self.dev.read_into(one, block + i, 1)
                except OSError as e:
                    if e.errno != errno.EIO:
                        raise
                    view[i * bs:(i + 1) * bs] = bytes(bs)
                    if block + i not in self._unreadable:     # (a window read again reads it again)
                        self.counters["unreadable_blocks"] += 1
                        self._unreadable.add(block + i)
            return view

    # --- the public API -----------------------------------------------------------------

    def put(self, key: bytes, delta: Delta, replace: bool = False) -> int:
        """Append delta to key's chain; returns its sequence number once it is durable. replace:
        the delta (from token 0) becomes key's whole chain instead, in one record (a delta with
        no parent, which drops the chain before it, on recovery as here): a session rolled back
        is never absent from the store, as it was between a delete and a put."""
        key, delta = check_key(key), check_delta(delta)
        raw = bytes(delta.payload)
        with self._key_locks[key[0]]:
            self._check_usable(write=True)
            if self._at_once and (seq := self._put_at_once(key, raw, delta, replace)):
                return seq
            return self._put(key, raw, delta, replace)

    def _put(self, key: bytes, raw: bytes, delta: Delta, replace: bool) -> int:
        """put's own path, through the group commit; the caller holds key's lock."""
        # Without the store lock, so writers queue up while a flush is in progress. Only
        # this key's puts (serialized here) move the chain's end; a relocation keeps it; an
        # eviction or a delete meanwhile is caught at staging (the chain's number differs).
        chain = self._ix.find(key)
        expect = chain.gen if chain is not None else 0
        if replace:
            if delta.tokens[0] != 0:
                raise ValueError(f"a delta that replaces the chain starts at token 0, not {delta.tokens[0]}")
            chain = None                  # the chain this record begins: the delta alone
        if chain is not None and chain.codec != delta.codec:
            raise ValueError(f"this session's deltas use codec {chain.codec!r}, not {delta.codec!r}")
        held = chain.tokens[1] if chain is not None else 0
        if delta.tokens[0] != held:
            raise SessionChanged(f"this delta starts at token {delta.tokens[0]} but the store holds "
                                 f"tokens [0, {held}) of the session (evicted or deleted?): put "
                                 f"its whole context again from token 0")
        # bytes of the base this chain compacts into: its deltas and a part table (a bound)
        total = len(raw) + (chain.raw_len + 4 * (chain.records + 2) if chain is not None else 8)
        if total > self.max_payload:
            what = "this delta" if chain is None else "this session's chain with this delta"
            raise TooLarge(f"{what} is {total} bytes, more than the {self.max_payload} bytes one "
                           f"record holds on {self.path}: use a larger device or smaller deltas")
        kind, tokens, layers = KIND_DELTA, delta.tokens, delta.layers
        if chain is not None and chain.records >= self.compact_after:
            with self._lock:
                self._check_usable(write=True)   # closed meanwhile: said so, not a read error
                now = self._ix.find(key)
                if now is None or now.gen != chain.gen:    # evicted since we looked
                    raise SessionChanged("the session was evicted while this put was in flight: "
                                         "put its whole context again")
                raw = fmt.pack_parts(self._read_chain(now, key) + [raw])
            kind, tokens = KIND_BASE, (now.tokens[0], delta.tokens[1])
            layers = (min(now.layers[0], delta.layers[0]), max(now.layers[1], delta.layers[1]))
            self.counters["compactions"] += 1
        req = self._request(kind, key, raw, tokens, layers, delta.codec, expect)
        req.fresh = replace
        self._commit(req)
        return req.seq

    def restore(self, key: bytes) -> Snapshot | None:
        """The chain of key concatenated, or None if the store has nothing for key."""
        key = check_key(key)
        with self._lock:
            self._check_usable()
            fd = getattr(self.dev, "fd", None)
            if fd is not None:            # a local device: find, touch and read in one hold of the index
                chain, rc, at, err, found = self._ix.find_and_read(key, fd, self.log_start, self.log_blocks,
                                                                   self.block_size, self._rbuf)
                if chain is None:
                    return None
                parts = self._parts_read(chain, rc, at, err, found)
            else:
                chain = self._ix.find(key)
                if chain is None:
                    return None
                self._ix.touch(chain)
                parts = self._read_chain(chain, key)
            self.counters["restores"] += 1
            return Snapshot(b"".join(parts), chain.tokens, chain.layers, chain.codec, chain.records, tuple(parts),
                            chain.last_seq)

    def held(self, key: bytes) -> tuple[int, int]:
        """(n, seq): the store holds tokens [0, n) of the session, its chain's last record numbered
        seq ((0, 0): nothing), from the index alone."""
        key = check_key(key)
        with self._lock:
            self._check_usable()     # after a failed write the index may be ahead of the device
            chain = self._ix.find(key)
            return (chain.tokens[1], chain.last_seq) if chain is not None else (0, 0)

    def delete(self, key: bytes) -> bool:
        """Drop key's chain durably (a tombstone record); False if there was none."""
        key = check_key(key)
        with self._key_locks[key[0]]:
            with self._lock:
                self._check_usable(write=True)
                if not self._in_log(key):
                    return False
            req = _Request(KIND_TOMBSTONE, key, block_size=self.block_size)
            self._commit(req)
        return req.seq != 0

    def _in_log(self, key: bytes) -> bool:
        """Has key records recovery would replay: a chain in the index, or one LRU eviction dropped."""
        return key in self._ix or key in self._evicted

    def list(self) -> list[bytes]:
        with self._lock:
            self._check_usable()
            return self._ix.keys()

    def stats(self) -> dict:
        with self._lock:
            used = self._tail - self._head
            return {
                "path": self.path, "block_size": self.block_size, "log_blocks": self.log_blocks,
                "sessions": self._ix.sessions, "records": self._ix.live_records, "log_records": len(self._ix),
                "index_bytes": self._ix.nbytes, "live_blocks": self._ix.live_blocks,
                "used_blocks": used, "free_blocks": self.log_blocks - used,
                "head": self._head, "tail": self._tail, "generation": self._generation,
                "last_seq": self._last_seq, "superblocks_valid": self.superblocks_valid,
                "superblock_cut": self.superblock_cut,
                "max_record_bytes": self.max_payload, "recovery_ms": round(self.recovery_s * 1e3, 3),
                **{k: self.counters[k] for k in ("puts", "puts_at_once", "restores", "flushes", "compactions",
                                                 "relocations", "copies", "evictions", "evicted_tombstones",
                                                 "torn_records_skipped", "corrupt_blocks_skipped", "unreadable_blocks",
                                                 "unlinked_records_skipped", "damaged_chains_dropped",
                                                 "damaged_tombstones", "end_unreadable")},
            }

    def entries(self, limit: int | None = None) -> list[LogRecord]:
        """Every record from head to tail (dead ones and pads too), or the first limit, its
        header read from the device (the index keeps little of it), for inspect and tests. A
        header damaged or unreadable since the store opened reads as what the index knows of it,
        with a zero key and codec "?"."""
        with self._lock:
            if self._closed:
                raise SnapshotError("the snapshot store is closed")
            blocks_at = _Window(self, self.dev.read_into).at
            one, out = aligned_buffer(self.block_size), []
            end = self._ix.tail if limit is None else min(self._ix.tail, self._ix.head + limit)
            for rid in range(self._ix.head, end):
                r = self._ix.rec(rid)
                try:
                    h = fmt.unpack_header(*blocks_at(r.lpos, 1))
                except OSError:                   # EIO somewhere in the window: this record's block alone
                    try:
                        h = fmt.unpack_header(self.dev.read_into(one, self.log_start + r.lpos % self.log_blocks, 1))
                    except OSError:
                        h = None
                if h is None or h.lpos != r.lpos or h.seq != r.seq:
                    h = RecordHeader(r.kind, 0, self.store_id, r.lpos, 0, r.seq, 0, bytes(fmt.KEY_LEN),
                                     0, 0, 0, 0, r.nblocks, 0, 0, "?", 0)
                out.append(LogRecord(h, r.live))
            return out

    def verify(self) -> list[str]:
        """Re-read every live chain from the device; the problems found (fsck)."""
        problems = []
        with self._lock:
            for key, chain in self._ix.chains():
                try:
                    self._read_chain(chain, key)
                except SnapshotError as e:
                    problems.append(f"session {key.hex()[:16]}: {e}")
        return problems

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if not self.readonly and self.failed is None:   # (a device gone: nothing to write to)
                    self._write_superblock()
            finally:
                self.dev.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- group commit ---------------------------------------------------------------------

    def _put_at_once(self, key: bytes, raw: bytes, delta: Delta, fresh: bool) -> int:
        """The put whole in one C call (six_put: put's checks, the staging, the write with the
        checkpoint if one is due, and the fdatasync) when a group commit would gather nothing:
        nothing is committing or queued, and the last group commit gathered no other writer
        (_crowded; with writers about, puts that went at once each flushed alone, 1.7 records per
        fdatasync from 4 threads against 2.2). Not with compression (six_put stores the payload
        as it is) or a wait for writers to join (group_commit_us). Its sequence number, durable;
        0 when six_put declined, nothing done: put's own path takes it, and raises what six_put
        found. (Through that path a lone put cost ~16 us over its I/O, run cold after it:
        1.27-1.35x a raw write + fdatasync, against a goal of 1.2x.)"""
        if self._crowded or self.compress or self.group_commit_us or len(raw) > self.max_payload:
            return 0                              # (a payload too large: TooLarge, from put's own path)
        with self._queue_lock:
            if self._leading or self._queue:
                return 0
            self._leading = True              # writers that come now queue for the next leader
        try:
            with self._lock:
                self._check_usable(write=True)
                before = self._generation, self._checkpointed
                try:
                    if time.monotonic() - self._checkpointed >= CHECKPOINT_EVERY_S:
                        self._room.checkpoint = self._checkpoint_block()   # written with the record
                    rid = self._ix.put(self._t, self._room, key, raw, delta.tokens, delta.layers, delta.codec, fresh)
                    if rid != PUT_DECLINED:
                        self._staged(key)
                except BaseException as e:        # (an interrupt too: the index may be ahead of the
                    self._fail(e)                 # device, or _evicted of the log, as in _write_batch)
                    raise self._write_error(e) from e
                finally:
                    self._room.checkpoint = -1
                if rid == PUT_DECLINED:
                    self._generation, self._checkpointed = before   # a checkpoint laid out, not written
                    return 0
                self.counters["puts"] += 1
                self.counters["puts_at_once"] += 1
                self.counters["flushes"] += 1
                return self._last_seq
        finally:
            with self._queue_lock:
                self._leading = False
                if self._waiting:
                    self._cv.notify_all()

    def _fail(self, e: BaseException):
        """A write that failed midway leaves the index ahead of the device: the store refuses every
        call until reopened (its first cause kept)."""
        if not self._closed and self._failed is None and not self.readonly:
            self._failed = e

    def _write_error(self, e: BaseException) -> SnapshotError:
        """What a writer whose record a failed write left not durable is told."""
        return e if isinstance(e, SnapshotError) else SnapshotError(f"writing to {self.path} failed ({e}): "
                                                                    f"reopen the store")

    def _request(self, kind, key, raw, tokens, layers, codec, expect) -> _Request:
        payload, flags = raw, 0
        if self.compress:
            packed = zlib.compress(raw, 1)
            if len(packed) < len(raw):
                payload, flags = packed, fmt.FLAG_ZLIB
        return _Request(kind, key, payload, flags, len(raw), tokens, layers, codec, expect, self.block_size)

    def _commit(self, req: _Request):
        with self._queue_lock:
            self._queue.append(req)
            self._waiting += 1
            try:
                while not req.done and self._leading:
                    self._cv.wait()
            except BaseException:
                # interrupted while waiting its turn: not taken by a leader yet, it leaves with its
                # caller (the next leader wrote it, as the interrupted leader's below; review)
                if req in self._queue:
                    self._queue.remove(req)
                    req.done = True
                raise
            finally:
                self._waiting -= 1
            lead = not req.done
            if lead:
                self._leading = True
        if lead:
            taken = False
            try:
                if self.group_commit_us:
                    time.sleep(self.group_commit_us / 1e6)   # let more writers join this flush
                with self._queue_lock:
                    batch, self._queue, taken = self._queue, [], True
                    self._crowded = len(batch) > 1
                self._write_batch(batch)
            finally:
                with self._queue_lock:
                    if not taken:
                        # interrupted before taking the batch (a signal in the wait): its own record
                        # leaves the queue: the next flush wrote the put its caller saw fail, and
                        # refused the caller's retry of it (found by review); the others' stay, for
                        # the next leader
                        self._queue.remove(req)
                        req.done = True
                    self._leading = False
                    if self._waiting:
                        self._cv.notify_all()
        if req.error is not None:
            raise req.error

    def _write_batch(self, batch: list[_Request]):
        with self._lock:
            try:
                self._check_usable(write=True)
                staged: list[_Request] = []
                protect = {r.key for r in batch}
                for req in batch:
                    if req.kind == KIND_TOMBSTONE and not self._in_log(req.key):
                        continue                  # deleted meanwhile: nothing to write
                    try:
                        if not self._fits(req.nblocks, self._floor(req.kind)):
                            self._check_chain(req)    # no room made for a put refused anyway
                            self._flush()
                            self._count_puts(staged)
                            staged = []
                            self._make_room(req, protect)
                        self._stage(req)              # refused if its chain changed (make_room may evict it)
                        if req.kind == KIND_BASE:     # a put that compacted: a use (a rebase keeps the
                            self._ix.touch(self._ix.find(req.key))   # LRU place, for relocation's)
                        staged.append(req)
                    except (DeviceFull, SessionChanged) as e:
                        req.error = e             # this record only; the batch goes on
                self._flush()
                self._count_puts(staged)
            except BaseException as e:
                self._fail(e)
                for req in batch:     # a put flushed before the failure is acknowledged: it is on disk
                    if req.error is None and not req.durable:
                        req.error = self._write_error(e)
            finally:
                for req in batch:
                    req.done = True

    @property
    def failed(self) -> BaseException | None:
        """The write error that left this open store unusable (every call refused until reopened), or
        a device that lost its connection (an NVMe/TCP target gone: every read and write fails until
        the device is opened again; a restore-only load never met a write error, and a server
        refused every restore after the target came back: found by review)."""
        lost = getattr(self.dev, "lost", None)
        return self._failed if self._failed is not None or not lost else DeviceError(lost)

    def _check_usable(self, write: bool = False):
        if self._closed:
            raise SnapshotError("the snapshot store is closed")
        if self._failed is not None:
            raise SnapshotError(f"the snapshot store hit an error ({self._failed}): reopen it")
        if write and self.readonly:
            raise SnapshotError(f"{self.path} is open read-only")

    def _check_chain(self, req: _Request):
        # (a replacing put depends on no chain: one evicted meanwhile is no reason to refuse it;
        # six_stage checks the same)
        if req.kind != KIND_TOMBSTONE and not req.fresh and self._ix.gen(req.key) != req.expect:
            raise SessionChanged(_CHAIN_CHANGED)

    # --- space --------------------------------------------------------------------------

    def _floor(self, kind: int) -> int:
        """Free blocks that must remain after a record of this kind. A put leaves the reserve
        and room to relocate the largest record (a chain's base is one) with the pad it may need
        before the lap's end (records never wrap). A tombstone may use the reserve (a delete is
        how room is made) but not that room, and leaves one block more for the tombstone reclaim
        may have to write first (_bury). Deletes that used that room (a floor of 1) left a live
        record at the head that could be neither compacted nor copied: every later put and
        delete DeviceFull, for good, reopened or not; with one block left, the same for _bury's
        tombstone."""
        relocation = 2 * self.max_record_blocks - 1
        if kind == KIND_TOMBSTONE:
            return relocation + 1
        return self._reserve + relocation

    def _fits(self, nblocks: int, floor: int) -> bool:
        phys = self._tail % self.log_blocks
        pad = self.log_blocks - phys if phys + nblocks > self.log_blocks else 0
        return self.log_blocks - (self._tail - self._head) - pad - nblocks >= floor

    def _make_room(self, req: _Request, protect: set):
        floor = self._floor(req.kind)
        # the record, a pad before it, and the floor (which holds a relocation and its pad)
        worst = 2 * req.nblocks + floor
        while self._ix.live_blocks + worst > self.log_blocks:
            self._evict_or_refuse(protect)
        sweep = 2 * len(self._ix) + 1             # steps in one pass: a live record is moved, then popped
        while not self._fits(req.nblocks, floor):
            if sweep == 0:                        # a whole pass freed too little: too much is live
                self._evict_or_refuse(protect)
                sweep = 2 * len(self._ix) + 1
            sweep -= 1
            if not len(self._ix):                 # every record passed: what is left is a gap of
                self._head = self._tail           # damaged blocks recovery skipped (an IndexError
                continue                          # here failed the store; found by review)
            e = self._ix.rec(self._ix.head)
            if not e.live:
                if self._dropped:                 # tombstones open had no room for: before the head
                    try:                          # passes more of what their chains left
                        self._bury_dropped(one=True)
                    except DeviceFull:
                        pass                      # still no room: at the next dead record
                halving = self._halving.get(e.rid)
                if halving is not None and self._halves_evicted(halving, e):
                    self._bury(halving)           # DeviceFull: still there for the next try
                self._halving.pop(e.rid, None)
                self._ix.pop()
                self._head = e.lpos + e.nblocks
                continue
            key = self._ix.key_of(e)
            # The record's whole chain compacted into one base at the tail: it costs the chain and
            # frees one record now, the chain's others as the head reaches them, dead. It may
            # borrow the tombstones' reserve (kept out of it, a live chain at the head that a
            # delete, or the pad before the lap's end, had left a few blocks short stopped the
            # head for good: DeviceFull with 15 of 254 blocks live), down to _compaction_floor.
            # When it does not fit, the record alone is copied as it is, which the head gives
            # back at once: a run of chains spread over the log, compacted one after another,
            # had used up the free room and stopped the head (DeviceFull with a fifth of the log
            # live, or evictions).
            try:
                base = self._base_of(key, self._ix.find(key))
            except DamagedRecord:
                self._drop_damaged(key)
                continue
            if self._fits(base.nblocks, self._compaction_floor):
                self._stage(base)                 # durable before the head passes it
                self._flush()
                self.counters["relocations"] += 1
            elif self._fits(e.nblocks, 0):
                self._copy(e, key)                # durable before the head passes the original
                self.counters["copies"] += 1
            else:
                self._evict_or_refuse(protect, key)   # the head is stuck on it
        # Then dead records at the head past the need, a reserve's worth: passing them costs nothing,
        # and the puts after this one find room at once (six_put) instead of each making its own,
        # as on a log that had wrapped every put did. Not one whose passing writes a tombstone.
        while (len(self._ix) and not self._fits(req.nblocks + self._reserve, floor)
               and not (e := self._ix.rec(self._ix.head)).live and not self._dropped and e.rid not in self._halving):
            self._ix.pop()
            self._head = e.lpos + e.nblocks

    def _drop_damaged(self, key: bytes):
        """The chain at the head has a record that is damaged or cannot be read: it cannot be
        moved, so it is dropped, durably (its tombstone), as recovery would drop it, and the
        head goes on. Before, the error failed the store: every put and restore of every
        session refused until a reopen (found by review)."""
        self._write_tombstone(key, "a damaged session")   # the tombstone unlinks the chain
        self.counters["damaged_chains_dropped"] += 1

    def _halves_evicted(self, key: bytes, e: Rec) -> bool:
        """Would passing the dead record e, once of key's chain, leave recovery half of a session
        LRU eviction dropped? Yes if that chain is still the one evicted and its first record lies
        further on (copied): recovery would find that first record and link what follows it,
        without e."""
        start = self._evicted.get(key)
        return start is not None and e.seq > start[0] and e.lpos < start[1]

    def _bury(self, key: bytes):
        """A durable tombstone for an evicted session, before the head passes part of it."""
        self._write_tombstone(key, "an evicted session")   # its link forgets the eviction
        self.counters["evicted_tombstones"] += 1

    def _write_tombstone(self, key: bytes, whose: str, floor: int = 0):
        """key's tombstone, durable, leaving `floor` blocks free (by default it may take what room
        reclaim has: the floor a put or a delete keeps is for this)."""
        req = _Request(KIND_TOMBSTONE, key, block_size=self.block_size)
        if not self._fits(req.nblocks, floor):
            raise DeviceFull(f"{self.path} has no room left for the tombstone of {whose} "
                             f"({self._ix.live_blocks} of {self.log_blocks} blocks live): delete sessions")
        self._stage(req)
        self._flush()

    def _evict_or_refuse(self, protect: set, key: bytes | None = None):
        """Under eviction="lru", drop key, by default the least recently used session, one
        without a put in this batch if there is one (a put to an evicted session fails
        with SessionChanged); under "refuse", raise DeviceFull."""
        if key is None:
            key = self._ix.least_recent(protect)
        if self.eviction != "lru" or key is None:
            raise DeviceFull(f"{self.path} is full of live snapshots ({self._ix.live_blocks} of {self.log_blocks} "
                             f"blocks): delete sessions, use a larger device, or open the store with "
                             f"eviction='lru'")
        chain = self._ix.find(key)
        first, *later = self._ix.records(chain)
        self._evicted[key] = (first.seq, first.lpos)
        self._halving.update((r.rid, key) for r in later if r.lpos < first.lpos)
        self._ix.drop(chain)
        self.counters["evictions"] += 1

    def _base_of(self, key: bytes, chain: Chain) -> _Request:
        """The chain compacted into one base record (relocation at the head)."""
        return self._request(KIND_BASE, key, fmt.pack_parts(self._read_chain(chain, key)), chain.tokens,
                             chain.layers, chain.codec, chain.gen)

    def _copy(self, e: Rec, key: bytes):
        """Copy the live record e to the tail as it is (its header but for a new position and
        epoch: key, sequence number and parent kept), durably, into its place in its chain."""
        _, _, record = self._read_record(e, key)
        while (rid := self._ix.stage_copy(self._t, record)) == STAGE_ROOM:
            self._grow_wbuf()
        if rid == STAGE_REFUSED:      # a header whose CRC held but whose sizes do not: never written so
            raise SnapshotError(f"the record at block {e.lpos % self.log_blocks} of {self.path} could not be copied: "
                                f"its header's sizes are not its blocks'")
        self._ix.swap(e.rid, rid)
        self._flush()

    # --- staging and flushing ------------------------------------------------------------

    def _stage(self, req: _Request):
        """Lay req out at the tail in the write buffer and link it into the index (six_stage: its
        sequence number, its parent, a pad before it if it would cross the lap's end)."""
        while (rid := self._ix.stage(self._t, req.kind, req.flags, req.key, req.payload, req.raw_len, req.tokens,
                                     req.layers, req.codec, req.fresh, req.expect)) == STAGE_ROOM:
            self._grow_wbuf()
        if rid == STAGE_CHANGED:
            raise SessionChanged(_CHAIN_CHANGED)
        if rid == STAGE_REFUSED:
            raise SnapshotError(f"the index did not take the record staged for sequence number {self._last_seq}: a bug")
        req.seq = self._last_seq
        self._staged(req.key)

    def _staged(self, key: bytes):
        """After key's record was staged (six_stage, six_put)."""
        if self._evicted and self._t.parent == 0:
            self._evicted.pop(key, None)          # what the log held of it is superseded now

    def _grow_wbuf(self):
        """The write buffer made twice what the next record needs (six_stage's t.need), what is
        staged in it kept."""
        t = self._t
        bigger = aligned_buffer(2 * t.need)
        bigger[:t.woff] = self._wbuf[:t.woff]
        self._wbuf, self._wbuf_view = bigger, self._ix.tail_buffer(t, bigger)

    def _count_puts(self, flushed: list[_Request]):
        # each flush's own: puts flushed before a batch made room were not counted before
        puts = 0
        for r in flushed:
            r.durable = True      # an error later in the batch is not theirs
            puts += r.kind != KIND_TOMBSTONE
        self.counters["puts"] += puts

    def _flush(self):
        """Write what is staged, the blocks from the durable tail to the tail, in order in the write
        buffer (one pwritev per physically contiguous run: the lap's end splits it), then one
        fdatasync."""
        lpos, end, L = self._durable_tail, self._t.tail, self.log_blocks
        if lpos == end:
            return
        if end - L > self._sb_head:
            self._write_superblock()                      # the head moves before its blocks are reused
        off = 0
        while lpos < end:
            n = min(end - lpos, L - lpos % L)
            self.dev.write_from(self._wbuf, off, self.log_start + lpos % L, n)
            lpos, off = lpos + n, off + n * self.block_size
        if time.monotonic() - self._checkpointed >= CHECKPOINT_EVERY_S:
            self._checkpoint()
        self.dev.sync()
        self._t.woff = 0
        self._durable_tail = end
        self.counters["flushes"] += 1

    def _checkpoint(self):
        """One superblock copy, in turn, moved up to what the last flush made durable, written in this
        flush's fdatasync (at most every CHECKPOINT_EVERY_S): so only the records of the flushes
        since can lie past the checkpoint, and recovery reads a bad record there as the torn end,
        any earlier one as damage. (With the checkpoint moved only at open, close and head moves,
        every record since was past it: one corrupt block cut off every later acknowledged record
        as a "torn" end, for good.) A torn copy leaves the other, one checkpoint older. The head
        stays the one both copies recorded."""
        self.dev.write_from(self._sbuf, 0, self._checkpoint_block(), 1)

    def _checkpoint_block(self) -> int:
        """The next checkpoint laid out in the superblock buffer: the block of the copy it goes to."""
        _pack_superblock_block(self._sbuf, self._next_superblock(self._sb_head), self.block_size)
        return self._generation % fmt.SB_COPIES

    def _next_superblock(self, head: int) -> Superblock:
        """The next generation's superblock: head, and the tail the last flush made durable."""
        self._generation += 1
        self._checkpointed = time.monotonic()
        return Superblock(self.block_size, self.store_id, self.capacity_blocks, self.log_start, self.log_blocks,
                          head, self._durable_tail, self._generation, self._last_seq, self._epoch)

    def _write_superblock(self):
        _write_superblocks(self.dev, self._sbuf, self._next_superblock(self._head))
        self._sb_head = self._head
        self._evicted = {k: start for k, start in self._evicted.items() if start[1] >= self._sb_head}
        self.superblocks_valid = fmt.SB_COPIES
        self.superblock_cut = False

    def _read_record(self, e: Rec, key: bytes) -> tuple[RecordHeader, bytes, memoryview]:
        """The record's header and stored payload, its CRC and identity checked, and the whole
        record as read."""
        bs, L = self.block_size, self.log_blocks
        try:
            view = self.dev.read_into(self._read_buf(e.nblocks * bs), self.log_start + e.lpos % L, e.nblocks)
        except OSError as err:
            raise DamagedRecord(f"the record at block {e.lpos % L} of {self.path} cannot be read ({err.strerror}): "
                                f"run `snapshotstore fsck {self.path}`") from None
        got = fmt.read_record(view, e.lpos, e.seq, key)
        if got is None:
            raise DamagedRecord(f"the record at block {e.lpos % L} of {self.path} is damaged "
                                f"(run `snapshotstore fsck {self.path}`)")
        return (*got, view)

    def _read_chain(self, chain: Chain, key: bytes) -> list[bytes]:
        """The chain's deltas, oldest first (a base gives back the ones it merged), each
        record's CRC and identity checked. On a local device the reads and checks run in C, one
        call for the chain (in Python each record cost ~8 us over its read: 1.26x the raw reads
        of 8 deltas, 1.05-1.07x in C); on a remote namespace (no fd) record by record here."""
        fd = getattr(self.dev, "fd", None)
        if fd is None:
            return self._read_chain_records(chain, key)
        return self._parts_read(chain, *self._ix.read_chain(chain, fd, self.log_start, self.log_blocks,
                                                            self.block_size, self._rbuf))

    def _parts_read(self, chain: Chain, rc: int, at: int, err: int, found) -> list[bytes]:
        """The deltas of what Index.read_chain read into the read buffer; a buffer too small for
        the chain grown and the chain read again; a record that could not be read or is not the
        one expected raised, named."""
        if rc == SIX_READ_ROOM and at > len(self._rbuf):
            self._rbuf = aligned_buffer(at)
            rc, at, err, found = self._ix.read_chain(chain, self.dev.fd, self.log_start, self.log_blocks,
                                                     self.block_size, self._rbuf)
        if rc < 0:
            where = self._ix.records(chain)[at].lpos % self.log_blocks if rc != SIX_READ_ROOM else 0
            if rc == SIX_READ_IO and err:
                raise DamagedRecord(f"the record at block {where} of {self.path} cannot be read "
                                    f"({os.strerror(err)}): run `snapshotstore fsck {self.path}`")
            if rc == SIX_READ_IO:
                raise DeviceError(f"short read at block {self.log_start + where} of {self.path}")
            if rc == SIX_READ_DAMAGED:
                raise DamagedRecord(f"the record at block {where} of {self.path} is damaged "
                                    f"(run `snapshotstore fsck {self.path}`)")
            raise SnapshotError(f"restore's read of a chain of {chain.records} records found no room: a bug")
        view, parts = memoryview(self._rbuf), []
        for off, n, flags, kind, _ in found:
            body = zlib.decompress(view[off:off + n]) if flags & fmt.FLAG_ZLIB else bytes(view[off:off + n])
            if kind == KIND_BASE:
                parts += fmt.unpack_parts(body)
            else:
                parts.append(body)
        return parts

    def _read_chain_records(self, chain: Chain, key: bytes) -> list[bytes]:
        """_read_chain record by record, each through the device's read_into."""
        parts = []
        for e in self._ix.records(chain):
            h, body, _ = self._read_record(e, key)
            body = zlib.decompress(body) if h.flags & fmt.FLAG_ZLIB else body
            if e.kind == KIND_BASE:
                parts += fmt.unpack_parts(body)
            else:
                parts.append(body)
        return parts
