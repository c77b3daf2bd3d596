"""bench ring: the shared-memory ring, the routing policies and the lanes.

Measured in one run (two pinned processes on cores 0 and 1 where there are two):
  references.pingpong_oneway_ns       a bare cache-line ping-pong between two pinned threads (round trip / 2),
                                      the median of three runs taken in turn with the ring's latency runs
  references.pingpong_2line_oneway_ns the same on two lines, each side storing to the line the other polls (as
                                      a one-way hand-off's writer and reader), no clock read; in turn too, the
                                      least of the three (bimodal with where its lines fall)
  references.handoff_oneway_p50|p99_ns  a bare cache line handed from one pinned process to the other,
                                      stamped as the ring's records are: the same method, without the ring
  metrics.ring_op_ns_bulk1|8|32       enqueue+dequeue per 64-byte record, one thread
  metrics.ring_oneway_p50|p99|p999_ns one record at a time, producer stamp to consumer stamp taken after it read
                                      the record (C, CLOCK_MONOTONIC)
  metrics.ring_mchunks_per_s          whole 128-token chunks (608-byte dp_chunk records) from one pinned process
                                      to the other in 32-record bursts: each written whole into its slot by the
                                      producer and copied out whole by the consumer, checked; the best of three
  references.copy_mchunks_per_s       the same two copies of each record on one core, without a ring; the best
                                      of three, taken in turn with the ring's
  metrics.policy_ns_<policy>_<n>      one routing decision, n = 4, 16, 64, 256 workers, in a loop that also
                                      draws the session and moves the lanes' depths
  references.policy_random_ns_<n>     that loop with a random pick (the session's bits), reading no state
  metrics.adm_decide_new_tenant_65535_ns  admission's decision for a tenant not in its table, 65,535 in it
  references.adm_decide_new_tenant_0_ns   the same with none in it
  metrics.adm_sweep_frees_one_us      the sweep of a full tenant table that frees one idle tenant
  references.adm_table_read_us        a pass reading one word of each cache line of that table
  metrics.lane_batch_us_shm|zmq_ipc|zmq_tcp  a 16-chunk batch delivered to a worker process and acknowledged (p50)
"""
from __future__ import annotations

import itertools
import mmap
import multiprocessing
import os
import shutil
import tempfile
import time

import numpy as np

from datapath import lanes, records
from datapath._dataplane import ffi, lib
from datapath.metrics import percentile
from datapath.ring import Ring, unlink
from datapath.router import policies

SEC = 1_000_000_000
ctx = multiprocessing.get_context("fork")
_seq = itertools.count()


def _cores():
    cores = sorted(os.sched_getaffinity(0))
    return (cores[0], cores[1]) if len(cores) > 1 else (cores[0], cores[0])


def _pinned(cpu, fn):
    os.sched_setaffinity(0, {cpu})
    fn()


def _across_cores(child, parent, cpus: tuple[int, int] | None = None):
    """Run child() in a forked process pinned to one core and parent() here, pinned to the other."""
    a, b = cpus or _cores()
    p = ctx.Process(target=_pinned, args=(b, child))
    p.start()
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {a})
    try:
        return parent()
    finally:
        os.sched_setaffinity(0, old)
        p.join(30)


def _name(what):
    return f"bench{os.getpid()}-{what}-{next(_seq)}"


def pingpong_oneway_ns(rounds: int, cpus: tuple[int, int] | None = None, two_lines: bool = False) -> float:
    """The bare cross-core hand-off: one cache line between two pinned threads (the median of
    timed blocks, the first, start-up, left out: native/ring_bench.c); two_lines, each side
    polls one line and stores to the other, as a one-way hand-off's two ends do. The calling
    thread's affinity is restored afterwards."""
    a, b = cpus or _cores()
    affinity = os.sched_getaffinity(0)
    try:
        ns = lib.dp_pingpong_oneway_ns(rounds, a, b, 60 * SEC, int(two_lines))
    finally:
        os.sched_setaffinity(0, affinity)
    if ns < 0:
        raise RuntimeError("ping-pong timed out (are both CPUs available to this process?)")
    return ns


def handoff_oneway_ns(n: int, cpus: tuple[int, int] | None = None) -> np.ndarray:
    """The ring's one-way measurement (ring_oneway_ns) on a bare shared line: its reference.
    Consumer on cpus[1], producer (this process) on cpus[0]."""
    shared = mmap.mmap(-1, 8 * n + lib.DP_HANDOFF_BYTES)   # page-aligned: the lines start at 0
    line = ffi.from_buffer(shared)
    samples = np.frombuffer(shared, dtype=np.uint64, count=n, offset=lib.DP_HANDOFF_BYTES)

    def consume():
        lib.dp_handoff_consume(line, n, ffi.cast("uint64_t *", line + lib.DP_HANDOFF_BYTES), 60 * SEC)

    def produce():
        time.sleep(0.05)  # let the consumer spin
        return lib.dp_handoff_produce(line, n, 2000, 60 * SEC)

    sent = _across_cores(consume, produce, cpus)
    if sent != n:
        raise RuntimeError(f"hand-off run sent {sent} of {n}")
    return samples.copy()


def _measured(ns: float, what: str) -> float:
    """A C loop's figure, or an error: its -1 (bad arguments, no memory) is no measurement."""
    if not ns > 0:
        raise RuntimeError(f"{what}: the C loop measured nothing ({ns})")
    return ns


def ring_op_ns(bulk: int, items: int) -> float:
    name = _name("op")
    with Ring.create(name, 64, 1024, role="producer") as r:
        ns = min(_measured(lib.dp_ring_op_ns(r.ptr, bulk, items, 64), "ring_op_ns") for _ in range(3))
    unlink(name)
    return ns


def copy_mchunks_per_s(n: int) -> float:
    size = records.CHUNK.itemsize
    return 1e3 / _measured(lib.dp_copy_ns(size, size, 1024, n), "copy_ns")


def ring_oneway_ns(n: int) -> np.ndarray:
    name = _name("lat")
    shared = mmap.mmap(-1, 8 * n)
    samples = np.frombuffer(shared, dtype=np.uint64)
    Ring.create(name, 64, 64).close()

    def consume():
        with Ring.attach(name, "consumer") as r:
            lib.dp_latency_consume(r.ptr, n, ffi.cast("uint64_t *", ffi.from_buffer(shared)), 60 * SEC)

    def produce():
        with Ring.attach(name, "producer") as r:
            time.sleep(0.05)  # let the consumer attach and spin
            return lib.dp_latency_produce(r.ptr, n, 2000, 60 * SEC)   # 2 us apart: latency, not queueing

    try:
        sent = _across_cores(consume, produce)
    finally:
        unlink(name)
    if sent != n:
        raise RuntimeError(f"latency run sent {sent} of {n}")
    return samples.copy()


def ring_mchunks_per_s(n: int) -> float:
    name = _name("tput")
    Ring.create(name, records.CHUNK.itemsize, 1024).close()
    done = ctx.Queue()

    def consume():
        err = ffi.new("uint64_t *")
        with Ring.attach(name, "consumer") as r:
            got = lib.dp_seq_consume(r.ptr, 0, n, 32, records.CHUNK.itemsize, 60 * SEC, err)
        done.put((got, err[0], time.monotonic_ns()))

    def produce():
        with Ring.attach(name, "producer") as r:
            time.sleep(0.05)
            t0 = time.monotonic_ns()
            lib.dp_seq_produce(r.ptr, 0, n, 32, records.CHUNK.itemsize, 60 * SEC)
        return (t0, *done.get(timeout=120))

    try:
        t0, got, errors, t1 = _across_cores(consume, produce)
    finally:
        unlink(name)
    if got != n or errors:
        raise RuntimeError(f"throughput run: {got} of {n} records, {errors} sequence errors")
    return n / ((t1 - t0) / 1e9) / 1e6


def _echo(kind, where, stop_after_s):
    lane = lanes.ShmWorkerLane(where) if kind == "shm" else lanes.ZmqWorkerLane(where)
    deadline = time.monotonic() + stop_after_s
    try:
        while time.monotonic() < deadline:
            batch = lane.recv_batch(0.05)
            if batch is not None:
                lane.send_completion(lanes.completion_for(batch, np.zeros(len(batch), np.uint32)))
    finally:
        lane.close()


def lane_batch_us(kind: str, rounds: int) -> float:
    """Python-driven round trips of one 16-chunk batch through a lane to an echoing worker process."""
    batch = records.request_chunks(1, range(16 * 128))
    batch["batch_len"] = 16
    batch["batch_pos"] = np.arange(16)
    payload = batch.tobytes()
    times = []
    if kind == "shm":
        where = _name("lane")
        lane, done = lanes.create_shm_lane(where)
        p = ctx.Process(target=_echo, args=("shm", where, 120))
        p.start()
        try:
            for i in range(rounds):
                t = time.perf_counter_ns()
                lane.enqueue(payload)
                while not done.dequeue(1):
                    pass
                times.append(time.perf_counter_ns() - t)
        finally:
            p.kill()
            p.join(5)
            lane.close(), done.close()
            lanes.unlink_shm_lane(where)
    else:
        import zmq
        tmp = tempfile.mkdtemp()
        where = f"ipc://{tmp}/lane" if kind == "zmq_ipc" else lanes.free_tcp_endpoint()
        p = ctx.Process(target=_echo, args=("zmq", where, 120))
        p.start()
        zc = zmq.Context()
        s = zc.socket(zmq.DEALER)
        s.linger = 0
        s.connect(where)
        try:
            for i in range(rounds):
                t = time.perf_counter_ns()
                s.send(payload, copy=False)
                s.recv()
                times.append(time.perf_counter_ns() - t)
        finally:
            s.close(0)
            zc.term()
            p.kill()
            p.join(5)
            shutil.rmtree(tmp, ignore_errors=True)
    return percentile(np.asarray(times[rounds // 10:], np.int64), 50) / 1000   # the first 10% warm up


def run(report, args):
    quick = args.quick
    report.machine["pinned_cores"] = list(_cores())
    report.note("two pinned processes; on this 2-core VM the benchmark shares cores with everything else")

    for bulk in (1, 8, 32):
        report.metric(f"ring_op_ns_bulk{bulk}", ring_op_ns(bulk, 2_000_000 if quick else 20_000_000), "ns")
    # the ring and its references in turn, three times each: a slow spell falls on all of them
    # (a ping-pong measured once, minutes from the ring's runs, read 217 ns beside a 70 ns ring)
    n = 25_000 if quick else 250_000
    lat, bare, pp, pp2 = [], [], [], []
    for _ in range(3):
        lat.append(ring_oneway_ns(n))
        bare.append(handoff_oneway_ns(n))
        pp.append(pingpong_oneway_ns(200_000 if quick else 1_000_000))
        pp2.append(pingpong_oneway_ns(200_000 if quick else 1_000_000, two_lines=True))
    lat, bare = np.concatenate(lat), np.concatenate(bare)
    report.reference("pingpong_oneway_ns", float(np.median(pp)), "ns")
    # the least: it is bimodal with where its two lines fall (130-160 or 300-490 ns, run to run)
    report.reference("pingpong_2line_oneway_ns", float(min(pp2)), "ns")
    report.note(f"ping-pong one-way, the three runs: {', '.join(f'{x:.1f}' for x in pp)} ns; on two lines: "
                f"{', '.join(f'{x:.1f}' for x in pp2)} ns")
    for q, name in ((50, "p50"), (99, "p99"), (99.9, "p999")):
        report.metric(f"ring_oneway_{name}_ns", percentile(lat, q), "ns")
    report.reference("handoff_oneway_p50_ns", percentile(bare, 50), "ns")
    report.reference("handoff_oneway_p99_ns", percentile(bare, 99), "ns")
    # each the best of three, in turn (the ring's was one run beside the copies' best of three)
    chunks = 2_000_000 if quick else 20_000_000
    tput = [(ring_mchunks_per_s(chunks), copy_mchunks_per_s(chunks)) for _ in range(3)]
    report.metric("ring_mchunks_per_s", max(r for r, _ in tput), "M/s")
    report.reference("copy_mchunks_per_s", max(c for _, c in tput), "M/s")
    report.ratio("ring_mchunks_per_s", "copy_mchunks_per_s")
    report.note("ring_mchunks_per_s against copy_mchunks_per_s: the same two 608-byte copies per chunk, on two "
                "cores at once through the ring, on one core without it (above 1: the ring's hand-off costs less "
                "than the second core gives)")
    decisions = 1_000_000 if quick else 10_000_000
    for n in (4, 16, 64, 256):
        loop = [_measured(lib.dp_policy_bench(b"", n, decisions), "random pick")]
        for pol in policies():
            report.metric(f"policy_ns_{pol}_{n}", _measured(lib.dp_policy_bench(pol.encode(), n, decisions), pol), "ns")
        loop.append(_measured(lib.dp_policy_bench(b"", n, decisions), "random pick"))
        report.reference(f"policy_random_ns_{n}", min(loop), "ns")
        for pol in policies():
            report.ratio(f"policy_ns_{pol}_{n}", f"policy_random_ns_{n}")
    report.note("policy_ns_* against policy_random_ns_*: the same loop (an xorshift, the indirect call, a lane's "
                "depth up and another's down) with a pick of a random worker from the session's bits, reading no "
                "state, before and after the policies (the lower): what a policy adds to the least decision")
    # admission's tenant table: a decision for a tenant never seen, at an empty table (its untouched
    # pages read as the kernel's zero page: the best case) and at one holding all but one of the
    # tenants it keeps before a sweep (20 MiB of slots: misses leave the cache)
    n = 200_000 if quick else 2_000_000
    empty = [_measured(lib.dp_adm_decide_bench(0, n), "admission at an empty table") for _ in range(3)]
    full = [_measured(lib.dp_adm_decide_bench(lib.DP_ADM_MAX_TENANTS - 1, n), "admission at a full table")
            for _ in range(3)]
    report.reference("adm_decide_new_tenant_0_ns", min(empty), "ns")
    report.metric("adm_decide_new_tenant_65535_ns", min(full), "ns")
    report.ratio("adm_decide_new_tenant_65535_ns", "adm_decide_new_tenant_0_ns")
    read_us = ffi.new("double *")
    sweeps = [(_measured(lib.dp_adm_sweep_bench(read_us), "the tenant table's sweep"), read_us[0]) for _ in range(3)]
    report.metric("adm_sweep_frees_one_us", min(s for s, _ in sweeps), "us")
    report.reference("adm_table_read_us", min(r for _, r in sweeps), "us")
    report.ratio("adm_sweep_frees_one_us", "adm_table_read_us")
    report.note("adm_*: admission's decision for a tenant not in its table (priced, with a budget: the table is "
                "probed for room) with 0 and with 65,535 tenants in it (one short of a sweep), the best of three "
                "loops; the sweep of a full table that frees one idle tenant (the kind that recurs, at most once a "
                "second; one that frees many costs more and buys as much room) against one pass reading a word of "
                "each cache line of the same table, the best of three")
    rounds = 2_000 if quick else 20_000
    for kind in ("shm", "zmq_ipc", "zmq_tcp"):
        report.metric(f"lane_batch_us_{kind}", lane_batch_us(kind, rounds), "us")
    report.note("lane_batch_us_*: a Python driver and a Python echo worker on each side, per batch (never per chunk)")
    report.ratio("ring_oneway_p50_ns", "pingpong_oneway_ns")
    report.ratio("ring_oneway_p50_ns", "pingpong_2line_oneway_ns")
    report.ratio("ring_oneway_p50_ns", "handoff_oneway_p50_ns")
    report.ratio("ring_oneway_p99_ns", "handoff_oneway_p99_ns")
    report.note("ring_oneway against handoff_oneway: the same stamped method (a clock read at each end), so "
                "the ratio is the ring's own cost; against the ping-pong's round trip / 2, which reads no "
                "clock per hand-off, it also carries the stamping. A ping-pong side stores to the line as soon as "
                "its read brings it: a hop is one line transfer. A one-way hand-off's writer stores to a line its "
                "reader polls, which it must take back first: two (the hypothesis the figures fit). "
                "pingpong_2line_oneway_ns is the ping-pong made to work that way, on two lines, each side "
                "storing to the one the other polls, no clock read; the least of three runs, as it is bimodal "
                "with where its lines fall")
