"""The tiny transformer: deterministic, chunked prefill equals one-shot, batched step equals separate steps.

Tolerances: chunked and one-shot prefill write the same K/V up to one fp16
rounding (BLAS sums a row differently in matrices of different heights), so
logits agree to 5e-3 absolute on logits whose spread is ~4 (worst seen over
150 random splits: 1.1e-3); greedy tokens agree wherever the top two logits
are further apart than twice that (one position of this prompt is a near-tie).
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapath.serving.model import LLAMA3_8B_KV_BYTES_PER_TOKEN, KVCache, Model, ModelConfig, kv_bytes_per_token, sample

LOGIT_ATOL = 5e-3


@pytest.fixture(scope="module")
def model():
    return Model(ModelConfig(), seed=0)


def prompt(seed, n, vocab=512):
    return np.random.default_rng(seed).integers(0, vocab, n)


def test_kv_size_formula():
    c = ModelConfig()
    assert c.kv_bytes_per_token == 2 * 4 * 2 * 32 * 2 == 1024
    assert LLAMA3_8B_KV_BYTES_PER_TOKEN == 128 * 1024
    cache = KVCache(c)
    cache.reserve(10)
    assert cache.nbytes == cache.capacity * c.kv_bytes_per_token
    assert kv_bytes_per_token(n_layers=2, n_kv_heads=1, head_dim=8, bytes_per_elem=2) == 64


def test_weights_are_deterministic_per_seed(model):
    again, other = Model(ModelConfig(), seed=0), Model(ModelConfig(), seed=1)
    assert np.array_equal(model.layers[2]["wq"], again.layers[2]["wq"])
    assert not np.array_equal(model.layers[2]["wq"], other.layers[2]["wq"])
    toks = prompt(1, 20)
    a, b = model.prefill(KVCache(model.config), toks), again.prefill(KVCache(again.config), toks)
    assert np.array_equal(a, b)


@pytest.fixture(scope="module")
def one_shot(model):
    toks = prompt(7, 333)
    cache = KVCache(model.config)
    return toks, model.forward([(cache, toks)], all_logits=True)[0], cache


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(1, 128), min_size=3, max_size=333))
def test_chunked_prefill_matches_one_shot(model, one_shot, sizes):
    """Any split into chunks of at most 128 tokens."""
    toks, ref, one = one_shot
    cache, got, i = KVCache(model.config), [], 0
    for n in sizes:
        if i >= toks.size:
            break
        got.append(model.forward([(cache, toks[i:i + n])], all_logits=True)[0])
        i += n
    if i < toks.size:
        got.append(model.prefill(cache, toks[i:], chunk=128, all_logits=True))
    got = np.concatenate(got)
    assert cache.length == one.length == toks.size
    np.testing.assert_allclose(got, ref, rtol=0, atol=LOGIT_ATOL)
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * LOGIT_ATOL
    assert clear.sum() > 300 and np.array_equal(got.argmax(axis=1)[clear], ref.argmax(axis=1)[clear])
    # the caches hold the same K/V up to one fp16 rounding step
    np.testing.assert_allclose(cache.k[:, :, :toks.size], one.k[:, :, :toks.size], rtol=2e-3, atol=2e-3)


def test_prefill_chunks_of_128_equal_forward_in_same_order(model):
    """Same chunks in the same order: bit-identical."""
    toks = prompt(8, 300)
    a, b = KVCache(model.config), KVCache(model.config)
    la = model.prefill(a, toks, chunk=128)
    for i in range(0, 300, 128):
        lb = model.forward([(b, toks[i:i + 128])])[0]
    assert np.array_equal(la, lb) and np.array_equal(a.k, b.k)


def test_batched_step_over_sessions_with_different_contexts(model):
    caches = []
    for n in (1, 50, 129, 300):
        c = KVCache(model.config)
        model.prefill(c, prompt(n, n))
        caches.append(c)
    alone = [model.decode(c.clone(), 3 + i) for i, c in enumerate(caches)]
    mixed_prefill = KVCache(model.config)
    together = model.forward([(c, [3 + i]) for i, c in enumerate(caches)] + [(mixed_prefill, prompt(9, 40))])
    for a, b in zip(alone, together):
        np.testing.assert_allclose(b, a, rtol=0, atol=LOGIT_ATOL)
        assert a.argmax() == b.argmax()
    assert [c.length for c in caches] == [2, 51, 130, 301] and mixed_prefill.length == 40


def test_segment_rules(model):
    c = KVCache(model.config)
    with pytest.raises(ValueError, match="only once"):
        model.forward([(c, [1]), (c, [2])])
    with pytest.raises(ValueError, match="token ids"):
        model.forward([(c, [512])])
    small = Model(ModelConfig(max_context=64))
    with pytest.raises(ValueError, match="max_context"):
        small.prefill(KVCache(small.config), prompt(1, 65))


def test_sampling(model):
    lg = model.prefill(KVCache(model.config), prompt(3, 10))
    assert sample(lg) == int(np.argmax(lg))
    draws = [sample(lg, 1.0, (5, 1, i)) for i in range(200)]
    assert draws == [sample(lg, 1.0, (5, 1, i)) for i in range(200)], "seeded: reproducible"
    assert len(set(draws)) > 1, "temperature 1 does not always pick the argmax"
    cold = [sample(lg, 1e-3, (5, 1, i)) for i in range(50)]
    assert set(cold) == {int(np.argmax(lg))}


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelConfig(n_heads=4, n_kv_heads=3)
