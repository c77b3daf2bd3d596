"""Routing policies' distribution properties, through the same C functions the router calls."""
import numpy as np
import pytest

from datapath._dataplane import ffi, lib
from datapath.router import policies

SESSIONS = np.random.default_rng(7).integers(1, 1 << 63, size=20000, dtype=np.uint64)


def view(n, depth=None, weight=None, up=None, generation=1, tokens=None):
    w = ffi.new("struct dp_workers *")
    w.n = n
    w.generation = generation
    for j in range(n):
        w.depth[j] = 0 if depth is None else depth[j]
        w.tokens[j] = 0 if tokens is None else tokens[j]
        w.weight[j] = 1 if weight is None else weight[j]
        w.up[j] = 1 if up is None else up[j]
    w.total_depth = sum(w.depth[j] for j in range(n))
    w.total_tokens = sum(w.tokens[j] for j in range(n))
    return w


def decide(policy, w, sessions=SESSIONS, param=0.0, seed=3):
    out = np.zeros(len(sessions), dtype=np.int32)
    s = np.ascontiguousarray(sessions, dtype=np.uint64)
    rc = lib.dp_policy_map(policy.encode(), param, seed, w, ffi.from_buffer("uint64_t[]", s),
                           ffi.from_buffer("int32_t[]", out), len(s))
    assert rc == 0
    return out


def test_round_robin_is_exactly_balanced_and_skips_down_workers():
    out = decide("round_robin", view(5, up=[1, 1, 0, 1, 1]))
    counts = np.bincount(out, minlength=5)
    assert counts[2] == 0 and set(counts[[0, 1, 3, 4]]) == {5000}


@pytest.mark.parametrize("policy", ["least_loaded", "power_of_two"])
def test_load_aware_policies_avoid_deep_lanes(policy):
    depth = [0, 50, 50, 50, 50, 50, 50, 50]
    out = decide(policy, view(8, depth=depth))
    share = np.mean(out == 0)
    if policy == "least_loaded":
        assert share == 1.0
    else:  # worker 0 wins every pair it is drawn into: 1 - (7/8 * 6/7) = 1/4
        assert 0.22 < share < 0.28
    assert -1 not in out


def test_least_tokens_goes_by_tokens_not_chunks_and_spreads_ties():
    # worker 0: 8 one-token decodes; worker 1: one 128-token chunk; 2 and 3: two 100-token chunks
    w = view(4, depth=[8, 1, 2, 2], tokens=[8, 128, 200, 200])
    assert set(decide("least_tokens", w, SESSIONS[:100])) == {0}
    assert set(decide("least_loaded", w, SESSIONS[:100])) == {1}
    assert list(np.bincount(decide("least_tokens", view(3), SESSIONS[:300]), minlength=3)) == [100, 100, 100]
    assert 1 not in decide("least_tokens", view(4, up=[1, 0, 1, 1]), SESSIONS[:300])


def test_no_worker_up_means_no_choice():
    for policy in policies():
        assert set(decide(policy, view(4, up=[0, 0, 0, 0]), SESSIONS[:50])) == {-1}


def test_power_of_two_with_one_worker():
    assert set(decide("power_of_two", view(1), SESSIONS[:100])) == {0}


def test_weighted_follows_weights():
    out = decide("weighted", view(4, weight=[1, 2, 3, 0]))
    share = np.bincount(out, minlength=4) / len(out)
    assert share[3] == 0
    assert np.allclose(share[:3], [1 / 6, 2 / 6, 3 / 6], atol=0.02)


def test_affinity_is_stable_and_balanced():
    w = view(16)
    a, b = decide("affinity", w), decide("affinity", w, seed=99)
    assert (a == b).all(), "a session's worker does not depend on randomness"
    counts = np.bincount(a, minlength=16)
    assert counts.min() > 0.5 * counts.mean() and counts.max() < 1.6 * counts.mean()


def test_affinity_removing_a_worker_moves_only_its_sessions():
    before = decide("affinity", view(16))
    up = [1] * 16
    up[5] = 0
    after = decide("affinity", view(16, up=up, generation=2))
    moved = before != after
    assert (before[moved] == 5).all() and (after != 5).all()
    assert moved.sum() == (before == 5).sum()


def test_affinity_adding_a_worker_moves_about_one_in_n():
    before = decide("affinity", view(16))
    after = decide("affinity", view(17, generation=2))
    moved = before != after
    assert (after[moved] == 16).all(), "sessions move only to the new worker"
    assert 0.5 / 17 < moved.mean() < 2.0 / 17


def test_affinity_bounded_load_sheds_an_overloaded_worker():
    sessions = SESSIONS[:5000]
    home = decide("affinity", view(8), sessions)
    depth = [10] * 8
    depth[int(home[0])] = 1000          # the first session's worker is far above the mean
    moved = decide("affinity", view(8, depth=depth), sessions, param=0.25)
    hot = home == home[0]
    assert (moved[hot] != home[0]).all()
    assert (moved[~hot] == home[~hot]).all(), "everyone else keeps their worker"
