"""`datapath model info` and `datapath worker`: sizes printed, user errors in one sentence."""
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
    assert capsys.readouterr().out.strip() == \
        "datapath worker: give one of --lane NAME, --zmq ENDPOINT or --demo N"
    assert main(["model", "info", "--heads", "3"]) == 2
    assert "Traceback" not in capsys.readouterr().out
    assert main(["worker", "--zmq", "nonsense"]) == 1
    assert "cannot bind zmq lane at nonsense" in capsys.readouterr().out
    assert main(["worker", "--lane", "zl-no-such-lane"]) == 1
    assert "no ring named 'zl-no-such-lane.lane'" in capsys.readouterr().out
