"""Real worker processes on ZeroMQ ipc lanes sharing one store (the in-memory stand-in in a manager process).

Restore on another process, then continue, equals a session never evicted;
a worker killed mid-batch leaves only whole, acknowledged deltas behind.
Bit-identical logits need the same BLAS threading on both sides (OpenBLAS
splits the sums differently with more threads), so the in-process reference
runs with one BLAS thread, as worker processes do.
"""
import multiprocessing
import os
import shutil
import signal
import tempfile
import time

import numpy as np
import pytest

from datapath.chunk import make_batch
from datapath.serving import kvdelta
from datapath.serving.model import Model, ModelConfig
from datapath.serving.worker import Worker, WorkerOptions, ZmqLaneDriver, one_blas_thread, worker_process
from serving_support import StoreServer, chunks, prompt, run

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def store():
    with StoreServer(ctx=SPAWN) as server:
        yield server.MemoryStore()


@pytest.fixture
def workers(store):
    """factory: workers(options) -> lane driver of a new worker process; all stopped at teardown."""
    tmp = tempfile.mkdtemp(prefix="zl5-")  # ipc paths must stay short
    started = []

    def start(options: WorkerOptions):
        n = len(started)
        ep_in, ep_out = f"ipc://{tmp}/w{n}-batches", f"ipc://{tmp}/w{n}-done"
        lane = ZmqLaneDriver(ep_in, ep_out)
        proc = SPAWN.Process(target=worker_process, args=(ep_in, ep_out, store, options), daemon=True)
        proc.start()
        started.append((proc, lane))
        return proc, lane

    yield start
    for proc, lane in started:
        if proc.is_alive():
            lane.close_lane()
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        lane.close()
    shutil.rmtree(tmp, ignore_errors=True)


def ask(lane, request, timeout_s=60):
    lane.send_batch(make_batch(request))
    done = lane.recv_completion(int(timeout_s * 1000))
    assert done is not None, "no completion in time"
    return done


def test_restore_on_another_process_equals_never_evicted(store, workers):
    opts = WorkerOptions(codec="zstd", return_logits=True)
    (pa, a), (pb, b) = workers(opts), workers(opts)
    turn1, turn2 = chunks(77, 1, prompt(11, 260), 5), chunks(77, 2, prompt(12, 90), 7)
    d1 = ask(a, turn1)
    d2 = ask(b, turn2)
    ref = Worker(Model(ModelConfig(), 0), None, return_logits=True)
    with one_blas_thread():
        r1, r2 = run(ref, [turn1])[0], run(ref, [turn2])[0]
    assert d1.status == d2.status == "ok"
    assert d2.restored_tokens == 260 + 4, "worker b restored what worker a snapshotted"
    assert d1.tokens == r1.tokens and d2.tokens == r2.tokens
    assert np.array_equal(d2.logits, r2.logits)
    assert [(m["token_start"], m["token_end"]) for m in store.meta(77)] == [(0, 264), (264, 264 + 90 + 6)]
    assert d2.stamps["t_restored"] <= d2.stamps["t_prefill_done"]
    a.close_lane(), b.close_lane()
    pa.join(10), pb.join(10)
    assert pa.exitcode == 0 and pb.exitcode == 0


def test_worker_killed_mid_batch_leaves_the_store_whole(store, workers):
    # l4 profile, sleeping: each step lasts ~70 ms, so 200 output tokens keep the worker inside steps
    slow = WorkerOptions(codec="lz4", device="l4", sim_mode="sleep")
    pa, a = workers(slow)
    turn1, turn2 = chunks(5, 1, prompt(21, 140), 2), chunks(5, 2, prompt(22, 30), 200)
    assert ask(a, turn1).status == "ok"
    a.send_batch(make_batch(turn2))
    time.sleep(0.5)
    os.kill(pa.pid, signal.SIGKILL)
    pa.join(10)
    assert pa.exitcode == -signal.SIGKILL
    chain = store.restore(5)
    assert [(m["token_start"], m["token_end"]) for m in store.meta(5)] == [(0, 141)], \
        "only the acknowledged delta of request 1"
    assert kvdelta.restore(chain, ModelConfig()).length == 141
    # the request is retried on another worker, which continues from the last durable snapshot
    _, b = workers(WorkerOptions(codec="lz4"))
    retried = ask(b, turn2)
    ref = Worker(Model(ModelConfig(), 0), None)
    with one_blas_thread():
        run(ref, [turn1])
        want = run(ref, [turn2])[0].tokens
    assert retried.restored_tokens == 141 and retried.tokens == want
