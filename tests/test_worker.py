"""The worker core, driven directly: lifecycle, snapshot on completion, LRU eviction after durability, restore.

The snapshot store is the in-memory stand-in (tests/memstore.py); the lane is
bypassed by calling Worker.step with dp_chunk records.
"""
import numpy as np
import pytest

from datapath import wire
from datapath.chunk import make_batch
from datapath.serving.devices import SimulatedDevice, profile
from datapath.serving.model import KVCache, Model, ModelConfig, sample
from datapath.serving.worker import Worker
from serving_support import MemoryStore, chunks, prompt, run

BIG = 1 << 30


@pytest.fixture(scope="module")
def model():
    return Model(ModelConfig(), seed=0)


def test_request_lifecycle(model):
    store = MemoryStore()
    w = Worker(model, store, kv_budget_bytes=BIG, codec="zstd", return_logits=True)
    toks = prompt(1, 300)
    c = chunks(5, 1, toks, max_out=8, t_send=123)
    (done,) = run(w, [c[:2], c[2:]])
    assert done.status == "ok" and len(done.tokens) == 8 and done.logits.shape == (8, 512)
    # the same computation by hand, in the same order: chunks 0+1 in one step, chunk 2, then decode
    cache = KVCache(model.config)
    model.forward([(cache, np.array(toks[:256]))])
    lg = model.forward([(cache, np.array(toks[256:]))])[0]
    want, want_logits = [], []
    for _ in range(8):
        want.append(sample(lg))
        want_logits.append(lg)
        if len(want) < 8:
            lg = model.decode(cache, want[-1])
    assert done.tokens == want and np.array_equal(done.logits, np.array(want_logits))
    s = done.stamps
    assert s["t_send"] == 123 and s["t_worker"] <= s["t_prefill_done"] <= s["t_first_token"] <= s["t_snapshot"] <= s["t_done"]
    assert done.context_tokens == 300 + 7 and done.kv_bytes_resident == w.kv_bytes_resident > 0
    (meta,) = store.meta(5)
    assert (meta["token_start"], meta["token_end"], meta["codec"]) == (0, 307, "zstd")
    assert done.snapshot_bytes == len(store.restore(5)[0])


@pytest.mark.parametrize("codec", ["raw", "zstd", "lz4"])
def test_evict_restore_continue_equals_never_evicted(model, codec):
    store = MemoryStore()
    first, second = Worker(model, store, kv_budget_bytes=0, codec=codec, return_logits=True), \
        Worker(model, store, kv_budget_bytes=BIG, codec=codec, return_logits=True)
    ref = Worker(model, None, kv_budget_bytes=BIG, return_logits=True)
    turn1, turn2 = chunks(9, 1, prompt(2, 200), 6), chunks(9, 2, prompt(3, 150), 6)
    a1 = run(first, [turn1])[0]
    assert not first.holds(9) and first.stats["evictions"] == 1, "budget 0: evicted once durable"
    b2 = run(second, [turn2])[0]
    r1, r2 = run(ref, [turn1])[0], run(ref, [turn2])[0]
    assert b2.restored_tokens == 200 + 5 and second.stats["restores"] == 1
    assert a1.tokens == r1.tokens and b2.tokens == r2.tokens
    assert np.array_equal(b2.logits, r2.logits), "lossless restore continues bit for bit"
    assert [m["token_start"] for m in store.meta(9)] == [0, 205]


def test_int8_restore_continues_with_bounded_logit_error(model):
    store = MemoryStore()
    first, second = Worker(model, store, kv_budget_bytes=0, codec="int8_zstd"), \
        Worker(model, store, codec="int8_zstd", return_logits=True)
    ref = Worker(model, None, return_logits=True)
    turn1, turn2 = chunks(4, 1, prompt(5, 200), 1), chunks(4, 2, prompt(6, 20), 1)
    run(first, [turn1]), run(ref, [turn1])
    err = np.abs(run(second, [turn2])[0].logits - run(ref, [turn2])[0].logits).max()
    assert 0 < err < 0.25, err


def test_eviction_waits_for_a_durable_snapshot(model):
    store = MemoryStore()
    store.fail_puts = True
    w = Worker(model, store, kv_budget_bytes=0)
    (done,) = run(w, [chunks(1, 1, prompt(1, 50), 3)])
    assert done.status == "ok" and done.snapshot_error and done.snapshot_bytes == 0
    assert w.holds(1) and w.stats["over_budget_steps"] > 0, "not durable, so kept over budget"
    store.fail_puts = False
    (done,) = run(w, [chunks(1, 2, prompt(2, 10), 3)])
    assert done.snapshot_error is None and not w.holds(1)
    (meta,) = store.meta(1)
    assert (meta["token_start"], meta["token_end"]) == (0, 50 + 2 + 10 + 2), "one delta from the last durable point"


def test_lru_evicts_the_least_recently_used_idle_session(model):
    one_session = KVCache(model.config).nbytes  # every session here stays within 128 tokens
    w = Worker(model, MemoryStore(), kv_budget_bytes=3 * one_session - 1)
    for sid in (1, 2):
        run(w, [chunks(sid, 1, prompt(sid, 40), 2)])
    run(w, [chunks(1, 2, prompt(7, 10), 2)])  # session 1 is now more recent than 2
    run(w, [chunks(3, 1, prompt(3, 40), 2)])
    assert w.holds(1) and not w.holds(2) and w.holds(3) and w.stats["evictions"] == 1


def test_sessions_generating_are_never_evicted(model):
    w = Worker(model, MemoryStore(), kv_budget_bytes=0)
    w.step(make_batch(chunks(1, 1, prompt(1, 30), 5) + chunks(2, 1, prompt(2, 30), 5)))
    assert w.holds(1) and w.holds(2) and w.busy
    done = run(w, [])
    assert sorted(c.session_id for c in done) == [1, 2] and not w.holds(1) and not w.holds(2)


def test_bad_chunks_get_error_completions(model):
    store = MemoryStore()
    w = Worker(model, store)
    c = chunks(1, 1, prompt(1, 200), 4)
    (err,) = w.step(make_batch([c[1]]))
    assert "out of order" in err.status and err.request_id == 1
    w.step(make_batch([c[0]]))
    (busy,) = w.step(make_batch(chunks(1, 2, prompt(2, 5), 1)))
    assert "busy with request 1" in busy.status
    bad = make_batch(chunks(3, 1, prompt(3, 5), 1))
    bad[0]["chunk_index"] = 4
    assert "malformed" in w.step(bad)[0].status


def test_close_frees_the_session_here_and_in_the_store(model):
    store = MemoryStore()
    w = Worker(model, store)
    run(w, [chunks(1, 1, prompt(1, 20), 2)])
    assert store.restore(1)
    assert w.step(make_batch([dict(session_id=1, kind=wire.KIND_CLOSE)])) == []
    assert not w.holds(1) and store.restore(1) == []


def test_corrupted_store_delta_fails_the_request_clearly(model):
    store = MemoryStore()
    run(Worker(model, store, kv_budget_bytes=0), [chunks(1, 1, prompt(1, 20), 2)])
    blob = bytearray(store.chains[1][0])
    blob[-3] ^= 1
    store.chains[1][0] = bytes(blob)
    (done,) = Worker(model, store).step(make_batch(chunks(1, 2, prompt(2, 5), 1)))
    assert done.status.startswith("restore failed: KV delta for tokens 0..21 is corrupted")


def test_simulated_worker_spends_the_profile_time_and_keeps_real_kv(model):
    import time
    h100 = profile("h100")
    sim = Worker(model, MemoryStore(), device=SimulatedDevice(h100, "sleep"), return_logits=True)
    real = Worker(model, MemoryStore(), return_logits=True)
    req = chunks(1, 1, prompt(1, 100), 4)
    t = time.monotonic()
    (a,) = run(sim, [req])
    elapsed = time.monotonic() - t
    (b,) = run(real, [req])
    want = h100.step_s(prefill=[(100, 0)]) + sum(h100.step_s(decode_contexts=[c]) for c in (100, 101, 102))
    assert sim.stats["simulated_s"] == pytest.approx(want)
    assert elapsed >= want  # a lower bound only: the machine may be slower, never faster
    assert a.tokens == b.tokens and np.array_equal(a.logits, b.logits)
    assert a.snapshot_bytes == b.snapshot_bytes > 0


def test_zero_output_tokens_snapshots_the_prompt_only(model):
    from datapath.serving.worker import Completion
    store = MemoryStore()
    (done,) = run(Worker(model, store, return_logits=True), [chunks(2, 1, prompt(2, 130), 0)])
    assert done.status == "ok" and done.tokens == [] and done.logits.shape == (0, 512)
    assert [(m["token_start"], m["token_end"]) for m in store.meta(2)] == [(0, 130)]
    back = Completion.from_frames(done.to_frames())
    assert back.tokens == [] and back.logits.shape == (0, 512) and back.stamps == done.stamps
