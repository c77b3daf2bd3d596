"""The worker core, driven directly with dp_chunk records in the router's protocol.

The snapshot store is the in-memory stand-in (tests/serving_support.py).
"""
import os

import numpy as np
import pytest

from datapath import records, wire
from datapath.serving.devices import SimulatedDevice, profile
from datapath.serving import kvdelta
from datapath.serving.model import KVCache, Model, ModelConfig, sample
from datapath.serving.worker import Worker
from snapshotstore.errors import DeviceError
from serving_support import MemoryStore, as_batch, decode_record, drive, prefill_records, prompt

BIG = 1 << 30


@pytest.fixture(scope="module")
def model():
    return Model(ModelConfig(), seed=0)


def finished(worker):
    done, worker.finished = worker.finished, []
    return done


def moved(step):
    """step, its batches flagged as the router flags a session that last ran elsewhere."""
    def exchange(batch):
        batch["flags"] |= records.CHUNK_F_MOVED
        return step(batch)
    return exchange


def test_request_lifecycle(model):
    store = MemoryStore()
    w = Worker(model, store, kv_budget_bytes=BIG, codec="zstd", return_logits=True)
    toks = prompt(1, 300)
    got = drive(w.step, [(5, 1, toks, 8)], max_chunks=2)
    (done,) = finished(w)
    # the same computation by hand, in the same order: pieces 0+1 in one step, piece 2, then decode
    cache = KVCache(model.config)
    model.forward([(cache, np.array(toks[:256]))])
    lg = model.forward([(cache, np.array(toks[256:]))])[0]
    want, want_logits = [], []
    for _ in range(8):
        want.append(sample(lg))
        want_logits.append(lg)
        if len(want) < 8:
            lg = model.decode(cache, want[-1])
    assert got[1] == done.tokens == want and np.array_equal(done.logits, np.array(want_logits))
    s = done.stamps
    assert s["t_worker"] <= s["t_prefill_done"] <= s["t_last_token"] <= s["t_snapshot"]
    assert done.context_tokens == 300 + 7 and done.restored_tokens == 0
    (meta,) = store.meta((0, 5))
    assert (meta["token_start"], meta["token_end"], meta["codec"]) == (0, 307, "zstd")
    assert done.snapshot_bytes == len(store.restore((0, 5))[0])


def test_completion_record_answers_every_record(model):
    w = Worker(model, None, index=3)
    batch = as_batch([prefill_records(1, 10, prompt(1, 200), 2, piece=100), prefill_records(2, 20, prompt(2, 5), 1)],
                     seq=42)
    comp = w.step(batch)
    c, e = comp[0], comp["e"][0]
    assert (c["batch_seq"], c["worker"], c["n"]) == (42, 3, 3)
    assert list(e["request_id"][:3]) == [10, 10, 20] and (e["status"][:3] == 200).all()
    assert e["token"][0] == 0 and e["token"][1] and e["token"][2], "tokens only after final pieces"
    assert c["t_start"] <= c["t_end"] and c["kv_bytes"] == w.kv_bytes_resident > 0
    comp = w.step(as_batch([decode_record(1, 10, 2)], seq=43))
    assert comp["e"][0]["status"][0] == 200 and comp["n"][0] == 1
    assert [d.request_id for d in finished(w)] == [20, 10]


@pytest.mark.parametrize("codec", ["raw", "zstd", "lz4"])
def test_evict_restore_continue_equals_never_evicted(model, codec):
    store = MemoryStore()
    first = Worker(model, store, kv_budget_bytes=0, codec=codec)
    second = Worker(model, store, kv_budget_bytes=BIG, codec=codec, return_logits=True)
    ref = Worker(model, MemoryStore(), kv_budget_bytes=BIG, codec=codec, return_logits=True)
    turn1, turn2 = (9, 1, prompt(2, 200), 6), (9, 2, prompt(3, 150), 6)
    a1 = drive(first.step, [turn1])
    assert not first.holds(9) and first.stats["evictions"] == 1, "budget 0: evicted once durable"
    b2 = drive(second.step, [turn2])
    r1, r2 = drive(ref.step, [turn1]), drive(ref.step, [turn2])
    assert a1 == r1 and b2 == r2
    (b_done,), (_, r_done) = finished(second), finished(ref)
    assert b_done.restored_tokens == 200 + 5 and second.stats["restores"] == 1
    assert np.array_equal(b_done.logits, r_done.logits), "lossless restore continues bit for bit"
    assert [m["token_start"] for m in store.meta((0, 9))] == [0, 205]


def test_a_session_restored_from_another_codec_s_chain_continues_it_in_that_codec(model, tmp_path):
    """A worker started with another --codec (a restart, a pool whose workers differ) over the same
    store: the store refuses a chain of mixed codecs, and every later turn of a session the other
    codec began was answered 503 until its CLOSE (found by review). Its deltas now continue the
    chain in the chain's codec; a session it begins is in its own."""
    from snapshotstore import LogStore
    from snapshotstore.api import WorkerStore
    from snapshotstore.device import create_image
    from snapshotstore.log import format_device
    image = str(tmp_path / "store.img")
    create_image(image, 4 << 20)
    format_device(image)
    with LogStore(image) as log:
        store = WorkerStore(log, b"0123456789abcdef0123")
        zstd = Worker(model, store, kv_budget_bytes=0, codec="zstd")
        lz4 = Worker(model, store, kv_budget_bytes=0, codec="lz4")
        drive(zstd.step, [(7, 1, prompt(1, 50), 1)])
        for rid in (2, 3):
            comp = lz4.step(as_batch([prefill_records(7, rid, prompt(rid, 20), 1, t_send=10 + rid)]))
            assert comp["e"][0]["status"][0] == 200, lz4.last_store_error
        drive(lz4.step, [(8, 1, prompt(4, 30), 1)])
        assert lz4.stats["snapshot_failures"] == 0 and lz4.stats["restores"] == 2
        assert [kvdelta.header(d)["codec"] for d in store.restore((0, 7))] == ["zstd"] * 3
        assert [kvdelta.header(d)["codec"] for d in store.restore((0, 8))] == ["lz4"]


def test_a_resident_session_whose_stored_chain_is_damaged_is_put_whole_again_not_refused_for_good(model, tmp_path):
    """A record of a resident session's chain damaged on the device (a flipped bit): appends went on
    until one compacted the chain, read it and failed; the session was then unsure, every later
    request read the damaged chain again and was answered 503, and it was never evicted (review).
    The worker's copy, the session's best now, replaces the chain: every turn is answered, and a
    restore elsewhere continues the session as a worker that never met the damage does."""
    from snapshotstore import LogStore
    from snapshotstore.api import WorkerStore
    from snapshotstore.device import create_image
    from snapshotstore.log import format_device
    image = str(tmp_path / "store.img")
    create_image(image, 16 << 20)           # (a record holds the chain compacted: 1/16 of the log)
    format_device(image)
    turns = [(7, rid, prompt(rid, 100 if rid == 1 else 30), 2) for rid in range(1, 8)]
    ref = Worker(model, MemoryStore(), kv_budget_bytes=BIG)
    want = {}
    for t in turns:
        want |= drive(ref.step, [t])
    with LogStore(image, compact_after=4) as log:
        store = WorkerStore(log, b"0123456789abcdef0123")
        w = Worker(model, store, kv_budget_bytes=BIG)
        got = drive(w.step, [turns[0]])
        (first,) = [e for e in log.entries() if e.live]
        where = (log.log_start + first.lpos % log.log_blocks) * log.block_size + 200
        fd = os.open(image, os.O_RDWR)
        try:
            os.pwrite(fd, bytes([os.pread(fd, 1, where)[0] ^ 0x40]), where)
            os.fsync(fd)
        finally:
            os.close(fd)
        for t in turns[1:]:
            got |= drive(w.step, [t])                    # (every record answered 200)
        assert got == want
        assert w.stats["damaged_rewritten"] == 1 and w.stats["snapshot_failures"] == 0
        again = Worker(model, store, kv_budget_bytes=BIG)
        assert drive(again.step, [(7, 9, prompt(9, 20), 3)]) == drive(ref.step, [(7, 9, prompt(9, 20), 3)])
        assert again.stats["restores"] == 1


def test_int8_restore_continues_with_bounded_logit_error(model):
    store = MemoryStore()
    first = Worker(model, store, kv_budget_bytes=0, codec="int8_zstd")
    second = Worker(model, store, codec="int8_zstd", return_logits=True)
    ref = Worker(model, None, return_logits=True)
    turn1, turn2 = (4, 1, prompt(5, 200), 1), (4, 2, prompt(6, 20), 1)
    drive(first.step, [turn1]), drive(ref.step, [turn1]), drive(second.step, [turn2]), drive(ref.step, [turn2])
    err = np.abs(finished(second)[0].logits - finished(ref)[1].logits).max()
    assert 0 < err < 0.25, err


def test_a_request_the_router_gave_up_on_leaves_nothing_in_the_session(model):
    """Request 2's first piece ran, then the router failed it (a later chunk malformed, or
    expired): its client got an error, so its prompt is not the session's. Request 3 on the same
    session continues from request 1's context alone, as if 2 had never come."""
    w = Worker(model, None, kv_budget_bytes=BIG, return_logits=True)
    ref = Worker(model, None, kv_budget_bytes=BIG, return_logits=True)
    first, last = (7, 1, prompt(1, 40), 2), (7, 3, prompt(3, 10), 2)
    drive(w.step, [first]), drive(ref.step, [first])
    length = w.sessions[(0, 7)].cache.length
    w.step(as_batch([prefill_records(7, 2, prompt(2, 150), 2)[:1]]))    # its first piece of two, no more
    assert w.sessions[(0, 7)].cache.length == length + 128
    got, want = drive(w.step, [last]), drive(ref.step, [last])
    assert got == want and w.stats["superseded"] == 1
    assert np.array_equal(finished(w)[-1].logits, finished(ref)[-1].logits)
    assert w.sessions[(0, 7)].cache.length == ref.sessions[(0, 7)].cache.length


def test_a_superseded_request_is_cut_off_before_the_next_one_s_room_is_judged():
    """Request 2 fills a 512-token context piece by piece until its last piece is refused (413) and
    the router fails it; request 3 (100 tokens) fits the session's real context (41 + 100). The
    room check ran before the cut once: 3 was refused too, and every request after it. (Request 2
    is now cut off at its refusal; the cut at a new request stays for one the router gave up on
    unseen: test_a_request_the_router_gave_up_on_leaves_nothing_in_the_session)"""
    import dataclasses
    small = Model(dataclasses.replace(ModelConfig(), max_context=512), seed=0)
    w = Worker(small, None, kv_budget_bytes=BIG)
    drive(w.step, [(7, 1, prompt(1, 40), 2)])
    recs = prefill_records(7, 2, prompt(2, 500), 2)
    statuses = [int(w.step(as_batch([recs[i:i + 1]]))["e"][0]["status"][0]) for i in range(len(recs))]
    assert statuses == [wire.STATUS_OK] * 3 + [wire.STATUS_TOO_LARGE]
    comp = w.step(as_batch([prefill_records(7, 3, prompt(3, 100), 2)[:1]]))
    assert int(comp["e"][0]["status"][0]) == wire.STATUS_OK and w.stats["cut_on_refusal"] == 1
    assert w.sessions[(0, 7)].cache.length == 41 + 100


def test_eviction_waits_for_a_durable_snapshot(model):
    """Only what the store holds is evicted: a request whose put failed is answered 503 and its
    session cut back to what the store holds (here nothing), which is all that may go; its retry
    puts the turn and the session goes once it is durable."""
    store = MemoryStore()
    store.fail_puts = True
    w = Worker(model, store, kv_budget_bytes=0)
    comp = w.step(as_batch([prefill_records(1, 1, prompt(1, 50), 1)]))
    assert comp["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE
    (done,) = finished(w)
    assert done.snapshot_error and done.snapshot_bytes == 0 and store.held((0, 1))[0] == 0
    assert not w.holds(1) and w.stats["over_budget_steps"] == 0, "cut back to nothing: nothing to keep"
    store.fail_puts = False
    drive(w.step, [(1, 2, prompt(1, 50), 3)])
    assert finished(w)[0].snapshot_error is None and not w.holds(1)
    (meta,) = store.meta((0, 1))
    assert (meta["token_start"], meta["token_end"]) == (0, 50 + 2), "the retried turn alone"


def test_lru_evicts_the_least_recently_used_idle_session(model):
    one_session = KVCache(model.config).nbytes  # every session here stays within 128 tokens
    w = Worker(model, MemoryStore(), kv_budget_bytes=3 * one_session - 1)
    for sid in (1, 2):
        drive(w.step, [(sid, sid, prompt(sid, 40), 2)])
    drive(w.step, [(1, 3, prompt(7, 10), 2)])  # session 1 is now more recent than 2
    drive(w.step, [(3, 4, prompt(3, 40), 2)])
    assert w.holds(1) and not w.holds(2) and w.holds(3) and w.stats["evictions"] == 1


def test_sessions_in_a_request_are_never_evicted(model):
    w = Worker(model, MemoryStore(), kv_budget_bytes=0)
    w.step(as_batch([prefill_records(1, 1, prompt(1, 30), 5), prefill_records(2, 2, prompt(2, 30), 5)]))
    assert w.holds(1) and w.holds(2) and w.stats["over_budget_steps"] == 1
    w.step(as_batch([decode_record(1, 1, 5), decode_record(2, 2, 5)]))
    assert w.holds(1) and w.holds(2)


def test_without_a_store_a_worker_over_its_budget_refuses_new_sessions_and_serves_its_own(model):
    """Nothing is durable without a store, so nothing can be evicted: the KV grew with every new
    session. Over its budget, a new session's request is refused 503 (nothing of it kept); the
    sessions held go on, and a CLOSE makes room."""
    one_session = KVCache(model.config).nbytes
    w = Worker(model, None, kv_budget_bytes=2 * one_session - 1)
    drive(w.step, [(1, 1, prompt(1, 40), 2), (2, 2, prompt(2, 40), 2)])
    comp = w.step(as_batch([prefill_records(3, 3, prompt(3, 40), 2)]))
    assert comp["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE and not w.holds(3)
    assert comp["e"][0]["flags"][0] == records.CE_KV_FULL | records.CE_NO_STORE   # the router's body says why
    assert w.stats["kv_full_refused"] == 1 and w.kv_bytes_resident == 2 * one_session
    drive(w.step, [(1, 4, prompt(4, 10), 2)])                  # a held session goes on
    close = np.zeros(1, dtype=records.CHUNK)
    close["session_id"], close["request_id"], close["kind"] = 2, 5, wire.KIND_CLOSE
    assert w.step(as_batch([close]))["e"][0]["status"][0] == wire.STATUS_OK
    drive(w.step, [(3, 6, prompt(3, 40), 2)])
    assert w.holds(3) and w.stats["kv_full_refused"] == 1


def test_protocol_errors_are_answered_per_record(model):
    w = Worker(model, MemoryStore())
    bad_kind = prefill_records(1, 1, prompt(1, 5), 1)
    bad_kind["kind"] = wire.KIND_OPEN
    no_tokens = prefill_records(2, 2, prompt(2, 5), 1)
    no_tokens["n_tokens"] = 0
    stray_decode = decode_record(3, 3, 4)
    twice = prefill_records(4, 4, prompt(4, 5), 4)
    comp = w.step(as_batch([bad_kind, no_tokens, stray_decode, twice, decode_record(4, 4, 4)]))
    assert list(comp["e"][0]["status"][:5]) == [400, 400, 422, 200, 422]
    # the router fails request 4 on its second decode's 422: none of it stays, not even its token
    assert not comp["e"][0]["token"][3] and w.stats["refused"] == 4 and w.stats["cut_on_refusal"] == 1
    assert _sessions_kv_length(w, 4) == 0 and not finished(w)
    w.step(as_batch([prefill_records(6, 6, prompt(5, 5), 4)]))
    late = prefill_records(6, 6, prompt(5, 3), 4)  # prompt after the final piece
    assert w.step(as_batch([late]))["e"][0]["status"][0] == 422
    assert _sessions_kv_length(w, 6) == 0 and w.stats["cut_on_refusal"] == 2
    out_of_vocab = prefill_records(5, 5, [1, 2, 512], 1)
    assert w.step(as_batch([out_of_vocab]))["e"][0]["status"][0] == 400


def test_a_request_refused_a_piece_leaves_nothing_of_it_in_the_session(model):
    """Its client is told the refusal (here 413: the second piece overflows the context), so none
    of the request may stay: its first piece, run in an earlier step, is cut off, and its third,
    which would fit, is refused with it. Before, the first and third ran, the request finished on
    a prompt with a hole in it, and its turn went to the store under a client told 413."""
    small = Model(ModelConfig(max_context=300), seed=0)
    store = MemoryStore()
    w = Worker(small, store)
    drive(w.step, [(1, 1, prompt(1, 100), 1)])
    assert finished(w)[0].context_tokens == 100
    pieces = prefill_records(1, 2, prompt(2, 266), 1)             # 128 + 128 + 10 tokens
    assert w.step(as_batch([pieces[:1]]))["e"][0]["status"][0] == 200
    comp = w.step(as_batch([pieces[1:]]))
    assert comp["e"][0]["status"][:2].tolist() == [wire.STATUS_TOO_LARGE] * 2
    assert not finished(w) and store.held((0, 1))[0] == 100 and _sessions_kv_length(w, 1) == 100
    assert w.stats["cut_on_refusal"] == 1
    drive(w.step, [(1, 3, prompt(3, 50), 1)])                      # the session goes on from its turn
    assert finished(w)[0].context_tokens == 150 and store.held((0, 1))[0] == 150


def test_a_retry_under_the_same_id_sent_anew_does_not_run_on_the_first_try_s_pieces(model):
    """The first try's first piece ran, then the router gave up on it (a chunk cut by the XDP
    bucket, an expiry): its client got an error and retried under the same id, stamped anew. The
    worker took the retry for the first try going on, appended it to that piece (the prompt's
    first 128 tokens twice) and answered 200. Now the first try's pieces are cut off first."""
    store = MemoryStore()
    w = Worker(model, store)
    drive(w.step, [(1, 1, prompt(1, 40), 1)])
    finished(w)
    first = prefill_records(1, 2, prompt(2, 200), 1, t_send=1_000)
    assert w.step(as_batch([first[:1]]))["e"][0]["status"][0] == 200     # 128 tokens in, then given up
    retry = prefill_records(1, 2, prompt(2, 200), 1, t_send=2_000)
    w.step(as_batch([retry]))
    (done,) = finished(w)
    assert done.context_tokens == 40 + 200 and store.held((0, 1))[0] == 40 + 200
    assert w.stats["superseded"] == 1


def test_a_request_refused_after_a_failed_restore_does_not_start_mid_prompt(model):
    """The store failed the session's restore at the request's first piece (503); it is back by the
    second, in the same batch. Before, the second piece restored the session and began the
    request there, half a prompt long."""
    store = MemoryStore()
    drive(Worker(model, store).step, [(1, 1, prompt(1, 40), 1)])
    w = Worker(model, store)
    pieces = prefill_records(1, 2, prompt(2, 200), 1)
    real_restore, calls = store.restore, []

    def flaky(key):
        calls.append(key)
        if len(calls) == 1:
            raise DeviceError("the first read fails")
        return real_restore(key)
    store.restore = flaky
    comp = w.step(as_batch([pieces]))
    assert comp["e"][0]["status"][:2].tolist() == [wire.STATUS_UNAVAILABLE] * 2
    assert not finished(w) and store.held((0, 1))[0] == 40


def test_context_past_max_context_is_refused_not_fatal():
    small = Model(ModelConfig(max_context=200), seed=0)
    w = Worker(small, None)
    comp = w.step(as_batch([prefill_records(1, 1, prompt(1, 150), 1), prefill_records(1, 1, prompt(2, 60), 1)]))
    assert list(comp["e"][0]["status"][:3]) == [200, 200, 413]
    ok = w.step(as_batch([prefill_records(2, 2, prompt(3, 10), 1)]))
    assert ok["e"][0]["status"][0] == 200 and ok["e"][0]["token"][0]


def test_a_request_that_fills_the_context_ends_there_with_eos_not_a_dead_worker():
    """A prompt that brings its session to max_context exactly: the first token is sampled from
    the last position, but there is no room to feed it back, so the request ends with it (the
    entry flagged CE_EOS: the router answers with the tokens so far). Before, the router's next
    decode record raised in the model and killed the worker, and the failover's replay killed the
    next one the same way. A decode record sent anyway finds no request generating: 422."""
    small = Model(ModelConfig(max_context=256), seed=0)
    w = Worker(small, None)
    comp = w.step(as_batch([prefill_records(1, 1, prompt(1, 256), 4)]))
    e = comp["e"][0]
    assert list(e["status"][:2]) == [200, 200] and e["flags"][1] & records.CE_EOS and e["token"][1]
    (done,) = finished(w)
    assert done.tokens == [int(e["token"][1])] and done.context_tokens == 256
    assert w.stats["context_full"] == 1
    comp = w.step(as_batch([decode_record(1, 1, 4)]))
    assert comp["e"][0]["status"][0] == wire.STATUS_UNPROCESSABLE   # it is over: no such request here
    # one token short of full: a decode fills the last slot, and that step's token ends it
    comp = w.step(as_batch([prefill_records(2, 2, prompt(2, 255), 4)]))
    assert not comp["e"][0]["flags"][1] & records.CE_EOS
    comp = w.step(as_batch([decode_record(2, 2, 4)]))
    assert comp["e"][0]["status"][0] == 200 and comp["e"][0]["flags"][0] & records.CE_EOS
    assert [len(d.tokens) for d in finished(w)] == [2] and w.stats["context_full"] == 2


class FailingStore(MemoryStore):
    """A store that is down: every call raises (as a remote store's timeout does)."""

    def __init__(self, exc):
        super().__init__()
        self.exc = exc

    def restore(self, key):
        raise self.exc

    def held(self, key):
        raise self.exc

    def delete(self, key):
        raise self.exc


@pytest.mark.parametrize("exc", [DeviceError("the target did not answer in 30 s"), OSError(5, "EIO")])
def test_a_store_that_fails_costs_the_request_a_503_not_the_worker(model, exc):
    store = FailingStore(exc)
    w = Worker(model, store)
    comp = w.step(as_batch([prefill_records(1, 1, prompt(1, 20), 2)]))
    assert comp["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE and not w.holds(1)
    assert w.stats["store_errors"] == 1 and type(exc).__name__ in w.last_store_error
    close = np.zeros(1, dtype=records.CHUNK)
    close["session_id"], close["request_id"], close["kind"] = 1, 2, wire.KIND_CLOSE
    closed = w.step(as_batch([close]))
    assert closed["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE
    ok = w.step(as_batch([prefill_records(2, 3, prompt(2, 20), 1)]))   # the worker goes on
    assert ok["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE and w.stats["store_errors"] == 3
    # each flagged: the router's body says the store failed (test_router)
    assert all(c["e"][0]["flags"][0] & records.CE_STORE for c in (comp, closed, ok))


class PutFailsOnce(MemoryStore):
    """A store whose next put raises: before it takes the delta, or after (a remote put whose
    reply was lost: the delta is in)."""

    def __init__(self, lands):
        super().__init__()
        self.lands, self.fail_next = lands, False

    def put(self, key, delta, meta):
        if self.fail_next:
            self.fail_next = False
            if self.lands:
                super().put(key, delta, meta)
            raise DeviceError("the store did not answer in 5 s")
        super().put(key, delta, meta)


@pytest.mark.parametrize("lands", [False, True], ids=["not taken", "taken, reply lost"])
def test_a_turn_the_store_did_not_take_is_answered_503_and_cut_back(model, lands):
    """The put at a request's end fails: the request is answered 503 (its turn is in no store)
    and the session keeps only what the store holds, so the client's retry runs on the context
    it had and the session stays evictable. Before, the request was answered 200 with its turn
    nowhere durable, and the next put spanned both turns under the second one's id. A put whose
    reply was lost but whose delta is in the store is the success it was."""
    store, ref = PutFailsOnce(lands), Worker(model, MemoryStore())
    w = Worker(model, store, kv_budget_bytes=BIG)
    t1, t2 = (3, 1, prompt(1, 40), 2), (3, 2, prompt(2, 30), 1)
    assert drive(w.step, [t1]) == drive(ref.step, [t1])
    store.fail_next = True
    comp = w.step(as_batch([prefill_records(*t2)]))
    status = comp["e"][0]["status"][0]
    if lands:
        assert status == wire.STATUS_OK and store.held((0, 3))[0] == 41 + 30 and w.stats["store_errors"] == 0
        assert finished(w)[-1].snapshot_error is None
        # counted as what it was (it was a failure and a snapshot both)
        assert (w.stats["snapshots"], w.stats["snapshot_replies_lost"], w.stats["snapshot_failures"]) == (2, 1, 0)
        assert not comp["e"][0]["flags"].any()
    else:
        assert status == wire.STATUS_UNAVAILABLE and store.held((0, 3))[0] == 41
        assert comp["e"][0]["flags"][0] & records.CE_STORE, "its body says the store failed"
        assert w.stats["store_errors"] == 1 and "did not answer" in w.last_store_error
        assert w.holds(3) and w.sessions[(0, 3)].cache.length == 41
        assert drive(w.step, [t2]) == drive(ref.step, [t2]), "the retry runs on the context before the turn"
        assert [(m["token_start"], m["token_end"], m["request_id"]) for m in store.meta((0, 3))] == \
               [(0, 41, 1), (41, 71, 2)]
    assert w.sessions[(0, 3)].cache.snapshot_len == w.sessions[(0, 3)].cache.length == 71, "evictable"


class UnreachableAfterPut(MemoryStore):
    """A remote store that times out on a put (which may still land there) and then refuses
    every call for a while, as RemoteStore does for its timeout after one."""

    def __init__(self, lands):
        super().__init__()
        self.lands, self.fail_next, self.down = lands, False, False

    def _up(self):
        if self.down:
            raise DeviceError("the store did not answer in 5 s a moment ago: not asked again yet")

    def put(self, key, delta, meta):
        self._up()
        if self.fail_next:
            self.fail_next, self.down = False, True
            if self.lands:
                super().put(key, delta, meta)
            raise DeviceError("the store did not answer in 5 s")
        super().put(key, delta, meta)

    def restore(self, key):
        self._up()
        return super().restore(key)

    def held(self, key):
        self._up()
        return super().held(key)

    def delete(self, key):
        self._up()
        super().delete(key)


@pytest.mark.parametrize("lands", [False, True], ids=["not taken", "taken late"])
def test_a_turn_whose_put_timed_out_is_taken_back_out_if_it_landed(model, lands):
    """The put times out and the store then cannot be asked: the request is answered 503 and
    the session cut back and marked; while the store still cannot say, its next request is
    refused 503 too; once it answers, a turn that landed after all is taken back out of it
    (the client was told 503), so the retry runs on the context before the turn and the
    store holds that turn once, the retry's. Before, the store kept the 503'd turn and the
    retry ran on top of it (the prompt twice)."""
    store, ref = UnreachableAfterPut(lands), Worker(model, MemoryStore())
    w = Worker(model, store, kv_budget_bytes=0)
    t1, t2 = (6, 1, prompt(1, 40), 2), (6, 2, prompt(2, 30), 1)
    drive(w.step, [t1]), drive(ref.step, [t1])
    store.fail_next = True
    assert w.step(as_batch([prefill_records(*t2)]))["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE
    assert w.holds(6) and w.sessions[(0, 6)].cache.length == 41, "cut back, kept (not evicted) to settle"
    retry = (6, 3, t2[2], 1)
    assert w.step(as_batch([prefill_records(*retry)]))["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE
    store.down = False
    assert drive(w.step, [retry]) == drive(ref.step, [retry])
    assert [(m["token_start"], m["token_end"]) for m in store.meta((0, 6))] == \
           ([(0, 41), (41, 71)] if lands else [(0, 41), (41, 71)])
    assert store.meta((0, 6))[-1]["request_id"] == 3 and w.stats["unsure_rolled_back"] == lands


@pytest.mark.parametrize("lands", [False, True], ids=["not taken", "taken late"])
def test_an_unsure_session_whose_client_never_returns_is_settled_and_evicted_over_budget(model, lands,
                                                                                       monkeypatch):
    """Only the session's own next request here settled it: one whose client never came back (or
    whose retry went to another worker) stayed resident for good, over the budget (found by review).
    Over budget with nothing else to evict, the worker settles one idle unsure session a second."""
    import datapath.serving.worker as worker_mod
    store = UnreachableAfterPut(lands)
    w = Worker(model, store, kv_budget_bytes=1 << 30)
    drive(w.step, [(6, 1, prompt(1, 40), 2)])
    store.fail_next = True
    assert w.step(as_batch([prefill_records(6, 2, prompt(2, 30), 1)]))["e"][0]["status"][0] == 503
    assert w.sessions[(0, 6)].unsure is not None
    w.kv_budget_bytes = 0
    w.step(as_batch([prefill_records(7, 1, prompt(3, 10), 1)]))   # over budget, the store still down: kept
    assert w.holds(6) and w.stats["unsure_settled_idle"] == 0 and w.stats["store_errors"] >= 1
    store.down = False
    monkeypatch.setattr(worker_mod, "SETTLE_EVERY_NS", 0)
    w._next_settle_ns = 0
    drive(w.step, [(8, 1, prompt(4, 10), 1)])
    assert not w.holds(6) and w.stats["unsure_settled_idle"] == 1 and w.stats["unsure_rolled_back"] == lands
    assert [(m["token_start"], m["token_end"]) for m in store.meta((0, 6))] == [(0, 41)], "the 503'd turn not kept"


def test_a_retry_answered_200_on_another_worker_is_not_taken_back_as_the_unsure_turn(model):
    """The put of request 2 timed out on worker 1 (it did not land): answered 503, the session
    marked unsure. The client's retry of it, under its id and stamped anew, ran on worker 2 and
    was answered 200. The session's next request comes back to worker 1, which took that turn for
    its own unsure one (the same id, at the same place) and took it out of the store: a turn its
    client was told 200 for, gone for every worker (found by review). The stamp tells them apart."""
    store = UnreachableAfterPut(lands=False)
    w1, w2 = Worker(model, store, kv_budget_bytes=0), Worker(model, store)
    drive(w1.step, [(6, 1, prompt(1, 40), 2)])
    store.fail_next = True
    sent = prefill_records(6, 2, prompt(2, 30), 1, t_send=1_000)
    assert w1.step(as_batch([sent]))["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE
    store.down = False
    assert w2.step(as_batch([prefill_records(6, 2, prompt(2, 30), 1, t_send=2_000)]))["e"][0]["status"][0] == 200
    back = prefill_records(6, 3, prompt(3, 20), 1, t_send=3_000)
    back["flags"] |= records.CHUNK_F_MOVED
    assert w1.step(as_batch([back]))["e"][0]["status"][0] == 200
    assert [(m["token_start"], m["token_end"], m["request_id"]) for m in store.meta((0, 6))] == \
        [(0, 41, 1), (41, 71, 2), (71, 91, 3)]
    assert w1.stats["unsure_rolled_back"] == 0 and finished(w1)[-1].context_tokens == 91


def test_a_put_that_failed_is_not_taken_for_landed_when_a_retry_s_turn_is_there(model):
    """Worker 2 runs the client's retry of request 2 (stamped anew); while it runs, worker 1's
    put of the first try (timed out there, landing late) reaches the store. Worker 2's put then
    fails (the chain moved on), and the store's last delta names request 2 and ends where its copy
    does: it was taken for its own put whose reply was lost, and answered 200 with a turn the store
    did not hold (found by review). By id and stamp it is not: answered 503."""
    store = MemoryStore()
    drive(Worker(model, store).step, [(6, 1, prompt(1, 40), 1)])
    w1 = Worker(model, store)

    class LateFirstTry:                      # worker 2's view: worker 1's put lands just before its own
        def __getattr__(self, name):
            return getattr(store, name)

        def put(self, key, delta, meta):
            if store.meta(key)[-1]["request_id"] != 2:
                w1.step(as_batch([prefill_records(6, 2, prompt(2, 30), 1, t_send=1_000)]))
            return store.put(key, delta, meta)
    w2 = Worker(model, LateFirstTry())
    comp = w2.step(as_batch([prefill_records(6, 2, prompt(2, 30), 1, t_send=2_000)]))
    assert [(m["request_id"]) for m in store.meta((0, 6))] == [1, 2]
    assert comp["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE
    assert w2.stats["snapshot_replies_lost"] == 0 and w2.stats["snapshot_failures"] == 1


def test_a_rollback_whose_put_fails_leaves_the_store_holding_the_session(model):
    """The turn that timed out landed after all, and the retry takes it back out. That was a delete
    and then a put of the session whole: when that put failed too (or the worker died between the
    two), the store held nothing of the session, and the next worker to run it restored an empty
    context (found by review). The session now replaces its chain in one put: failing, the store
    keeps the chain (with the turn) and the session stays unsure, settled at the next request."""
    store, ref = UnreachableAfterPut(lands=True), Worker(model, MemoryStore())
    w = Worker(model, store, kv_budget_bytes=0)
    t1, t2 = (6, 1, prompt(1, 40), 2), (6, 2, prompt(2, 30), 1)
    drive(w.step, [t1]), drive(ref.step, [t1])
    store.fail_next = True
    assert w.step(as_batch([prefill_records(*t2)]))["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE
    store.down = False
    store.fail_puts = True                   # the store answers again, but its puts fail
    retry = (6, 3, t2[2], 1)
    assert w.step(as_batch([prefill_records(*retry)]))["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE
    assert store.held((0, 6))[0] == 71, "the chain is still there, with the turn taken late"
    store.fail_puts = False
    assert drive(w.step, [retry]) == drive(ref.step, [retry])
    assert [(m["token_start"], m["token_end"]) for m in store.meta((0, 6))] == [(0, 41), (41, 71)]
    assert store.meta((0, 6))[-1]["request_id"] == 3 and w.stats["unsure_rolled_back"] == 1


def test_what_the_store_lacks_before_a_turn_goes_in_as_a_delta_of_its_own(model):
    """A put that must also carry earlier entries the store lacks (here: a settle deleted the
    chain and its re-put failed) puts them as their own delta, naming no request, then the turn
    under its request's id: a replay of that request rolls back its turn only. Before, one delta
    spanned both under the later id, and a replay rolled both back."""
    store = MemoryStore()
    w = Worker(model, store, kv_budget_bytes=BIG)
    drive(w.step, [(2, 1, prompt(1, 40), 2)])
    store.delete((0, 2))
    w.sessions[(0, 2)].cache.snapshot_len = 0
    drive(w.step, [(2, 2, prompt(2, 30), 2)])
    assert [(m["token_start"], m["token_end"], m["request_id"]) for m in store.meta((0, 2))] == \
           [(0, 41, 0), (41, 72, 2)]


def test_a_replay_refused_before_it_began_leaves_neither_its_turn_nor_a_short_copy(model):
    """A replay whose own turn is in the store takes it back out and restores the session without
    it; refused at its first record (too large: the client is told 413), the store and the copy
    agree on the context before it, and the next request runs there. Before session 18 the store
    kept the first run's turn of a request answered 413 and the copy had to go; the next request
    ran on top of that turn."""
    store = MemoryStore()
    small = ModelConfig(max_context=160)
    m = Model(small, seed=0)
    first, other, ref = Worker(m, store), Worker(m, store), Worker(m, MemoryStore())
    t1, t2, t3 = (8, 1, prompt(1, 40), 2), (8, 2, prompt(2, 30), 2), (8, 3, prompt(3, 20), 2)
    drive(first.step, [t1]), drive(ref.step, [t1])
    drive(first.step, [t2])                                      # durable; its answer lost with the worker
    big = prefill_records(8, 2, prompt(4, 250), 2)               # request 2 again, replayed: too large now
    big["flags"] |= records.CHUNK_F_MOVED | records.CHUNK_F_REPLAY
    assert other.step(as_batch([big[:1]]))["e"][0]["status"][0] == wire.STATUS_TOO_LARGE
    assert store.held((0, 8))[0] == 41 and other.sessions[(0, 8)].cache.length == 41
    assert drive(other.step, [t3]) == drive(ref.step, [t3]), "on the context without turn 2"


def test_a_request_replayed_back_to_the_worker_that_holds_it_half_done_starts_over(model):
    """A zmq worker holding a request mid-prompt is marked down for a stall; the router replays
    the request, which comes back to this worker: its records, flagged REPLAY, start it over
    (before, they were appended to its first run's pieces: the prompt's start twice)."""
    w, ref = Worker(model, MemoryStore()), Worker(model, MemoryStore())
    t = (9, 1, prompt(5, 300), 3)
    first_piece = prefill_records(*t)[:1]
    assert w.step(as_batch([first_piece]))["e"][0]["status"][0] == wire.STATUS_OK
    assert drive(replayed(w.step), [t]) == drive(ref.step, [t])
    assert w.stats["superseded"] == 1 and finished(w)[-1].context_tokens == 300 + 2


def test_a_turn_refused_because_another_worker_moved_the_session_on_drops_the_copy(model):
    """The store holds another history of the session (another worker ran a turn of it, and this
    request was not flagged moved): the put is refused, the whole re-put too; the request is
    answered 503 and the stale copy goes, so the next request continues the store's history."""
    store = MemoryStore()
    a, b, ref = Worker(model, store), Worker(model, store), Worker(model, MemoryStore())
    t1, t2b, t2a, t3 = (5, 1, prompt(1, 40), 2), (5, 2, prompt(2, 20), 2), (5, 3, prompt(3, 30), 2), \
        (5, 4, prompt(4, 10), 2)
    drive(a.step, [t1]), drive(ref.step, [t1])
    drive(b.step, [t2b]), drive(ref.step, [t2b])
    comp = a.step(as_batch([prefill_records(5, 3, t2a[2], 1)]))
    assert comp["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE and not a.holds(5)
    assert store.held((0, 5))[0] == 41 + 21 and a.stats["store_errors"] == 1
    assert drive(a.step, [t3]) == drive(ref.step, [t3]), "continued from the store's history"


def replayed(step):
    """What the router sends when failover replays a request on another worker."""
    def exchange(batch):
        batch["flags"] |= records.CHUNK_F_MOVED | records.CHUNK_F_REPLAY
        return step(batch)
    return exchange


@pytest.mark.parametrize("max_out", [1, 3])
@pytest.mark.parametrize("whole", [False, True], ids=["delta", "whole re-put"])
def test_a_replay_whose_turn_is_already_durable_runs_from_before_it_and_is_stored_once(model, max_out, whole):
    """A worker finishes a request (its turn put, durable) and dies before the router has the
    answer: the router replays the request, flagged REPLAY, on another worker. The store's last
    delta names the request, so the replay takes that turn back out and runs from the context
    before it: the same tokens as the first run, and the store holds the turn once (the replay's). Before, the replay ran on top of
    its own turn (the prompt twice in the context: other tokens, and the turn stored twice).
    Also when the turn went in with a whole re-put (the store had evicted the chain): its turn
    is a delta of its own, so the roll-back is exact there too."""
    store = MemoryStore()
    turn1, turn2 = (7, 1, prompt(1, 40), 2), (7, 2, prompt(2, 64), max_out)
    first = Worker(model, store)
    drive(first.step, [turn1])
    if whole:
        store.evict((0, 7))                        # turn 2's put then goes in whole
    want = drive(first.step, [turn2])[2]           # durable; its completion "lost" with the worker
    held = store.held((0, 7))[0]
    assert held == 41 + 64 + max_out - 1 and first.stats["whole_reputs"] == whole
    replay = Worker(model, store)
    assert drive(replayed(replay.step), [turn2])[2] == want
    (done,) = finished(replay)
    assert done.context_tokens == held and done.restored_tokens == 41
    assert store.held((0, 7))[0] == held and len(store.restore((0, 7))) == 2, "the turn is in the store once"
    assert replay.stats["replays_durable"] == 1
    turn3 = (7, 3, prompt(3, 10), 2)                # and the session goes on from it
    ref = Worker(model, MemoryStore())
    drive(ref.step, [turn1]), drive(ref.step, [turn2])
    assert drive(replay.step, [turn3]) == drive(ref.step, [turn3])


def test_a_replay_back_on_the_worker_that_finished_it_runs_from_before_its_turn(model):
    """The worker finished the request and put its turn, but the answer was lost (a zmq worker
    given up on for a stall); the replay went elsewhere, that worker went down before running
    it, and the replay comes back here, where the session is held idle with the turn at its end.
    The store then agreed with this copy, so the copy was kept and the request ran on top of its
    own turn: other tokens, and the turn stored twice (found by review). A replay on a held,
    idle session now restores from the store, without the turn."""
    store = MemoryStore()
    turn1, turn2 = (7, 1, prompt(1, 40), 2), (7, 2, prompt(2, 64), 3)
    w = Worker(model, store)
    drive(w.step, [turn1])
    want = drive(w.step, [turn2])[2]
    held = store.held((0, 7))[0]
    assert drive(replayed(w.step), [turn2])[2] == want
    assert store.held((0, 7))[0] == held and len(store.restore((0, 7))) == 2, "the turn is in the store once"
    assert w.stats["replay_restored"] == 1 and w.stats["replays_durable"] == 1


def sent_at(step, t_send, replay=False):
    """The records stamped with the client's send time (the router copies the request's first
    chunk's onto every record of it), and flagged as a failover's replay if asked."""
    def exchange(batch):
        batch["t_send"] = t_send
        if replay:
            batch["flags"] |= records.CHUNK_F_MOVED | records.CHUNK_F_REPLAY
        return step(batch)
    return exchange


def test_a_replay_does_not_take_back_an_earlier_request_s_turn_that_reused_its_id(model):
    """The store's last turn is an answered request's; the client reuses its id for the session's
    next request, whose worker dies before its put, and the router replays it. The take-back
    matched by id alone removed the answered turn (the replay ran on a context without it, and
    the store lost it); the turn's send stamp tells the two requests apart."""
    store = MemoryStore()
    first, second = (7, 5, prompt(1, 40), 2), (7, 5, prompt(2, 30), 2)
    drive(sent_at(Worker(model, store).step, 1_000), [first])
    replay, ref = Worker(model, store), Worker(model, MemoryStore())
    got = drive(sent_at(replay.step, 2_000, replay=True), [second])
    drive(ref.step, [first])
    assert got == drive(ref.step, [second]), "on the context with the earlier turn"
    assert replay.stats["replays_durable"] == 0 and store.held((0, 7))[0] == 41 + 30 + 1


def test_a_moved_request_with_a_reused_id_is_no_replay(model):
    """Only the router's REPLAY flag means "maybe already durable": a request merely flagged
    MOVED whose id equals the store's last delta's (a client reusing ids) runs on the whole
    context."""
    store = MemoryStore()
    a, b = Worker(model, store), Worker(model, store)
    drive(a.step, [(7, 5, prompt(1, 40), 2)])

    drive(moved(b.step), [(7, 5, prompt(2, 10), 2)])
    assert finished(b)[-1].restored_tokens == 41 and b.stats["replays_durable"] == 0


def _sessions_kv_length(worker, sid):
    return worker.sessions[(0, sid)].cache.length


@pytest.mark.parametrize("where", ["resident", "restored on another worker"])
def test_a_verbatim_repeat_of_the_session_s_last_answered_request_is_409_not_run_again(model, where):
    """The router remembers finished requests for some 4,000 requests; a repeat of one after that
    (a client's verbatim resend, a late duplicate), same id and send stamp, ran again on top of
    its own turn: the prompt twice in the context, a history its client never had. The worker
    knows the session's last answered request (a resident copy's, or the store's last delta's)
    and refuses its every record 409. A new request that reuses the id with a new send stamp
    runs, and so does a failover's replay (CHUNK_F_REPLAY)."""
    store = MemoryStore()
    w = Worker(model, store)
    drive(sent_at(w.step, 1_000), [(7, 5, prompt(1, 200), 2)])
    assert len(finished(w)) == 1
    if where != "resident":
        w = Worker(model, store)
    recs = prefill_records(7, 5, prompt(1, 200), 2, t_send=1_000)
    comp = w.step(as_batch([recs]))
    assert comp["e"][0]["status"][:2].tolist() == [wire.STATUS_CONFLICT] * 2
    assert w.stats["duplicates_refused"] == 1 and store.held((0, 7))[0] == 201 and not finished(w)   # once a request
    assert not w.holds(7) or _sessions_kv_length(w, 7) == 201
    drive(sent_at(w.step, 2_000), [(7, 5, prompt(2, 30), 2)])     # the id reused: a new request
    assert store.held((0, 7))[0] == 201 + 30 + 1 and w.stats["duplicates_refused"] == 1


@pytest.mark.parametrize("where", ["resident", "restored on another worker"])
def test_a_verbatim_repeat_of_an_older_answered_request_is_409_too(model, where):
    """Only the session's last answered request was known: a late duplicate of the one before it
    ran again, its prompt a second time on top of two turns. The worker keeps the session's last
    ANSWERED_KEPT (8) answered requests, from its turns or from their deltas' headers."""
    store = MemoryStore()
    w = Worker(model, store)
    for rid, t in ((5, 1_000), (6, 2_000), (7, 3_000)):
        drive(sent_at(w.step, t), [(7, rid, prompt(rid, 20), 2)])
    held, _ = store.held((0, 7)), finished(w)
    if where != "resident":
        w = Worker(model, store)
    comp = w.step(as_batch([prefill_records(7, 5, prompt(5, 20), 2, t_send=1_000)]))
    assert comp["e"][0]["status"][0] == wire.STATUS_CONFLICT and store.held((0, 7)) == held
    assert w.stats["duplicates_refused"] == 1 and not finished(w)
    drive(sent_at(w.step, 4_000), [(7, 5, prompt(5, 20), 2)])           # the id with a new stamp runs
    assert store.held((0, 7))[0] == held[0] + 20 + 1


@pytest.mark.parametrize("begun_again_by", ["a failover's take-back", "a whole re-put"])
def test_a_verbatim_repeat_is_409_after_the_chain_was_begun_again(model, begun_again_by):
    """A chain begun again from token 0 (a replay taking its turn back out, a whole re-put after
    the store evicted the chain) names no request in its first delta: the turns it replaced took
    the answered requests' ids with them, and a verbatim resend of one ran again on a fresh
    worker, its prompt twice in the context (found by review). That delta carries them now."""
    store = MemoryStore()
    first = Worker(model, store)
    drive(sent_at(first.step, 101), [(7, 1, prompt(1, 40), 2)])
    if begun_again_by == "a whole re-put":
        store.evict((0, 7))
        drive(sent_at(first.step, 102), [(7, 2, prompt(2, 30), 2)])
        assert first.stats["whole_reputs"] == 1
    else:
        drive(sent_at(first.step, 102), [(7, 2, prompt(2, 30), 2)])   # durable; its worker "dies"
        replay = Worker(model, store)
        drive(sent_at(replay.step, 102, replay=True), [(7, 2, prompt(2, 30), 2)])
        assert replay.stats["replays_durable"] == 1
    held = store.held((0, 7))
    for rid, t in ((1, 101), (2, 102)):
        fresh = Worker(model, store)
        comp = fresh.step(as_batch([prefill_records(7, rid, prompt(rid, 40 if rid == 1 else 30), 2, t_send=t)]))
        assert comp["e"][0]["status"][0] == wire.STATUS_CONFLICT, (rid, comp["e"][0]["status"][0])
        assert fresh.stats["duplicates_refused"] == 1 and store.held((0, 7)) == held


def test_the_answered_requests_of_a_chain_are_its_last_eight_across_a_chain_begun_again(model):
    """A chain begun again lists 6; three named turns follow: the last 8 are the list's last 5,
    then the three, oldest first; a chain of named turns alone gives its last 8."""
    from datapath.serving.worker import _answered_of
    cache = KVCache(model.config)
    model.prefill(cache, prompt(1, 12))
    enc = lambda a, b, **kw: kvdelta.encode(kvdelta.export_delta(cache, a, b), model.config, "raw", **kw)
    begun = enc(0, 3, answered=tuple((i, 100 + i) for i in range(1, 7)))
    chain = [begun] + [enc(3 + i, 4 + i, request_id=7 + i, sent_ns=107 + i) for i in range(3)]
    assert _answered_of(chain) == tuple((i, 100 + i) for i in range(2, 10))
    named = [enc(i, i + 1, request_id=i + 1, sent_ns=101 + i) for i in range(10)]
    assert _answered_of(named) == tuple((i, 100 + i) for i in range(3, 11))
    assert _answered_of([enc(0, 12)]) == ()


def test_a_repeat_of_a_request_whose_turn_failed_runs(model):
    """Only a request answered 200 is remembered: one whose turn the store refused was answered
    503, and its client's verbatim resend must run."""
    store = MemoryStore()
    w = Worker(model, store)
    drive(sent_at(w.step, 1_000), [(7, 4, prompt(1, 20), 2)])
    store.fail_puts = True
    comp = w.step(as_batch([prefill_records(7, 5, prompt(2, 20), 1, t_send=2_000)]))
    assert comp["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE
    store.fail_puts = False
    got = drive(sent_at(w.step, 2_000), [(7, 5, prompt(2, 20), 1)])
    assert len(got[5]) == 1 and w.stats["duplicates_refused"] == 0 and store.held((0, 7))[0] == 21 + 20


@pytest.mark.parametrize("retried_on", ["the replay's worker", "another (the replay's died)"])
def test_a_replay_given_up_on_leaves_no_turn_of_it_in_the_store(model, retried_on):
    """A replay that found its first run's turn durable, and is then given up on (the router
    failed it, or its worker died: the client is told 503), leaves the store without that turn,
    so the client's retry (a new request) runs on the context it had. Before session 18 the
    replay kept the first run's turn in the store and the next request restored it: the retry ran
    on top of it, the prompt twice (found by review)."""
    store = MemoryStore()
    turn1, turn2 = (7, 1, prompt(1, 40), 2), (7, 2, prompt(2, 200), 2)
    w = Worker(model, store)
    drive(w.step, [turn1]), drive(w.step, [turn2])
    replay = Worker(model, store)
    piece = prefill_records(7, 2, prompt(2, 200), 2)[:1]
    piece["flags"] |= records.CHUNK_F_MOVED | records.CHUNK_F_REPLAY
    replay.step(as_batch([piece]))                   # its first piece only: then the router gives up
    assert replay.stats["replays_durable"] == 1 and store.held((0, 7))[0] == 41
    retry, ref = (7, 3, prompt(2, 200), 2), Worker(model, MemoryStore())
    drive(ref.step, [turn1])
    worker = replay if retried_on == "the replay's worker" else Worker(model, store)
    assert drive(worker.step, [retry]) == drive(ref.step, [retry]), "on the context before turn 2"
    done = finished(worker)[-1]
    assert done.context_tokens == 41 + 200 + 1 and done.snapshot_error is None
    assert store.held((0, 7))[0] == 41 + 200 + 1


def test_a_request_the_router_gave_up_on_is_released_and_its_session_evicted(model, monkeypatch):
    """The router expires a request still missing chunks (or fails it on a refusal) and tells no
    worker: after ABANDONED_NS untouched, its KV is cut back off the session, which can be evicted
    again, and a late piece of it is refused 503. Before, the session stayed pinned, over the
    budget, until its next request came."""
    from datapath.serving import worker as worker_mod
    w = Worker(model, MemoryStore(), kv_budget_bytes=1)
    w.step(as_batch([prefill_records(1, 1, prompt(1, 200), 2)[:1]]))   # piece 1 of 2 never comes
    drive(w.step, [(2, 2, prompt(2, 10), 1)])
    assert w.holds(1) and w.stats["abandoned"] == 0, "a live request is never released"
    monkeypatch.setattr(worker_mod, "ABANDONED_NS", 0)
    drive(w.step, [(3, 3, prompt(3, 10), 1)])
    assert not w.holds(1) and w.stats["abandoned"] == 1
    late = w.step(as_batch([prefill_records(1, 1, prompt(1, 200), 2)[1:]]))   # its piece 2 after all
    assert late["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE, "never run on a cut-back context"


def test_a_late_decode_step_of_a_released_request_is_503_and_few_are_remembered(model, monkeypatch):
    """A request released as abandoned while generating: a late decode step of it got 422, its
    pieces 503. And what is remembered of released requests grew by one per session that never
    came back; now the oldest are forgotten past ABANDONED_KEPT (both found by review)."""
    from datapath.serving import worker as worker_mod
    w = Worker(model, MemoryStore(), kv_budget_bytes=1)
    w.step(as_batch([prefill_records(1, 1, prompt(1, 20), 3)]))          # prefilled; decoding, then nothing
    monkeypatch.setattr(worker_mod, "ABANDONED_NS", 0)
    monkeypatch.setattr(worker_mod, "ABANDONED_KEPT", 2)
    drive(w.step, [(2, 2, prompt(2, 10), 1)])
    assert w.stats["abandoned"] == 1
    late = w.step(as_batch([decode_record(1, 1, 3)]))
    assert late["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE
    for sid in (3, 4, 5):
        w.step(as_batch([prefill_records(sid, sid, prompt(sid, 20), 3)]))
        drive(w.step, [(10 + sid, 10 + sid, prompt(sid, 5), 1)])
    assert w.stats["abandoned"] == 4 and list(w._abandoned) == [(0, 4), (0, 5)]


def test_close_frees_the_session_here_and_in_the_store(model):
    store = MemoryStore()
    w = Worker(model, store)
    drive(w.step, [(1, 1, prompt(1, 20), 2)])
    assert store.restore((0, 1))
    w.close(1)
    assert not w.holds(1) and store.restore((0, 1)) == []


def test_a_close_record_frees_the_session_and_a_reused_id_starts_fresh(model):
    store = MemoryStore()
    w = Worker(model, store)
    drive(w.step, [(1, 1, prompt(1, 20), 2)])
    close = np.zeros(1, dtype=records.CHUNK)
    close["session_id"], close["request_id"], close["kind"] = 1, 2, wire.KIND_CLOSE
    comp = w.step(as_batch([close]))
    assert comp["e"][0]["status"][0] == wire.STATUS_OK and w.stats["closed"] == 1
    assert not w.holds(1) and store.restore((0, 1)) == []
    again = drive(w.step, [(1, 3, prompt(9, 10), 3)])
    fresh = drive(Worker(model, MemoryStore()).step, [(1, 3, prompt(9, 10), 3)])
    assert again == fresh and finished(w)[-1].restored_tokens == 0


def test_corrupted_store_delta_is_refused(model):
    store = MemoryStore()
    drive(Worker(model, store, kv_budget_bytes=0).step, [(1, 1, prompt(1, 20), 2)])
    blob = bytearray(store.chains[(0, 1)][0])
    blob[-3] ^= 1
    store.chains[(0, 1)][0] = bytes(blob)
    w = Worker(model, store)
    comp = w.step(as_batch([prefill_records(1, 2, prompt(2, 5), 1)]))
    assert comp["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE and not w.holds(1)
    # a retry meets the same delta: the client's body says to start a new session, not to retry
    assert comp["e"][0]["flags"][0] == records.CE_KV_LOST


def test_a_store_error_the_worker_cannot_place_costs_a_503_that_says_no_reason(model):
    """Neither the store's failure nor its data's (a bug in a store, or here): no flag, so the
    client's body claims no reason it cannot stand behind."""
    w = Worker(model, FailingStore(RuntimeError("a bug")))
    comp = w.step(as_batch([prefill_records(1, 1, prompt(1, 20), 2)]))
    assert comp["e"][0]["status"][0] == wire.STATUS_UNAVAILABLE and comp["e"][0]["flags"][0] == 0


def test_zero_output_tokens_snapshots_the_prompt_only(model):
    store = MemoryStore()
    w = Worker(model, store, return_logits=True)
    assert drive(w.step, [(2, 1, prompt(2, 130), 0)]) == {1: []}
    (done,) = finished(w)
    assert done.tokens == [] and done.logits.shape == (0, 512)
    assert [(m["token_start"], m["token_end"]) for m in store.meta((0, 2))] == [(0, 130)]


def test_simulated_worker_spends_the_profile_time_and_keeps_real_kv(model):
    import time
    h100 = profile("h100")
    sim = Worker(model, MemoryStore(), device=SimulatedDevice(h100, "sleep"), return_logits=True)
    real = Worker(model, MemoryStore(), return_logits=True)
    req = (1, 1, prompt(1, 100), 4)
    t = time.monotonic()
    a = drive(sim.step, [req])
    elapsed = time.monotonic() - t
    assert a == drive(real.step, [req])
    want = h100.step_s(prefill=[(100, 0)]) + sum(h100.step_s(decode_contexts=[c]) for c in (100, 101, 102))
    assert sim.stats["simulated_s"] == pytest.approx(want)
    assert elapsed >= want  # a lower bound only: the machine may be slower, never faster
    (x,), (y,) = finished(sim), finished(real)
    assert np.array_equal(x.logits, y.logits) and x.snapshot_bytes == y.snapshot_bytes > 0



def test_a_straggler_answers_the_same_and_its_device_takes_its_factor(model):
    """bench compare --straggler: a worker slowed 3x computes what a healthy one does, and its
    simulated device takes 3x the profile's time (a lower bound on the wall time: the machine may
    be slower, never faster); without a device, its forward passes are slowed."""
    import time
    h100 = profile("h100")
    slow = Worker(model, MemoryStore(), device=SimulatedDevice(h100, "sleep"), slowdown=3)
    healthy = Worker(model, MemoryStore(), device=SimulatedDevice(h100, "sleep"))
    req = (1, 1, prompt(1, 100), 4)
    t = time.monotonic()
    got = drive(slow.step, [req])
    elapsed = time.monotonic() - t
    assert got == drive(healthy.step, [req])
    sim = slow.stats["simulated_s"]
    assert sim == pytest.approx(healthy.stats["simulated_s"])
    assert slow.stats["slowed_s"] == pytest.approx(2 * sim) and healthy.stats["slowed_s"] == 0
    assert elapsed >= 3 * sim
    bare = Worker(model, MemoryStore(), slowdown=50)   # (a factor past what the step's other work costs)
    t = time.monotonic()
    assert drive(bare.step, [req]) == got
    assert time.monotonic() - t >= bare.stats["slowed_s"] > 0 and bare.stats["simulated_s"] == 0
    Worker(model, slowdown=np.float32(4))
    for bad in (0.5, 0, float("nan"), float("inf"), 1001, "2", True):
        with pytest.raises(ValueError, match="slowdown must be a number from 1"):
            Worker(model, slowdown=bad)


def test_the_same_session_id_of_two_tenants_is_two_sessions(model):
    def as_tenant(t):
        def exchange(batch):
            batch["tenant"] = t
            return w.step(batch)
        return exchange
    store = MemoryStore()
    w = Worker(model, store, kv_budget_bytes=BIG)
    drive(as_tenant(0), [(5, 1, prompt(1, 200), 3)])
    got = drive(as_tenant(1), [(5, 2, prompt(2, 50), 3)])
    alone = drive(Worker(model, MemoryStore(), kv_budget_bytes=BIG).step, [(5, 2, prompt(2, 50), 3)])
    assert got == alone, "tenant 1's session 5 saw none of tenant 0's context"
    assert w.holds(5, tenant=0) and w.holds(5, tenant=1)
    assert [m["token_end"] for m in store.meta((0, 5))] == [202] and [m["token_end"] for m in store.meta((1, 5))] == [52]


def test_a_session_that_moved_on_is_not_continued_from_a_stale_resident_copy(model):
    """Turn 1 on worker A (kept resident), turn 2 on B (restored from the shared store), turn 3
    on A again, flagged by the router as moved: A's resident copy lacks turn 2, so A restores
    from the store instead of using it. Unflagged requests ask the store nothing."""
    store = MemoryStore()
    asked = []
    held = store.held
    store.held = lambda key: asked.append(key) or held(key)
    a = Worker(model, store, kv_budget_bytes=BIG, codec="zstd")
    b = Worker(model, store, kv_budget_bytes=BIG, codec="zstd")
    ref = Worker(model, MemoryStore(), kv_budget_bytes=BIG, codec="zstd")

    turns = [(4, 1, prompt(5, 40), 5), (4, 2, prompt(6, 30), 5), (4, 3, prompt(7, 20), 5), (4, 4, prompt(8, 9), 2)]
    got = [drive(a.step, [turns[0]]), drive(moved(b.step), [turns[1]]), drive(moved(a.step), [turns[2]])]
    assert len(asked) == 1, "B held nothing: nothing to check; A held a copy: one lookup"
    got.append(drive(a.step, [turns[3]]))
    assert len(asked) == 1, "a session that stays on its worker costs no lookup"
    assert got == [drive(ref.step, [t]) for t in turns]
    done = finished(a)
    assert done[1].restored_tokens == 40 + 4 + 30 + 4 and a.stats["restores"] == 1 and a.stats["stale_dropped"] == 1


def test_a_session_closed_on_another_worker_is_not_continued_from_a_stale_resident_copy(model):
    """Turn 1 on A (kept resident, durable), turn 2 on B, the client's CLOSE on B (the store's
    chain deleted), then the same session id again on A, flagged moved: the store holds less
    than A's copy, so A drops it and the reused id starts fresh, as on a worker that never saw
    it. Before, only a store holding more made the copy stale: A continued the closed session."""
    store = MemoryStore()
    a, b = Worker(model, store, kv_budget_bytes=BIG), Worker(model, store, kv_budget_bytes=BIG)

    drive(a.step, [(4, 1, prompt(5, 40), 3)])
    drive(moved(b.step), [(4, 2, prompt(6, 30), 3)])
    close = np.zeros(1, dtype=records.CHUNK)
    close["session_id"], close["request_id"], close["kind"] = 4, 3, wire.KIND_CLOSE
    assert b.step(as_batch([close]))["e"][0]["status"][0] == wire.STATUS_OK and store.restore((0, 4)) == []
    again = (4, 4, prompt(7, 20), 3)
    assert drive(moved(a.step), [again]) == drive(Worker(model, MemoryStore()).step, [again])
    assert finished(a)[-1].context_tokens == 20 + 2 and a.stats["stale_dropped"] == 1


def test_a_reused_session_id_grown_to_the_stale_copy_s_length_is_not_taken_for_it(model):
    """Turn 1 on A (resident, durable, 42 tokens), the client's CLOSE on B, the reused id's first
    turn on B to exactly 42 tokens too, then the session back on A, flagged moved: the store's
    chain ends at A's length but in a record A did not put or restore, so A drops its copy and
    restores B's. Before, the length alone was compared (docs/workers.md, session 18):
    A answered from the closed session's context."""
    store = MemoryStore()
    a, b = Worker(model, store, kv_budget_bytes=BIG), Worker(model, store, kv_budget_bytes=BIG)
    ref = Worker(model, MemoryStore())

    drive(a.step, [(4, 1, prompt(5, 40), 3)])
    close = np.zeros(1, dtype=records.CHUNK)
    close["session_id"], close["request_id"], close["kind"] = 4, 2, wire.KIND_CLOSE
    assert b.step(as_batch([close]))["e"][0]["status"][0] == wire.STATUS_OK and store.restore((0, 4)) == []
    anew, back = (4, 3, prompt(6, 40), 3), (4, 4, prompt(7, 20), 3)
    assert drive(moved(b.step), [anew]) == drive(ref.step, [anew])
    assert store.held((0, 4))[0] == a.sessions[(0, 4)].cache.length == 42, "the same length: the case"
    assert drive(moved(a.step), [back]) == drive(ref.step, [back])
    assert a.stats["stale_dropped"] == 1 and finished(a)[-1].restored_tokens == 42


def test_a_session_the_store_evicted_goes_back_in_whole_at_its_next_put(model):
    """The store's LRU drops a chain while the session stays resident on its worker: the next put
    (a delta from where the store no longer is) is refused, so the worker puts its whole copy
    from token 0, and another worker restoring it later continues from the whole context."""
    store = MemoryStore()
    w = Worker(model, store, kv_budget_bytes=BIG)
    ref = Worker(model, None, return_logits=True)
    turns = [(1, 1, prompt(1, 40), 2), (1, 2, prompt(2, 20), 2), (1, 3, prompt(3, 10), 2)]
    drive(w.step, turns[:1]), drive(ref.step, turns[:1])
    store.evict((0, 1))
    drive(w.step, turns[1:2]), drive(ref.step, turns[1:2])
    done = finished(w)[-1]
    assert done.snapshot_error is None and w.stats["whole_reputs"] == 1
    # prompts and all but each turn's last output, the turn its own delta
    assert [(m["token_start"], m["token_end"]) for m in store.meta((0, 1))] == [(0, 41), (41, 40 + 1 + 20 + 1)]
    other = Worker(model, store, return_logits=True)
    drive(other.step, turns[2:]), drive(ref.step, turns[2:])
    (got,), want = finished(other), finished(ref)[2]
    assert got.restored_tokens == 62
    assert np.array_equal(got.logits, want.logits), "restored whole: the never-evicted logits"


def test_resident_kv_bytes_follow_every_session_that_comes_grows_and_goes(model):
    """The worker keeps the resident total as sessions are made, restored, grown past their
    capacity, evicted, found stale and closed (it was a sum over every session each step)."""
    store = MemoryStore()
    one_session = KVCache(model.config).nbytes
    w = Worker(model, store, kv_budget_bytes=BIG)
    other = Worker(model, store, kv_budget_bytes=BIG)

    def held():
        return sum(s.cache.nbytes for s in w.sessions.values())

    drive(w.step, [(1, 1, prompt(1, 40), 2)])
    drive(w.step, [(2, 2, prompt(2, 300), 2)])     # grows past its first capacity, in three pieces
    assert w.kv_bytes_resident == held() > 3 * one_session
    w.kv_budget_bytes = held() + one_session // 2
    drive(w.step, [(3, 3, prompt(3, 40), 2)])      # over budget: the least recent idle one goes
    assert w.stats["evictions"] == 1 and not w.holds(1) and w.kv_bytes_resident == held()
    drive(w.step, [(1, 4, prompt(4, 20), 2)])      # session 1 back from the store
    assert w.stats["restores"] == 1 and w.kv_bytes_resident == held()
    drive(other.step, [(3, 5, prompt(5, 20), 2)])  # continued elsewhere: w's copy is stale
    drive(moved(w.step), [(3, 6, prompt(6, 20), 2)])
    assert w.stats["stale_dropped"] == 1 and w.kv_bytes_resident == held()
    for sid in list(w.sessions):
        w.close(sid[1], sid[0])
    assert w.kv_bytes_resident == held() == 0


def test_a_client_s_retry_after_its_only_worker_died_past_its_put_runs_on_the_context_before(model):
    """A real router and workers on one store: the only worker finishes request 2 (its turn put,
    durable) and dies before the router has the answer, so the client is told 503 (no worker to
    replay it on). The client's retry under the same ids, to the replacement, restored the chain
    with that turn and ran on top of it: a 200 with other tokens, the turn stored twice (a review's
    probe). The router now sends the retry as the lost try's replay, and the replacement takes
    the turn back first: the answer is the one a run without the death gives, the turn stored once."""
    from datapath.records import request_chunks
    from test_router import Bench
    store, b = MemoryStore(), Bench(n_workers=1)
    try:
        def serve(worker, die_after_put=False):
            """Worker 0's lane, stepped by `worker` until the router is idle; dying (its answer
            lost) right after the step that finished a request, if asked."""
            finished(worker)
            for _ in range(500):
                batch = b.workers[0].recv_batch(0)
                if batch is None:
                    b.router.poll()
                    b.collect()
                    if b.router.stats()["active_requests"] == 0:
                        return
                    continue
                comp = worker.step(batch)
                if die_after_put and finished(worker):
                    b.router.set_up(0, False)
                    b.router.poll()
                    b.collect()
                    return
                assert b.workers[0].send_completion(comp)
            raise AssertionError("the router did not go idle")

        first = Worker(model, store)
        b.send(request_chunks(1, prompt(1, 40), session=5, max_out=2, t_send=1000))
        serve(first)
        b.send(request_chunks(2, prompt(2, 64), session=5, max_out=3, t_send=2000))
        serve(first, die_after_put=True)
        assert [int(r["status"]) for r in b.responses] == [200, 503]
        held = store.held((0, 5))[0]
        assert held == 41 + 64 + 2, "its turn is in the store"
        b.workers[0].recv_batch(0)                     # (what the dead worker left in its lane)
        b.router.set_up(0, True)
        replacement = Worker(model, store)
        b.send(request_chunks(2, prompt(2, 64), session=5, max_out=3, t_send=3000))
        serve(replacement)
        ref = Worker(model, MemoryStore())
        drive(ref.step, [(5, 1, prompt(1, 40), 2)])
        want = drive(ref.step, [(5, 2, prompt(2, 64), 3)])[2]
        (retry,) = b.responses[2:]
        assert (int(retry["status"]), int(retry["t_send"])) == (200, 3000)
        assert retry["tokens"][:retry["n_out"]].tolist() == want, "run on the context before its lost turn"
        assert store.held((0, 5))[0] == held and replacement.stats["replays_durable"] == 1, "the turn stored once"
    finally:
        b.close()


@pytest.mark.parametrize("abandoned", [False, True], ids=["held", "released as abandoned"])
def test_a_retake_begins_its_request_again_whatever_of_the_lost_try_is_here(model, abandoned, monkeypatch):
    """A zmq worker given up on for a stall holds a replay's first piece; the router answered 503
    and the client's retry comes back here as that try's retake (its stamp, REPLAY, and RETAKE on
    the first record). Taken as the try going on, the piece ran twice (a review: 368 tokens of
    context, not 240); released as abandoned meanwhile, the retake was refused 503 at every try.
    The retake begins the request again: the context the request would have alone."""
    from datapath.serving import worker as wmod
    w = Worker(model, MemoryStore())
    drive(w.step, [(1, 1, prompt(1, 40), 1)])
    finished(w)
    replay = prefill_records(1, 2, prompt(2, 200), 1, t_send=1000)
    replay["flags"] |= records.CHUNK_F_REPLAY
    w.step(as_batch([replay[:1]]))                   # its first piece; then the stall
    if abandoned:                                    # (its stall outlasted the worker's patience)
        monkeypatch.setattr(wmod, "ABANDONED_NS", 0)
        w._release_abandoned()
        assert w._abandoned[(0, 1)] == (2, 1000)
    retake = prefill_records(1, 2, prompt(2, 200), 1, t_send=1000)
    retake["flags"] |= records.CHUNK_F_REPLAY
    retake["flags"][0] |= records.CHUNK_F_RETAKE
    comp = w.step(as_batch([retake]))
    assert comp["e"][0]["status"][:len(retake)].tolist() == [200] * len(retake)
    (done,) = finished(w)
    assert done.context_tokens == 40 + 200, "the first piece once"
    ref = Worker(model, MemoryStore())
    drive(ref.step, [(1, 1, prompt(1, 40), 1)])
    assert done.tokens == drive(ref.step, [(1, 2, prompt(2, 200), 1)])[2]
