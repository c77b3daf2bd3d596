"""The native router: micro-batch semantics, reassembly, refusals, driven pass by pass.

The test plays the worker: it reads each batch from the lane and answers it
with a completion, so every record the router emits is checked.
"""
import itertools
import json
import math
import time
import os
import signal
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from datapath import lanes, records, wire
from datapath._dataplane import lib
from datapath.ring import Ring, unlink
from datapath.records import request_chunks as chunks_of
from datapath.router import Router, policies, policy_params

_seq = itertools.count()


class Bench:
    """Rings around one router: an input ring, n worker lanes, an egress ring."""

    def __init__(self, n_workers=1, egress_slots=1024, **router_kw):
        tag = f"rt{os.getpid()}-{next(_seq)}"
        self.names = [f"{tag}.in", f"{tag}.out"]
        self.input = Ring.create(self.names[0], records.CHUNK.itemsize, 1024, role="producer")
        self.egress = Ring.create(self.names[1], records.RESPONSE.itemsize, egress_slots, role="consumer")
        self.router = Router(**router_kw)
        self.router.add_input(self.input)
        self.router.set_egress(self.egress)
        self.lanes, self.workers = [], []
        for k in range(n_workers):
            name = f"{tag}.w{k}"
            lane, done = lanes.create_shm_lane(name)
            self.router.add_worker(lane, done)
            self.lanes.append(name)
            self.workers.append(lanes.ShmWorkerLane(name))
        self.responses = []
        self.no_store = set()    # workers whose answers say they have no snapshot store, as worker.py's do

    def send(self, *chunks):
        arr = np.concatenate(chunks)
        assert self.input.enqueue(arr.tobytes()) == len(arr)

    def step(self, k=0, sample=lambda rec: 1000 + int(rec["request_id"]), eos=None):
        """One worker step: take a batch (or None), answer it, let the router see the answer."""
        batch = self.workers[k].recv_batch(0)
        if batch is not None:
            tokens = [sample(r) for r in batch]
            comp = lanes.completion_for(batch, tokens, worker=k, eos=eos)
            if k in self.no_store:
                comp["e"][0]["flags"][:len(batch)] |= records.CE_NO_STORE
            assert self.workers[k].send_completion(comp)
        self.router.poll()
        self.collect()
        return batch

    def collect(self):
        raw = self.egress.dequeue(1024)
        self.responses += list(np.frombuffer(raw, dtype=records.RESPONSE))

    def run(self, k=0, max_steps=1000, **kw):
        """Steps until the router has nothing left for worker k; returns the batches seen."""
        self.router.poll()
        seen = []
        for _ in range(max_steps):
            b = self.step(k, **kw)
            if b is None:
                if self.router.stats()["active_requests"] == 0 or not self.router.poll():
                    if self.workers[k].lane.stats()["depth"] == 0 and self.router.stats()["active_requests"] == 0:
                        break
                continue
            seen.append(b)
        return seen

    def close(self):
        self.router.close()
        for w in self.workers:
            w.close()
        for ring in (self.input, self.egress):
            ring.close()
        for n in self.names:
            unlink(n)
        for n in self.lanes:
            lanes.unlink_shm_lane(n)


@pytest.fixture
def bench_factory():
    made = []

    def make(**kw):
        b = Bench(**kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def place_on(b, flags, up, *chunks):
    """Send chunks with only worker `up` up and run it dry; flags[request id]: its MOVED flag."""
    b.router.set_up(up, True)
    b.router.set_up(1 - up, False)
    b.send(*chunks)
    for batch in b.run(up):
        for r in batch[batch["kind"] == wire.KIND_CHUNK]:
            flags[int(r["request_id"])] = bool(r["flags"] & records.CHUNK_F_MOVED)


def refusal(r) -> str:
    """The error a refusal's JSON body gives."""
    return json.loads(bytes(r["body"][:r["body_len"]]))["error"]


def prefill_seen(batches):
    """{request_id: tokens in the order the worker received them}."""
    out = {}
    for b in batches:
        for r in b:
            if r["kind"] == wire.KIND_CHUNK:
                out.setdefault(int(r["request_id"]), []).extend(r["tokens"][:r["n_tokens"]].tolist())
    return out


def test_one_request_prefill_then_decode(bench_factory):
    b = bench_factory()
    toks = list(range(300))
    b.send(chunks_of(7, toks, max_out=4))
    batches = b.run()
    assert [len(x) for x in batches] == [3, 1, 1, 1]          # 300 tokens fit one 512 budget; 3 decode steps
    assert prefill_seen(batches) == {7: toks}
    assert batches[0]["flags"][-1] & records.CHUNK_F_FINAL and not batches[0]["flags"][0] & records.CHUNK_F_FINAL
    assert all(x["kind"][0] == records.KIND_DECODE for x in batches[1:])
    (resp,) = b.responses
    assert resp["status"] == 200 and resp["request_id"] == 7 and resp["n_out"] == 4
    assert list(resp["tokens"][:4]) == [1007] * 4
    assert b.router.stats()["active_requests"] == 0


def test_the_worker_takes_a_batch_whole_stamped_and_in_its_own_memory(bench_factory):
    """dp_lane_recv: all of a batch's records in one call, the pickup stamped after the lane's,
    and the next batch does not overwrite one the worker still holds."""
    b = bench_factory()
    b.send(chunks_of(1, list(range(300)), max_out=2), chunks_of(2, list(range(50)), max_out=2))
    b.router.poll()
    w = b.workers[0]
    first = w.recv_batch(0.5)
    after = time.monotonic_ns()
    assert len(first) == first["batch_len"][0] == 4 and sorted(set(first["request_id"].tolist())) == [1, 2]
    assert (first["t_lane"] <= w.t_pickup).all() and w.t_pickup <= after
    kept, t_first = first.copy(), w.t_pickup
    assert w.send_completion(lanes.completion_for(first, [5] * 4))
    b.router.poll()
    second = w.recv_batch(0.5)
    assert len(second) == 2 and (second["kind"] == records.KIND_DECODE).all() and w.t_pickup >= t_first
    assert np.array_equal(first, kept), "a later batch landed in the earlier one's memory"


def test_budget_cap_and_rechunking(bench_factory):
    b = bench_factory(token_budget=200, max_chunks=5, split_slack=0)   # the budget as a hard cap
    reqs = {rid: list(range(rid * 1000, rid * 1000 + 90 + 37 * rid)) for rid in range(1, 9)}
    for rid, toks in reqs.items():
        b.send(chunks_of(rid, toks, max_out=3))
    batches = b.run()
    for x in batches:
        assert len(x) <= 5
        assert int(sum(int(r["n_tokens"]) if r["kind"] == wire.KIND_CHUNK else 1 for r in x)) <= 200
        assert x["n_tokens"].max() <= 128
        kinds = list(x["kind"])
        assert kinds == sorted(kinds, key=lambda k: k != records.KIND_DECODE), "decode records come first"
    assert prefill_seen(batches) == reqs                        # split pieces reassemble exactly, in order
    assert b.router.stats()["splits"] > 0
    assert sorted(int(r["request_id"]) for r in b.responses) == sorted(reqs)
    assert all(r["n_out"] == 3 for r in b.responses)


def test_a_long_prompt_takes_at_most_half_a_step_while_others_wait_behind_it(bench_factory):
    """First come first served took the oldest request's chunks until they ran out: a 64-token
    request behind a 4,096-token prompt went into the 9th step (behind a 262,144-token one, the
    1,025th; a review). Now, while others wait, a request takes at most half the step's budget,
    and the rest of the budget in a second round: the short one goes in the first step, the long
    one still first and with all the budget the others leave."""
    b = bench_factory(token_budget=512)
    long, short = list(range(4096)), list(range(5000, 5064))
    b.send(chunks_of(1, long, session=1, tenant=1, max_out=1), chunks_of(2, short, session=2, tenant=2, max_out=1))
    batches = b.run()
    ids = [x["request_id"].tolist() for x in batches]
    at = next(i for i, x in enumerate(ids) if 2 in x)
    assert at <= 1 and ids[at][:2] == [1, 1], ids[:3]          # (the first may go before the router saw 2)
    assert int(batches[at]["n_tokens"].sum()) == 512, "the budget filled"
    assert prefill_seen(batches) == {1: long, 2: short}
    assert sorted((int(r["request_id"]), int(r["status"])) for r in b.responses) == [(1, 200), (2, 200)]


def test_one_long_prefill_a_step_is_bounded_and_a_prompt_that_fits_is_not_split(bench_factory):
    """Two long prompts halved the step between them ahead of a short one behind (15 steps to its
    first piece), and a 300-token prompt that would have gone whole was split to make room (its
    first token a step later); a review of the bound. Only what cannot be done in the step is
    bounded, and one such a step: the short request goes in the first two steps, and of two
    300-token prompts the first still goes whole."""
    b = bench_factory(token_budget=512)
    b.send(chunks_of(1, list(range(4096)), session=1, max_out=1), chunks_of(2, list(range(4096)), session=2, max_out=1))
    for _ in range(3):
        b.step()                                  # (both long ones queued, their prefill under way)
    b.send(chunks_of(3, list(range(64)), session=3, max_out=1))
    batches = b.run()
    ids = [x["request_id"].tolist() for x in batches]
    at = next(i for i, x in enumerate(ids) if 3 in x)
    assert at <= 1 and ids[at][0] == 1, ids[:3]       # (the batch already built when it came, then its own)
    assert all(int(x["n_tokens"][x["kind"] == wire.KIND_CHUNK].sum()) <= 512 + 32 for x in batches)
    assert sorted(int(r["request_id"]) for r in b.responses if r["status"] == 200) == [1, 2, 3]
    b.send(chunks_of(4, list(range(300)), session=4, max_out=1), chunks_of(5, list(range(300)), session=5, max_out=1))
    b.router.poll()
    first = b.workers[0].recv_batch(0)
    got = [(int(r["request_id"]), int(r["n_tokens"])) for r in first]
    assert got[:3] == [(4, 128), (4, 128), (4, 44)] and sum(n for _, n in got) == 512, got


def test_a_piece_that_overruns_the_budget_by_at_most_the_slack_goes_whole(bench_factory):
    """split_slack: a split costs its request a whole step (its first token a step later); a piece
    over the budget by at most the slack goes whole instead, and one over it by more is split."""
    b = bench_factory(token_budget=100, split_slack=32)
    b.send(chunks_of(1, list(range(60)), max_out=1), chunks_of(2, list(range(70)), max_out=1))
    b.router.poll()
    first = b.workers[0].recv_batch(0)                         # 60 + 70 = 130: 30 over, within 32
    assert [int(n) for n in first["n_tokens"]] == [60, 70] and b.router.stats()["splits"] == 0
    assert b.workers[0].send_completion(lanes.completion_for(first, [7] * len(first)))
    b.run()
    b.send(chunks_of(3, list(range(60)), max_out=1), chunks_of(4, list(range(80)), max_out=1))
    b.router.poll()
    second = b.workers[0].recv_batch(0)                        # 60 + 80 = 140: 40 over: split at 100
    assert [int(n) for n in second["n_tokens"]] == [60, 40] and b.router.stats()["splits"] == 1
    assert b.workers[0].send_completion(lanes.completion_for(second, [7] * len(second)))
    b.run()
    assert sorted(int(r["request_id"]) for r in b.responses) == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        Router(split_slack=129)


def test_a_worker_budget_caps_that_workers_steps_only(bench_factory):
    """A worker on a device whose step stops being flat at 100 tokens steps at most 100; the
    other keeps the router's 512; None gives the router's back."""
    b = bench_factory(n_workers=2, policy="round_robin", split_slack=0)
    b.router.set_worker_budget(0, 100)
    assert [b.router.worker_stats(k)["token_budget"] for k in (0, 1)] == [100, 512]
    reqs = {rid: list(range(rid * 1000, rid * 1000 + 300)) for rid in range(1, 5)}   # round robin: 1, 3 on w0
    for rid, toks in reqs.items():
        b.send(chunks_of(rid, toks, max_out=2))
    b.router.poll()
    first = {k: b.workers[k].recv_batch(0) for k in (0, 1)}
    step_tokens = {k: int(x["n_tokens"].sum()) for k, x in first.items()}
    assert step_tokens == {0: 100, 1: 512}
    for k, x in first.items():   # answer them, then let each worker finish its requests
        assert b.workers[k].send_completion(lanes.completion_for(x, [7] * len(x), worker=k))
    seen = {k: [first[k]] + b.run(k) for k in (0, 1)}
    assert all(int(x[x["kind"] == wire.KIND_CHUNK]["n_tokens"].sum()) <= 100 for x in seen[0])
    assert prefill_seen(seen[0] + seen[1]) == reqs
    assert b.router.stats()["active_requests"] == 0
    b.router.set_worker_budget(0, None)
    assert b.router.worker_stats(0)["token_budget"] == 512
    with pytest.raises(ValueError, match="token_budget"):
        b.router.set_worker_budget(0, 0)
    with pytest.raises(ValueError, match="worker 5"):
        b.router.set_worker_budget(5, 100)


def test_dynamic_does_not_wait_for_a_full_batch(bench_factory):
    b = bench_factory(max_batch_size=32)
    b.send(chunks_of(1, [5, 6, 7], max_out=1))
    b.router.poll()
    batch = b.workers[0].recv_batch(0)
    assert batch is not None and len(batch) == 1 and batch["n_tokens"][0] == 3


def test_static_waits_for_a_full_batch_then_runs_it_to_the_end(bench_factory):
    b = bench_factory(batching="static", max_batch_size=4, batch_timeout_s=60)
    for rid in range(1, 4):
        b.send(chunks_of(rid, [1, 2, 3], max_out=2))
    b.router.poll()
    assert b.workers[0].recv_batch(0) is None                  # 3 of 4: it waits
    b.send(chunks_of(4, [1, 2, 3], max_out=2))
    b.router.poll()
    first = b.step()
    assert sorted(first["request_id"].tolist()) == [1, 2, 3, 4]
    b.send(chunks_of(5, [9], max_out=2))                        # arrives while the batch runs
    second = b.step()
    assert sorted(second["request_id"].tolist()) == [1, 2, 3, 4]   # decode steps of the same set only
    assert set(second["kind"].tolist()) == {records.KIND_DECODE}
    b.step()
    assert len(b.responses) == 4
    assert b.workers[0].recv_batch(0) is None                  # request 5 alone waits for a full batch


def test_static_timeout_sends_a_partial_batch(bench_factory):
    b = bench_factory(batching="static", max_batch_size=32, batch_timeout_s=0.02)
    b.send(chunks_of(1, [1, 2], max_out=1))
    b.router.poll()
    assert b.workers[0].recv_batch(0) is None
    time.sleep(0.03)
    b.router.poll()
    batch = b.workers[0].recv_batch(0)
    assert batch is not None and batch["request_id"].tolist() == [1]


def test_out_of_order_and_duplicate_chunks(bench_factory):
    b = bench_factory()
    toks = list(range(400))
    arr = chunks_of(3, toks, max_out=1)
    b.send(arr[[3, 1]])
    b.router.poll()
    assert b.workers[0].recv_batch(0) is None                  # nothing in order yet
    b.send(arr[[0, 0, 2]])                                       # chunk 0 twice
    batches = b.run()
    assert prefill_seen(batches) == {3: toks}
    assert b.router.stats()["duplicate_chunks"] == 1
    assert len(b.responses) == 1


def test_early_chunks_are_found_by_index_and_freed_when_their_request_ends(bench_factory):
    """Early chunks were searched for along an unsorted list (a successor at every in-order
    step, a duplicate at every arrival): a 2,048-chunk request in reverse cost ~n^2/2 steps. They
    are indexed by (request slot, chunk index) now; here the same indices are parked by three
    requests at once, in reverse, shuffled and with repeats, and one expires with its parked."""
    b = bench_factory(reassembly_timeout_s=0.2)
    rng = np.random.default_rng(5)
    toks = {rid: [rid * 100_000 + i for i in range(300 * 128)] for rid in (1, 2)}
    arr = {rid: chunks_of(rid, t, max_out=1) for rid, t in toks.items()}
    b.send(arr[1][:0:-1])                                  # 299 .. 1: all early
    order = rng.permutation(np.arange(1, 300))
    b.send(arr[2][order[:150]], arr[2][order[:20]])       # half of them, and 20 again
    b.send(arr[2][order[150:]])
    late = chunks_of(3, list(range(4 * 128)), max_out=1)
    b.send(late[[3, 2, 2]])                                # 3 never gets its chunks 0 and 1
    while b.router.poll():
        pass
    assert b.router.stats()["duplicate_chunks"] == 21
    b.send(arr[1][:1], arr[2][:1])                         # the first chunks: everything in order
    batches = b.run()
    seen = prefill_seen(batches)
    assert seen[1] == toks[1] and seen[2] == toks[2]
    deadline = time.monotonic() + 5
    while len(b.responses) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
        b.router.poll()
        b.collect()
    got = {int(r["request_id"]): int(r["status"]) for r in b.responses}
    assert got == {1: 200, 2: 200, 3: 400}
    st = b.router.stats()
    assert st["active_requests"] == 0 and st["pool_free"] == 8192


def test_eos_ends_a_request_early(bench_factory):
    b = bench_factory()
    b.send(chunks_of(9, [1], max_out=50))
    b.router.poll()
    b.step()                                                     # prefill
    b.step(eos=[True])                                           # first decode says end of sequence
    assert len(b.responses) == 1 and b.responses[0]["n_out"] == 2


def test_malformed_chunks_and_full_table_are_answered(bench_factory):
    b = bench_factory(max_requests=8)
    bad = chunks_of(1, [1, 2])
    bad["n_tokens"] = 0
    worse = chunks_of(2, [1, 2])
    worse["chunk_index"] = 5
    b.send(bad, worse)
    for rid in range(10, 30):
        b.send(chunks_of(rid, [1], max_out=1))
    b.router.poll()
    b.collect()
    statuses = sorted(int(r["status"]) for r in b.responses)
    assert statuses.count(400) == 2
    assert {refusal(r) for r in b.responses if r["status"] == 400} == {
        "a chunk of the request is malformed (its token count is not 1 to 128, its index is not below its "
        "chunk count, or its chunk count is not its first record's)"}, "said (it had no body)"
    assert statuses.count(503) == 20 - 8                          # 8 slots; the rest refused, not lost
    assert {refusal(r) for r in b.responses if r["status"] == 503} == {"the router's request table is full: retry shortly"}
    st = b.router.stats()
    assert st["bad_chunks"] == 2 and st["table_full"] == 12 and st["active_requests"] == 8


def test_a_malformed_chunk_of_a_request_under_way_fails_it_400_saying_so(bench_factory):
    b = bench_factory(n_workers=1)
    arr = chunks_of(1, list(range(300)), max_out=1)
    b.send(arr[[0]])
    b.router.poll()
    bad = arr[[1]]
    bad["n_tokens"] = 0
    b.send(bad)
    b.run()
    (r,) = b.responses
    assert r["status"] == 400 and b.router.stats()["bad_chunks"] == 1
    assert refusal(r).startswith("a chunk of the request is malformed"), "said (it had no body)"


def test_chunks_that_disagree_on_their_count_fail_the_request_400_at_once(bench_factory):
    """Chunk 0 says 2 chunks, chunks 1 and 2 say 3: the disagreeing chunk was dropped as a duplicate
    and the request answered 400 "chunks missing" at the reassembly timeout, every chunk sent
    (found by review). It is refused at once, saying why, and its later chunks are dropped."""
    b = bench_factory(n_workers=1, reassembly_timeout_s=30)
    arr = chunks_of(1, list(range(300)), max_out=1)
    first = arr[[0]]
    first["chunk_count"] = 2
    b.send(first)
    b.router.poll()
    b.send(arr[[1]])
    b.run()
    (r,) = b.responses
    assert r["status"] == 400 and b.router.stats()["bad_chunks"] == 1
    assert "its chunk count is not its first record's" in refusal(r)
    b.send(arr[[2]])
    b.run()
    assert len(b.responses) == 1 and b.router.stats()["active_requests"] == 0


def test_requests_spread_over_workers(bench_factory):
    b = bench_factory(n_workers=3, policy="round_robin")
    for rid in range(1, 7):
        b.send(chunks_of(rid, [1, 2, 3], max_out=1))
    b.router.poll()
    got = [sorted(b.workers[k].recv_batch(0)["request_id"].tolist()) for k in range(3)]
    assert got == [[1, 4], [2, 5], [3, 6]]


def test_bad_router_arguments():
    with pytest.raises(ValueError, match="known: round_robin"):
        Router(policy="nope")
    with pytest.raises(ValueError):
        Router(batching="lazy")
    with pytest.raises(ValueError):
        Router(max_requests=100)
    with pytest.raises(ValueError):
        Router(max_chunks=65)
    with Router() as r:                # ZeroMQ took port 99999 as 34463, and port 0 (found by review)
        for bad in ("tcp://127.0.0.1:99999", "tcp://127.0.0.1:0", "udp://127.0.0.1:5"):
            with pytest.raises(ValueError):
                r.add_zmq_worker(bad)
    assert policies()[:5] == ["round_robin", "least_loaded", "power_of_two", "affinity", "weighted"]   # then any new one


def test_weights_and_health_change_live(bench_factory):
    b = bench_factory(n_workers=2, policy="weighted")
    b.router.set_weight(1, 0)
    for rid in range(1, 5):
        b.send(chunks_of(rid, [1], max_out=1))
    b.router.poll()
    assert len(b.workers[0].recv_batch(0)) == 4 and b.workers[1].recv_batch(0) is None
    b.router.set_weight(0, 0)
    b.router.set_weight(1, 5)
    b.router.set_up(0, False)   # worker 0 is gone: its unanswered requests 1-4 move to worker 1
    for rid in range(5, 9):
        b.send(chunks_of(rid, [1], max_out=1))
    b.router.poll()
    batch = b.workers[1].recv_batch(0)
    assert sorted(batch["request_id"].tolist()) == [1, 2, 3, 4, 5, 6, 7, 8]
    st = b.router.worker_stats(1)
    assert st["batches"] == 1 and st["records"] == 8 and st["up"] == 1
    assert b.router.worker_stats(0)["up"] == 0 and b.router.stats()["replayed"] == 4
    # placed: where each came (1-4 on worker 0); answered: where each ended (all 8 on worker 1)
    def placed_answered():
        return [(b.router.worker_stats(k)["placed"], b.router.worker_stats(k)["answered"]) for k in (0, 1)]
    assert placed_answered() == [(4, 0), (4, 0)]
    assert b.workers[1].send_completion(lanes.completion_for(batch, [7] * len(batch), worker=1))
    b.router.poll()
    b.collect()
    assert len(b.responses) == 8 and placed_answered() == [(4, 0), (4, 8)]
    b.router.set_policy("affinity", 0.5)
    with pytest.raises(ValueError):
        b.router.set_weight(7, 1)


def test_started_router_thread_pinned_and_stopped(bench_factory):
    b = bench_factory()
    b.router.start(cpu=0)
    b.send(chunks_of(1, [1, 2], max_out=1))
    deadline = time.monotonic() + 5
    batch = None
    while batch is None and time.monotonic() < deadline:
        batch = b.workers[0].recv_batch(0.01)
    assert batch is not None and batch["t_router"][0] <= batch["t_lane"][0]
    with pytest.raises(RuntimeError):
        b.router.start()
    b.router.stop()
    assert b.router.stats()["loops"] > 0


@pytest.mark.parametrize("batching,policy,seed,pauses", [
    ("dynamic", "round_robin", 1, False), ("dynamic", "affinity", 2, False), ("dynamic", "power_of_two", 3, False),
    ("static", "least_loaded", 4, False), ("static", "weighted", 5, False), ("dynamic", "least_tokens", 6, False),
    ("dynamic", "peak_ewma", 7, False),
    ("dynamic", "affinity", 8, True), ("static", "round_robin", 9, True), ("dynamic", "least_tokens", 10, True),
])
def test_random_traffic_every_request_answered_once_and_intact(bench_factory, batching, policy, seed, pauses):
    """Random sizes, shuffled chunk order, duplicates, EOS and budgets (and, with pauses, workers that
    stop answering for a while, stalled at 1 ms): the invariants hold."""
    rng = np.random.default_rng(seed)
    n_workers = 3
    b = bench_factory(n_workers=n_workers, batching=batching, policy=policy,
                      token_budget=int(rng.integers(64, 700)), max_chunks=int(rng.integers(4, 65)),
                      max_batch_size=int(rng.integers(1, 9)), batch_timeout_s=0.001,
                      max_requests=1024 if pauses else 64,   # (requests a pause holds up: no tenant share 503)
                      stall_s=0.001 if pauses else 0.5)
    want, max_out, session = {}, {}, {}
    pending = []
    for rid in range(1, 121):
        toks = rng.integers(0, 50000, size=int(rng.integers(1, 700))).tolist()
        want[rid] = toks
        max_out[rid] = int(rng.integers(0, 6))
        session[rid] = int(rng.integers(1, 40))
        arr = chunks_of(rid, toks, session=session[rid], max_out=max_out[rid])
        order = rng.permutation(len(arr))
        dup = [int(order[0])] if rng.random() < 0.2 else []
        pending += [arr[[i]] for i in list(order) + dup]
    seen, stepped = {}, 0
    paused_until = [0] * n_workers
    for i in range(20000):
        if pending and rng.random() < 0.6:
            k = int(rng.integers(1, 6))
            batch, pending = pending[:k], pending[k:]
            if b.input.enqueue(np.concatenate(batch).tobytes()) < len(batch):
                pending = batch + pending   # input ring full: resend later, as ingress would
        if pauses and rng.random() < 0.02:
            paused_until[int(rng.integers(0, n_workers))] = i + int(rng.integers(10, 300))
        for k in range(n_workers):
            if i < paused_until[k]:
                b.router.poll()
                continue
            got = b.step(k, eos=None)
            if got is not None:
                stepped += 1
                for x in got:
                    if x["kind"] == wire.KIND_CHUNK:
                        seen.setdefault(int(x["request_id"]), []).extend(x["tokens"][:x["n_tokens"]].tolist())
                    assert x["n_tokens"] <= 128
        if not pending and len(b.responses) >= len(want) and b.router.stats()["active_requests"] == 0:
            break
        if rng.random() < 0.3:
            time.sleep(0.0005)  # let static batches time out
    ids = [int(r["request_id"]) for r in b.responses]
    assert sorted(ids) == sorted(want), "every request answered exactly once"
    assert seen == want, "prefill tokens arrive whole and in order"
    for sid in set(session.values()):
        mine = [rid for rid in ids if session[rid] == sid]
        assert mine == sorted(mine), f"session {sid}'s requests answered in their order"
    if pauses:
        assert b.router.stats()["stalls"] > 0 and b.router.stats()["replayed"] == 0
    for r in b.responses:
        rid = int(r["request_id"])
        assert r["status"] == 200
        assert r["n_out"] == min(max_out[rid], records.MAX_OUTPUT_TOKENS)
        assert all(t == 1000 + rid for t in r["tokens"][:r["n_out"]])
    st = b.router.stats()
    assert st["active_requests"] == 0 and st["pool_free"] == 8192
    assert all(b.router.worker_stats(k)["depth"] == 0 for k in range(n_workers))
    assert all(b.router.worker_stats(k)["queued_tokens"] == 0 for k in range(n_workers))


@pytest.mark.parametrize("policy", ["peak_ewma", "least_tokens"])
def test_peak_ewma_learns_from_answers_which_worker_is_slow(bench_factory, policy):
    """Worker 1 answers each step 30 ms late, worker 0 at once, one request at a time (both queues
    empty at every pick). peak_ewma learns it from the requests that ended (the done hook) and sends
    every request to worker 0 once both have answered one; least_tokens, which sees only queues,
    spreads them over both. (Through the router: what the policy is told of each request's end.)"""
    b = bench_factory(n_workers=2, policy=policy)
    ran_on = {}
    for rid in range(1, 21):
        b.send(chunks_of(rid, list(range(30)), max_out=2))
        b.router.poll()
        for k, delay in ((0, 0.0), (1, 0.03)):
            while True:
                time.sleep(delay)
                batch = b.step(k)
                if batch is None:
                    break
                ran_on.update((int(r["request_id"]), k) for r in batch)
        assert len(b.responses) == rid
    assert all(r["status"] == wire.STATUS_OK for r in b.responses)
    on_slow = [rid for rid in range(1, 21) if ran_on[rid] == 1]
    for key in ("placed", "answered"):    # bench compare's straggler shares
        assert [b.router.worker_stats(k)[key] for k in (0, 1)] == [20 - len(on_slow), len(on_slow)]
    if policy == "peak_ewma":   # a worker not measured yet is taken at the other's figure: a tie
        measured = max(min(r for r in ran_on if ran_on[r] == k) for k in (0, 1))
        assert measured < 10 and [r for r in on_slow if r > measured] == [], on_slow
    else:
        assert len(on_slow) == 10, on_slow   # ties spread: every other one


@pytest.mark.parametrize("policy,want", [("least_tokens", [158, 128]), ("least_loaded", [30, 256])])
def test_least_tokens_weighs_a_worker_s_queue_in_tokens_where_least_loaded_counts_chunks(bench_factory, policy, want):
    """Worker 0 holds three 10-token requests (3 chunks, 30 tokens), worker 1 nothing; then two
    128-token requests. By chunks the second goes to worker 1 too (1 chunk < 3); by tokens to
    worker 0 (30 < 128): a step's cost follows its tokens. Depth in tokens counts a chunk's tokens
    until its last piece is done and one per request decoding, and comes back to 0."""
    b = bench_factory(n_workers=2, policy=policy)
    b.router.set_up(1, False)
    b.send(*(chunks_of(rid, list(range(10)), max_out=2) for rid in (1, 2, 3)))
    b.router.poll()
    assert [b.router.worker_stats(k)["queued_tokens"] for k in (0, 1)] == [30, 0]
    b.router.set_up(1, True)
    b.send(chunks_of(4, list(range(128)), max_out=2))
    b.router.poll()
    b.send(chunks_of(5, list(range(128)), max_out=2))
    b.router.poll()
    assert [b.router.worker_stats(k)["queued_tokens"] for k in (0, 1)] == want
    for _ in range(20):
        b.step(0)
        b.step(1)
    assert sorted(int(r["request_id"]) for r in b.responses) == [1, 2, 3, 4, 5]
    assert all(r["status"] == 200 for r in b.responses)
    assert [(b.router.worker_stats(k)["depth"], b.router.worker_stats(k)["queued_tokens"]) for k in (0, 1)] == \
        [(0, 0), (0, 0)]


def test_a_worker_s_depth_in_tokens_is_its_prompt_tokens_then_one_per_request_decoding(bench_factory):
    b = bench_factory()
    b.send(chunks_of(1, list(range(300)), max_out=3), chunks_of(2, list(range(20)), max_out=1))
    b.router.poll()
    assert b.router.worker_stats(0)["queued_tokens"] == 320          # in flight until completed
    b.step()                                                         # prefill done: 1 decodes on
    assert b.router.worker_stats(0)["queued_tokens"] == 1
    b.run()
    assert b.router.worker_stats(0)["queued_tokens"] == 0


def test_a_split_chunk_weighs_its_whole_tokens_until_its_last_piece_is_done(bench_factory):
    b = bench_factory(token_budget=100, split_slack=0)
    b.send(chunks_of(1, list(range(128)), max_out=1))
    b.router.poll()
    first = b.step()                                                 # the first 100-token piece, done
    assert int(first["n_tokens"][0]) == 100 and b.router.stats()["splits"] == 1
    assert b.router.worker_stats(0)["queued_tokens"] == 128
    b.run()
    assert [int(r["status"]) for r in b.responses] == [200]
    assert (b.router.worker_stats(0)["depth"], b.router.worker_stats(0)["queued_tokens"]) == (0, 0)


def test_a_failover_moves_a_worker_s_depth_in_tokens_whole(bench_factory):
    """Worker 0 goes down with a 300-token request in flight and a 40-token one decoding: its depth
    goes to 0 and both requests' prompt tokens to worker 1, where they are replayed, and both
    come back to 0 once answered."""
    b = bench_factory(n_workers=2, policy="round_robin")
    b.router.set_up(1, False)
    b.send(chunks_of(1, list(range(40)), max_out=5))
    b.router.poll()
    b.step(0)                                                        # 1 decodes on worker 0
    b.send(chunks_of(2, list(range(300)), max_out=2))
    b.router.poll()
    assert [b.router.worker_stats(k)["queued_tokens"] for k in (0, 1)] == [301, 0]
    b.router.set_up(1, True)
    b.router.set_up(0, False)
    b.router.poll()
    assert b.router.worker_stats(0)["queued_tokens"] == 0
    assert b.router.worker_stats(1)["queued_tokens"] == 340          # both replayed from their prompts
    b.run(1)
    assert sorted((int(r["request_id"]), int(r["status"])) for r in b.responses) == [(1, 200), (2, 200)]
    assert [(b.router.worker_stats(k)["depth"], b.router.worker_stats(k)["queued_tokens"]) for k in (0, 1)] == \
        [(0, 0), (0, 0)]


def test_a_kv_full_flag_on_a_decode_step_is_a_refusal_not_a_move(bench_factory):
    """A worker flags CE_KV_FULL only on a request none of which it ran (worker.py). On a decode
    step, after its prefill ran there, a move left the request on that worker's decoding list and
    its chunks counted on both workers for good (depth 1 and 50 tokens after everything ended, a
    pool slot lost; found by review): it is answered 503 as any other refusal."""
    b = bench_factory(n_workers=2, policy="least_tokens")
    b.send(chunks_of(1, list(range(50)), max_out=4))
    b.router.poll()
    k = next(k for k in (0, 1) if b.router.worker_stats(k)["depth"])
    b.step(k)                                                        # prefill done: decoding there
    batch = b.workers[k].recv_batch(0)
    assert list(batch["kind"]) == [records.KIND_DECODE]
    comp = lanes.completion_for(batch, [0])
    comp["e"][0]["status"][0] = wire.STATUS_UNAVAILABLE
    comp["e"][0]["flags"][0] = records.CE_KV_FULL
    assert b.workers[k].send_completion(comp)
    for _ in range(10):
        b.step(0)
        b.step(1)
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses] == [(1, wire.STATUS_UNAVAILABLE)]
    assert b.responses[0]["body_len"] == 0, "not the KV-full body: its session is there, a new one is not refused"
    st = b.router.stats()
    assert st["active_requests"] == 0 and st["pool_free"] == 8192 and st["kv_moved"] == 0
    assert [(b.router.worker_stats(x)["depth"], b.router.worker_stats(x)["queued_tokens"]) for x in (0, 1)] == \
        [(0, 0), (0, 0)]


def test_incomplete_request_expires_with_400(bench_factory):
    b = bench_factory(reassembly_timeout_s=0.05)
    arr = chunks_of(4, list(range(200)), max_out=2)
    b.send(arr[[0]])                          # chunk 1 of 2 never comes
    b.router.poll()
    first = b.step()
    assert first["request_id"].tolist() == [4] and not first["flags"][0] & records.CHUNK_F_FINAL
    deadline = time.monotonic() + 5
    while not b.responses and time.monotonic() < deadline:
        time.sleep(0.01)
        b.router.poll()
        b.collect()
    (resp,) = b.responses
    assert resp["status"] == 400 and resp["request_id"] == 4
    st = b.router.stats()
    assert st["expired"] == 1 and st["active_requests"] == 0 and st["pool_free"] == 8192
    assert b.router.worker_stats(0)["depth"] == 0 and b.router.worker_stats(0)["queued_tokens"] == 0


def test_every_record_of_a_request_carries_its_send_stamp_not_its_packet_s(bench_factory):
    """A worker tells a verbatim repeat of an answered request by its id and send stamp
    (test_worker); each chunk's packet has its own stamp, so the router writes the request's on
    every record: with the packets', the repeat's first chunk was refused 409 and its second,
    stamped otherwise, began a request of half a prompt (found by review)."""
    b = bench_factory(n_workers=1)
    arr = chunks_of(6, list(range(200)), max_out=1)
    arr["t_send"] = [1_000, 2_000]
    b.send(arr)
    b.router.poll()
    batch = b.workers[0].recv_batch(0)
    assert len(batch) == 2 and batch["t_send"].tolist() == [1_000, 1_000]


@pytest.mark.parametrize("status, flags, says", [
    (wire.STATUS_CONFLICT, 0, "already ran"),                       # a repeat of an answered request
    (wire.STATUS_UNAVAILABLE, records.CE_KV_FULL, "KV cache is full"),   # a store-less worker with no room
    (wire.STATUS_UNAVAILABLE, records.CE_STORE, "snapshot store failed"),   # a restore or a put failed
    (wire.STATUS_UNAVAILABLE, records.CE_KV_LOST, "start a new session"),   # its stored KV is unusable
    (wire.STATUS_TOO_LARGE, 0, "context length"),                   # the session's context is full
    (wire.STATUS_BAD_REQUEST, 0, "vocabulary"),                     # a token the model has not
    (wire.STATUS_UNPROCESSABLE, 0, "out of order"),                 # the worker found the data path's fault
    (wire.STATUS_UNAVAILABLE, 0, None),                             # any other 503: no reason known
])
def test_a_worker_s_refusal_whose_reason_the_client_cannot_guess_comes_with_a_body(bench_factory, status, flags,
                                                                                    says):
    """A worker's refusals (worker.py _take: a verbatim repeat 409, a store-less worker's full KV
    503 CE_KV_FULL, its store's failure 503 CE_STORE, its stored KV unusable 503 CE_KV_LOST, the
    context full 413, a token past the vocabulary 400, records out of order 422): the client gets the status and a body that says
    why, none of which it could tell from the status alone. (Only the first two had one before.)"""
    b = bench_factory(n_workers=1)
    b.send(chunks_of(6, [1, 2], max_out=2))
    b.router.poll()
    batch = b.workers[0].recv_batch(0)
    comp = lanes.completion_for(batch, [0] * len(batch))
    comp["e"][0]["status"][0], comp["e"][0]["flags"][0] = status, flags
    b.workers[0].send_completion(comp)
    b.run()
    (r,) = b.responses
    assert r["status"] == status and r["n_out"] == 0 and b.router.stats()["refused_by_worker"] == 1
    if says is None:
        assert r["body_len"] == 0
    else:
        doc = json.loads(bytes(r["body"][:r["body_len"]]))
        assert doc["status"] == status and says in doc["error"]


def answer_kv_full(b, k):
    """Worker k, without a store and over its KV budget, refuses the batch's request as worker.py
    does: its first record 503 flagged CE_KV_FULL, the rest of it 503; returns the batch."""
    batch = b.workers[k].recv_batch(0)
    comp = lanes.completion_for(batch, [0] * len(batch))
    comp["e"][0]["status"][:len(batch)] = wire.STATUS_UNAVAILABLE
    comp["e"][0]["flags"][0] = records.CE_KV_FULL
    assert b.workers[k].send_completion(comp)
    b.router.poll()
    return batch


def batches_waiting(b):
    return [k for k, w in enumerate(b.workers) if w.lane.stats()["depth"]]


@pytest.mark.parametrize("batching", ["dynamic", "static"])
def test_a_request_a_store_less_worker_has_no_kv_room_for_moves_to_the_next_worker(bench_factory, batching):
    """A store-less worker over its KV budget refuses a session new to it, having run none of it.
    The policy (affinity) would pick the full worker again, so the router moves the request to the
    pool's next up worker, from its first token, and the session's request held behind it
    follows (on a worker without the first turn it would begin the session again), as do its
    later requests until its CLOSE. Before, the client got the 503 though another worker had room."""
    b = bench_factory(n_workers=3, policy="affinity", batching=batching, max_batch_size=1, batch_timeout_s=0)
    prompt = list(range(1, 201))
    b.send(chunks_of(6, prompt, session=9, max_out=1), chunks_of(7, [5, 6], session=9, max_out=1))
    b.router.poll()
    (k,) = batches_waiting(b)
    first = answer_kv_full(b, k)
    assert batches_waiting(b) == [(k + 1) % 3], "the next worker of the pool"
    got = b.run((k + 1) % 3)
    assert prefill_seen(got) == {6: prompt, 7: [5, 6]} and prefill_seen([first]) == {6: prompt}
    assert {int(r["request_id"]): int(r["status"]) for r in b.responses} == {6: 200, 7: 200}
    st = b.router.stats()
    assert st["kv_moved"] == 1 and st["refused_by_worker"] == 0 and st["active_requests"] == 0
    assert st["kv_homes"] == 1 and [b.router.worker_stats(x)["depth"] for x in range(3)] == [0, 0, 0]
    assert [b.router.worker_stats(x)["queued_tokens"] for x in range(3)] == [0, 0, 0]
    # the session lives there now: its next request and its CLOSE go there, not to the policy's pick
    close = chunks_of(9, [], session=9)
    close["kind"], close["n_tokens"] = wire.KIND_CLOSE, 0
    b.send(chunks_of(8, [7, 8], session=9, max_out=1), close)
    b.router.poll()
    assert batches_waiting(b) == [(k + 1) % 3]
    got = b.run((k + 1) % 3)
    assert [(int(r["request_id"]), int(r["kind"])) for x in got for r in x] == [(8, wire.KIND_CHUNK),
                                                                              (9, wire.KIND_CLOSE)]
    assert b.router.stats()["kv_moved"] == 1 and b.router.stats()["kv_homes"] == 0
    b.send(chunks_of(10, [9], session=9, max_out=1))        # the id afresh after its CLOSE: the policy's
    b.router.poll()
    assert batches_waiting(b) == [k]


def test_sessions_moved_for_kv_room_are_remembered_until_the_table_is_full_then_refused(bench_factory):
    """A session moved away from a full worker is placed where it moved until its CLOSE, so the
    router remembers each; past KV_HOMES (4,096) of them it cannot, and a request that would need
    one more is answered 503 like one every worker refused, not moved where its later requests
    would not find it."""
    b = bench_factory(n_workers=2, policy="weighted")
    b.router.set_weight(1, 0)                                  # every session to worker 0 first
    for i in range(4096 + 1):
        b.send(chunks_of(i + 1, [1, 2], session=10_000 + i, max_out=1))
        b.router.poll()
        answer_kv_full(b, 0)
        b.step(1)
        b.collect()
    st = b.router.stats()
    assert st["kv_homes"] == 4096 and st["kv_moved"] == 4096 and st["refused_by_worker"] == 1
    statuses = [int(r["status"]) for r in b.responses]
    assert statuses.count(200) == 4096 and statuses[-1] == wire.STATUS_UNAVAILABLE


def test_a_close_held_behind_a_moved_request_moves_with_it_and_ends_its_home(bench_factory):
    """The session's CLOSE came while its first request was still out, and was placed with it on
    the worker that then refused it: both move, and once the CLOSE is answered the session's id
    starts afresh (its home is forgotten), as it does for a CLOSE placed at the home."""
    b = bench_factory(n_workers=2, policy="affinity")
    close = chunks_of(7, [], session=9)
    close["kind"], close["n_tokens"] = wire.KIND_CLOSE, 0
    b.send(chunks_of(6, [1, 2], session=9, max_out=1), close)
    b.router.poll()
    (k,) = batches_waiting(b)
    answer_kv_full(b, k)
    assert b.router.stats()["kv_homes"] == 1
    got = b.run(1 - k)
    assert [(int(r["request_id"]), int(r["kind"])) for x in got for r in x] == [(6, wire.KIND_CHUNK),
                                                                              (7, wire.KIND_CLOSE)]
    assert {int(r["request_id"]): int(r["status"]) for r in b.responses} == {6: 200, 7: 200}
    assert b.router.stats()["kv_homes"] == 0


def store_less_bench(bench_factory, n, policy="affinity", no_store=True):
    """n workers, without a store unless no_store is False, each of which has answered something
    (so the router knows)."""
    b = bench_factory(n_workers=n, policy=policy)
    b.no_store = set(range(n)) if no_store else set()
    for s in range(100, 100 + 10 * n):
        b.send(chunks_of(s, [1], session=s, max_out=1))
        for j in range(n):
            b.run(j)
    return b


def kill_taken(b, k):
    """Worker k takes its batch, then dies: returns the worker its request was replayed on."""
    b.workers[k].recv_batch(0)
    b.router.set_up(k, False)
    b.router.poll()
    (nk,) = batches_waiting(b)
    return nk


def then_request_and_close_on(b, worker):
    """Session 9's request 9, then its CLOSE (10): each placed on `worker`, and run there."""
    close = chunks_of(10, [], session=9)
    close["kind"], close["n_tokens"] = wire.KIND_CLOSE, 0
    for req in (chunks_of(9, [5], session=9, max_out=1), close):
        b.send(req)
        b.router.poll()
        assert batches_waiting(b) == [worker]
        b.run(worker)


def fail_over(b, session, rid):
    """Session's request rid, taken by its worker, which dies: returns (that worker, the replay's)."""
    b.send(chunks_of(rid, [1, 2], session=session, max_out=1))
    b.router.poll()
    (k,) = batches_waiting(b)
    return k, kill_taken(b, k)


def test_a_moved_session_replayed_by_failover_is_closed_where_it_ran_again(bench_factory):
    """A session's home (a KV-full move) dies with its request in flight; the failover replays the
    request on another worker, where the session (store-less) begins again. The home's
    replacement comes up: the session's later request and its CLOSE go where it now is. Before,
    the stale home drew both to the fresh worker, and the copy the replay made was never closed."""
    b = bench_factory(n_workers=3, policy="affinity")
    b.send(chunks_of(6, [1, 2], session=9, max_out=1))
    b.router.poll()
    (k,) = batches_waiting(b)
    answer_kv_full(b, k)
    home = (k + 1) % 3
    b.run(home)
    b.send(chunks_of(8, [3, 4], session=9, max_out=1))
    b.router.poll()
    assert batches_waiting(b) == [home]
    nk = kill_taken(b, home)
    b.run(nk)
    b.router.set_up(home, True)                            # its replacement
    then_request_and_close_on(b, nk)
    assert {int(r["request_id"]): int(r["status"]) for r in b.responses} == {6: 200, 8: 200, 9: 200, 10: 200}
    assert b.router.stats()["kv_homes"] == 0


@pytest.mark.parametrize("store", [False, True])
def test_a_session_a_failover_moved_to_a_store_less_worker_stays_there_until_its_close(bench_factory, store):
    """Session 9's worker dies with its request taken; the failover replays the request on another
    worker. Without a store there (its answers say so, CE_NO_STORE) the session lives only where
    the replay ran: its later request and its CLOSE go there once the dead worker's replacement is
    up. Before, the policy sent them to the replacement, which began the session again, and the
    replay's copy stayed on the other worker, never closed (found by review, session 29). With a
    store the policy's pick restores it: nothing is remembered."""
    b = store_less_bench(bench_factory, 3, no_store=not store)
    b.send(chunks_of(6, [1, 2], session=9, max_out=1))
    b.router.poll()
    (k,) = batches_waiting(b)
    b.run(k)
    b.send(chunks_of(8, [3, 4], session=9, max_out=1))
    b.router.poll()
    assert batches_waiting(b) == [k]
    nk = kill_taken(b, k)
    b.run(nk)
    assert b.router.stats()["kv_homes"] == (0 if store else 1)
    b.router.set_up(k, True)                               # its replacement
    then_request_and_close_on(b, k if store else nk)
    assert {int(r["request_id"]): int(r["status"]) for r in b.responses if r["session_id"] == 9} == \
        {6: 200, 8: 200, 9: 200, 10: 200}
    assert b.router.stats()["kv_homes"] == 0


def test_a_worker_declared_store_less_keeps_a_session_replayed_there_before_its_first_answer(bench_factory):
    """Nothing answered yet, so no answer has said that the workers have no store: the control
    plane did (set_worker_store, as the pipeline does). Session 9's worker dies with its first
    request taken; the replay's worker keeps the session until its CLOSE. Before, only answers
    told: the policy sent the session's next request to the dead worker's replacement, which began
    it again (a known limit since session 30)."""
    b = bench_factory(n_workers=3, policy="affinity")
    for k in range(3):
        b.router.set_worker_store(k, False)
    b.no_store = {0, 1, 2}
    k, nk = fail_over(b, 9, 6)
    assert b.router.stats()["kv_homes"] == 1, "placed there before it had answered anything"
    b.run(nk)
    b.router.set_up(k, True)                               # its replacement
    then_request_and_close_on(b, nk)
    assert {int(r["request_id"]): int(r["status"]) for r in b.responses} == {6: 200, 9: 200, 10: 200}
    assert b.router.stats()["kv_homes"] == 0


def test_a_declared_store_less_worker_s_replacement_is_taken_to_have_none_before_it_answers(bench_factory):
    """Worker 0 dies and its replacement comes up (the same declaration, nothing answered yet);
    then worker 1 dies with session 9's request taken, which the failover replays on worker 0's
    replacement: the session stays there (a death reset the worker to "has a store" until its
    answers said otherwise)."""
    b = bench_factory(n_workers=2, policy="weighted")
    for k in range(2):
        b.router.set_worker_store(k, False)
    b.no_store = {0, 1}
    b.router.set_up(0, False)
    b.router.poll()
    b.router.set_up(0, True)                               # its replacement
    b.router.set_weight(0, 0)                              # session 9 to worker 1
    b.send(chunks_of(6, [1, 2], session=9, max_out=1))
    b.router.poll()
    assert batches_waiting(b) == [1]
    b.router.set_weight(0, 1)
    assert kill_taken(b, 1) == 0
    assert b.router.stats()["kv_homes"] == 1


def test_declaring_a_worker_has_a_store_does_not_unsay_what_its_answers_said(bench_factory):
    """Its answers said it has none (CE_NO_STORE): a declaration of one does not erase that before
    its next answer, so a failover onto it still remembers the session (review)."""
    b = store_less_bench(bench_factory, 2)
    for k in range(2):
        b.router.set_worker_store(k, True)
    fail_over(b, 9, 6)
    assert b.router.stats()["kv_homes"] == 1


def test_a_failover_s_entry_goes_when_its_worker_refuses_the_session_or_dies(bench_factory):
    """The replay's worker refuses the session for want of KV room and no other has any: the
    request is answered 503 and the entry goes (a failover's walk counts no moves, so it stayed,
    drawing the session's next request to the worker that had refused it). And an entry whose
    worker dies goes with it: kept, failovers of sessions never closed filled the table for good,
    and a KV-full move was then answered 503 (both found by review)."""
    b = store_less_bench(bench_factory, 2)
    k, nk = fail_over(b, 9, 6)
    assert b.router.stats()["kv_homes"] == 1
    answer_kv_full(b, nk)
    b.collect()
    assert {int(r["request_id"]): int(r["status"]) for r in b.responses if r["session_id"] == 9} == {6: 503}
    assert b.router.stats()["kv_homes"] == 0
    b = store_less_bench(bench_factory, 3)
    k, nk = fail_over(b, 9, 6)
    b.run(nk)
    assert b.router.stats()["kv_homes"] == 1
    b.router.set_up(k, True)
    b.router.set_up(nk, False)                             # the session's copy dies with nk
    b.router.poll()
    assert b.router.stats()["kv_homes"] == 0


def test_a_completion_shorter_than_its_batch_does_not_unsay_the_worker_s_lack_of_a_store(bench_factory):
    """The router fills in a record a completion does not cover (503, no flags): read as the
    worker's own answer, it cleared what the worker had said, and a failover made no entry."""
    b = store_less_bench(bench_factory, 2, policy="weighted")
    b.router.set_weight(0, 0)                              # everything to worker 1 first
    b.send(chunks_of(20, [1], session=20, max_out=1), chunks_of(21, [1], session=21, max_out=1))
    b.router.poll()
    batch = b.workers[1].recv_batch(0)
    assert len(batch) == 2
    comp = lanes.completion_for(batch, [1, 1], worker=1)
    comp["e"][0]["flags"][:2] |= records.CE_NO_STORE
    comp["n"] = 1
    assert b.workers[1].send_completion(comp)
    b.router.poll()
    b.router.set_weight(0, 1)
    b.router.set_weight(1, 0)
    k, nk = fail_over(b, 9, 6)
    assert (k, nk) == (0, 1) and b.router.stats()["kv_homes"] == 1


@pytest.mark.parametrize("policy", ["round_robin", "affinity", "least_loaded"])
def test_a_failover_sends_a_held_close_where_its_session_went(bench_factory, policy):
    """Request 6 runs on a worker and its session's CLOSE (7) waits behind it there; the worker
    dies. The failover replays 6 on another worker, and the CLOSE goes where 6 went: each was
    picked anew by the policy before, and the CLOSE ran on a worker that never held the session,
    while the replay's worker kept it for good (found by review: every policy here did it)."""
    b = bench_factory(n_workers=3, policy=policy)
    close = chunks_of(7, [], session=9)
    close["kind"], close["n_tokens"] = wire.KIND_CLOSE, 0
    b.send(chunks_of(6, [1, 2, 3], session=9, max_out=1), close)
    b.router.poll()
    (k,) = batches_waiting(b)
    assert b.workers[k].recv_batch(0)["request_id"].tolist() == [6]   # taken; the CLOSE waits behind it
    b.router.set_up(k, False)
    b.router.poll()
    ran_on = {}
    for _ in range(20):
        for j in range(3):
            if j != k and (batch := b.step(j)) is not None:
                for r in batch:
                    ran_on.setdefault(int(r["request_id"]), set()).add(j)
    assert {int(r["request_id"]): int(r["status"]) for r in b.responses} == {6: 200, 7: 200}
    assert ran_on[6] == ran_on[7] and len(ran_on[6]) == 1, ran_on


def test_a_failover_places_held_requests_in_their_session_s_order_whatever_their_slots(bench_factory):
    """A (session 9) runs on worker 0; B, held behind it, and then its CLOSE C wait on worker 1, C in
    a slot freed before B's (slots are reused). Worker 1 dies: B follows A, and C follows B. In slot
    order alone C was placed first, by the dead worker's stale entries, on worker 2, which never held
    the session, while worker 0 kept it for good (found by review, session 29)."""
    b = bench_factory(n_workers=3, policy="weighted")

    def weights(*w):
        for k, x in enumerate(w):
            b.router.set_weight(k, x)
    close = chunks_of(4, [], session=9)
    close["kind"], close["n_tokens"] = wire.KIND_CLOSE, 0
    weights(1, 0, 0)
    b.send(chunks_of(1, [1, 2, 3], session=9, max_out=1))     # A: slot 0, worker 0
    b.router.poll()
    a_batch = b.workers[0].recv_batch(0)                       # taken, not answered yet
    weights(0, 1, 0)
    b.send(chunks_of(2, [4], session=50, max_out=1))           # X: slot 1, worker 1, another session
    b.send(chunks_of(3, [5], session=9, max_out=1))            # B: slot 2, worker 1, held behind A
    b.router.poll()
    b.step(1)                                                  # X answered: slot 1 free again
    b.send(close)                                              # C: slot 1, worker 1, held behind B
    b.router.poll()
    weights(0, 0, 1)
    b.router.set_up(1, False)
    b.workers[0].send_completion(lanes.completion_for(a_batch, [7] * len(a_batch)))
    ran_on = {}
    for _ in range(20):
        for k in (0, 2):
            if (batch := b.step(k)) is not None:
                for r in batch:
                    ran_on.setdefault(int(r["request_id"]), set()).add(k)
    assert ran_on == {3: {0}, 4: {0}}, ran_on
    assert {int(r["request_id"]): int(r["status"]) for r in b.responses} == {1: 200, 2: 200, 3: 200, 4: 200}


def test_a_session_s_home_follows_the_request_held_behind_its_close(bench_factory):
    """6 is refused for KV room and moves; its CLOSE 7 and the session's next life's first request
    8, held behind it, move with it. Once the CLOSE is answered the home was dropped, and the
    session's next request went to the policy's pick, away from the copy 8 began, its turn lost
    (found by review): the home now follows 8."""
    b = bench_factory(n_workers=2, policy="affinity")
    close = chunks_of(7, [], session=9)
    close["kind"], close["n_tokens"] = wire.KIND_CLOSE, 0
    b.send(chunks_of(6, [1, 2], session=9, max_out=1), close, chunks_of(8, [3, 4], session=9, max_out=1))
    b.router.poll()
    (k,) = batches_waiting(b)
    answer_kv_full(b, k)
    got = b.run(1 - k)
    assert [int(r["request_id"]) for x in got for r in x] == [6, 7, 8]
    assert b.router.stats()["kv_homes"] == 1
    b.send(chunks_of(10, [5], session=9, max_out=1))           # continues 8
    b.router.poll()
    assert batches_waiting(b) == [1 - k]


def test_a_kv_full_walk_that_fails_leaves_the_home_where_the_held_request_went(bench_factory):
    """Every worker refuses 6 (answered 503); 8, held behind it, was carried along the walk and runs
    on the last worker tried, beginning the session there. The home was dropped, and the session's
    next request went to the policy's pick, away from it (found by review): it now stays with 8."""
    b = bench_factory(n_workers=3, policy="affinity")
    b.send(chunks_of(6, [1, 2], session=9, max_out=1), chunks_of(8, [3, 4], session=9, max_out=1))
    b.router.poll()
    for _ in range(3):
        (k,) = batches_waiting(b)
        answer_kv_full(b, k)
        b.collect()
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses] == [(6, wire.STATUS_UNAVAILABLE)]
    (last,) = batches_waiting(b)
    b.run(last)
    assert b.router.stats()["kv_homes"] == 1
    b.send(chunks_of(10, [5], session=9, max_out=1))
    b.router.poll()
    assert batches_waiting(b) == [last]


def test_a_request_every_worker_has_no_kv_room_for_is_refused_503_saying_why(bench_factory):
    """Each worker of the pool is tried once, from the one after the first to refuse it; then the
    client gets the 503 and its body."""
    b = bench_factory(n_workers=3, policy="affinity")
    b.send(chunks_of(6, list(range(1, 201)), session=9, max_out=1))
    b.router.poll()
    tried = []
    while not b.responses:
        (k,) = batches_waiting(b)
        tried.append(k)
        answer_kv_full(b, k)
        b.collect()
    assert sorted(tried) == [0, 1, 2] and tried == [(tried[0] + i) % 3 for i in range(3)]
    (r,) = b.responses
    assert r["status"] == wire.STATUS_UNAVAILABLE and "KV cache is full" in json.loads(bytes(r["body"][:r["body_len"]]))["error"]
    st = b.router.stats()
    assert st["kv_moved"] == 2 and st["refused_by_worker"] == 1 and st["active_requests"] == 0
    assert st["kv_homes"] == 0, "no worker holds the session: no home kept for it"
    assert [b.router.worker_stats(x)["depth"] for x in range(3)] == [0, 0, 0]
    assert [b.router.worker_stats(x)["queued_tokens"] for x in range(3)] == [0, 0, 0]


def test_late_duplicate_of_a_finished_request_is_not_run_again(bench_factory):
    b = bench_factory()
    arr = chunks_of(5, [1, 2, 3], max_out=1)
    b.send(arr)
    b.run()
    assert len(b.responses) == 1
    b.send(arr)                               # the same chunk again, after the answer
    b.router.poll()
    assert b.workers[0].recv_batch(0) is None
    st = b.router.stats()
    assert st["late_duplicates"] == 1 and st["active_requests"] == 0


def test_a_record_the_worker_refuses_ends_its_request_with_that_status(bench_factory):
    b = bench_factory(n_workers=1)
    b.send(chunks_of(6, list(range(300)), max_out=5), chunks_of(7, [1], max_out=2))
    b.router.poll()
    batch = b.workers[0].recv_batch(0)
    comp = lanes.completion_for(batch, [1006] * len(batch))
    comp["e"][0]["status"][0] = 503          # the worker could not take request 6's first piece
    b.workers[0].send_completion(comp)
    b.run()
    by_id = {int(r["request_id"]): r for r in b.responses}
    assert by_id[6]["status"] == 503 and by_id[7]["status"] == 200 and by_id[7]["n_out"] == 2
    assert by_id[6]["body_len"] == 0, "a 503 the worker gave no reason for: none made up"
    st = b.router.stats()
    assert st["refused_by_worker"] == 1 and st["active_requests"] == 0 and st["pool_free"] == 8192
    b.send(chunks_of(6, list(range(300)), max_out=5)[[2]])   # a straggler of the failed request
    b.router.poll()
    assert b.router.stats()["late_duplicates"] == 1


def test_a_request_refused_after_some_output_is_answered_without_it(bench_factory):
    """A request its worker refuses part-way through decoding ends 503 with no tokens: it is
    not charged, and its first tokens are not an answer. Before, the 503 carried them."""
    b = bench_factory(n_workers=1)
    b.send(chunks_of(6, [1, 2, 3], max_out=5))
    b.router.poll()
    for _ in range(2):                           # the prefill and one decode step, a token each
        assert b.step() is not None
    batch = b.workers[0].recv_batch(0)
    comp = lanes.completion_for(batch, [1006] * len(batch))
    comp["e"][0]["status"][0] = 503              # the third is refused
    b.workers[0].send_completion(comp)
    b.run()
    (r,) = b.responses
    assert r["status"] == 503 and r["n_out"] == 0


def test_a_dead_workers_requests_are_replayed_whole_on_another(bench_factory):
    b = bench_factory(n_workers=2, policy="round_robin", token_budget=100, split_slack=0)
    toks = {rid: list(range(rid * 1000, rid * 1000 + 300)) for rid in (1, 2)}
    for rid, t in toks.items():
        b.send(chunks_of(rid, t, max_out=3))
    b.router.poll()
    first = b.workers[0].recv_batch(0)           # request 1's first 100 tokens went to worker 0 ...
    assert first["request_id"].tolist() == [1] and first["n_tokens"].tolist() == [100]
    b.router.set_up(0, False)                    # ... which dies before answering
    batches = b.run(k=1)
    assert prefill_seen(batches)[1] == toks[1], "request 1 is replayed from its first token"
    assert prefill_seen(batches)[2] == toks[2]
    got = {int(r["request_id"]): r for r in b.responses}
    assert set(got) == {1, 2} and all(r["status"] == 200 and r["n_out"] == 3 for r in got.values())
    assert all(int(r["worker"]) == 1 for r in got.values())
    st = b.router.stats()
    assert st["replayed"] == 1 and st["active_requests"] == 0 and st["pool_free"] == 8192


def test_a_dead_worker_comes_back_on_a_fresh_lane_without_its_old_batch(bench_factory):
    """A worker set up again on its old lane first ran the batch the router had replayed
    elsewhere (its KV and snapshots written twice): its replacement gets a fresh lane."""
    b = bench_factory(n_workers=2, policy="round_robin")
    b.send(chunks_of(1, [5] * 10, max_out=1))
    b.router.poll()
    assert b.workers[0].lane.stats()["depth"] == 1            # request 1's batch, on worker 0
    with pytest.raises(RuntimeError, match="must be an shm worker, and down"):
        b.router.replace_lane(0, *lanes.create_shm_lane(b.lanes[0] + ".x"))
    b.lanes.append(b.lanes[0] + ".x")
    b.router.set_up(0, False)                                 # dies: 1 is replayed on worker 1
    name = b.lanes[0] + ".new"
    b.lanes.append(name)
    for ring in b.router.replace_lane(0, *lanes.create_shm_lane(name)):
        ring.close()
    b.router.set_up(0, True)
    assert b.workers[0].lane.stats()["depth"] == 1            # (the old lane still holds it)
    b.workers[0].close()
    b.workers[0] = lanes.ShmWorkerLane(name)
    b.run(k=1)
    b.send(chunks_of(2, [6] * 10, max_out=1))                 # round robin: the new worker 0's turn
    seen = b.run(k=0)
    assert [r["request_id"].tolist() for r in seen] == [[2]]
    got = {int(r["request_id"]): (int(r["status"]), int(r["worker"])) for r in b.responses}
    assert got == {1: (200, 1), 2: (200, 0)}


def test_a_request_whose_replay_kills_its_worker_too_is_answered_503_not_replayed_again(bench_factory):
    """A request that kills workers (a bug, a store that hangs them) goes round the pool no
    further than one replay: when the worker it was replayed on dies too, it is answered 503
    although a third worker is up; the other requests of both dead workers move on as before."""
    b = bench_factory(n_workers=3, policy="round_robin")
    b.send(chunks_of(1, [1, 2, 3], max_out=2))
    b.router.poll()
    assert b.workers[0].recv_batch(0)["request_id"].tolist() == [1]
    b.router.set_up(0, False)                    # replayed once: on worker 1
    b.router.poll()
    assert b.workers[1].recv_batch(0)["request_id"].tolist() == [1]
    b.send(chunks_of(2, [4, 5], max_out=1))      # round robin: worker 2; then 3 goes to worker 1
    b.send(chunks_of(3, [6, 7], max_out=1))
    b.router.poll()
    b.router.set_up(1, False)                    # request 1's replay dies too
    b.run(k=2)
    got = {int(r["request_id"]): int(r["status"]) for r in b.responses}
    assert got == {1: 503, 2: 200, 3: 200}, got
    (refused,) = [r for r in b.responses if r["status"] == 503]
    assert refusal(refused) == ("the request's worker died or stopped answering, and so did the one it was run "
                                "again on: not tried a third time"), "said (it had no body)"
    st = b.router.stats()
    assert st["replay_refused"] == 1 and st["replayed"] == 1 and st["active_requests"] == 0   # 3 only moved


def test_a_request_whose_worker_dies_with_no_other_up_is_answered_503_saying_so(bench_factory):
    """A failover with nowhere to go: the client is told its worker died (before, a bare 503)."""
    b = bench_factory(n_workers=1)
    b.send(chunks_of(1, [1, 2, 3], max_out=2))
    b.router.poll()
    assert b.workers[0].recv_batch(0)["request_id"].tolist() == [1]
    b.router.set_up(0, False)
    b.router.poll()
    b.collect()
    (r,) = b.responses
    assert r["status"] == 503 and r["n_out"] == 0
    assert refusal(r) == ("the request's worker died or stopped answering, and no other worker is up to run it "
                          "again")


def _replay_flagged(batch):
    return [bool(f & records.CHUNK_F_REPLAY) + 2 * bool(f & records.CHUNK_F_RETAKE) for f in batch["flags"]]


def test_a_retry_of_a_request_lost_with_its_worker_goes_as_that_try_s_replay(bench_factory):
    """The only worker dies holding request 1 (it may have put the turn before dying): answered 503.
    The client's retry under the same ids, sent later, was a new request and ran on top of that
    turn: the prompt twice in the context, a 200 with other tokens, every later turn of the session
    off (a review's probe). Now it goes to its worker as the lost try's replay, under that try's
    stamp and flagged REPLAY, so the worker takes the turn back out of the store first; the answer
    carries the retry's own stamp. Once: a request after it is plain. The 503 counts in no_worker."""
    b = bench_factory(n_workers=1)
    b.send(chunks_of(1, [1, 2, 3], session=5, max_out=2, t_send=1000))
    b.router.poll()
    assert b.workers[0].recv_batch(0)["request_id"].tolist() == [1]
    b.router.set_up(0, False)
    b.router.poll()
    b.collect()
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses] == [(1, 503)]
    st = b.router.stats()
    assert st["lost_tries"] == 1 and st["no_worker"] == 1
    b.workers[0].recv_batch(0)                    # (what the dead worker left in its lane)
    b.router.set_up(0, True)
    b.send(chunks_of(1, [1, 2, 3], session=5, max_out=2, t_send=900))    # a straggler, not a retry
    b.send(chunks_of(1, [1, 2, 3], session=5, max_out=2, t_send=3000))   # the retry
    (retry, *decodes) = b.run()
    assert retry["t_send"].tolist() == [1000] and _replay_flagged(retry) == [3], "REPLAY and RETAKE"
    assert decodes and not any(d["flags"] & records.CHUNK_F_RETAKE for d in decodes), "RETAKE on its first record only"
    assert [(int(r["request_id"]), int(r["status"]), int(r["t_send"])) for r in b.responses[1:]] == [(1, 200, 3000)]
    b.send(chunks_of(2, [4, 5], session=5, max_out=1, t_send=4000))
    (nxt,) = b.run()
    assert nxt["t_send"].tolist() == [4000] and _replay_flagged(nxt) == [0]
    st = b.router.stats()
    assert st["lost_retaken"] == 1 and st["late_duplicates"] == 1 and st["lost_tries"] == 1


def test_a_retry_of_a_request_whose_replay_died_too_goes_as_its_replay(bench_factory):
    """Request 1's worker dies, its replay's worker dies too (after putting the turn, maybe): 503,
    not tried a third time. The client's retry goes as that request's replay (its first stamp,
    flagged), whatever worker it lands on: there the turn is taken back, not run on top of."""
    b = bench_factory(n_workers=2, policy="round_robin")
    b.send(chunks_of(1, list(range(300)), session=5, max_out=2, t_send=1000))
    b.router.poll()
    assert b.workers[0].recv_batch(0)["request_id"].tolist() == [1, 1, 1]
    b.router.set_up(0, False)
    b.router.poll()
    replay = b.workers[1].recv_batch(0)
    assert replay["t_send"].tolist() == [1000] * 3 and _replay_flagged(replay) == [1, 1, 1]
    b.router.set_up(1, False)
    b.router.poll()
    b.collect()
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses] == [(1, 503)]
    for k in (0, 1):
        b.workers[k].recv_batch(0)
    b.router.set_up(1, True)
    b.send(chunks_of(1, list(range(300)), session=5, max_out=2, t_send=2000))
    (retry, *_) = b.run(k=1)
    assert retry["t_send"].tolist() == [1000] * 3 and _replay_flagged(retry) == [3, 1, 1], "RETAKE on the first"
    assert [(int(r["status"]), int(r["t_send"])) for r in b.responses[1:]] == [(200, 2000)]
    assert b.router.stats()["lost_retaken"] == 1


def test_a_record_a_worker_s_completion_leaves_out_fails_its_request_saying_so(bench_factory):
    """A completion of fewer entries than its batch's records: the rest are refused 503 (never taken
    as answered), with a body naming the worker's fault."""
    b = bench_factory(n_workers=1)
    b.send(chunks_of(1, [1], max_out=1), chunks_of(2, [2], max_out=1))
    b.router.poll()
    batch = b.workers[0].recv_batch(0)
    assert batch["request_id"].tolist() == [1, 2]
    comp = lanes.completion_for(batch, [7, 7])
    comp["n"] = 1                                # the worker answered request 1 only
    b.workers[0].send_completion(comp)
    b.run()
    got = {int(r["request_id"]): r for r in b.responses}
    assert got[1]["status"] == 200 and got[2]["status"] == 503
    assert refusal(got[2]) == "the worker's completion did not answer this request (a fault of the worker)"


def test_a_request_a_dead_worker_never_had_moves_on_at_every_death(bench_factory):
    """Only a request the dead worker had some of replays once: one that waited in its queue, none
    of it sent, had no part in the death and moves on again at the next one (it was answered 503,
    its move taken for a replay). Here workers 0 and 1 die holding batches; the requests queued
    behind theirs (4 on worker 0, then 1 and 4 moved to 1 and 2) all end on 2."""
    b = bench_factory(n_workers=3, policy="round_robin")
    for rid in (1, 2, 3, 4):                     # 1, 2, 3 sent to workers 0, 1, 2; 4 queued on 0
        b.send(chunks_of(rid, [rid, rid + 1], max_out=1))
        b.router.poll()
    assert [b.workers[k].recv_batch(0)["request_id"].tolist() for k in range(2)] == [[1], [2]]
    b.router.set_up(0, False)                    # 1 replays, 4 moves: one queued on 1, one on 2
    b.router.poll()
    b.router.set_up(1, False)                    # 2 replays; whichever of 1 and 4 waited on 1 moves on
    b.run(k=2)
    got = {int(r["request_id"]): int(r["status"]) for r in b.responses}
    assert got == {1: 200, 2: 200, 3: 200, 4: 200}, got
    st = b.router.stats()
    assert st["replay_refused"] == 0 and st["replayed"] == 2 and st["active_requests"] == 0   # 1 and 2


def test_a_new_request_with_no_worker_up_is_counted_as_such_not_as_a_full_table(bench_factory):
    b = bench_factory(n_workers=1)
    b.router.set_up(0, False)
    b.send(chunks_of(1, [1, 2, 3], max_out=2))
    b.router.poll()
    b.collect()
    assert [int(r["status"]) for r in b.responses] == [503]
    assert refusal(b.responses[0]) == "no worker is up to take the request", "said (it had no body)"
    st = b.router.stats()
    assert st["no_worker"] == 1 and st["table_full"] == 0 and st["bad_picks"] == 0
    close = chunks_of(2, [], session=5)
    close["kind"], close["n_tokens"] = wire.KIND_CLOSE, 0
    b.send(close)
    b.router.poll()
    b.collect()
    assert [int(r["status"]) for r in b.responses] == [503, 503] and refusal(b.responses[1]) == refusal(b.responses[0])


def bring_back(b, k):
    """Worker k's replacement: a fresh lane (the old one may hold a batch replayed since), then up."""
    name = f"{b.lanes[k]}.r{next(_seq)}"
    b.lanes.append(name)
    for ring in b.router.replace_lane(k, *lanes.create_shm_lane(name)):
        ring.close()
    b.workers[k].close()
    b.workers[k] = lanes.ShmWorkerLane(name)
    b.router.set_up(k, True)


def close_of(rid, session):
    close = chunks_of(rid, [], session=session)
    close["kind"], close["n_tokens"] = wire.KIND_CLOSE, 0
    return close


def poll_until(b, done, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
        b.router.poll()
        b.collect()


def test_while_a_worker_is_coming_what_none_is_up_to_take_waits_for_it_not_503(bench_factory):
    """A spawner's death takes every worker: each request of the ~150 ms until its heir's were up,
    and each the dead ones held, was answered 503 (bench e2e scenario 6). With the control plane's
    word that a worker is coming (hold), they wait and run on it: two in flight, replayed from
    their first tokens; one held behind one of them in its session; new ones, one of two chunks
    whose second comes while it waits; a CLOSE, held behind its session's request."""
    b = bench_factory(n_workers=1, token_budget=100, split_slack=0)
    toks = {1: list(range(1000, 1300)), 2: [7, 8, 9], 3: [4, 5], 4: list(range(200)), 6: [11, 12]}
    b.send(chunks_of(1, toks[1], session=1, max_out=2), chunks_of(2, toks[2], session=2, max_out=1),
           chunks_of(6, toks[6], session=1, max_out=1))
    b.router.poll()
    ran = set(b.workers[0].recv_batch(0)["request_id"].tolist())     # 1's first 50 tokens, 2; 6 held
    assert ran == {1, 2}
    b.router.hold(60)
    b.router.set_up(0, False)
    four = chunks_of(4, toks[4], max_out=1)
    b.send(chunks_of(3, toks[3], max_out=1), four[[0]], close_of(5, session=2))
    b.router.poll()
    b.send(four[[1]])
    b.router.poll()
    b.collect()
    st = b.router.stats()
    assert b.responses == [] and st["waiting_for_worker"] == st["waited_for_worker"] == 6
    assert st["no_worker"] == 0 and st["replayed"] == 0
    bring_back(b, 0)
    assert b.router.stats()["waiting_for_worker"] == 0
    batches = b.run(k=0)
    got = {int(r["request_id"]): (int(r["status"]), int(r["n_out"])) for r in b.responses}
    assert got == {1: (200, 2), 2: (200, 1), 3: (200, 1), 4: (200, 1), 5: (200, 0), 6: (200, 1)}, got
    seen = prefill_seen(batches)
    assert seen[1] == toks[1], "replayed from its first token"
    assert seen[4] == toks[4] and seen[6] == toks[6]
    with_ = lambda rid: [i for i, x in enumerate(batches) if rid in x["request_id"].tolist()]
    assert max(with_(1)) < min(with_(6)) and max(with_(2)) < min(with_(5)), "each after its session's earlier one"
    st = b.router.stats()
    assert st["replayed"] == 2 and st["no_worker"] == 0 and st["waited_for_worker"] == 6
    assert st["active_requests"] == 0 and st["pool_free"] == 8192
    assert b.router.worker_stats(0)["depth"] == 0 and b.router.worker_stats(0)["queued_tokens"] == 0


def test_what_waits_for_a_worker_is_answered_503_once_the_hold_ends(bench_factory):
    """A hold is bounded: what still waits when it ends is answered 503 saying why, as it was at
    once before; a hold of 0 ends one at once; a request whose chunks stop coming while it waits
    still expires 400; none of it holds anything after."""
    b = bench_factory(n_workers=1, reassembly_timeout_s=0.05)
    b.send(chunks_of(1, [1, 2, 3], max_out=2))
    b.router.poll()
    assert b.workers[0].recv_batch(0)["request_id"].tolist() == [1]
    b.router.hold(0.3)
    b.router.set_up(0, False)
    b.send(chunks_of(2, [4, 5], max_out=1), chunks_of(3, list(range(200)), max_out=1)[[0]])
    b.router.poll()
    b.collect()
    assert b.responses == [] and b.router.stats()["waiting_for_worker"] == 3
    poll_until(b, lambda: len(b.responses) == 3)
    got = {int(r["request_id"]): (int(r["status"]), refusal(r)) for r in b.responses}
    assert got == {1: (503, "the request's worker died or stopped answering, and no other worker is up to "
                            "run it again"),
                   2: (503, "no worker is up to take the request"),
                   3: (400, "chunks missing after the reassembly timeout")}, got
    assert [int(r["request_id"]) for r in b.responses][0] == 3, "3 expired first, while it waited"
    st = b.router.stats()
    assert st["no_worker"] == 2 and st["expired"] == 1 and st["waiting_for_worker"] == 0
    b.router.hold(60)
    b.send(chunks_of(4, [6], max_out=1))
    b.router.poll()
    b.collect()
    assert len(b.responses) == 3 and b.router.stats()["waiting_for_worker"] == 1
    b.router.hold(0)
    b.collect()
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses[3:]] == [(4, 503)]
    st = b.router.stats()
    assert st["waiting_for_worker"] == 0 and st["waited_for_worker"] == 4 and st["active_requests"] == 0
    assert st["pool_free"] == 8192 and b.router.worker_stats(0)["depth"] == 0
    for bad in (-1, float("nan"), 1e12):
        with pytest.raises(ValueError, match="hold_s must be"):
            b.router.hold(bad)
    b.router.hold(60)
    b.router.hold(0.01)                          # a shorter hold keeps the later end
    time.sleep(0.05)
    b.send(chunks_of(5, [7], max_out=1))
    b.router.poll()
    assert b.router.stats()["waiting_for_worker"] == 1
    b.router.hold(0)
    b.collect()
    assert b.router.stats()["waiting_for_worker"] == 0 and int(b.responses[-1]["status"]) == 503


def test_workers_gone_at_once_are_all_down_before_any_one_s_requests_move(bench_factory):
    """The spawner's death takes every worker: marked down one by one, a request the first held
    moved onto the next, dead too but not yet down, went out in its lane, and was answered 503 at
    that one's death (its replay's worker died too: session 43's first run of the heir test). All
    down at once, both wait for the worker coming; a worker listed twice or out of range is
    handled."""
    b = bench_factory(n_workers=2, policy="round_robin")
    b.send(chunks_of(1, [1, 2], max_out=1), chunks_of(2, [3, 4], max_out=1))
    b.router.poll()
    assert [b.workers[k].recv_batch(0)["request_id"].tolist() for k in (0, 1)] == [[1], [2]]
    with pytest.raises(ValueError, match="invalid argument"):
        b.router.set_down([0, 2])
    assert b.router.worker_stats(0)["up"] == 1, "refused whole"
    b.router.hold(60)
    b.router.set_down([0, 1, 0])
    b.router.poll()
    st = b.router.stats()
    assert st["waiting_for_worker"] == 2 and st["replay_refused"] == 0 and st["replayed"] == 0
    bring_back(b, 1)
    b.run(k=1)
    assert {int(r["request_id"]): int(r["status"]) for r in b.responses} == {1: 200, 2: 200}
    st = b.router.stats()
    assert st["replayed"] == 2 and st["active_requests"] == 0 and st["pool_free"] == 8192


def test_a_request_that_waits_waits_as_a_prefill_and_is_counted_once(bench_factory):
    """Found by review: one parked while decoding kept its decode state, and a malformed chunk of it
    then took a decode step's depth off its down worker, whose depth the failover had zeroed: it
    wrapped to 2^32 - 1, and that worker's pool read as full from then on. And one that waited
    twice (its worker died again in the hold) was counted twice in waited_for_worker."""
    b = bench_factory(n_workers=1)
    b.send(chunks_of(1, [1, 2, 3], max_out=5))
    b.step(0)
    b.step(0)                                    # prefilled: decoding
    assert b.router.worker_stats(0)["decoding"] == 1
    b.router.hold(60)
    b.router.set_up(0, False)
    bad = chunks_of(1, [9], max_out=5)
    bad["n_tokens"] = 0                          # malformed: its request fails 400
    b.send(bad)
    b.router.poll()
    b.collect()
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses] == [(1, 400)]
    assert b.router.worker_stats(0)["depth"] == 0 and b.router.worker_stats(0)["queued_tokens"] == 0
    b.send(chunks_of(2, [4, 5], max_out=1))
    b.router.poll()
    bring_back(b, 0)
    b.router.poll()                              # 2 placed, in the new lane
    b.router.set_up(0, False)                    # and its worker dies again within the hold
    bring_back(b, 0)
    b.run(k=0)
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses] == [(1, 400), (2, 200)]
    st = b.router.stats()
    assert st["waited_for_worker"] == 2 and st["active_requests"] == 0, st
    assert b.router.worker_stats(0)["depth"] == 0 and b.router.pool_stats(0)["depth"] == 0


def test_a_worker_added_while_requests_wait_takes_them(bench_factory):
    """Found by review: only set_up placed what waited; a worker added (an operator replacing a
    zmq worker) left it waiting out the hold while later requests ran."""
    b = bench_factory(n_workers=1)
    b.router.hold(60)
    b.router.set_up(0, False)
    b.send(chunks_of(1, [1, 2], max_out=1))
    b.router.poll()
    assert b.router.stats()["waiting_for_worker"] == 1
    name = f"{b.lanes[0]}.added"
    b.lanes.append(name)
    assert b.router.add_worker(*lanes.create_shm_lane(name)) == 1
    b.workers.append(lanes.ShmWorkerLane(name))
    assert b.router.stats()["waiting_for_worker"] == 0
    b.run(k=1)
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses] == [(1, 200)]


def test_a_new_request_that_waited_gets_no_moved_session_entry_on_a_store_less_worker(bench_factory):
    """A failover's replay onto a store-less worker is remembered there (kv_homes); a new request
    placed after a wait is not a replay, and admission makes no entry for one (found by review:
    4,200 that waited left the table full, and KV-full refusals were then answered 503)."""
    b = bench_factory(n_workers=1)
    b.router.set_worker_store(0, False)
    b.router.hold(60)
    b.router.set_up(0, False)
    for rid in range(10, 15):
        b.send(chunks_of(rid, [rid], max_out=1))
    b.router.poll()
    bring_back(b, 0)
    b.run(k=0)
    assert sorted(int(r["status"]) for r in b.responses) == [200] * 5
    assert b.router.stats()["kv_homes"] == 0


def test_a_hold_changes_nothing_while_a_worker_is_up(bench_factory):
    """With one worker of two up, the dead one's requests move to it at once, hold or not."""
    b = bench_factory(n_workers=2, policy="round_robin")
    b.send(chunks_of(1, [1, 2], max_out=1), chunks_of(2, [3, 4], max_out=1))
    b.router.poll()
    b.router.hold(60)
    b.router.set_up(0, False)
    assert b.router.stats()["waiting_for_worker"] == 0
    b.run(k=1)
    assert {int(r["request_id"]): int(r["status"]) for r in b.responses} == {1: 200, 2: 200}
    assert b.router.stats()["waited_for_worker"] == 0


def test_a_parameter_for_a_policy_that_reads_none_is_refused():
    assert policy_params()["affinity"].startswith("load bound") and policy_params()["round_robin"] is None
    with pytest.raises(ValueError, match="takes no parameter"):
        Router(policy="round_robin", policy_param=3)
    with Router(policy="affinity", policy_param=0.1) as rt:
        with pytest.raises(ValueError, match="takes no parameter"):
            rt.set_policy("round_robin", 3)
        assert lib.dp_router_set_policy(rt._rt, b"round_robin", 3.0) < 0, "C refuses it too"
        rt.set_policy("affinity", 0.2)


@pytest.mark.parametrize("param", [float("nan"), float("inf"), -1.0])
def test_a_policy_parameter_that_is_not_a_finite_number_at_least_0_is_refused(param):
    """NaN passed the C side's `param <= 0` default test and made affinity's load cap NaN, its
    bound off (a worker 100 chunks deep took 556 of 2,000 sessions); -1 read as the default."""
    with pytest.raises(ValueError, match="finite number >= 0"):
        Router(policy="affinity", policy_param=param)
    with Router(policy="affinity", policy_param=0.1) as rt:
        assert lib.dp_router_set_policy(rt._rt, b"affinity", param) < 0, "C refuses it too"


def until_stalled(b, k, timeout_s=10.0):
    """Poll passes (the router looks for stalls every 64) until worker k is stalled."""
    deadline = time.monotonic() + timeout_s
    while not b.router.worker_stats(k)["stalled"]:
        assert time.monotonic() < deadline, b.router.worker_stats(k)
        for _ in range(64):
            b.router.poll()
        time.sleep(0.005)


def answer(b, k, batch):
    assert b.workers[k].send_completion(lanes.completion_for(batch, [7] * len(batch), worker=k))
    b.router.poll()
    b.collect()


def test_a_worker_whose_batch_goes_unanswered_is_stalled_and_new_requests_go_to_the_others(bench_factory):
    """A worker alive but stopped (a SIGSTOP, a host that stopped scheduling it) drew its share of
    new requests until the control plane's hang kill, 30 s on (a review's probe: every new request
    waited 31 s). One whose batch has gone unanswered stall_s is now stalled: placed on no more
    while another worker is up, it keeps what it holds (nothing replayed), and its answer ends
    the stall."""
    b = bench_factory(n_workers=2, policy="round_robin", stall_s=0.2)
    b.send(chunks_of(1, [1, 2, 3], max_out=1))
    b.router.poll()
    held = b.workers[0].recv_batch(0)                 # worker 0 takes it and says nothing
    assert held["request_id"].tolist() == [1]
    b.send(chunks_of(2, [1, 2, 3], max_out=1), chunks_of(3, [1, 2, 3], max_out=1))
    b.router.poll()                                   # 2 on worker 1; 3 queued on worker 0 behind its batch
    assert b.router.worker_stats(0)["depth"] == 2 and b.router.worker_stats(1)["depth"] == 1
    b.step(1)                                         # worker 1 answers 2 (else it would be stalled too)
    until_stalled(b, 0)                               # 3, none of it in worker 0's lane, moves to worker 1
    assert b.router.worker_stats(0)["up"] == 1 and b.router.worker_stats(0)["depth"] == 1
    st = b.router.stats()
    assert st["stalls"] == 1 and st["stall_moved"] == 1 and st["replayed"] == 0
    for rid in range(4, 8):
        b.send(chunks_of(rid, [1, 2, 3], max_out=1))
    b.run(1)
    assert sorted((int(r["request_id"]), int(r["worker"])) for r in b.responses) == [(rid, 1) for rid in range(2, 8)]
    assert b.router.worker_stats(0)["placed"] == 2 and b.router.stats()["replayed"] == 0
    answer(b, 0, held)                                # it wakes: its answer counts, and it is placed on again
    assert [(int(r["request_id"]), int(r["status"]), int(r["worker"])) for r in b.responses[6:]] == [(1, 200, 0)]
    assert b.router.worker_stats(0)["stalled"] == 0 and b.router.stats()["stalls"] == 1
    for rid in range(8, 12):
        b.send(chunks_of(rid, [1, 2, 3], max_out=1))
    b.router.poll()
    assert sorted(b.workers[0].recv_batch(0)["request_id"].tolist() + b.workers[1].recv_batch(0)["request_id"].tolist()) \
        == [8, 9, 10, 11]
    assert b.router.worker_stats(0)["placed"] >= 2


def test_a_stalled_worker_s_queued_session_moves_whole_and_in_order(bench_factory):
    """A request queued on the stalled worker moves with the requests of its session held behind
    it, which run after it on the worker it went to; one that is not hidden (known to have no
    store: its sessions could not be restored elsewhere) keeps drawing requests."""
    b = bench_factory(n_workers=2, policy="weighted", stall_s=0.2)
    b.router.set_weight(1, 0)                         # everything to worker 0 for now
    b.send(chunks_of(1, [1, 2, 3], max_out=1))
    b.router.poll()
    held = b.workers[0].recv_batch(0)
    b.send(chunks_of(3, [1, 2, 3], session=30, max_out=1), chunks_of(4, [4, 5], session=30, max_out=1))
    b.router.poll()
    assert b.router.worker_stats(0)["depth"] == 3 and b.router.stats()["held"] == 1
    b.router.set_weight(1, 1)
    until_stalled(b, 0)
    assert b.router.stats()["stall_moved"] == 2 and b.router.worker_stats(1)["depth"] == 2
    seen = b.run(1)
    assert [r["request_id"].tolist() for r in seen] == [[3], [4]], "the session's order kept"
    assert [int(r["worker"]) for r in b.responses] == [1, 1]
    answer(b, 0, held)

    b.no_store.add(0)                                 # worker 0's answers now say it has no store
    b.router.set_weight(1, 0)
    b.send(chunks_of(5, [1, 2, 3], max_out=1))
    b.run(0)
    b.send(chunks_of(6, [1, 2, 3], max_out=1))
    b.router.poll()
    held = b.workers[0].recv_batch(0)
    assert held is not None and held["request_id"].tolist() == [6]
    until_stalled(b, 0)
    b.router.set_weight(1, 1)
    b.send(*(chunks_of(rid, [1, 2, 3], max_out=1) for rid in range(7, 11)))
    b.router.poll()
    assert b.router.worker_stats(0)["depth"] > 1, "not hidden: it still takes its share"
    assert b.router.stats()["stall_moved"] == 2


def test_with_every_worker_stalled_a_new_request_waits_for_one_not_refused(bench_factory):
    """A stall keeps a worker from new requests only while another is up and not stalled: with none,
    a 503 would be worse than a wait."""
    b = bench_factory(n_workers=1, stall_s=0.1)
    b.send(chunks_of(1, [1, 2, 3], max_out=1))
    b.router.poll()
    held = b.workers[0].recv_batch(0)
    until_stalled(b, 0)
    b.send(chunks_of(2, [1, 2, 3], max_out=1))
    b.router.poll()
    assert b.router.stats()["no_worker"] == 0 and b.responses == []
    answer(b, 0, held)
    b.run(0)
    assert sorted((int(r["request_id"]), int(r["status"])) for r in b.responses) == [(1, 200), (2, 200)]


def test_a_worker_stalled_while_every_worker_was_is_hidden_once_another_answers(bench_factory):
    """With both workers stalled neither is hidden and nothing moves; once one answers, the other,
    still stalled, is hidden, and what is queued for it moves then."""
    b = bench_factory(n_workers=2, policy="round_robin", stall_s=0.1)
    b.send(chunks_of(1, [1, 2, 3], max_out=1), chunks_of(2, [1, 2, 3], max_out=1))
    b.router.poll()
    held = [b.workers[k].recv_batch(0) for k in (0, 1)]
    b.send(chunks_of(3, [1, 2, 3], max_out=1), chunks_of(4, [1, 2, 3], max_out=1))
    b.router.poll()                                   # 3 queued on worker 0, 4 on worker 1
    until_stalled(b, 0)
    until_stalled(b, 1)
    assert b.router.stats()["stall_moved"] == 0
    answer(b, 1, held[1])                             # worker 1 answers 2: worker 0 is hidden, 3 moves
    assert b.router.stats()["stall_moved"] == 1 and b.router.worker_stats(0)["depth"] == 1
    b.run(1)
    assert sorted((int(r["request_id"]), int(r["worker"])) for r in b.responses) == [(2, 1), (3, 1), (4, 1)]
    answer(b, 0, held[0])
    assert b.router.worker_stats(0)["stalled"] == 0 and len(b.responses) == 4


def test_a_request_let_go_on_a_stalled_worker_after_the_stall_moves_then(bench_factory):
    """A request held behind its session's request on another worker, let go once the stall was
    found, joined the stalled worker's queue and waited for it while the other worker idled
    (review). It is placed again as it is let go."""
    b = bench_factory(n_workers=2, policy="round_robin", stall_s=0.2)
    b.send(chunks_of(1, [1, 2, 3], max_out=1))
    b.router.poll()
    held = b.workers[0].recv_batch(0)
    b.send(chunks_of(10, [1, 2, 3], session=5, max_out=1), chunks_of(11, [4, 5], session=5, max_out=1))
    b.router.poll()                                   # 10 on worker 1, 11 held behind it on worker 0
    first = b.workers[1].recv_batch(0)
    assert first["request_id"].tolist() == [10] and b.router.stats()["held"] == 1
    until_stalled(b, 0)
    assert b.router.stats()["stall_moved"] == 0, "held: it waits for 10 wherever it is"
    answer(b, 1, first)                               # 10 answered: 11 let go, and placed again
    assert b.router.stats()["stall_moved"] == 1
    b.run(1)
    assert [(int(r["request_id"]), int(r["worker"])) for r in b.responses] == [(10, 1), (11, 1)]
    answer(b, 0, held)


def test_a_worker_stalled_alone_is_hidden_once_another_comes_up_and_its_queue_moves(bench_factory):
    """The only worker up, stalled, is not hidden: new requests queue on it. One coming up (a
    replacement, a revived zmq worker, one added) hides it, and what is queued there moves: before,
    it waited for the stalled worker while the new one idled (review)."""
    b = bench_factory(n_workers=2, policy="round_robin", stall_s=0.2)
    b.router.set_up(1, False)
    b.send(chunks_of(1, [1, 2, 3], max_out=1))
    b.router.poll()
    held = b.workers[0].recv_batch(0)
    until_stalled(b, 0)
    b.send(chunks_of(2, [1, 2, 3], max_out=1), chunks_of(3, [1, 2, 3], max_out=1))
    b.router.poll()
    assert b.router.worker_stats(0)["depth"] == 3 and b.router.stats()["stall_moved"] == 0
    b.router.set_up(1, True)
    assert b.router.stats()["stall_moved"] == 2
    b.run(1)
    assert sorted((int(r["request_id"]), int(r["worker"])) for r in b.responses) == [(2, 1), (3, 1)]
    answer(b, 0, held)


@pytest.mark.parametrize("pool", [7, -1, 1.5, True])
def test_a_worker_added_to_a_pool_that_cannot_be_is_not_added(pool):
    """The worker was added, then its pool refused: the caller saw an error, and the router served
    requests on that worker in pool 0 (found by review). Now refused before anything is added."""
    tag = f"zl-pool-{os.getpid()}"
    lane, done = lanes.create_shm_lane(tag)
    r = Router()
    try:
        with pytest.raises(ValueError, match="pool must be 0..3"):
            r.add_worker(lane, done, pool=pool)
        with pytest.raises(ValueError, match="pool must be 0..3"):
            r.add_zmq_worker(f"ipc://{tempfile.gettempdir()}/zl-pool-nobody", pool=pool)
        assert r.n_workers == 0 and r.pool_stats(0)["workers"] == 0
    finally:
        r.close()
        lane.close(), done.close()
        lanes.unlink_shm_lane(tag)


def test_a_stalled_worker_s_queue_takes_no_room_from_its_pool(bench_factory):
    """A pool has room while the depth of its workers up is under room x those workers: counted whole,
    a stalled worker's two chunks filled a pool of room 2 a worker, and every new request went to
    the dearer pool past the cheap one's idle worker (review)."""
    b = bench_factory(n_workers=3, policy="round_robin", stall_s=0.2)
    b.router.set_pool(0, 100, 2)                      # workers 0 and 1
    b.router.set_pool(1, 900, 0)                      # worker 2
    b.router.set_worker_pool(2, 1)
    b.router.set_up(1, False)
    b.send(chunks_of(1, [1, 2, 3], max_out=1), chunks_of(2, [1, 2, 3], max_out=1))
    b.router.poll()
    held = b.workers[0].recv_batch(0)
    assert held["request_id"].tolist() == [1, 2]
    b.router.set_up(1, True)
    until_stalled(b, 0)
    for rid in range(3, 9):
        b.send(chunks_of(rid, [1, 2, 3], max_out=1))
        b.router.poll()
        b.step(1)
        b.step(2)
    assert {int(r["worker"]) for r in b.responses} == {1}, "the cheap pool's idle worker, not the dear pool"
    answer(b, 0, held)


def test_a_stalled_worker_s_queue_does_not_loosen_affinity_s_load_bound_for_the_others(bench_factory):
    """A pool's view counts only its up workers' depth in its totals: counted, a hidden worker's
    32-chunk batch raised affinity's mean, and its bound (1.25 x the mean + 1) let one worker
    take every new session that hashed to it (21 chunks) while the other stood idle."""
    probe = bench_factory(n_workers=3, policy="affinity")
    probe.router.set_up(0, False)
    to_1 = []                                         # sessions that, unloaded, go to worker 1 of {1, 2}
    for sid in range(1000, 1200):
        probe.send(chunks_of(sid, [1, 2, 3], max_out=1, session=sid))
        probe.router.poll()
        if probe.step(1) is not None:
            to_1.append(sid)
        probe.step(2)
    assert len(to_1) >= 12
    b = bench_factory(n_workers=3, policy="affinity", stall_s=0.2)
    b.router.set_up(1, False)
    b.router.set_up(2, False)
    b.send(*[chunks_of(rid, [1, 2, 3], max_out=1) for rid in range(1, 33)])
    b.router.poll()
    held = b.workers[0].recv_batch(0)                 # 32 chunks, held: worker 0 says nothing
    assert len(held) == 32
    b.router.set_up(1, True)
    b.router.set_up(2, True)
    until_stalled(b, 0)
    assert b.router.worker_stats(0)["depth"] == 32 and b.router.pool_stats(0)["depth"] == 0
    for sid in to_1[:12]:
        b.send(chunks_of(sid, [1, 2, 3], max_out=1, session=sid))
    b.router.poll()
    depth = [b.router.worker_stats(k)["depth"] for k in (1, 2)]
    assert b.router.pool_stats(0)["depth"] == 12
    assert depth[0] <= 1.25 * 6 + 1 and depth[1] >= 4, depth     # 8 and 4 (12 and 0 counting worker 0)
    answer(b, 0, held)


def test_a_stop_lengthens_the_patience_a_little_and_a_replacement_starts_afresh(bench_factory):
    """A stalled batch's time is learnt only up to the wait it was found stalled at: learnt whole, a
    stop of 7.5 s put the next stall past the 30 s hang kill for dozens of answers, and a dead
    worker's replacement inherited it (review)."""
    b = bench_factory(n_workers=2, stall_s=0.1)
    b.router.set_up(1, False)                         # everything on worker 0

    def stalled_after(rid):
        b.send(chunks_of(rid, [1, 2, 3], max_out=1))
        b.router.poll()
        batch = b.workers[0].recv_batch(0)
        t0 = time.monotonic()
        until_stalled(b, 0)
        return batch, time.monotonic() - t0
    batch, _ = stalled_after(1)
    time.sleep(1.0)                                   # a 1.1 s stop, learnt as 0.1 s
    answer(b, 0, batch)
    batch, waited = stalled_after(2)
    assert waited < 0.9, "4 x 0.1 s learnt, not 4 x 1.1 s"
    time.sleep(0.5)
    answer(b, 0, batch)                               # learnt as 0.4 s: the next 1.6 s
    b.router.set_up(0, False)                         # it dies; its replacement comes up
    b.router.set_up(0, True)
    batch, waited = stalled_after(3)
    assert waited < 0.9, "the replacement's own patience: stall_s, not the dead worker's 1.6 s"
    answer(b, 0, batch)


def test_a_stalled_worker_s_queue_does_not_move_to_a_worker_known_to_have_no_store(bench_factory):
    """The session would begin again there without its turns (review): it waits for its worker."""
    b = bench_factory(n_workers=2, policy="weighted", stall_s=0.2)
    b.router.set_worker_store(1, False)
    b.router.set_weight(1, 0)
    b.send(chunks_of(1, [1, 2, 3], session=7, max_out=1))
    b.router.poll()
    held = b.workers[0].recv_batch(0)
    b.send(chunks_of(2, [4, 5], session=8, max_out=1))
    b.router.poll()                                   # queued on worker 0
    b.router.set_weight(1, 1)
    until_stalled(b, 0)
    assert b.router.stats()["stall_moved"] == 0 and b.workers[1].recv_batch(0) is None
    assert b.router.pool_stats(0)["requests"] == 2, "a pick not taken is not counted"
    answer(b, 0, held)
    b.run(0)
    assert sorted((int(r["request_id"]), int(r["worker"])) for r in b.responses) == [(1, 0), (2, 0)]


@pytest.mark.parametrize("follower", ["request", "close"])
def test_a_request_let_go_on_a_stalled_worker_takes_its_session_s_held_requests_with_it(bench_factory, follower):
    """Moved alone as it was let go, a request left the requests of its session held behind it on the
    stalled worker: a later turn ran there on its stale copy, unflagged, and a CLOSE waited for it
    while the other idled, then freed a copy that was not the session's (review)."""
    b = bench_factory(n_workers=2, policy="weighted", stall_s=0.2)

    def weights(*w):
        for k, x in enumerate(w):
            b.router.set_weight(k, x)
    weights(1, 0)
    b.send(chunks_of(1, [1, 2, 3], session=1, max_out=1))
    b.router.poll()
    held = b.workers[0].recv_batch(0)                 # worker 0 takes it and stops
    weights(0, 1)
    ten = chunks_of(10, list(range(1, 200)), session=5, max_out=1)   # two chunks: the second comes later
    b.send(ten[:1])
    b.router.poll()
    b.step(1)                                         # 10's first chunk runs on worker 1
    weights(1, 0)
    b.send(chunks_of(11, [3, 4], session=5, max_out=1))   # held behind 10, on worker 0
    later = chunks_of(12, [5], session=5, max_out=1)
    if follower == "close":
        later["kind"], later["n_tokens"] = wire.KIND_CLOSE, 0
    b.send(later)                                     # held behind 11, on worker 0 too
    b.router.poll()
    weights(1, 1)
    until_stalled(b, 0)
    b.send(ten[1:])
    b.router.poll()
    b.step(1)                                         # 10 answered: 11 let go, moved, 12 with it
    assert b.router.stats()["stall_moved"] == 2 and b.router.worker_stats(0)["depth"] == 1, "what is in its lane"
    answer(b, 0, held)                                # worker 0 wakes before 11 is done
    b.run(1)
    b.run(0)
    assert sorted((int(r["request_id"]), int(r["worker"])) for r in b.responses) == [(1, 0), (10, 1), (11, 1), (12, 1)]


def test_requests_of_a_session_left_behind_by_a_stall_move_ask_the_store_and_so_does_the_next(bench_factory):
    """A move names the session's latest request's worker as its last: it named the moved one's, and
    a new request placed there went unflagged although one of the session left behind on the stalled
    worker ran before it there, on another copy (review: a turn lost)."""
    b = bench_factory(n_workers=3, policy="weighted", stall_s=0.2)

    def weights(*w):
        for k, x in enumerate(w):
            b.router.set_weight(k, x)

    def flags_of(batch, rid):
        return [bool(r["flags"] & records.CHUNK_F_MOVED) for r in batch if int(r["request_id"]) == rid]
    weights(1, 0, 0)
    b.send(chunks_of(1, [1, 2, 3], session=1, max_out=1))
    b.router.poll()
    held = b.workers[0].recv_batch(0)                 # worker 0 takes it and stops
    b.send(chunks_of(10, [1, 2], session=5, max_out=1))    # queued on worker 0
    b.router.poll()
    weights(0, 1, 0)
    b.send(chunks_of(11, [3], session=5, max_out=1))       # held behind 10, on worker 1
    b.router.poll()
    weights(1, 0, 0)
    b.send(chunks_of(12, [4], session=5, max_out=1))       # held behind 11, on worker 0
    b.router.poll()
    weights(0, 0, 1)
    until_stalled(b, 0)                               # 10 moves to worker 2; 11 and 12 are not behind it on 0
    assert b.router.stats()["stall_moved"] == 1
    answer(b, 0, held)                                # worker 0 wakes
    b.send(chunks_of(13, [6], session=5, max_out=1))       # placed on worker 2, held behind 12
    b.router.poll()
    for k, rid in ((2, 10), (1, 11), (0, 12)):        # the session's turns where they were placed
        batch = b.workers[k].recv_batch(0)
        assert batch is not None and int(batch["request_id"][0]) == rid, (k, rid)
        if rid != 10:
            assert flags_of(batch, rid) == [True], f"{rid}: the request before it moved"
        answer(b, k, batch)
    batch = b.workers[2].recv_batch(0)
    assert flags_of(batch, 13) == [True], "12 ran on worker 0: 13 on worker 2 asks the store"
    answer(b, 2, batch)
    assert sorted(int(r["request_id"]) for r in b.responses) == [1, 10, 11, 12, 13]


def test_the_stall_threshold_changes_live_and_0_ends_every_stall(bench_factory):
    b = bench_factory(n_workers=2, policy="round_robin", stall_s=0)
    b.send(chunks_of(1, [1, 2, 3], max_out=1))
    b.router.poll()
    held = b.workers[0].recv_batch(0)
    time.sleep(0.15)
    for _ in range(128):
        b.router.poll()
    assert b.router.worker_stats(0)["stalled"] == 0, "0: never"
    b.router.set_stall(0.1)
    until_stalled(b, 0)
    b.router.set_stall(0)
    assert b.router.worker_stats(0)["stalled"] == 0
    b.send(chunks_of(2, [1, 2, 3], max_out=1), chunks_of(3, [1, 2, 3], max_out=1))
    b.router.poll()
    assert b.router.worker_stats(0)["placed"] == 2, "placed on again"
    with pytest.raises(ValueError):
        b.router.set_stall(-1)
    answer(b, 0, held)


def test_a_worker_whose_steps_are_long_is_stalled_once_then_waited_for(bench_factory):
    """What counts as a stall is the worker's own: 4x its recent longest batch when that is longer
    than stall_s, so a slow device is judged stalled on its first long batch, not on every one."""
    b = bench_factory(n_workers=1, stall_s=0.1)
    for rid, stalls in ((1, 1), (2, 1)):
        b.send(chunks_of(rid, [1, 2, 3], max_out=1))
        b.router.poll()
        batch = b.workers[0].recv_batch(0)
        deadline = time.monotonic() + 0.3                 # a 0.3 s step, the router polling all along
        while time.monotonic() < deadline:
            for _ in range(64):
                b.router.poll()
            time.sleep(0.002)
        assert b.router.stats()["stalls"] == stalls, "the first: nothing learnt yet; the second: 4 x 0.3 s allowed"
        answer(b, 0, batch)
    assert [int(r["status"]) for r in b.responses] == [200, 200] and b.router.worker_stats(0)["stalled"] == 0


def test_a_zmq_worker_that_never_answers_is_marked_down_and_its_request_replayed(bench_factory):
    """ZeroMQ does not resend a batch a broken connection held, and nothing watches a remote
    worker: before, it stayed busy for good and its requests were never answered."""
    b = bench_factory(n_workers=1, policy="round_robin", zmq_timeout_s=0.2)
    silent = lanes.ZmqWorkerLane("tcp://127.0.0.1:0")
    try:
        assert b.router.add_zmq_worker(silent.endpoint) == 1
        b.router.set_up(0, False)                # the request goes to the zmq worker
        b.send(chunks_of(1, [1, 2, 3], max_out=2))
        deadline = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < deadline:
            b.router.poll()
            got = silent.recv_batch(0.01)
        assert got is not None and got["request_id"].tolist() == [1]   # taken, never answered
        b.router.set_up(0, True)
        while b.router.stats()["zmq_timeouts"] == 0 and time.monotonic() < deadline:
            b.router.poll()
            time.sleep(0.01)
        b.run(0)
        assert [(int(r["request_id"]), int(r["status"]), int(r["worker"])) for r in b.responses] == [(1, 200, 0)]
        st = b.router.stats()
        assert st["zmq_timeouts"] == 1 and st["replayed"] == 1 and b.router.worker_stats(1)["up"] == 0
    finally:
        b.router.close()
        silent.close()


def test_a_zmq_worker_marked_down_comes_back_once_it_answers_the_router_s_probe(bench_factory):
    """A passing stall (or a dropped link) took a zmq worker out for good: nothing brought it back
    but the control plane. Now the router probes it; once its loop takes messages again, it
    answers, and it is up and takes batches. One the control plane marks down is not probed."""
    b = bench_factory(n_workers=1, policy="round_robin", zmq_timeout_s=0.2)
    lane = lanes.ZmqWorkerLane("tcp://127.0.0.1:0")
    deadline = time.monotonic() + 20

    def batch_taken():
        while time.monotonic() < deadline:
            b.router.poll()
            got = lane.recv_batch(0.01)
            if got is not None:
                return got
        raise AssertionError("no batch reached the zmq worker")

    def until(cond, worker_loop):
        while not cond() and time.monotonic() < deadline:
            b.router.poll()
            lane.recv_batch(0.01) if worker_loop else time.sleep(0.01)
        assert cond()

    try:
        assert b.router.add_zmq_worker(lane.endpoint) == 1
        b.router.set_up(0, False)                # the requests go to the zmq worker
        b.send(chunks_of(1, [1, 2, 3], max_out=2))
        assert batch_taken()["request_id"].tolist() == [1]
        b.router.set_up(0, True)
        until(lambda: b.router.stats()["zmq_timeouts"] == 1, worker_loop=False)   # it stalls
        assert b.router.worker_stats(1)["up"] == 0
        until(lambda: b.router.stats()["zmq_revived"] == 1, worker_loop=True)     # back in its loop
        assert b.router.worker_stats(1)["up"] == 1 and lane.probes >= 1
        b.run(0)                                 # request 1, replayed there at the timeout
        b.router.set_up(0, False)
        b.send(chunks_of(2, [4, 5], max_out=1))
        assert batch_taken()["request_id"].tolist() == [2]
        b.router.set_up(0, True)
        b.router.set_up(1, False)                # the control plane's word: no probes
        probes, t_end = lane.probes, time.monotonic() + 0.8
        while time.monotonic() < t_end:
            b.router.poll()
            assert lane.recv_batch(0.01) is None
        assert lane.probes == probes and b.router.worker_stats(1)["up"] == 0
        b.run(0)
        assert sorted((int(r["request_id"]), int(r["status"])) for r in b.responses) == [(1, 200), (2, 200)]
    finally:
        b.router.close()
        lane.close()


def test_a_zmq_worker_nobody_serves_is_marked_down_and_gets_no_stale_batch_when_it_comes_back(bench_factory):
    """A batch no peer ever took (unsent, so never busy) escaped the deadline. Then the batch a
    zmq worker timed out on waited in the router's connecting socket; once the worker was up
    (restarted, or its link healed) it took it and ran requests already answered elsewhere, on
    the store's newer copy of their sessions (found by review). The socket is now replaced as
    the worker goes down (and queues to live connections only): the worker that binds the
    endpoint later gets probes only."""
    b = bench_factory(n_workers=1, policy="round_robin", zmq_timeout_s=0.2)
    endpoint = lanes.free_tcp_endpoint()
    assert b.router.add_zmq_worker(endpoint) == 1      # nobody binds it yet
    b.router.set_up(0, False)
    b.send(chunks_of(1, [1, 2, 3], max_out=2))
    b.router.poll()
    b.router.set_up(0, True)
    deadline = time.monotonic() + 10
    while b.router.stats()["zmq_timeouts"] == 0 and time.monotonic() < deadline:
        b.router.poll()
        time.sleep(0.01)
    b.run(0)                                           # replayed on the shm worker, answered
    assert [(int(r["request_id"]), int(r["status"]), int(r["worker"])) for r in b.responses] == [(1, 200, 0)]
    assert b.router.worker_stats(1)["up"] == 0
    back = lanes.ZmqWorkerLane(endpoint)               # the worker comes up at last
    try:
        got, t_end = [], time.monotonic() + 2.5
        while time.monotonic() < t_end:
            b.router.poll()
            batch = back.recv_batch(0.01)
            if batch is not None:
                got.append(batch["request_id"].tolist())
        assert got == [] and back.probes >= 1, "the replayed batch reached the worker"
        st = b.router.stats()
        assert st["zmq_sockets_replaced"] == 1 and st["zmq_revived"] == 1
    finally:
        b.router.close()
        back.close()


def test_a_zmq_batch_no_connection_took_is_replayed_within_a_second_not_the_timeout(bench_factory):
    """The worker's endpoint has nobody bound (a worker killed, not yet back): the socket refuses
    the batch. Nothing of it reached a worker, yet it was due at zmq_timeout like a batch sent, and
    its requests waited 30 s (found by review). Unsent for ZMQ_UNSENT_NS (1 s), the worker is
    marked down and the batch replayed on the other."""
    b = bench_factory(n_workers=1, policy="round_robin", zmq_timeout_s=30)
    endpoint = lanes.free_tcp_endpoint()
    assert b.router.add_zmq_worker(endpoint) == 1      # nobody binds it
    b.router.set_up(0, False)
    b.send(chunks_of(1, [1, 2, 3], max_out=2))
    b.router.poll()
    b.router.set_up(0, True)
    t0, deadline = time.monotonic(), time.monotonic() + 10
    while b.router.stats()["zmq_timeouts"] == 0 and time.monotonic() < deadline:
        b.router.poll()
        time.sleep(0.01)
    waited = time.monotonic() - t0
    b.run(0)
    assert [(int(r["request_id"]), int(r["status"]), int(r["worker"])) for r in b.responses] == [(1, 200, 0)]
    assert 0.9 < waited < 5, waited
    assert b.router.worker_stats(1)["up"] == 0 and b.router.stats()["replayed"] == 1
    b.router.close()


def test_a_zmq_worker_that_dies_with_a_batch_is_found_by_its_lost_connection_not_the_timeout(bench_factory):
    """The worker takes a batch and dies unanswered: its TCP connection closes with it, so the answer
    cannot come, yet the batch was due at zmq_timeout and its requests waited 30 s, a worker
    restarted on the endpoint idle meanwhile (found by review). The socket's monitor reports the
    loss: the worker is marked down ZMQ_LOST_NS (50 ms) after it and the batch replayed."""
    b = bench_factory(n_workers=1, policy="round_robin", zmq_timeout_s=30)
    endpoint = lanes.free_tcp_endpoint()
    lane = lanes.ZmqWorkerLane(endpoint)
    try:
        assert b.router.add_zmq_worker(endpoint) == 1
        b.router.set_up(0, False)
        b.send(chunks_of(1, [1, 2, 3], max_out=2))
        batch, deadline = None, time.monotonic() + 10
        while batch is None and time.monotonic() < deadline:
            b.router.poll()
            batch = lane.recv_batch(0.01)
        assert batch is not None and batch["request_id"].tolist() == [1]
        b.router.set_up(0, True)
    finally:
        lane.close()                                   # it dies, the batch unanswered
    waited = until_zmq_timeout(b, 10)
    b.run(0)
    assert [(int(r["request_id"]), int(r["status"]), int(r["worker"])) for r in b.responses] == [(1, 200, 0)]
    st = b.router.stats()
    assert waited < 5 and st["zmq_lost"] == 1 and st["replayed"] == 1, (waited, st)
    b.router.close()


def until_zmq_timeout(b, limit_s: float) -> float:
    """The router polled until it times a zmq worker out (limit_s at most): the seconds it took."""
    t0 = time.monotonic()
    while b.router.stats()["zmq_timeouts"] == 0 and time.monotonic() < t0 + limit_s:
        b.router.poll()
        time.sleep(0.005)
    return time.monotonic() - t0


# a zmq worker in a process of its own: takes batches and never answers (bounded: 60 s)
SILENT_ZMQ_WORKER = """
import sys, time
from datapath import lanes
lane = lanes.ZmqWorkerLane(sys.argv[1])
print("ready", flush=True)
t_end = time.monotonic() + 60
while time.monotonic() < t_end:
    lane.recv_batch(0.1)
"""


def test_a_zmq_worker_stopped_with_a_batch_is_found_by_its_heartbeats_not_the_timeout(bench_factory):
    """A worker stopped (SIGSTOP; or a link that drops with no FIN) keeps its TCP connection, so
    no disconnect came: its batch waited zmq_timeout (30 s) and a store-less one drew new requests
    meanwhile (found by review). ZMTP heartbeats, answered by the peer's I/O thread and not its
    loop, close the connection once pings go unanswered (ZMQ_PING_TIMEOUT_MS): the loss is
    reported and the batch replayed. A worker alive but slow (the batch held 3.5 s, past that
    timeout) is not taken for lost."""
    b = bench_factory(n_workers=1, policy="round_robin", zmq_timeout_s=30)
    endpoint = lanes.free_tcp_endpoint()
    proc = subprocess.Popen([sys.executable, "-c", SILENT_ZMQ_WORKER, endpoint], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert b.router.add_zmq_worker(endpoint) == 1
        time.sleep(0.5)                                # connected
        b.router.set_up(0, False)                      # the request goes to the zmq worker
        b.send(chunks_of(1, [1, 2, 3], max_out=2))
        t_end = time.monotonic() + 3.5
        while time.monotonic() < t_end:                # alive, holding its batch
            b.router.poll()
            time.sleep(0.005)
        st = b.router.stats()
        assert st["zmq_lost"] == 0 and st["zmq_timeouts"] == 0 and b.router.worker_stats(1)["up"] == 1, st
        b.router.set_up(0, True)
        os.kill(proc.pid, signal.SIGSTOP)
        waited = until_zmq_timeout(b, 15)
        b.run(0)
        assert [(int(r["request_id"]), int(r["status"]), int(r["worker"])) for r in b.responses] == [(1, 200, 0)]
        st = b.router.stats()
        assert waited < 6 and st["zmq_lost"] == 1 and st["replayed"] == 1, (waited, st)
        assert b.router.worker_stats(1)["up"] == 0     # down while stopped: no new requests
    finally:
        proc.kill()                                    # (SIGKILL ends a stopped process too)
        proc.wait(10)
        proc.stdout.close()
        b.router.close()


def test_a_zmq_worker_restarted_while_idle_is_not_taken_for_lost_at_its_next_batch(bench_factory):
    """Its monitor is read only while a batch is out (an idle pass costs nothing): the loss of the
    connection while idle is left there, and must not be taken for the next batch's, answered here
    after 0.3 s (past ZMQ_LOST_NS)."""
    b = bench_factory(n_workers=1, policy="round_robin", zmq_timeout_s=30)
    endpoint = lanes.free_tcp_endpoint()
    first = lanes.ZmqWorkerLane(endpoint)
    assert b.router.add_zmq_worker(endpoint) == 1
    time.sleep(0.3)                                    # connected
    first.close()                                      # gone while idle, then back
    time.sleep(0.3)
    lane = lanes.ZmqWorkerLane(endpoint)
    try:
        time.sleep(0.5)                                # (reconnected: 100 ms interval)
        b.router.set_up(0, False)
        b.send(chunks_of(1, [1, 2, 3], max_out=1))
        t_end, batch, due = time.monotonic() + 5, None, None
        while not b.responses and time.monotonic() < t_end:
            b.router.poll()
            if batch is None:
                batch = lane.recv_batch(0.01)
                due = time.monotonic() + 0.3
            elif time.monotonic() > due:
                assert lane.send_completion(lanes.completion_for(batch, [7] * len(batch)))
                due = math.inf
            time.sleep(0.002)
            b.collect()
        assert [(int(r["request_id"]), int(r["status"]), int(r["worker"])) for r in b.responses] == [(1, 200, 1)]
        assert b.router.stats()["zmq_lost"] == 0 and b.router.stats()["zmq_timeouts"] == 0
    finally:
        b.router.close()
        lane.close()


def test_a_timed_out_zmq_worker_marked_down_leaves_no_socket_on_its_endpoint(bench_factory):
    """A zmq worker times out (its probe socket connected to the endpoint); the operator marks it
    down and adds the replacement bound there as a new worker. The probe socket stayed open,
    read by nobody: the replacement's DEALER sent every other completion to it, and those
    batches timed out (found by review). Closed now: every batch is answered, no more timeouts."""
    b = bench_factory(n_workers=1, policy="round_robin", zmq_timeout_s=0.2)
    endpoint = lanes.free_tcp_endpoint()
    assert b.router.add_zmq_worker(endpoint) == 1      # nobody binds it yet
    b.router.set_up(0, False)
    b.send(chunks_of(1, [1, 2, 3], max_out=1))
    deadline = time.monotonic() + 10
    while b.router.stats()["zmq_timeouts"] == 0 and time.monotonic() < deadline:
        b.router.poll()
        time.sleep(0.01)
    b.router.set_up(1, False)                          # the operator's word, then its replacement
    lane = lanes.ZmqWorkerLane(endpoint)
    try:
        assert b.router.add_zmq_worker(endpoint) == 2
        time.sleep(0.5)                                # (a reconnecting socket's 100 ms interval, and more)
        for rid in range(2, 8):
            b.send(chunks_of(rid, [rid], max_out=1))
            t_end = time.monotonic() + 2
            while not any(int(r["request_id"]) == rid for r in b.responses) and time.monotonic() < t_end:
                b.router.poll()
                batch = lane.recv_batch(0.01)
                if batch is not None:
                    assert lane.send_completion(lanes.completion_for(batch, [7] * len(batch)))
                b.collect()
        answered = {int(r["request_id"]): int(r["status"]) for r in b.responses}
        assert all(answered.get(rid) == 200 for rid in range(2, 8)), answered
        assert b.router.stats()["zmq_timeouts"] == 1
    finally:
        b.router.close()
        lane.close()


def test_no_worker_left_answers_503(bench_factory):
    b = bench_factory(n_workers=1)
    b.send(chunks_of(1, [1, 2, 3], max_out=2))
    b.router.poll()
    b.router.set_up(0, False)
    b.router.poll()
    b.collect()
    assert [int(r["status"]) for r in b.responses] == [503]
    assert b.router.stats()["active_requests"] == 0 and b.router.stats()["pool_free"] == 8192


def test_a_pool_s_room_counts_the_chunks_its_requests_have_still_to_send(bench_factory):
    """A pool's room counted only the chunks queued on its workers: requests opened first (their
    OPENs, no chunk queued yet) all went to the cheapest pool, 6x its room, the dearer one idle
    (found by review). The chunks still to come of the requests placed on a pool count too."""
    b = bench_factory(n_workers=2, policy="round_robin")
    b.router.set_worker_pool(1, 1)
    b.router.set_pool(0, 354, 4)                          # room: 4 chunks a worker
    b.router.set_pool(1, 936, 4)
    b.send(*[records.request_open(rid, 3, max_out=2) for rid in range(1, 9)])     # 8 requests of 3 chunks, opened first
    b.router.poll()
    placed = [b.router.pool_stats(p) for p in (0, 1)]
    assert placed[0]["promised"] + placed[1]["promised"] == 24
    assert placed[1]["requests"] >= 1, placed             # past the cheap pool's room: the next one
    b.send(*[chunks_of(rid, list(range(300)), max_out=2, session=rid) for rid in range(1, 9)])
    for _ in range(400):
        if len(b.responses) == 8:
            break
        b.step(0)
        b.step(1)
    assert sorted(int(r["status"]) for r in b.responses) == [200] * 8
    after = [b.router.pool_stats(p) for p in (0, 1)]
    assert after[0]["promised"] == after[1]["promised"] == 0, after
    assert after[1]["requests"] == placed[1]["requests"] >= 1


def test_a_stalled_worker_s_chunks_to_come_take_no_room_from_its_pool(bench_factory):
    """A worker stalled with a request of 6 chunks half arrived: its chunks to come counted in its
    pool's room, while its queue and itself did not (hidden), so the pool read full with its other
    worker idle and new requests went to the dearer pool (found by review). They count on their
    worker, and a hidden one's are left out as its queue is."""
    b = bench_factory(n_workers=3, policy="round_robin", stall_s=0.05)
    b.router.set_worker_pool(2, 1)
    b.router.set_pool(0, 100, 2)
    b.router.set_pool(1, 900, 2)
    big = chunks_of(1, list(range(128 * 6)), max_out=2, session=1)
    b.router.set_up(1, False)
    b.router.set_up(2, False)
    b.send(big[:1])
    b.router.poll()
    assert b.workers[0].recv_batch(0.5) is not None    # worker 0 takes its first chunk, and stalls
    b.router.set_up(1, True)
    b.router.set_up(2, True)
    t_end = time.monotonic() + 1.0
    while b.router.worker_stats(0)["stalled"] == 0 and time.monotonic() < t_end:
        b.router.poll()
        time.sleep(0.01)
    assert b.router.worker_stats(0)["stalled"] == 1
    assert b.router.pool_stats(0)["promised"] == 5
    before = b.router.pool_stats(1)["requests"]
    b.send(chunks_of(2, list(range(50)), max_out=2, session=2))
    for _ in range(50):
        b.step(1)
        b.step(2)
    assert [(int(r["request_id"]), int(r["worker"])) for r in b.responses] == [(2, 1)]
    assert b.router.pool_stats(1)["requests"] == before


def test_a_pool_full_of_half_arrived_requests_refuses_new_ones_instead_of_stalling(bench_factory):
    b = bench_factory(pool_chunks=8)
    # 2 chunks each, a tenant each (a tenant's requests still arriving hold a quarter of the pool at most)
    two = {rid: chunks_of(rid, list(range(200)), max_out=1, tenant=rid) for rid in range(1, 9)}
    b.send(*[two[rid][[0]] for rid in range(1, 9)])          # every first chunk, interleaved
    b.send(*[two[rid][[1]] for rid in range(1, 9)])          # then every second one
    batches = b.run()
    by_status = {}
    for r in b.responses:
        by_status.setdefault(int(r["status"]), []).append(int(r["request_id"]))
    assert sorted(by_status[200]) == [1, 2, 3, 4], "the admitted requests complete: nothing waits on a stall"
    assert sorted(by_status[503]) == [5, 6, 7, 8], "the rest are refused once, not expired later"
    assert {refusal(r) for r in b.responses if r["status"] == 503} == {"the router's chunk pool is full: retry shortly"}
    assert len(b.responses) == 8
    st = b.router.stats()
    assert st["pool_refused"] == 4 and st["late_duplicates"] == 4 and st["input_stalls"] == 0
    assert st["pool_free"] == 8 and st["active_requests"] == 0 and st["expired"] == 0
    assert prefill_seen(batches) == {rid: list(range(200)) for rid in range(1, 5)}


def test_an_expired_requests_late_chunk_is_a_straggler(bench_factory):
    b = bench_factory(reassembly_timeout_s=0.05)
    arr = chunks_of(5, list(range(200)), max_out=1)
    b.send(arr[[1]])                          # chunk 0 comes only after the expiry
    deadline = time.monotonic() + 5
    while not b.responses and time.monotonic() < deadline:
        time.sleep(0.01)
        b.router.poll()
        b.collect()
    b.send(arr[[0]])
    b.router.poll()
    b.collect()
    assert [int(r["status"]) for r in b.responses] == [400], "one answer for the request"
    assert b.workers[0].recv_batch(0) is None and b.router.stats()["late_duplicates"] == 1


def test_a_malformed_chunk_refuses_its_whole_request_once(bench_factory):
    b = bench_factory()
    arr = chunks_of(6, list(range(300)), max_out=1)
    bad = arr[[1]].copy()
    bad["n_tokens"] = 0
    b.send(arr[[0]], bad, arr[[2]])
    b.run()
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses] == [(6, 400)]
    assert b.router.stats()["active_requests"] == 0 and b.router.stats()["pool_free"] == 8192


def test_requests_are_named_by_tenant_session_and_id(bench_factory):
    """Two tenants (and two sessions of one) reusing request id 9 are three requests, not one."""
    b = bench_factory()
    reqs = {(1, 100): list(range(200)), (2, 100): list(range(1000, 1200)), (1, 101): list(range(2000, 2150))}
    parts = [chunks_of(9, toks, session=s, tenant=t, max_out=1) for (t, s), toks in reqs.items()]
    for i in range(2):                        # interleaved: chunk i of each, so a shared key would mix them
        b.send(*[p[i:i + 1] for p in parts])
    seen = {}
    for batch in b.run():
        for r in batch[batch["kind"] == wire.KIND_CHUNK]:
            seen.setdefault((int(r["tenant"]), int(r["session_id"])), []).extend(r["tokens"][:r["n_tokens"]])
    assert seen == reqs
    assert sorted((int(r["tenant"]), int(r["session_id"]), int(r["status"])) for r in b.responses) == \
        [(1, 100, 200), (1, 101, 200), (2, 100, 200)]
    st = b.router.stats()
    assert st["requests_in"] == 3 and st["duplicate_chunks"] == 0 and st["late_duplicates"] == 0
    b.send(parts[1][:1])                      # a late repeat of tenant 2's request is still recognised
    b.router.poll()
    assert b.router.stats()["late_duplicates"] == 1


@pytest.mark.parametrize("batching", ["dynamic", "static"])
def test_a_sessions_requests_run_one_at_a_time_in_arrival_order(bench_factory, batching):
    """Three requests of session 3 arrive together; the middle one never gets its second chunk.
    Each reaches the worker only once the one before it has ended: A runs to its end, B then
    (dynamic: its first chunk) until it expires with 400, then C; request 9 of another session
    is not held."""
    b = bench_factory(reassembly_timeout_s=0.05, batching=batching, max_batch_size=1, batch_timeout_s=0.001)
    a, bb, c = (chunks_of(rid, list(range(rid, rid + 40 * n)), session=3, max_out=3) for rid, n in ((1, 1), (2, 4), (5, 1)))
    b.send(a, bb[[0]], c, chunks_of(9, [7] * 10, session=4, max_out=1))
    first_seen, deadline = {}, time.monotonic() + 5    # request -> requests answered before its first chunk ran
    while len(b.responses) < 4 and time.monotonic() < deadline:
        answered = {int(r["request_id"]) for r in b.responses}
        batch = b.step()
        if batch is None:
            time.sleep(0.005)
            continue
        for r in batch[batch["kind"] == wire.KIND_CHUNK]:
            first_seen.setdefault(int(r["request_id"]), answered)
    assert {int(r["request_id"]): int(r["status"]) for r in b.responses} == {1: 200, 2: 400, 5: 200, 9: 200}
    assert first_seen[1] == set()
    assert {1, 2} <= first_seen[5], "C ran only after A and B had ended"
    if batching == "dynamic":
        assert 1 in first_seen[2], "B's first chunk ran only after A had ended"
        assert 1 not in first_seen[9], "another session's request did not wait"
    else:
        assert 2 not in first_seen, "static: incomplete B never ran"
    st = b.router.stats()
    assert st["held"] == 2 and st["expired"] == 1 and st["active_requests"] == 0


def test_the_trace_flag_of_a_requests_first_chunk_reaches_its_response(bench_factory):
    b = bench_factory()
    traced, plain = chunks_of(1, list(range(10)), max_out=2), chunks_of(2, list(range(10)), max_out=2)
    traced["flags"] = wire.FLAG_TRACE
    b.send(traced, plain)
    b.run()
    flags = {int(r["request_id"]): int(r["flags"]) for r in b.responses}
    assert flags == {1: wire.FLAG_TRACE, 2: 0}
    assert all(r["t_first_lane"] > 0 for r in b.responses)


@pytest.mark.parametrize("policy", policies())
def test_idle_rehearsals_leave_no_trace(bench_factory, policy):
    """The idle router runs a new request's path dry (router.c, rehearse) to keep it warm:
    the same requests with and without long idle stretches between them are placed on the
    same workers, admitted or refused alike, and each worker receives exactly its records.
    Every registered policy (it named four: a new one that kept per-pick state would have
    routed by how long the router sat idle, unseen; found by review)."""
    from datapath.admission import TenantPolicy
    outcomes = []
    for idle in (0, 1100):            # 4 rehearsals and a shadow run a gap (3 would hide a round-robin step)
        b = bench_factory(n_workers=3, policy=policy)
        b.router.set_tenant(4, TenantPolicy(tokens_per_minute=3 * (128 + 1)))   # room for 3 requests
        placed = []
        for rid in range(1, 9):
            b.send(chunks_of(rid, [rid, 2, 3], max_out=1, tenant=4 if rid % 2 else 0))
            b.router.poll()
            for _ in range(idle):
                b.router.poll()
            placed.append(tuple(int(b.workers[k].lane.stats()["depth"]) for k in range(3)))
        assert (b.router.stats()["rehearsals"] > 0) == (b.router.stats()["shadow_answered"] > 0) == (idle > 0)
        got = [sorted(prefill_seen(b.run(k))) for k in range(3)]   # each worker's requests, run to the end
        statuses = sorted((int(r["request_id"]), int(r["status"])) for r in b.responses)
        st = b.router.stats()
        outcomes.append((placed, got, statuses, st["admitted"], st["adm_rate_limited"]))
    assert outcomes[0] == outcomes[1]
    placed, got, statuses, admitted, limited = outcomes[0]
    assert admitted == 7 and limited == 1
    assert sorted(sum(got, [])) == [1, 2, 3, 4, 5, 6, 8]
    assert statuses == [(rid, wire.STATUS_RATE_LIMITED if rid == 7 else wire.STATUS_OK) for rid in range(1, 9)]


@pytest.mark.parametrize("budget", [512, 50])
def test_the_shadow_runs_the_whole_path_on_rings_of_its_own(bench_factory, budget):
    """Every 4th rehearsal the last admitted chunk goes, as a new request, through a second
    router's whole path (router.c, shadow_run): admitted, batched, answered by a played worker,
    decoded, answered 200, each run's request within the run (also when the live budget is less
    than a chunk). The live router, its lane and its egress see none of it."""
    b = bench_factory(token_budget=budget)
    b.send(chunks_of(1, list(range(120)), max_out=1))
    b.run()
    before = b.router.stats()
    lane_before = b.workers[0].lane.stats()["enqueued"]
    for _ in range(4 * 1024):         # idle passes: a shadow run every 1024
        b.router.poll()
    st = b.router.stats()
    assert st["shadow_answered"] == 4
    for key in ("requests_in", "admitted", "chunks_in", "batches", "records_out", "completions", "responses"):
        assert st[key] == before[key], key
    assert b.workers[0].lane.stats()["enqueued"] == lane_before
    b.collect()
    assert len(b.responses) == 1, "nothing of the shadow's reaches the live egress"
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"dp-private.{os.getpid()}.")], "its rings are unlinked"
    b.send(chunks_of(2, [5, 6, 7], max_out=2))
    assert [len(x) for x in b.run()] == [1, 1] and len(b.responses) == 2
    for _ in range(40 * 1024):        # 40 more runs: more than its 8 request slots, all answered
        b.router.poll()
    assert b.router.stats()["shadow_answered"] == 44


@pytest.mark.parametrize("batching", ["dynamic", "static"])
def test_close_runs_after_the_sessions_request_and_is_answered_once(bench_factory, batching):
    """A CLOSE waits for the session's unfinished request, goes to the session's worker as one
    record (no tokens, not priced), is answered 200 once; a request reusing the session id after
    it runs after it. A repeat of the CLOSE is counted, not run again."""
    b = bench_factory(batching=batching, batch_timeout_s=0.0) if batching == "static" else bench_factory()
    close = chunks_of(2, [], session=5)
    close["kind"], close["n_tokens"] = wire.KIND_CLOSE, 0
    b.send(chunks_of(1, [1, 2, 3], session=5, max_out=3), close, close, chunks_of(3, [4, 5], session=5, max_out=1))
    batches = b.run()
    order = [(int(r["request_id"]), int(r["kind"])) for x in batches for r in x]
    assert order == [(1, wire.KIND_CHUNK), (1, records.KIND_DECODE), (1, records.KIND_DECODE),
                     (2, wire.KIND_CLOSE), (3, wire.KIND_CHUNK)]
    got = {int(r["request_id"]): (int(r["status"]), int(r["n_out"])) for r in b.responses}
    assert len(b.responses) == 3 and got == {1: (200, 3), 2: (200, 0), 3: (200, 1)}
    st = b.router.stats()
    assert st["closed"] == 1 and st["control_in"] == 1 and st["admitted"] == 2 and st["active_requests"] == 0


def test_a_request_whose_session_last_ran_elsewhere_is_flagged_moved(bench_factory):
    """The worker checks its resident copy against the store only when told the session last
    ran on another worker (or the router does not know where): first sight, a move, a move back."""
    b = bench_factory(n_workers=2, policy="round_robin")
    flags = []
    for rid, up in [(1, 0), (2, 0), (3, 1), (4, 0), (5, 0)]:
        b.router.set_up(up, True)
        b.router.set_up(1 - up, False)
        b.send(chunks_of(rid, [rid, 7], session=5, max_out=1))
        (batch,) = b.run(up)
        flags.append((up, bool(batch["flags"][0] & records.CHUNK_F_MOVED)))
    assert flags == [(0, True), (0, False), (1, True), (0, True), (0, False)]
    assert b.router.stats()["moved"] == 2   # the two moves, not the first sight


def test_a_worker_set_up_again_after_its_failover_runs_new_requests(bench_factory):
    """A and B of one session on the only worker (B held behind A); the worker goes down: both are
    answered 503. Ending A made B ready on the down worker's queue, which the failover had already
    emptied: the queue kept B's freed slot, and the first poll after set_up(True) read it
    (a crash). Now nothing is queued on a down worker."""
    b = bench_factory(n_workers=1)
    b.send(chunks_of(1, [1, 2, 3], session=5, max_out=3), chunks_of(2, [4, 5, 6], session=5, max_out=3))
    b.router.poll()
    b.router.set_up(0, False)
    b.router.poll()
    b.collect()
    assert sorted((int(r["request_id"]), int(r["status"])) for r in b.responses) == [(1, 503), (2, 503)]
    assert b.router.stats()["active_requests"] == 0
    b.workers[0].recv_batch(0)                 # what the dead worker left in its lane
    b.router.set_up(0, True)
    b.send(chunks_of(3, [7, 8], session=6, max_out=2))
    b.run()
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses[2:]] == [(3, 200)]


def test_a_failed_request_leaves_where_its_session_ran_unknown(bench_factory):
    """R1 on w0, R2 on w1 (the store now has more than w0's copy), R3 placed on w0 fails before it
    runs (a malformed chunk): R4 on w0 must be flagged moved, or w0 answers from its copy without
    R2's turn. A request of the session placed behind the failed one is flagged too."""
    b = bench_factory(n_workers=2, policy="round_robin")
    flags = {}
    place_on(b, flags, 0, chunks_of(1, [1, 2], session=9, max_out=1))
    place_on(b, flags, 1, chunks_of(2, [3, 4], session=9, max_out=1))
    r3 = chunks_of(3, list(range(200)), session=9, max_out=1)
    bad = r3[[1]].copy()
    bad["n_tokens"] = 0
    place_on(b, flags, 0, r3[[0]], bad)
    place_on(b, flags, 0, chunks_of(4, [5, 6], session=9, max_out=1))
    assert flags[2] and flags[4], flags
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses] == [(1, 200), (2, 200), (3, 400), (4, 200)]
    # behind a request that fails: R6 placed on w0 while R5 (on w0) is unfinished, then R5 fails
    b.router.set_up(0, True)
    b.router.set_up(1, False)
    r5 = chunks_of(5, list(range(200)), session=9, max_out=1)
    b.send(r5[[0]], chunks_of(6, [7, 8], session=9, max_out=1))
    b.router.poll()
    bad = r5[[1]].copy()
    bad["n_tokens"] = 0
    b.send(bad)
    for batch in b.run(0):
        for r in batch[batch["kind"] == wire.KIND_CHUNK]:
            flags[int(r["request_id"])] = bool(r["flags"] & records.CHUNK_F_MOVED)
    assert flags[6], "placed behind R5 as if R5 would run on w0"


def test_an_expired_request_leaves_where_its_session_ran_unknown(bench_factory):
    """As a failed one: R3, placed on w0, expires still missing its first chunk (nothing of it ran
    there); R4 on w0 must be flagged moved. Before, the reassembly timeout freed R3 and left w0 as
    where the session last ran: w0 answered R4 from its copy, without R2's turn."""
    b = bench_factory(n_workers=2, policy="round_robin", reassembly_timeout_s=0.05)
    flags = {}
    place_on(b, flags, 0, chunks_of(1, [1, 2], session=9, max_out=1))
    place_on(b, flags, 1, chunks_of(2, [3, 4], session=9, max_out=1))
    place_on(b, flags, 0, chunks_of(3, list(range(200)), session=9, max_out=1)[[1]])   # its first chunk never comes
    deadline = time.monotonic() + 10
    while len(b.responses) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
        b.router.poll()
        b.collect()
    place_on(b, flags, 0, chunks_of(4, [5, 6], session=9, max_out=1))
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses] == [(1, 200), (2, 200), (3, 400), (4, 200)]
    assert flags[2] and flags[4], flags


def test_set_batching_refuses_more_chunks_a_step_than_a_lane_holds():
    """add_worker refuses a lane smaller than a step; set_batching raising the step past a lane
    made that worker's lane never ready, its requests never answered."""
    tag = f"rtsmall{os.getpid()}"
    lane = Ring.create(f"{tag}.lane", records.CHUNK.itemsize, 16, role="producer")
    done = Ring.create(f"{tag}.done", records.COMPLETION.itemsize, 64, role="consumer")
    try:
        with Router(max_chunks=16) as rt:
            rt.add_worker(lane, done)
            with pytest.raises(ValueError, match="batching: invalid argument"):
                rt.set_batching("dynamic", 512, 32)
            rt.set_batching("dynamic", 512, 16)
    finally:
        for ring, name in ((lane, "lane"), (done, "done")):
            ring.close()
            unlink(f"{tag}.{name}")


KEY_SECRET = 0x5eC2e7


def _key_index(tenant, session, request_id, bits=12):
    """The router's req_key (splitmix64 finaliser, native/policy.h, keyed by the router's secret,
    here set to KEY_SECRET) and its direct-mapped index of old."""
    mask = (1 << 64) - 1

    def h(x):
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)
    return (h(request_id ^ h(session ^ h(tenant ^ KEY_SECRET))) >> 32) & ((1 << bits) - 1)


def test_a_refused_request_s_later_chunks_stay_late_duplicates_past_colliding_requests(bench_factory):
    """Request 1 is refused at its first chunk (malformed); three requests whose keys share its
    12 bits then finish; its other two chunks come after. With one direct-mapped entry per 12
    bits the first of them made the router forget 1, so its chunks were taken for a new request
    and its client answered again. Now 8 keys share a set, first in first out."""
    b = bench_factory()
    b.router.set_key_secret(KEY_SECRET)
    want = _key_index(0, 1, 1)
    colliding = [rid for rid in range(2, 200_000) if _key_index(0, 1, rid) == want][:3]
    assert len(colliding) == 3
    x = chunks_of(1, list(range(300)), session=1, max_out=1)
    bad = x[[0]].copy()
    bad["n_tokens"] = 0
    b.send(bad)
    b.run()
    for rid in colliding:
        b.send(chunks_of(rid, [1, 2], session=1, max_out=1))
        b.run()
    b.send(x[[1]], x[[2]])
    b.run()
    got = [(int(r["request_id"]), int(r["status"])) for r in b.responses]
    assert got == [(1, 400)] + [(rid, 200) for rid in colliding], got
    assert b.router.stats()["late_duplicates"] == 2


def _splitmix64(x: int) -> int:
    """policy.h's dp_hash64, the public hash the router's request keys are made of."""
    m = (1 << 64) - 1
    x = (x + 0x9e3779b97f4a7c15) & m
    x = ((x ^ (x >> 30)) * 0xbf58476d1ce4e5b9) & m
    x = ((x ^ (x >> 27)) * 0x94d049bb133111eb) & m
    return x ^ (x >> 31)


def test_no_tenant_can_aim_a_request_id_at_another_tenants_request(bench_factory):
    """Finished requests are remembered by key alone (recent[]). With an unkeyed hash, a bijection,
    tenant 2 could choose a request id whose key is tenant 1's next request's; once tenant 2's was
    answered, tenant 1's was dropped unanswered as a late duplicate. The key is now keyed by the
    router's random secret."""
    b = bench_factory()
    h = _splitmix64
    victim = (1, 55, 1001)                                    # (tenant, session, request_id)
    attacker_tenant, attacker_session = 2, 77
    rid = victim[2] ^ h(victim[1] ^ h(victim[0])) ^ h(attacker_session ^ h(attacker_tenant))
    b.send(chunks_of(rid, [1, 2, 3], session=attacker_session, max_out=1, tenant=attacker_tenant))
    b.run(sample=lambda rec: 7)
    b.send(chunks_of(victim[2], [4, 5, 6], session=victim[1], max_out=1, tenant=victim[0]))
    b.run(sample=lambda rec: 7)
    got = {(int(r["tenant"]), int(r["request_id"])): int(r["status"]) for r in b.responses}
    assert got == {(attacker_tenant, rid): 200, (victim[0], victim[2]): 200}
    assert b.router.stats()["late_duplicates"] == 0


def test_every_record_carries_the_admitted_answer_length_whatever_its_packet_said(bench_factory):
    """A request's chunks that disagree on max_output_tokens: the worker gets the one admitted
    (the first chunk seen's) on every record, so it neither stops early nor runs on."""
    b = bench_factory()
    req = chunks_of(5, list(range(200)), max_out=3)
    req[1]["max_output_tokens"] = 1
    b.send(req)
    batches = b.run()
    assert {int(r["max_output_tokens"]) for x in batches for r in x} == {3}
    (resp,) = b.responses
    assert resp["status"] == 200 and resp["n_out"] == 3


def test_request_keys_are_hashed_with_the_router_s_secret(bench_factory):
    """The other side of the test above: knowing the secret (set_key_secret, for tests), the same
    aim does collide, so the secret, not luck, is what keeps tenants apart."""
    b = bench_factory()
    secret = 0xABCDEF
    b.router.set_key_secret(secret)
    h = _splitmix64
    victim = (1, 55, 1001)
    rid = victim[2] ^ h(victim[1] ^ h(victim[0] ^ secret)) ^ h(77 ^ h(2 ^ secret))
    b.send(chunks_of(rid, [1, 2, 3], session=77, max_out=1, tenant=2))
    b.run(sample=lambda rec: 7)
    b.send(chunks_of(victim[2], [4, 5, 6], session=victim[1], max_out=1, tenant=victim[0]))
    b.run(sample=lambda rec: 7)
    assert b.router.stats()["late_duplicates"] == 1 and len(b.responses) == 1
    with pytest.raises(RuntimeError):
        b.router.set_key_secret(1)          # keys were made with the old one


def test_a_peak_ewma_decay_time_over_a_day_is_refused_saying_what_the_parameter_means():
    """1e300 s passed the generic checks, and tau in ns was inf: every figure NaN (found by review)."""
    with pytest.raises(ValueError, match="at most a day"):
        Router(policy="peak_ewma", policy_param=1e300)
    Router(policy="peak_ewma", policy_param=86400).close()


def steps(b, k: int, tries: int):
    """Worker k's batches as it steps them, numbered from 1, over `tries` steps tried."""
    n = 0
    for _ in range(tries):
        batch = b.step(k)
        if batch is not None:
            n += 1
            yield n, batch


def test_decodes_short_of_budget_are_served_in_turn(bench_factory):
    """64 requests decoding, a step's budget cut to 16 tokens: each is served every 4th step. The
    rotation moved on by one a step, so each got a run of steps and then waited ~49 (found by review)."""
    b = bench_factory(n_workers=1, max_requests=1024)
    b.send(*[chunks_of(i + 1, [5] * 4, max_out=200) for i in range(64)])
    b.router.poll()
    for _ in range(3):
        b.step(0)
    assert b.router.worker_stats(0)["decoding"] == 64
    b.router.set_worker_budget(0, 16)
    last, gaps = {}, {}
    for step, batch in steps(b, 0, 100):
        for r in batch:
            rid = int(r["request_id"])
            if rid in last:
                gaps[rid] = max(gaps.get(rid, 0), step - last[rid])
            last[rid] = step
    assert len(gaps) == 64 and max(gaps.values()) == 4, sorted(gaps.values())[-5:]


def test_static_prefills_its_whole_set_before_decoding_under_a_short_chunk_cap(bench_factory):
    """A set of 8 under a cap of 4 chunks a batch: the second half's prefill waited for the first
    half's whole answers (step 21 of 20-token answers), member by member (found by review); prefill
    goes first across the set."""
    b = bench_factory(n_workers=1, batching="static", max_chunks=4, max_batch_size=8, batch_timeout_s=0.001)
    b.send(*[chunks_of(i, [5] * 4, max_out=20) for i in range(1, 9)])
    b.router.poll()
    time.sleep(0.002)
    first_prefill = {}
    for step, batch in steps(b, 0, 200):
        for r in batch:
            if r["kind"] != records.KIND_DECODE:
                first_prefill.setdefault(int(r["request_id"]), step)
    assert first_prefill == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 2, 7: 2, 8: 2}, first_prefill


HELD = [chunks_of(rid, list(range(200)), max_out=1, tenant=rid, t_send=50) for rid in range(10, 18)]   # a tenant's share each


def test_a_retry_under_the_same_ids_is_run_and_its_first_try_s_stragglers_are_not(bench_factory):
    """A refused request's ids are its stragglers' (and repeats') for thousands of requests more,
    but a client's retry under them, which the refusal asks for ("retry shortly"), is a new
    request: it opens one again and was sent later than the first try. Dropped as a late duplicate
    it went unanswered (found by review)."""
    b = bench_factory(max_requests=8)
    b.send(*[h[:1] for h in HELD])            # each holds a slot, its second chunk not come
    b.send(chunks_of(2, list(range(200)), max_out=1, t_send=100))
    b.router.poll()
    b.collect()
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses] == [(2, 503)]
    b.send(*[h[1:] for h in HELD])
    b.run()
    assert len(b.responses) == 9 and b.router.stats()["active_requests"] == 0
    b.send(chunks_of(2, list(range(200)), max_out=1, t_send=100))       # the first try's again
    b.router.poll()
    assert b.router.stats()["late_duplicates"] == 1 + 2 and b.router.stats()["active_requests"] == 0
    retry = chunks_of(2, list(range(200)), max_out=1, t_send=300)
    b.send(retry)
    b.run()
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses][9:] == [(2, 200)]
    assert b.router.stats()["late_duplicates"] == 3


def test_a_retry_of_a_request_begun_with_an_open_is_an_open(bench_factory):
    """After a try that began with an OPEN, its first chunk (stamped after the OPEN) is one of its
    stragglers, not a retry; the retry is the next OPEN stamped later. A request answered 200 is
    never retried: its turn ran."""
    b = bench_factory(max_requests=8)
    b.send(*[h[:1] for h in HELD])
    opened = np.zeros(1, dtype=records.CHUNK)
    opened["kind"], opened["request_id"], opened["session_id"], opened["chunk_count"] = wire.KIND_OPEN, 2, 2, 2
    opened["max_output_tokens"], opened["t_send"] = 1, 100
    b.send(opened)                            # the table is full: 503 at the OPEN
    b.router.poll()
    chunks = chunks_of(2, list(range(200)), max_out=1)
    chunks["t_send"] = [101, 102]
    b.send(chunks)
    b.send(*[h[1:] for h in HELD])
    b.run()
    assert b.router.stats()["late_duplicates"] == 2
    assert [int(r["status"]) for r in b.responses if r["request_id"] == 2] == [503]
    assert len(b.responses) == 9 and b.router.stats()["active_requests"] == 0
    opened["t_send"], chunks["t_send"] = 200, [201, 202]
    b.send(opened, chunks)
    b.run()
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses][9:] == [(2, 200)]
    # request 10 was answered 200: resent anew, it is not run again (its turn would be in the
    # session twice). It was dropped unanswered, and a client whose 200 was lost on its way heard
    # nothing however often it retried (found by review): answered 409 once, saying it ran; the
    # retry's second chunk is its straggler, and a repeat of the retry is dropped whole
    retry = chunks_of(10, list(range(200)), max_out=1, tenant=10, t_send=400)
    b.send(retry)
    b.run()
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses][10:] == [(10, 409)]
    assert "already ran and was answered 200" in refusal(b.responses[10])
    assert b.router.stats()["retries_ran"] == 1 and b.router.stats()["late_duplicates"] == 2 + 1
    b.send(retry)
    b.run()
    assert len(b.responses) == 11 and b.router.stats()["late_duplicates"] == 2 + 3
    # and a retry of a request answered 200 that began with an OPEN: 409 at the OPEN, its chunks
    # (stamped after it) are its stragglers
    opened["t_send"], chunks["t_send"] = 500, [501, 502]
    b.send(opened, chunks)
    b.run()
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses][11:] == [(2, 409)]
    assert b.router.stats()["retries_ran"] == 2 and b.router.stats()["active_requests"] == 0


def test_a_retry_that_reaches_its_live_request_becomes_its_try(bench_factory):
    """The first try's first two chunks of three came (from port 1111, sent at 100 and 101; its
    last was cut by XDP's bucket); the client's retry comes from a new socket (port 2222, sent
    from 500): its first two chunks are repeats, its last completes the request. One answer, to
    the retry's port and under its stamp, and the request is remembered as the retry's try (a
    repeat of the retry is dropped). The answer went to port 1111, under stamp 100, and the
    retry's repeats left the timeout running from the first try's last chunk: a retry that came
    near it was answered 400 (found by review)."""
    b = bench_factory(reassembly_timeout_s=0.4)
    first = chunks_of(2, list(range(300)), max_out=1, t_send=100)
    first["client_port"], first["t_send"] = 1111, [100, 101, 102]
    b.send(first[:2])
    b.run()
    time.sleep(0.3)                                   # most of the timeout gone
    retry = first.copy()
    retry["client_port"], retry["t_send"] = 2222, [500, 501, 502]
    b.send(retry[:2])                                 # repeats of what the router holds
    b.router.poll()
    time.sleep(0.2)                                   # past the first try's timeout, not the retry's
    b.router.poll()
    b.collect()
    assert b.responses == [] and b.router.stats()["expired"] == 0
    b.send(retry[2:])
    batches = b.run()
    # its worker, which had the first chunks under stamp 100, has the rest under it too: it tells a
    # request by (id, stamp), and under the retry's the last chunk would have begun another
    assert {int(rec["t_send"]) for batch in batches for rec in batch} == {100}
    (resp,) = b.responses
    assert (int(resp["status"]), int(resp["client_port"]), int(resp["t_send"])) == (200, 2222, 500)
    st = b.router.stats()
    assert (st["retries_taken"], st["duplicate_chunks"], st["active_requests"]) == (1, 2, 0)
    b.send(retry[:1])                                 # the retry again: a repeat, no second answer
    b.run()
    assert len(b.responses) == 1 and b.router.stats()["late_duplicates"] == 1


@pytest.mark.parametrize("how", ["expires", "bad chunk"])
def test_a_close_held_behind_a_request_that_fails_runs_where_the_session_is(bench_factory, how):
    """A runs on worker 0; B, held behind it, is placed on worker 1 (round robin), and the CLOSE
    behind B with it. B fails before any of it reached worker 1 (its chunks never all come, or one
    is malformed): the CLOSE goes where the session is, worker 0. It ran on worker 1, which never
    held the session, and worker 0 kept it (found by review)."""
    b = bench_factory(n_workers=2, policy="round_robin", reassembly_timeout_s=0.05)
    close = chunks_of(3, [], session=9)
    close["kind"], close["n_tokens"] = wire.KIND_CLOSE, 0
    second = chunks_of(2, list(range(200)), session=9, max_out=1)
    b.send(chunks_of(1, [1, 2, 3], session=9, max_out=1), second[[0]], close)
    b.router.poll()
    if how == "bad chunk":
        bad = second[[1]].copy()
        bad["n_tokens"] = 0
        b.send(bad)
    deadline = time.monotonic() + 5
    while not b.responses and time.monotonic() < deadline:   # A still running: B fails held
        time.sleep(0.01)
        b.router.poll()
        b.collect()
    assert [(int(r["request_id"]), int(r["status"])) for r in b.responses] == [(2, 400)]
    ran = {0: [], 1: []}
    while len(b.responses) < 3 and time.monotonic() < deadline:
        for k in (0, 1):
            got = b.step(k)
            if got is not None:
                ran[k] += [(int(r["request_id"]), int(r["kind"])) for r in got]
        time.sleep(0.005)
    assert sorted((int(r["request_id"]), int(r["status"])) for r in b.responses) == [(1, 200), (2, 400), (3, 200)]
    assert (3, wire.KIND_CLOSE) in ran[0] and (3, wire.KIND_CLOSE) not in ran[1], ran
    assert [b.router.worker_stats(k)["depth"] for k in (0, 1)] == [0, 0]


def test_a_malformed_chunk_that_waits_for_egress_room_is_counted_once(bench_factory):
    """Its refusal found the egress full: the record stays in its ring and is taken again once
    there is room, and counted then, not at each try."""
    b = bench_factory(egress_slots=8)
    b.send(*[chunks_of(rid, [1], max_out=1) for rid in range(100, 108)])
    b.router.poll()
    for _ in range(50):                       # run, the answers left unread: 8 fill the egress
        batch = b.workers[0].recv_batch(0)
        if batch is not None:
            b.workers[0].send_completion(lanes.completion_for(batch, [7] * len(batch)))
        b.router.poll()
        if b.router.stats()["responses"] == 8:
            break
    assert b.router.stats()["responses"] == 8
    bad = chunks_of(1, [1, 2])
    bad["n_tokens"] = 0
    b.send(bad)
    for _ in range(5):
        b.router.poll()
    assert b.router.stats()["bad_chunks"] == 0, "not taken yet: no room for its answer"
    b.collect()
    b.router.poll()
    b.collect()
    assert [int(r["status"]) for r in b.responses].count(400) == 1 and b.router.stats()["bad_chunks"] == 1
