"""Lanes with real worker processes: the router in its native thread, workers across a process
boundary on shm rings and on ZeroMQ (ipc and tcp on loopback); every request answered once."""
import itertools
import multiprocessing
import os
import time

import numpy as np
import pytest

from datapath import lanes, records
from datapath.ring import Ring, unlink
from datapath.router import Router
from datapath.records import request_chunks as chunks_of

ctx = multiprocessing.get_context("fork")
_seq = itertools.count()


def echo_worker(kind, where, k, stop_after_s):
    """A worker that answers each record with token = request_id + 1000 + batch position."""
    lane = lanes.ShmWorkerLane(where) if kind == "shm" else lanes.ZmqWorkerLane(where)
    deadline = time.monotonic() + stop_after_s
    try:
        while time.monotonic() < deadline:
            batch = lane.recv_batch(0.05)
            if batch is None:
                continue
            t0 = time.monotonic_ns()
            toks = (batch["request_id"] % 1000 + 1000).astype(np.uint32)
            lane.send_completion(lanes.completion_for(batch, toks, worker=k, t_start=t0, t_end=time.monotonic_ns()))
    finally:
        lane.close()


@pytest.mark.parametrize("kind", ["shm", "zmq_ipc", "zmq_tcp"])
def test_requests_through_real_worker_processes(kind, tmp_path):
    tag = f"ln{os.getpid()}-{next(_seq)}"
    n_workers, n_requests = 2, 200
    inp = Ring.create(f"{tag}.in", records.CHUNK.itemsize, 1024, role="producer")
    egress = Ring.create(f"{tag}.out", records.RESPONSE.itemsize, 1024, role="consumer")
    router = Router(policy="power_of_two", token_budget=256)
    router.add_input(inp)
    router.set_egress(egress)
    procs, names = [], []
    try:
        for k in range(n_workers):
            if kind == "shm":
                where = f"{tag}.w{k}"
                router.add_worker(*lanes.create_shm_lane(where))
                names.append(where)
            else:
                where = f"ipc://{tmp_path}/w{k}" if kind == "zmq_ipc" else lanes.free_tcp_endpoint()
            p = ctx.Process(target=echo_worker, args=("shm" if kind == "shm" else "zmq", where, k, 60))
            p.start()
            procs.append(p)
            if kind != "shm":
                router.add_zmq_worker(where)
        router.start()
        sent = 0
        for rid in range(1, n_requests + 1):
            arr = chunks_of(rid, list(range(rid % 300 + 1)), max_out=3)
            while inp.enqueue(arr.tobytes()) == 0:
                time.sleep(0.001)
            sent += 1
        got = []
        deadline = time.monotonic() + 30
        while len(got) < n_requests and time.monotonic() < deadline:
            raw = egress.dequeue(256)
            got += list(np.frombuffer(raw, dtype=records.RESPONSE)) if raw else []
            if not raw:
                time.sleep(0.001)
        router.stop()
        ids = sorted(int(r["request_id"]) for r in got)
        assert ids == list(range(1, n_requests + 1)), "every request answered exactly once"
        for r in got:
            assert r["status"] == 200 and r["n_out"] == 3
            assert list(r["tokens"][:3]) == [int(r["request_id"]) % 1000 + 1000] * 3
        used = {int(r["worker"]) for r in got}
        assert used == set(range(n_workers))
        st = router.stats()
        assert st["active_requests"] == 0 and st["responses"] == n_requests
    finally:
        router.stop()
        router.close()
        for p in procs:
            p.kill()
            p.join(5)
        inp.close(), egress.close()
        unlink(f"{tag}.in"), unlink(f"{tag}.out")
        for n in names:
            lanes.unlink_shm_lane(n)


def test_a_zmq_worker_lane_without_its_router_neither_blocks_nor_dies():
    """With no router connected (gone mid-step), a send would block for ever: the worker's stop
    flag was never checked again. A stray peer's malformed message killed the worker."""
    import zmq
    lane = lanes.ZmqWorkerLane("tcp://127.0.0.1:0")
    try:
        comp = np.zeros(1, dtype=records.COMPLETION)
        t0 = time.monotonic()
        assert lane.send_completion(comp) is False and time.monotonic() - t0 < 1
        ctx = zmq.Context()
        peer = ctx.socket(zmq.DEALER)
        peer.linger = 0
        peer.connect(lane.endpoint)
        try:
            peer.send(b"x" * 7)
            peer.send(np.zeros(records.MAX_BATCH_CHUNKS + 1, dtype=records.CHUNK).tobytes())
            peer.send(np.zeros(2, dtype=records.CHUNK).tobytes())
            got = [lane.recv_batch(2.0) for _ in range(3)]
            assert got[0] is None and got[1] is None and len(got[2]) == 2 and lane.malformed == 2
        finally:
            peer.close(0)
            ctx.term()
    finally:
        lane.close()


def test_a_worker_refuses_a_lane_whose_slots_are_smaller_than_a_chunk():
    """Each slot is read as a whole dp_chunk: a lane of 64-byte slots was attached without a word and
    read across its slots, past the mapping at the last (found by review)."""
    name = f"lanes-small-{os.getpid()}"
    lane_name, done_name = lanes.lane_names(name)
    made = [Ring.create(lane_name, 64, 64, role="producer"),
            Ring.create(done_name, records.COMPLETION.itemsize, 64, role="consumer")]
    try:
        with pytest.raises(ValueError, match="64-byte slots"):
            lanes.ShmWorkerLane(name)
        assert made[0].stats()["consumer_pid"] == 0, "the role it took is given back"
    finally:
        for r in made:
            r.close()
        lanes.unlink_shm_lane(name)
