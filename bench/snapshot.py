"""bench snapshot: the snapshot store against raw O_DIRECT I/O on the same device, in the same run.

The store and the references run on image files in one directory (one
filesystem, one disk: ZEROLAYER_BENCH_DIR, default /var/tmp), both written
through once first so neither pays for allocating blocks. Latency samples of
the store and of its reference alternate in small rounds, so a noisy
neighbour hits both alike.
  references.raw_write_sync_p50_us|p99_us  O_DIRECT 4 KiB pwrite + fdatasync, sequential
  references.raw_write_sync_per_s          back-to-back write + fdatasync per second, one thread (half
                                           before the puts' runs, half after)
  references.raw_read_p50_us               O_DIRECT 4 KiB pread at random offsets
  references.raw_read_chain<n>_p50_us      O_DIRECT preads of exactly the blocks restore_chain<n> reads
  metrics.put_4k_p50_us|p99_us             put of a one-block record (4 KiB: header + payload), durable
  metrics.put_records_per_s_w1|w4|w16      one-block puts per second from 1, 4, 16 threads (group commit)
  metrics.put_records_per_s_w16_wait300us  the same, w16, the leader waiting 300 us for more writers (the knob)
  metrics.restore_chain<1|8|64>_p50_us     restore of a chain of n one-block deltas (compaction off)
  metrics.index_bytes_per_session          what the reopened store holds per one-record session: its native
                                           index's allocation and the Python heap it took (tracemalloc)
  metrics.recovery_ms_per_gib              open (scan, CRC, index) per GiB of log, one-block records
  references.raw_scan_ms_per_gib           O_DIRECT reads of the same blocks in recovery's 1 MiB windows
With --soak: the crash soak, 1,000 SIGKILLed writers (snapshotstore/crashtest.py).
"""
from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
import time
import tracemalloc

import numpy as np

from datapath.metrics import percentile
from snapshotstore import Delta, LogStore, crashtest, format_device, session_key
from snapshotstore.device import aligned_buffer, create_image
from snapshotstore.format import HEADER_SIZE, LOG_START
from snapshotstore.log import SCAN_WINDOW_BYTES

SECRET = b"bench-tenant-secret-0123"
MiB = 1 << 20


def pct(xs_us, q):
    """Quantile q (0..1) of samples in us, by HdrHistogram (datapath.metrics) on their ns."""
    return percentile(np.rint(np.asarray(xs_us, dtype=np.float64) * 1e3).astype(np.int64), 100 * q) / 1e3


def _us(t0):
    return (time.perf_counter_ns() - t0) / 1e3


def _precondition(path: str, size: int):
    """Create the image and write every block once (so no write below allocates)."""
    create_image(path, size)
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    buf = aligned_buffer(MiB)
    try:
        for off in range(0, size, MiB):
            os.pwritev(fd, [buf], off)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _mount(path: str) -> tuple[str, str]:
    """(source, type) of the filesystem path is on: its longest mount point in /proc/mounts."""
    path, best = os.path.realpath(path), ("?", "?", "")
    for line in open("/proc/mounts"):
        src, mnt, fstype = line.split()[:3]
        if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[2]):
            best = (src, fstype, mnt)
    return best[0], best[1]


def _filesystem(path: str) -> str:
    return "{} ({})".format(*_mount(path))


# O_DIRECT there is taken and ignored (tmpfs since Linux 6.6): the "raw I/O" reference and the
# store's would both be copies in memory, the ratios of nothing the goals speak of
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def bench_dir() -> str:
    """Where the image files go: ZEROLAYER_BENCH_DIR (default /var/tmp), refused on a filesystem in
    memory (ValueError)."""
    base = os.environ.get("ZEROLAYER_BENCH_DIR", "/var/tmp")
    fstype = _mount(base)[1]
    if fstype in MEMORY_FILESYSTEMS:
        raise ValueError(f"ZEROLAYER_BENCH_DIR={base} is on {fstype}, in memory: O_DIRECT there measures no "
                         f"device (give a directory on a disk)")
    return base


class RawDevice:
    """The reference: bare O_DIRECT preadv/pwritev on an image, no format, no Python store."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        self.blocks = os.fstat(self.fd).st_size // 4096
        self.buf = aligned_buffer(4096 * 64)
        self.view = memoryview(self.buf)
        self.next = 0

    def write_sync_us(self) -> float:
        t0 = time.perf_counter_ns()
        os.pwritev(self.fd, [self.view[:4096]], (self.next % self.blocks) * 4096)
        os.fdatasync(self.fd)
        self.next += 1
        return _us(t0)

    def read_us(self, rng) -> float:
        off = rng.randrange(self.blocks) * 4096
        t0 = time.perf_counter_ns()
        os.preadv(self.fd, [self.view[:4096]], off)
        return _us(t0)

    def close(self):
        os.close(self.fd)


def _raw_read_extents_us(fd, extents, block_size, buf) -> float:
    view = memoryview(buf)
    t0 = time.perf_counter_ns()
    for block, n in extents:
        os.preadv(fd, [view[:n * block_size]], block * block_size)
    return _us(t0)


def _put_latency(report, store, raw, samples):
    payload = os.urandom(store.block_size - HEADER_SIZE)     # header + payload = one block
    raw_us, put_us = [], []
    for n in range(samples):                                 # one of each, alternately
        raw_us.append(raw.write_sync_us())
        k, d = session_key(SECRET, f"lat{n}"), Delta(payload)
        t0 = time.perf_counter_ns()
        store.put(k, d)
        put_us.append(_us(t0))
    report.reference("raw_write_sync_p50_us", pct(raw_us, 0.5), "us")
    report.reference("raw_write_sync_p99_us", pct(raw_us, 0.99), "us")
    report.metric("put_4k_p50_us", pct(put_us, 0.5), "us")
    report.metric("put_4k_p99_us", pct(put_us, 0.99), "us")
    report.ratio("put_4k_p50_us", "raw_write_sync_p50_us")
    report.ratio("put_4k_p99_us", "raw_write_sync_p99_us")


def put_rate(store, writers: int, total: int, payload: bytes, tag: str) -> float:
    """Puts per second of `writers` threads putting total // writers records each, started together
    (keys derived before). A writer's failure fails the measurement: a thread's exception is not
    seen by its joiner, and the rate of the planned puts over a shorter time came out inflated."""
    per = total // writers
    barrier = threading.Barrier(writers + 1)
    done, errors = [0] * writers, []

    def work(w):
        keys = [session_key(SECRET, f"{tag}-{w}-{i}") for i in range(per)]
        barrier.wait()
        try:
            for k in keys:
                store.put(k, Delta(payload))
                done[w] += 1
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors or sum(done) != per * writers:
        raise RuntimeError(f"{tag}: {sum(done)} of {per * writers} puts acknowledged; {errors[:1]}")
    return per * writers / seconds


def _raw_writes_s(raw, n) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        raw.write_sync_us()
    return time.perf_counter() - t0


def _throughput(report, store, raw, total):
    payload = os.urandom(store.block_size - HEADER_SIZE)
    # the reference's writes half before the puts' runs and half after, so a drift of the disk
    # over them hits both (it ran once, before them all)
    raw_s = _raw_writes_s(raw, total // 2)
    names = []
    for writers in (1, 4, 16):
        before = store.stats()["flushes"]
        rate = put_rate(store, writers, total, payload, f"tp{writers}")
        flushes = store.stats()["flushes"] - before
        names.append(f"put_records_per_s_w{writers}")
        report.metric(names[-1], rate, "records/s")
        report.note(f"w{writers}: {total // writers * writers / max(flushes, 1):.1f} records per fdatasync "
                    "(group commit)")
    # the knob: the leader waits for more writers before its flush (the same measurement as above)
    store.group_commit_us = 300
    before = store.stats()["flushes"]
    try:
        rate = put_rate(store, 16, total, payload, "gc")
    finally:
        store.group_commit_us = 0
    report.note(f"w16, leader waits 300 us: {total // 16 * 16 / max(store.stats()['flushes'] - before, 1):.1f} "
                f"records per fdatasync")
    names.append("put_records_per_s_w16_wait300us")
    report.metric(names[-1], rate, "records/s")
    raw_s += _raw_writes_s(raw, total - total // 2)
    report.reference("raw_write_sync_per_s", total / raw_s, "records/s")
    for name in names:
        report.ratio(name, "raw_write_sync_per_s")


def _restore(report, store, raw_fd, sessions, samples, rng):
    bs = store.block_size
    payload = os.urandom(bs - HEADER_SIZE)
    buf = aligned_buffer(64 * bs)
    for n in (1, 8, 64):
        keys = [session_key(SECRET, f"chain{n}-{s}") for s in range(sessions)]
        for i in range(n):                    # interleaved, as sessions' deltas land in a shared log
            for k in keys:
                store.put(k, Delta(payload, tokens=(i * 10, i * 10 + 10)))
        keyset, extents = set(keys), {}
        for e in store.entries():             # log order is chain order
            if e.live and e.key in keyset:
                extents.setdefault(e.key, []).append((LOG_START + e.lpos % store.log_blocks, e.nblocks))
        raw_us, restore_us = [], []
        for i in range(samples):
            k = rng.choice(keys)
            # in turn first: the second read of the same blocks may find them in a cache below
            # O_DIRECT (the host's, the device's), which must not favour one side
            if i % 2:
                raw_us.append(_raw_read_extents_us(raw_fd, extents[k], bs, buf))
            t0 = time.perf_counter_ns()
            snap = store.restore(k)
            restore_us.append(_us(t0))
            if not i % 2:
                raw_us.append(_raw_read_extents_us(raw_fd, extents[k], bs, buf))
            assert snap.records == n and len(snap.payload) == n * len(payload)
        ref, met = f"raw_read_chain{n}_p50_us", f"restore_chain{n}_p50_us"
        report.reference(ref, pct(raw_us, 0.5), "us")
        report.metric(met, pct(restore_us, 0.5), "us")
        report.ratio(met, ref)


def _fill(store, records, writers=16):
    payload = os.urandom(store.block_size - HEADER_SIZE)

    def work(w):
        for i in range(w, records, writers):
            store.put(session_key(SECRET, f"fill{i}"), Delta(payload))

    threads = [threading.Thread(target=work, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _raw_scan_s(path, st) -> float:
    """Recovery's least I/O: O_DIRECT reads of the log's used blocks (stats st) in its windows,
    in order, across the lap's end as it does."""
    bs, L = st["block_size"], st["log_blocks"]
    window = SCAN_WINDOW_BYTES // bs
    buf = aligned_buffer(window * bs)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        pos = st["head"]
        while pos < st["tail"]:
            n = min(window, st["tail"] - pos, L - pos % L)
            got = os.preadv(fd, [memoryview(buf)[:n * bs]], (LOG_START + pos % L) * bs)
            if got != n * bs:
                raise OSError(f"raw scan: {got} of {n * bs} bytes read at block {LOG_START + pos % L}")
            pos += n
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _recovery_and_index(report, path, records):
    with LogStore(path, compact_after=1000) as store:
        _fill(store, records)
        st = store.stats()
    opens, raws = [], []
    for i in range(6):               # in turn, each first as often, so a slow spell lands on both
        for what in ((0, 1) if i % 2 else (1, 0)):
            if what:
                raws.append(_raw_scan_s(path, st))
                continue
            t0 = time.perf_counter()
            store = LogStore(path, readonly=True)
            opens.append(time.perf_counter() - t0)
            st = store.stats()
            store.close()
    gib = (st["tail"] - st["head"]) * st["block_size"] / (1 << 30)
    report.metric("recovery_ms_per_gib", min(opens) * 1e3 / gib, "ms/GiB")
    report.reference("raw_scan_ms_per_gib", min(raws) * 1e3 / gib, "ms/GiB")
    report.ratio("recovery_ms_per_gib", "raw_scan_ms_per_gib")
    report.note(f"recovery: {st['tail'] - st['head']} blocks, {st['records']} records scanned in "
                f"{min(opens) * 1e3:.1f} ms, their raw reads {min(raws) * 1e3:.1f} ms (best of 6, in turn)")
    tracemalloc.start()
    store = LogStore(path, readonly=True)
    heap, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    st = store.stats()
    store.close()
    sessions, native = st["sessions"], st["index_bytes"]
    report.metric("index_bytes_per_session", (heap + native) / sessions, "bytes")
    report.note(f"index: {native / 1e6:.2f} MB native + {heap / 1e6:.2f} MB of Python heap for {sessions} "
                f"one-record sessions in {st['log_records']} records")


def _soak(report, workdir, iterations):
    res = crashtest.run(os.path.join(workdir, "soak.img"), iterations, seed=int(time.time()))
    report.metric("crash_iterations", res.iterations, "")
    report.metric("crash_failures", len(res.failures), "")
    report.metric("crash_acked_puts", res.acked_puts, "")
    report.metric("crash_records_verified", res.records_verified, "")
    report.note(f"soak: {res.iterations} SIGKILLed writers in {res.seconds:.0f} s, "
                f"{res.writer_finished} finished before the kill; failures: {res.failures[:3] or 'none'}")
    if res.failures or res.iterations < iterations:     # the soak returns them: the suite fails on them
        raise RuntimeError(f"crash soak: {len(res.failures)} failures in {res.iterations} of {iterations} "
                           f"iterations: {res.failures[:3]}")


def run(report, args):
    quick = args.quick
    base = bench_dir()
    workdir = tempfile.mkdtemp(prefix="zl-snapshot-bench-", dir=base)
    rng = random.Random(6)
    try:
        report.machine["device"] = f"image files in a temporary directory under {base} on {_filesystem(workdir)}"
        raw_path, store_path = os.path.join(workdir, "raw.img"), os.path.join(workdir, "store.img")
        _precondition(raw_path, 16 * MiB)
        _precondition(store_path, (128 if quick else 512) * MiB)
        format_device(store_path, force=True)
        raw = RawDevice(raw_path)
        try:
            with LogStore(store_path, compact_after=1000) as store:
                _put_latency(report, store, raw, samples=400 if quick else 3000)
                reads = [raw.read_us(rng) for _ in range(300 if quick else 2000)]
                report.reference("raw_read_p50_us", pct(reads, 0.5), "us")
                _throughput(report, store, raw, total=480 if quick else 3200)
                store_fd = os.open(store_path, os.O_RDONLY | os.O_DIRECT)
                try:
                    _restore(report, store, store_fd, sessions=10 if quick else 30,
                             samples=60 if quick else 300, rng=rng)
                finally:
                    os.close(store_fd)
        finally:
            raw.close()
        os.unlink(store_path)
        _precondition(store_path, (64 if quick else 256) * MiB)
        format_device(store_path, force=True)
        _recovery_and_index(report, store_path, records=(12000 if quick else 50000))
        if getattr(args, "soak", False):
            _soak(report, workdir, 1000)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
