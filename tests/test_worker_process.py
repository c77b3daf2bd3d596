"""Real worker processes sharing one store (the in-memory stand-in, in a manager process).

Over ZeroMQ ipc lanes, driven deterministically: restore on another process,
then continue, equals a session never evicted (tokens, and the KV it stores
byte for byte); a worker killed mid-batch leaves only its acknowledged deltas.
Behind the native router, on shared-memory and on ZeroMQ lanes: the same
restore, end to end.
Bit-identity needs the same BLAS threading on both sides (OpenBLAS splits sums
differently with more threads), so in-process references run with one BLAS
thread, as worker processes do.
"""
import multiprocessing
import os
import shutil
import signal
import tempfile
import time

import numpy as np
import pytest

from datapath import lanes, records, wire
from datapath.ring import Ring, unlink
from datapath.router import Router
from datapath.serving import kvdelta
from datapath.serving.model import Model, ModelConfig
from datapath.serving.worker import Worker, WorkerOptions, one_blas_thread, worker_process
from serving_support import MemoryStore, StoreServer, ZmqRouterEnd, as_batch, drive, prefill_records, prompt

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def store():
    with StoreServer(ctx=SPAWN) as server:
        yield server.MemoryStore()


@pytest.fixture
def processes():
    """start(lane_spec, store, options) -> a worker process; all stopped at teardown."""
    started = []

    def start(lane_spec, store, options):
        stop = SPAWN.Event()
        proc = SPAWN.Process(target=worker_process, args=(lane_spec, store, options, stop.is_set), daemon=True)
        proc.start()
        started.append((proc, stop))
        return proc

    yield start
    for proc, stop in started:
        killed_by_test = proc.exitcode is not None
        if not killed_by_test:   # a process killed inside Event.is_set holds its lock for good
            stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        assert killed_by_test or proc.exitcode == 0, "a stopped worker exits cleanly"


@pytest.fixture
def zmq_lanes():
    tmp = tempfile.mkdtemp(prefix="zl5-")  # ipc paths must stay short
    made = []

    def make():
        spec = ("zmq", f"ipc://{tmp}/w{len(made)}")
        made.append(ZmqRouterEnd(spec[1]))
        return spec, made[-1]

    yield make
    for end in made:
        end.close()
    shutil.rmtree(tmp, ignore_errors=True)


def reference(turns, codec):
    """Tokens and stored deltas of a worker that never evicts, in this process."""
    store = MemoryStore()
    w = Worker(Model(ModelConfig(), 0), store, codec=codec)
    with one_blas_thread():
        out = [drive(w.step, [t], max_chunks=64) for t in turns]
    return out, store.restore((0, turns[0][0]))


def test_restore_on_another_process_equals_never_evicted(store, processes, zmq_lanes):
    (spec_a, a), (spec_b, b) = zmq_lanes(), zmq_lanes()
    processes(spec_a, store, WorkerOptions(codec="zstd")), processes(spec_b, store, WorkerOptions(codec="zstd"))
    turns = [(77, 1, prompt(11, 260), 5), (77, 2, prompt(12, 90), 7)]
    got = [drive(a.exchange, [turns[0]], max_chunks=64), drive(b.exchange, [turns[1]], max_chunks=64)]
    want, want_chain = reference(turns, "zstd")
    assert got == want
    assert [(m["token_start"], m["token_end"]) for m in store.meta((0, 77))] == [(0, 264), (264, 264 + 90 + 6)]
    assert store.restore((0, 77)) == want_chain, "worker b's KV after the restore is the never-evicted KV, byte for byte"


def test_worker_killed_mid_batch_leaves_the_store_whole(store, processes, zmq_lanes):
    # dpu profile, sleeping: a 10-token prefill step lasts ~0.4 s, long enough to kill the worker inside it
    (spec_a, a), (spec_c, c) = zmq_lanes(), zmq_lanes()
    pa = processes(spec_a, store, WorkerOptions(codec="lz4", device="dpu", sim_mode="sleep"))
    turns = [(5, 1, prompt(21, 10), 2), (5, 2, prompt(22, 10), 20)]
    drive(a.exchange, [turns[0]])
    a.send(as_batch([prefill_records(*turns[1])]))
    time.sleep(0.15)
    os.kill(pa.pid, signal.SIGKILL)
    pa.join(10)
    assert pa.exitcode == -signal.SIGKILL
    assert [(m["token_start"], m["token_end"]) for m in store.meta((0, 5))] == [(0, 11)], \
        "only the acknowledged delta of request 1"
    assert kvdelta.restore(store.restore((0, 5)), ModelConfig()).length == 11
    # the router retries the request on another worker, which continues from the last durable snapshot
    processes(spec_c, store, WorkerOptions(codec="lz4"))
    assert drive(c.exchange, [turns[1]]) == reference(turns, "lz4")[0][1]


@pytest.mark.parametrize("kind", ["shm", "zmq"])
def test_native_router_restores_on_the_other_worker(store, processes, kind):
    tag = f"zl5-{os.getpid()}-{kind}"
    names = [f"{tag}.in", f"{tag}.out"]
    tmp = tempfile.mkdtemp(prefix="zl5-")
    inp = Ring.create(names[0], records.CHUNK.itemsize, 1024, role="producer")
    egress = Ring.create(names[1], records.RESPONSE.itemsize, 64, role="consumer")
    router = Router()
    lane_names = [f"{tag}.w{k}" for k in range(2)] if kind == "shm" else []
    try:
        router.add_input(inp)
        router.set_egress(egress)
        for k in range(2):
            opts = WorkerOptions(index=k, codec="zstd")
            if kind == "shm":
                router.add_worker(*lanes.create_shm_lane(lane_names[k]))
                processes(("shm", lane_names[k]), store, opts)
            else:
                endpoint = f"ipc://{tmp}/w{k}"
                processes(("zmq", endpoint), store, opts)
                router.add_zmq_worker(endpoint)
                # bound before the first request: a batch no connection takes is due in 1 s, and a
                # spawned worker took up to 1.02 s to bind here (the request answered 503)
                deadline = time.monotonic() + 30
                while not os.path.exists(endpoint[len("ipc://"):]) and time.monotonic() < deadline:
                    time.sleep(0.01)
        turns = [(9, 101, prompt(31, 300), 6), (9, 102, prompt(32, 50), 6)]
        router.set_up(1, False)
        router.start()
        responses = []
        for k, (sid, rid, toks, max_out) in enumerate(turns):
            router.set_up(k, True)
            router.set_up(1 - k, False)
            recs = records.request_chunks(rid, toks, session=sid, max_out=max_out)
            assert inp.enqueue(recs.tobytes()) == len(recs)
            deadline = time.monotonic() + 60
            while not (raw := egress.dequeue(1)) and time.monotonic() < deadline:
                time.sleep(0.005)
            (resp,) = np.frombuffer(raw, dtype=records.RESPONSE)
            responses.append(resp)
        router.stop()
        want, want_chain = reference(turns, "zstd")
        for resp, turn, w, worker in zip(responses, turns, want, (0, 1)):
            assert resp["status"] == 200 and resp["worker"] == worker and resp["request_id"] == turn[1]
            assert resp["tokens"][:resp["n_out"]].tolist() == w[turn[1]]
        assert store.restore((0, 9)) == want_chain, "the second worker restored the first one's snapshot"
        close = records.request_chunks(103, [], session=9)          # the client is done with session 9
        close["kind"] = wire.KIND_CLOSE
        router.start()
        assert inp.enqueue(close.tobytes()) == 1
        deadline = time.monotonic() + 60
        while not (raw := egress.dequeue(1)) and time.monotonic() < deadline:
            time.sleep(0.005)
        router.stop()
        (resp,) = np.frombuffer(raw, dtype=records.RESPONSE)
        assert (resp["request_id"], resp["status"], resp["n_out"], resp["worker"]) == (103, 200, 0, 1)
        assert store.restore((0, 9)) == [], "the CLOSE freed the session's snapshots"
    finally:
        router.close()
        inp.close(), egress.close()
        for n in names:
            unlink(n)
        for n in lane_names:
            lanes.unlink_shm_lane(n)
        shutil.rmtree(tmp, ignore_errors=True)
