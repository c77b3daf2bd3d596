"""Simulated device profiles: the roofline behaves as a roofline, capacities follow from memory."""
import pytest

from datapath.serving.devices import LLAMA3_8B, PROFILES, SimulatedDevice, profile
from datapath.serving.model import ModelConfig


@pytest.mark.parametrize("name", ["cpu", "l4", "h100", "dpu"])
def test_builtin_profile_shapes(name):
    p = profile(name)
    assert p.source and p.price_per_hour > 0
    # decode: the weights are read once per step, so per-token time falls with batch and rises with context
    assert p.decode_s_per_token(8, 2048) < p.decode_s_per_token(1, 2048) < p.decode_s_per_token(1, 8192)
    # prefill is compute-heavier per step, cheaper per token than decode, and attention grows with context
    assert p.prefill_s_per_token(1, 0) < p.decode_s_per_token(1, 0)
    assert p.prefill_s_per_token(1, 8192) > p.prefill_s_per_token(1, 0)
    assert p.step_s() == 0.0


def test_memory_bound_decode_is_weights_over_bandwidth():
    h = profile("h100")
    weights_only = LLAMA3_8B.weight_bytes / (h.mem_bandwidth * h.bandwidth_util) + h.step_overhead_s
    assert h.step_s(decode_contexts=[0]) == pytest.approx(weights_only, rel=1e-3)


def test_kv_capacity_and_budget():
    h = profile("h100")
    tokens = (80e9 - LLAMA3_8B.weight_bytes) // LLAMA3_8B.kv_bytes_per_token
    assert h.kv_capacity_tokens == tokens
    assert h.kv_budget_bytes(ModelConfig()) == tokens * 1024
    assert profile("l4").kv_capacity_tokens < h.kv_capacity_tokens


@pytest.mark.parametrize("name", ["cpu", "l4", "h100", "dpu"])
def test_a_step_costs_the_same_up_to_the_knee_and_grows_past_it(name):
    p = profile(name)
    knee = p.knee_tokens
    one, at_knee = p.step_s(prefill=[(1, 0)]), p.step_s(prefill=[(knee, 0)])
    assert at_knee == pytest.approx(one, rel=0.01), "flat: the weights' read sets the step"
    assert p.step_s(prefill=[(knee + max(2, knee // 10), 0)]) > 1.05 * at_knee
    twice, four = (p.step_s(prefill=[(n * knee, 0)]) - p.step_overhead_s for n in (2, 4))
    assert four == pytest.approx(2 * twice, rel=0.01), "past it, compute-bound: linear in tokens"
    assert profile("l4").knee_tokens == 252     # 16.06 GB / 240 GB/s x 60.5 TFLOP/s / 16.06 GFLOP a token


def test_faster_devices_are_faster():
    order = sorted(PROFILES.values(), key=lambda p: p.decode_s_per_token(8, 2048))
    assert [p.name for p in order] == ["h100", "l4", "cpu", "dpu"]


def test_bad_names():
    with pytest.raises(ValueError, match="unknown device profile 'tpu'"):
        profile("tpu")
    with pytest.raises(ValueError, match="simulation mode"):
        SimulatedDevice(profile("cpu"), "nap")
