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
    assert np.array_equal(model.layers[2]["wqkv"], again.layers[2]["wqkv"])
    assert not np.array_equal(model.layers[2]["wqkv"], other.layers[2]["wqkv"])
    toks = prompt(1, 20)
    a, b = model.prefill(KVCache(model.config), toks), again.prefill(KVCache(again.config), toks)
    assert np.array_equal(a, b)


def reference_logits(model, toks):
    """The same transformer written out plainly, a token and a head at a time (float64, K/V
    rounded to fp16 as the cache keeps them): what the vectorised forward must compute."""
    c = model.config
    nq, nkv, hd, half = c.n_heads, c.n_kv_heads, c.head_dim, c.head_dim // 2
    g = nq // nkv

    def norm(v, w):
        return v / np.sqrt(np.mean(v * v) + c.norm_eps) * w

    def rope(v, pos):                     # rotate each pair (i, i + half) by pos * theta^(-2i/hd)
        ang = pos * c.rope_theta ** (-2.0 * np.arange(half) / hd)
        a, b = v[:half], v[half:]
        return np.concatenate([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)])
    xs = [model.embed[t].astype(np.float64) for t in toks]
    for w in model.layers:
        wqkv = w["wqkv"].astype(np.float64)
        wq, wk, wv = wqkv[:, :nq * hd], wqkv[:, nq * hd:(nq + nkv) * hd], wqkv[:, (nq + nkv) * hd:]
        K, V, out = [], [], []
        for pos, x in enumerate(xs):
            h = norm(x, w["attn_norm"])
            K.append([rope(k, pos).astype(np.float16).astype(np.float64) for k in (h @ wk).reshape(nkv, hd)])
            V.append([v.astype(np.float16).astype(np.float64) for v in (h @ wv).reshape(nkv, hd)])
            heads = []
            for j, q in enumerate((h @ wq).reshape(nq, hd)):
                q = rope(q, pos)
                scores = np.array([q @ K[t][j // g] for t in range(pos + 1)]) / np.sqrt(hd)
                p = np.exp(scores - scores.max())
                heads.append(sum(pi * V[t][j // g] for t, pi in enumerate(p / p.sum())))
            out.append(x + np.concatenate(heads) @ w["wo"])
        gate_up = w["w_gate_up"].astype(np.float64)
        xs = []
        for x in out:
            h = norm(x, w["mlp_norm"])
            gate, up = h @ gate_up[:, :c.d_ff], h @ gate_up[:, c.d_ff:]
            xs.append(x + (gate / (1 + np.exp(-gate)) * up) @ w["w_down"])
    return np.array([norm(x, model.final_norm) @ model.head for x in xs])


def test_forward_computes_the_transformer_written_out_plainly(model):
    """Chunks of a prompt then decode steps, against the plain reference: RoPE, GQA, the causal
    mask, RMSNorm and SwiGLU as written, not only consistent with themselves."""
    toks = prompt(11, 40)
    cache = KVCache(model.config)
    got = [model.forward([(cache, toks[:25])], all_logits=True)[0],
           model.forward([(cache, toks[25:37])], all_logits=True)[0]]
    got += [model.forward([(cache, toks[i:i + 1])], all_logits=True)[0] for i in range(37, 40)]
    np.testing.assert_allclose(np.concatenate(got), reference_logits(model, toks), rtol=0, atol=LOGIT_ATOL)


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


def test_a_long_segment_attends_in_blocks_its_memory_linear_and_its_result_the_chunks(model):
    """A session's pieces in one worker step are one segment, up to the step's token budget. Its
    attention took the whole (heads, n, n) scores and an (n, n) mask: 60 MiB at 1,024 tokens,
    ~1 GiB at 4,096 (found by review). In blocks of 128 queries it is what prefill's 128-token
    chunks give, bit for bit, and the step's peak is what the activations take."""
    import tracemalloc
    toks = prompt(11, 1024)
    one, chunks = KVCache(model.config), KVCache(model.config)
    one.reserve(toks.size)
    tracemalloc.start()
    try:
        got = model.forward([(one, toks)])[0]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 24 << 20, f"{peak / 2**20:.1f} MiB for a 1,024-token segment"
    want = model.prefill(chunks, toks, chunk=128)
    assert np.array_equal(got, want) and np.array_equal(one.k[:, :, :1024], chunks.k[:, :, :1024])


def test_n_params_counts_every_weight(model):
    """The embedding and the head are separate matrices: the count (which `model info` prints and
    the worker's memory guard multiplies) had the head left out, 7% short here (found by review)."""
    arrays = [model.embed, model.head, model.final_norm] + [a for layer in model.layers for a in layer.values()]
    assert model.config.n_params == sum(a.size for a in arrays) == 918_656


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
    assert sample(lg, 1e-308, (5, 1, 0)) == int(np.argmax(lg)), "a temperature the CLI takes (it drew from NaN)"
    p = np.exp(lg.astype(np.float64) - lg.max())
    p /= p.sum()
    freq = np.bincount([sample(lg, 1.0, (3, 9, i)) for i in range(20_000)], minlength=p.size) / 20_000
    assert np.abs(freq - p).max() < 0.015, "draws follow softmax(logits / T)"   # (fixed seeds: no flake)


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelConfig(n_heads=4, n_kv_heads=3)
