"""bench nvmetcp: LogStore on a remote NVMe/TCP namespace (loopback) against LogStore on a local image, same run.

The target is `snapshotstore target` in a child process (its own interpreter,
as a remote host would be) serving an image file; the local store uses an
image in the same directory (ZEROLAYER_BENCH_DIR, default /var/tmp), both
written through once first. Samples of the remote and the local store
alternate, so a noisy neighbour hits both alike.
  references.local_put_4k_p50_us|p99_us     put of a one-block record, durable, local image
  references.local_put_64k_p50_us           put of a 64 KiB record (17 blocks)
  references.local_restore_chain8_p50_us    restore of a chain of 8 one-block deltas
  references.local_put_records_per_s_w16    one-block puts per second from 16 threads (group commit), the mean
                                            of two runs taken local, remote, remote, local
  references.local_open_ms                  open (recovery scan) of the store after the runs above, the mean
                                            of two taken in the same order
  metrics.remote_*                          the same through NVMe/TCP: one-block writes in the capsule,
                                            larger ones by R2T/H2CData, durability by a Flush command
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

from snapshotstore import Delta, LogStore, format_device, session_key
from snapshotstore.format import HEADER_SIZE
from snapshotstore.nvmetcp.process import TargetProcess

from .snapshot import MiB, _filesystem, _precondition, _us, bench_dir, pct, put_rate

SECRET = b"bench-nvmetcp-secret-0123"


def _alternate(report, stores, name, samples, op):
    """op(store, n) timed on each store in turn, samples times, which goes first alternating (the
    local one always went first); p50 (and p99) per store."""
    times = {side: [] for side in stores}
    for n in range(samples):
        for side, store in (list(stores.items())[::-1] if n % 2 else stores.items()):
            t0 = time.perf_counter_ns()
            op(store, n)
            times[side].append(_us(t0))
    for q, tag in ((0.5, "p50"), (0.99, "p99")):
        if tag == "p99" and not name.startswith("put_4k"):
            continue
        report.reference(f"local_{name}_{tag}_us", pct(times["local"], q), "us")
        report.metric(f"remote_{name}_{tag}_us", pct(times["remote"], q), "us")
        report.ratio(f"remote_{name}_{tag}_us", f"local_{name}_{tag}_us")


def run(report, args):
    quick = args.quick
    base = bench_dir()
    workdir = tempfile.mkdtemp(prefix="zl-nvmetcp-bench-", dir=base)
    size = (64 if quick else 256) * MiB
    samples = 300 if quick else 3000
    try:
        report.machine["device"] = (f"image files in a temporary directory under {base} on {_filesystem(workdir)}, "
                                    f"target on 127.0.0.1")
        local_path, remote_path = os.path.join(workdir, "local.img"), os.path.join(workdir, "remote.img")
        for p in (local_path, remote_path):
            _precondition(p, size)
            format_device(p, force=True)
        with TargetProcess(remote_path) as target:
            report.note(f"target pid {target.pid} at {target.url}")
            local, remote = LogStore(local_path, compact_after=1000), LogStore(target.url, compact_after=1000)
            stores = {"local": local, "remote": remote}
            try:
                one = os.urandom(local.block_size - HEADER_SIZE)       # header + payload = one block
                big = os.urandom(64 << 10)
                _alternate(report, stores, "put_4k", samples,
                           lambda s, n: s.put(session_key(SECRET, f"p4-{n}"), Delta(one)))
                _alternate(report, stores, "put_64k", samples // 2,
                           lambda s, n: s.put(session_key(SECRET, f"p64-{n}"), Delta(big)))
                chains = [session_key(SECRET, f"c8-{c}") for c in range(10)]
                for i in range(8):
                    for k in chains:
                        for s in stores.values():
                            s.put(k, Delta(one, tokens=(i * 10, i * 10 + 10)))

                def restore(s, n):
                    assert s.restore(chains[n % len(chains)]).records == 8
                _alternate(report, stores, "restore_chain8", samples, restore)
                total = 480 if quick else 3200
                rates = {side: [] for side in stores}
                for run, side in enumerate(("local", "remote", "remote", "local")):   # ABBA: a drift hits both
                    rates[side].append(put_rate(stores[side], 16, total // 2, one, f"w16-{side}-{run}"))
                for side, r in rates.items():
                    (report.reference if side == "local" else report.metric)(
                        f"{side}_put_records_per_s_w16", sum(r) / len(r), "records/s")
                report.ratio("remote_put_records_per_s_w16", "local_put_records_per_s_w16")
                blocks = {side: s.stats()["used_blocks"] for side, s in stores.items()}
            finally:
                local.close()
                remote.close()
            paths, opens = {"local": local_path, "remote": target.url}, {"local": [], "remote": []}
            for side in ("local", "remote", "remote", "local"):                     # ABBA
                t0 = time.perf_counter()
                LogStore(paths[side], readonly=True).close()
                opens[side].append((time.perf_counter() - t0) * 1e3)
            for side, ms in opens.items():
                (report.reference if side == "local" else report.metric)(f"{side}_open_ms", sum(ms) / 2, "ms")
            report.ratio("remote_open_ms", "local_open_ms")
            report.note(f"open: a recovery scan of {blocks['local']} local / {blocks['remote']} remote log blocks "
                        f"(1 MiB reads: one Read command each)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
