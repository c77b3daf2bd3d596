"""Simulated device profiles, for heterogeneous worker pools without a GPU.

A profile prices a model step on some device as if it ran a target model
(Llama-3-8B by default) with a roofline: a step takes the longer of its
compute (2 x params FLOP per token plus attention over the context, at a
fraction of peak) and its memory traffic (the weights once per step plus every
session's KV, at a fraction of peak bandwidth), plus a fixed per-step
overhead. A worker in simulated mode runs the real tiny model (so its KV cache
and snapshots are real) and then spends the rest of the profile's step time,
sleeping or busy-waiting.

The figures are vendors' datasheet peaks and public list prices; the
utilisation fractions are assumptions (typical of published serving
measurements), written next to each number. They are for comparing routing
and placement policies, not for predicting any one deployment.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .model import LLAMA3_8B_KV_BYTES_PER_TOKEN, ModelConfig

GB = 1e9
GiB = 1 << 30
TFLOPS = 1e12


@dataclass(frozen=True)
class TargetModel:
    """The model whose cost a profile simulates."""
    name: str
    n_params: float
    weight_bytes: float
    kv_bytes_per_token: int
    attn_flops_per_token_per_ctx: float  # 4 x layers x heads x head dim (QK^T and PV)


# Llama-3-8B: 8.03 B parameters in bf16; 32 layers, 32 query heads of 128 dims, 8 KV heads.
LLAMA3_8B = TargetModel("llama-3-8b", 8.03e9, 2 * 8.03e9, LLAMA3_8B_KV_BYTES_PER_TOKEN, 4 * 32 * 32 * 128)


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    mem_bandwidth: float     # bytes/s, peak
    peak_flops: float        # FLOP/s, dense fp16/bf16, peak
    memory_bytes: float
    price_per_hour: float    # USD
    compute_util: float      # fraction of peak FLOP/s a prefill reaches (assumption)
    bandwidth_util: float    # fraction of peak bandwidth a decode step reaches (assumption)
    step_overhead_s: float   # per step: launch, scheduling (assumption)
    source: str
    target: TargetModel = LLAMA3_8B

    def step_s(self, prefill: list[tuple[int, int]] = (), decode_contexts: list[int] = ()) -> float:
        """Seconds for one step: prefill segments as (n_tokens, context before them), decode tokens by context."""
        t = self.target
        flops = 0.0
        kv_read = 0.0
        for n, ctx in prefill:
            flops += n * (2 * t.n_params + t.attn_flops_per_token_per_ctx * (ctx + n / 2))
            kv_read += (ctx + n) * t.kv_bytes_per_token
        for ctx in decode_contexts:
            flops += 2 * t.n_params + t.attn_flops_per_token_per_ctx * ctx
            kv_read += (ctx + 1) * t.kv_bytes_per_token
        if not flops:
            return 0.0
        compute = flops / (self.peak_flops * self.compute_util)
        memory = (t.weight_bytes + kv_read) / (self.mem_bandwidth * self.bandwidth_util)
        return max(compute, memory) + self.step_overhead_s

    @property
    def knee_tokens(self) -> int:
        """Tokens a step can carry before its compute outlasts reading the weights: up to here a
        step costs about the same whatever it carries (a dynamic batcher's best token budget,
        as chunked-prefill schedulers pick theirs); past it, every token adds its FLOPs' time."""
        t = self.target
        weights_s = t.weight_bytes / (self.mem_bandwidth * self.bandwidth_util)
        return max(1, int(weights_s * self.peak_flops * self.compute_util / (2 * t.n_params)))

    def prefill_s_per_token(self, batch: int, context: int, chunk: int = 128) -> float:
        """A step prefilling one `chunk`-token chunk for each of `batch` sessions at `context`."""
        return self.step_s(prefill=[(chunk, context)] * batch) / (batch * chunk)

    def decode_s_per_token(self, batch: int, context: int) -> float:
        return self.step_s(decode_contexts=[context] * batch) / batch

    @property
    def kv_capacity_tokens(self) -> int:
        """Target-model tokens of KV that fit beside the weights."""
        return max(0, int((self.memory_bytes - self.target.weight_bytes) // self.target.kv_bytes_per_token))

    def kv_budget_bytes(self, config: ModelConfig) -> int:
        """The same token capacity, in the tiny model's KV bytes: what a simulated worker may keep."""
        return self.kv_capacity_tokens * config.kv_bytes_per_token


PROFILES = {p.name: p for p in (
    DeviceProfile(
        "cpu", mem_bandwidth=307 * GB, peak_flops=32.8 * TFLOPS, memory_bytes=128 * GiB, price_per_hour=1.61,
        compute_util=0.3, bandwidth_util=0.6, step_overhead_s=200e-6,
        source="one 16-core 4th-gen Xeon socket (Sapphire Rapids): 8 channels DDR5-4800 = 307 GB/s; AMX "
               "1024 BF16 FLOP/cycle/core x 16 cores x 2.0 GHz = 32.8 TFLOPS (Intel AMX documentation); "
               "128 GiB and USD 1.61/h: AWS m7i.8xlarge on-demand list price, us-east-1, 2024"),
    DeviceProfile(
        "l4", mem_bandwidth=300 * GB, peak_flops=121 * TFLOPS, memory_bytes=24 * GB, price_per_hour=0.71,
        compute_util=0.5, bandwidth_util=0.8, step_overhead_s=50e-6,
        source="NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, 121 TFLOPS FP16/BF16 dense (242 with sparsity); "
               "USD 0.71/h: Google Cloud g2-standard-4 (one L4) on-demand list price, us-central1, 2024"),
    DeviceProfile(
        "h100", mem_bandwidth=3350 * GB, peak_flops=989 * TFLOPS, memory_bytes=80 * GB, price_per_hour=2.99,
        compute_util=0.5, bandwidth_util=0.8, step_overhead_s=30e-6,
        source="NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS BF16 dense (1979 with sparsity); "
               "USD 2.99/h: on-demand price of one H100 SXM GPU at GPU clouds (Lambda list price), 2024"),
    DeviceProfile(
        "dpu", mem_bandwidth=89.6 * GB, peak_flops=1.0 * TFLOPS, memory_bytes=32 * GB, price_per_hour=0.10,
        compute_util=0.4, bandwidth_util=0.6, step_overhead_s=100e-6,
        source="NVIDIA BlueField-3 DPU datasheet: 16 Arm Cortex-A78 cores, 32 GB DDR5-5600 on two 64-bit "
               "channels = 89.6 GB/s; FP16 peak = 16 cores x 2 NEON FMA pipes x 8 lanes x 2 FLOP x 2.0 GHz "
               "= 1.0 TFLOPS (derived); no hourly price exists: USD 0.10/h assumes a ~USD 2,600 card "
               "amortised over 3 years"),
)}


def profile(name: str) -> DeviceProfile:
    if name not in PROFILES:
        raise ValueError(f"unknown device profile {name!r}: choose one of {', '.join(PROFILES)}")
    return PROFILES[name]


class SimulatedDevice:
    """Makes each worker step last as long as the profile says, by sleeping or spinning."""

    MODES = ("sleep", "busy")

    def __init__(self, prof: DeviceProfile, mode: str = "sleep"):
        if mode not in self.MODES:
            raise ValueError(f"simulation mode must be one of {', '.join(self.MODES)}, got {mode!r}")
        self.profile, self.mode = prof, mode

    def spend_until(self, deadline_ns: int):
        now = time.monotonic_ns()
        if now >= deadline_ns:   # the real compute took longer already
            return
        if self.mode == "sleep":
            time.sleep((deadline_ns - now) / 1e9)
        else:
            while time.monotonic_ns() < deadline_ns:
                pass
