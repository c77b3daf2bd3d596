"""bench nvmetcp --quick follows the contract: every remote figure next to its local reference, same run."""
import os

from bench_support import disk_dir, run_suite

PAIRS = ["put_4k_p50_us", "put_4k_p99_us", "put_64k_p50_us", "restore_chain8_p50_us", "put_records_per_s_w16",
         "open_ms"]


def test_nvmetcp_suite_quick(tmp_path):
    data, _ = run_suite("nvmetcp", tmp_path, timeout=120, env=dict(os.environ, ZEROLAYER_BENCH_DIR=disk_dir(tmp_path)))
    for name in PAIRS:
        metric, ref = f"remote_{name}", f"local_{name}"
        assert data["metrics"][metric] > 0 and data["references"][ref] > 0
        assert data["ratios"][f"{metric}_vs_{ref}"] == data["metrics"][metric] / data["references"][ref]
    assert "127.0.0.1" in data["machine"]["device"]
    assert os.listdir(tmp_path) == ["nvmetcp.json"]           # the images are removed
