"""`datapath model info` and `datapath worker`: sizes printed, user errors in one sentence."""
import pytest

from datapath.cli import main


def test_model_info_prints_the_formula_and_measured_sizes(capsys):
    assert main(["model", "info"]) == 0
    out = capsys.readouterr().out
    assert "= 1,024 bytes" in out and "Llama-3-8B (2 x 32 x 8 x 128 x 2): 131,072 bytes" in out
    assert "raw        decode step   1,080 B   128-token chunk   131,128 B" in out
    assert all(f"  {d:<5} decode" in out for d in ("cpu", "l4", "h100", "dpu"))
    assert main(["model", "info", "--layers", "2"]) == 0
    assert "= 512 bytes" in capsys.readouterr().out


def test_worker_demo_runs_requests_through_the_native_router(capsys):
    assert main(["worker", "--demo", "2", "--prompt-tokens", "130", "--output-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count(": status 200, 3 tokens") == 2 and "KV resident 512 KiB" in out


def test_user_errors_are_one_sentence(capsys):
    assert main(["worker"]) == 2
    assert capsys.readouterr().err.strip() == \
        "datapath worker: give one of --lane NAME, --zmq ENDPOINT or --demo N"
    assert main(["model", "info", "--heads", "3"]) == 2
    assert "must be a multiple of n_kv_heads" in capsys.readouterr().err
    assert main(["worker", "--zmq", "nonsense"]) == 1
    assert "cannot bind zmq lane at nonsense" in capsys.readouterr().err
    assert main(["worker", "--lane", "zl-no-such-lane"]) == 1
    assert "no ring named 'zl-no-such-lane.lane'" in capsys.readouterr().err


@pytest.mark.parametrize("args,says", [
    (["model", "info", "--kv-heads", "0"], "--kv-heads: 0 must be positive"),      # was a ZeroDivisionError
    (["model", "info", "--layers", "-1"], "--layers: -1 must be positive"),        # printed -131,200 parameters
    (["model", "info", "--seed", "-1"], "--seed: -1 must be 0 or more"),
    (["worker", "--demo", "1", "--prompt-tokens", "0"], "--prompt-tokens: 0 must be positive"),   # hung 600 s
    (["worker", "--demo", "1", "--output-tokens", "-1"], "--output-tokens: -1 must be positive"),  # OverflowError
    (["worker", "--demo", "1", "--output-tokens", "300"], "--output-tokens: 300 must be at most 256"),
    (["ingress", "stats", "nan"], "interval: nan must be positive"),
    (["ingress", "stats", "1", "-p", "99999999999"], "must be at most 4294967295"),
    (["model", "info", "--layers", "9" * 400], "is not a whole number"),        # OverflowError in isfinite
])
def test_bad_numbers_are_usage_errors_naming_the_flag(capsys, args, says):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_model_info_of_a_model_too_large_to_build_prints_its_sizes(capsys):
    big = ["--layers", "32", "--heads", "32", "--kv-heads", "8", "--head-dim", "128", "--d-model", "4096"]
    assert main(["model", "info", *big]) == 0
    out = capsys.readouterr().out
    assert "= 131,072 bytes" in out and "stored delta: not measured (the model would take 5.6 GiB" in out
