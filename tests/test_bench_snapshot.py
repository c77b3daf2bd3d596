"""bench snapshot --quick follows the contract and reports every figure the issue names."""
import os
import subprocess
import sys

import pytest
from bench_support import disk_dir, run_suite

from bench.snapshot import _mount

REFERENCES = {"raw_write_sync_p50_us", "raw_write_sync_p99_us", "raw_read_p50_us", "raw_write_sync_per_s",
              "raw_read_chain1_p50_us", "raw_read_chain8_p50_us", "raw_read_chain64_p50_us", "raw_scan_ms_per_gib"}
METRICS = {"put_4k_p50_us", "put_4k_p99_us", "put_records_per_s_w1", "put_records_per_s_w4",
           "put_records_per_s_w16", "restore_chain1_p50_us", "restore_chain8_p50_us", "restore_chain64_p50_us",
           "index_bytes_per_session", "recovery_ms_per_gib"}


@pytest.mark.slow
def test_snapshot_suite_quick(tmp_path):
    data, _ = run_suite("snapshot", tmp_path, env=dict(os.environ, ZEROLAYER_BENCH_DIR=disk_dir(tmp_path)))
    assert REFERENCES <= set(data["references"]) and METRICS <= set(data["metrics"])
    for name in ("put_4k_p50_us_vs_raw_write_sync_p50_us", "restore_chain64_p50_us_vs_raw_read_chain64_p50_us",
                 "put_records_per_s_w16_vs_raw_write_sync_per_s", "recovery_ms_per_gib_vs_raw_scan_ms_per_gib"):
        metric, ref = name.split("_vs_")
        assert data["ratios"][name] == pytest.approx(data["metrics"][metric] / data["references"][ref])
    assert all(v > 0 for v in {**data["references"], **data["metrics"]}.values())
    assert "device" in data["machine"] and str(tmp_path) in data["machine"]["device"]
    assert os.listdir(tmp_path) == ["snapshot.json"]           # the images are removed


@pytest.mark.skipif(_mount("/dev/shm")[1] != "tmpfs", reason="needs /dev/shm on tmpfs to refuse")
@pytest.mark.parametrize("suite", ["snapshot", "nvmetcp"])
def test_a_bench_dir_in_memory_is_refused_before_the_run(tmp_path, suite):
    """tmpfs takes O_DIRECT and ignores it: the raw references and the store were both memory copies
    (a put 3x its "raw write + fdatasync" of 1.7 us), reported ok (found by review)."""
    out = tmp_path / f"{suite}.json"
    r = subprocess.run([sys.executable, "-m", "bench", suite, "--quick", "--json", str(out)], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, ZEROLAYER_BENCH_DIR="/dev/shm"))
    assert r.returncode == 2 and "is on tmpfs, in memory" in r.stderr and not out.exists()
