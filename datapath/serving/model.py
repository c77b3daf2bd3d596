"""A tiny but real decoder-only transformer in numpy, with a per-session KV cache.

Token embedding, RoPE, grouped-query attention, RMSNorm, SwiGLU MLP and an output
head; weights are drawn from a seeded generator, so every process that
builds Model(config, seed) holds the same model. Compute is float32; the KV
cache stores float16, and a step writes its own K/V to the cache before it
attends, so a token's attention reads the same fp16 values whichever chunk,
step or process produced them. That is what makes restored sessions continue
bit for bit, given steps of the same make-up: a BLAS product's row may round
differently with the number of rows beside it (other sessions in the step).

One forward pass (Model.forward) runs any mix of segments, one per session: a
prefill chunk or a single decode token, each against its own cache and
context length. The linear layers see all segments' tokens as one matrix;
attention runs per segment.

KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per
element: 1 KiB for the default below, 128 KiB for Llama-3-8B (32 x 8 x 128, fp16).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import numpy as np

KV_DTYPE = np.dtype(np.float16)
ATTEND_ROWS = 128   # a segment's queries attend this many at a time: its scores grow with it, not its square


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    d_ff: int = 384
    max_context: int = 16384
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("vocab", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.vocab > 1 << 32:
            raise ValueError(f"vocab must be at most 2**32 (token ids are u32 on the wire), not {self.vocab}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.n_layers, self.n_kv_heads, self.head_dim, KV_DTYPE.itemsize)

    @property
    def n_params(self) -> int:
        d, hd = self.d_model, self.head_dim
        attn = d * hd * (self.n_heads * 2 + self.n_kv_heads * 2)
        mlp = 3 * d * self.d_ff
        return 2 * self.vocab * d + self.n_layers * (attn + mlp + 2 * d) + d   # embedding and head: untied

    def as_dict(self) -> dict:
        return asdict(self)


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, bytes_per_elem: int = 2) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes per element."""
    return 2 * n_layers * n_kv_heads * head_dim * bytes_per_elem


# The figure docs/workers.md quotes, so nobody takes "< 4 KiB per delta" for a big model.
LLAMA3_8B_KV_BYTES_PER_TOKEN = kv_bytes_per_token(n_layers=32, n_kv_heads=8, head_dim=128)


class KVCache:
    """One session's K and V for every layer: (layers, KV heads, capacity, head dim) in fp16.

    `length` tokens are valid; `snapshot_len` of them are already in the store,
    the last of them in the store's record numbered `snapshot_seq` (0: no
    chain there), which tells this copy's chain from one another worker put
    since, even to the same length (the worker's _moved_on).
    Capacity grows by doubling, so appending is amortized O(1); resident bytes
    count the allocation, which is what the memory budget pays for.
    """

    def __init__(self, config: ModelConfig, capacity: int = 128):
        self.config = config
        shape = (config.n_layers, config.n_kv_heads, capacity, config.head_dim)
        self.k = np.zeros(shape, KV_DTYPE)
        self.v = np.zeros(shape, KV_DTYPE)
        self.length = 0
        self.snapshot_len = 0
        self.snapshot_seq = 0
        self.snapshot_codec: str | None = None   # the codec of the store's chain it continues (None: none)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def reserve(self, n: int):
        need = self.length + n
        if need > self.config.max_context:
            raise ValueError(f"context would reach {need} tokens, the model's max_context is {self.config.max_context}")
        if need <= self.capacity:
            return
        cap = min(max(need, 2 * self.capacity), self.config.max_context)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = np.zeros(old.shape[:2] + (cap,) + old.shape[3:], KV_DTYPE)
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)

    def append(self, k: np.ndarray, v: np.ndarray):
        """Append entries shaped (layers, KV heads, n, head dim), e.g. an imported delta."""
        n = k.shape[2]
        self.reserve(n)
        self.k[:, :, self.length:self.length + n] = k
        self.v[:, :, self.length:self.length + n] = v
        self.length += n

    def entries(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of K and V for tokens [start, end), shaped (layers, KV heads, n, head dim)."""
        return self.k[:, :, start:end].copy(), self.v[:, :, start:end].copy()

    def clone(self) -> "KVCache":
        c = KVCache(self.config, self.capacity)
        c.k[...], c.v[...] = self.k, self.v
        c.length, c.snapshot_len, c.snapshot_seq = self.length, self.snapshot_len, self.snapshot_seq
        c.snapshot_codec = self.snapshot_codec
        return c


@functools.lru_cache(maxsize=ATTEND_ROWS)
def _causal(n: int) -> np.ndarray:
    """(n, n): 0 on and below the diagonal, -inf above (a query's later keys). Read-only: shared."""
    m = np.triu(np.full((n, n), -np.inf, np.float32), k=1)
    m.flags.writeable = False
    return m


def _rmsnorm(x, w, eps):
    return x * (1.0 / np.sqrt((x * x).sum(axis=-1, keepdims=True) / np.float32(x.shape[-1]) + eps)) * w


def _silu(x):
    return x / (1.0 + np.exp(-x))


class Model:
    def __init__(self, config: ModelConfig = ModelConfig(), seed: int = 0):
        self.config, self.seed = config, seed
        c = config
        rng = np.random.default_rng(seed)

        def w(fan_in, *shape):
            # divided in place (in float64, rounded to float32, as ever): through a float64
            # temporary of the whole matrix, a vocab-heavy shape took ~4x its weights to build
            a = rng.standard_normal(shape, dtype=np.float32)
            return np.divide(a, np.sqrt(fan_in), out=a, casting="same_kind")

        self.embed = rng.standard_normal((c.vocab, c.d_model), dtype=np.float32)
        self.layers = []
        for _ in range(c.n_layers):
            wq = w(c.d_model, c.d_model, c.n_heads * c.head_dim)
            wk = w(c.d_model, c.d_model, c.n_kv_heads * c.head_dim)
            wv = w(c.d_model, c.d_model, c.n_kv_heads * c.head_dim)
            wo = w(c.n_heads * c.head_dim, c.n_heads * c.head_dim, c.d_model)
            w_gate, w_up = w(c.d_model, c.d_model, c.d_ff), w(c.d_model, c.d_model, c.d_ff)
            # Q, K, V side by side, and gate beside up: one matrix product each instead of three
            # and two (a step's cost at a few tokens is numpy's per-call overhead, not FLOPs)
            self.layers.append(dict(
                attn_norm=np.ones(c.d_model, np.float32),
                wqkv=np.concatenate([wq, wk, wv], axis=1),
                wo=wo,
                mlp_norm=np.ones(c.d_model, np.float32),
                w_gate_up=np.concatenate([w_gate, w_up], axis=1),
                w_down=w(c.d_ff, c.d_ff, c.d_model),
            ))
        self.final_norm = np.ones(c.d_model, np.float32)
        # A separate head (tied, a random model mostly repeats its input token), scaled so
        # logits spread by a few units, as peaked as a trained model's rather than near-uniform.
        self.head = w(c.d_model, c.d_model, c.vocab)
        self.head *= np.float32(4.0)
        inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim))
        angles = np.outer(np.arange(c.max_context, dtype=np.float64), inv_freq)
        # rotate-half RoPE as x * cos + swap_halves(x) * sin, with the sign in the sine's first half
        self.rope_cos = np.tile(np.cos(angles), 2).astype(np.float32)
        self.rope_sin = np.concatenate([-np.sin(angles), np.sin(angles)], axis=1).astype(np.float32)

    def _attend(self, q, cache: KVCache, layer: int, start: int):
        """GQA attention of q (n, heads, hd) at positions start.. over cache[:start + n], each
        query masked from the later keys of its own segment. ATTEND_ROWS queries at a time: a
        session's pieces in one step are one segment (up to the step's token budget, 8,192 tokens
        at most), and its whole (heads, n, start + n) scores and (n, n) mask took ~1 GiB at 4,096
        tokens (found by review)."""
        n = q.shape[0]
        if n > ATTEND_ROWS:
            return np.concatenate([self._attend(q[i:i + ATTEND_ROWS], cache, layer, start + i)
                                   for i in range(0, n, ATTEND_ROWS)])
        c = self.config
        g = c.n_heads // c.n_kv_heads
        s = start + n
        k = cache.k[layer, :, :s].astype(np.float32)                      # (kvh, s, hd)
        v = cache.v[layer, :, :s].astype(np.float32)
        qg = q.reshape(n, c.n_kv_heads, g, c.head_dim).transpose(1, 2, 0, 3).reshape(c.n_kv_heads, g * n, c.head_dim)
        scores = (qg @ k.transpose(0, 2, 1)).reshape(c.n_kv_heads, g, n, s) * np.float32(1.0 / np.sqrt(c.head_dim))
        if n > 1:               # only the block's own keys can be in the future
            scores[..., start:] += _causal(n)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        out = scores.reshape(c.n_kv_heads, g * n, s) @ v                  # (kvh, g*n, hd)
        return out.reshape(c.n_kv_heads, g, n, c.head_dim).transpose(2, 0, 1, 3).reshape(n, c.n_heads * c.head_dim)

    def forward(self, segments: list[tuple[KVCache, np.ndarray]], all_logits: bool = False) -> list[np.ndarray]:
        """One model step over several sessions: segments of (cache, new tokens).

        Appends every segment's K/V to its cache and returns, per segment, the
        logits of its last token (vocab,), or of all its tokens (n, vocab).
        A cache must appear at most once per step.
        """
        c = self.config
        if len({id(cache) for cache, _ in segments}) != len(segments):
            raise ValueError("a session can appear only once in a step (merge its chunks)")
        toks = [np.asarray(t, dtype=np.int64).reshape(-1) for _, t in segments]
        for t in toks:
            if t.size == 0:
                raise ValueError("a segment needs at least one token")
            if t.min() < 0 or t.max() >= c.vocab:
                raise ValueError(f"token ids must be in [0, {c.vocab})")
        starts = [cache.length for cache, _ in segments]
        for (cache, _), t in zip(segments, toks):
            cache.reserve(t.size)
        bounds = np.cumsum([0] + [t.size for t in toks])
        positions = np.concatenate([st + np.arange(t.size) for st, t in zip(starts, toks)])
        # once a step, not once a layer: each row's rotation
        cos, sin = self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :]
        x = self.embed[np.concatenate(toks)]
        n_all, nq, nkv, half = x.shape[0], c.n_heads, c.n_kv_heads, c.head_dim // 2
        for li, w in enumerate(self.layers):
            h = _rmsnorm(x, w["attn_norm"], c.norm_eps)
            qkv = (h @ w["wqkv"]).reshape(n_all, nq + 2 * nkv, c.head_dim)
            qk = qkv[:, :nq + nkv]                  # Q and K rotate alike
            qk = qk * cos + np.concatenate([qk[..., half:], qk[..., :half]], axis=-1) * sin
            q, k, v = qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv:]
            attn = np.empty((n_all, nq * c.head_dim), np.float32)
            for i, (cache, _) in enumerate(segments):
                a, b, st = bounds[i], bounds[i + 1], starts[i]
                # Write first, then attend: the chunk reads its own K/V back as fp16, like any later step.
                cache.k[li, :, st:st + b - a] = k[a:b].transpose(1, 0, 2)
                cache.v[li, :, st:st + b - a] = v[a:b].transpose(1, 0, 2)
                attn[a:b] = self._attend(q[a:b], cache, li, st)
            x = x + attn @ w["wo"]
            h = _rmsnorm(x, w["mlp_norm"], c.norm_eps)
            gate_up = h @ w["w_gate_up"]
            x = x + (_silu(gate_up[:, :c.d_ff]) * gate_up[:, c.d_ff:]) @ w["w_down"]
        for (cache, _), t in zip(segments, toks):
            cache.length += t.size
        rows = x if all_logits else x[bounds[1:] - 1]
        logits = _rmsnorm(rows, self.final_norm, c.norm_eps) @ self.head
        if all_logits:
            return [logits[bounds[i]:bounds[i + 1]] for i in range(len(segments))]
        return list(logits)

    def prefill(self, cache: KVCache, tokens, chunk: int = 128, all_logits: bool = False):
        """Prefill in chunks of at most `chunk` tokens against the cached KV; logits of the last (or all)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        out = []
        for i in range(0, tokens.size, chunk):
            out.append(self.forward([(cache, tokens[i:i + chunk])], all_logits)[0])
        return np.concatenate(out) if all_logits else out[-1]

    def decode(self, cache: KVCache, token: int) -> np.ndarray:
        return self.forward([(cache, np.array([token]))])[0]


def sample(logits: np.ndarray, temperature: float = 0.0, seed: tuple[int, ...] = (0,)) -> int:
    """Greedy when temperature is 0; otherwise one draw from softmax(logits / T).

    The generator is seeded per draw (e.g. by (seed, session, position)), so a
    restored session samples exactly what it would have without eviction.
    """
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64)
    # the maximum taken out before dividing: a tiny temperature (1e-308 is accepted) made the
    # logits inf, then inf - inf NaN, and the draw raised out of the worker's step (found by review)
    with np.errstate(over="ignore"):     # (-inf, whose exp is 0: as greedy)
        p = np.exp((z - z.max()) / temperature)
    c = np.cumsum(p)
    return min(int(np.searchsorted(c, _uniform(seed) * c[-1], side="right")), p.size - 1)


_M64 = (1 << 64) - 1


def _uniform(seed: tuple[int, ...]) -> float:
    """A draw in [0, 1) that is a function of the seed's ints: splitmix64's mix folded over them (a
    counter-based generator). A numpy Generator made per draw cost ~50 us a token (review)."""
    h = 0
    for x in seed:
        h = (h ^ (int(x) & _M64)) + 0x9E3779B97F4A7C15 & _M64
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & _M64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _M64
        h ^= h >> 31
    return (h >> 11) * 2.0 ** -53
