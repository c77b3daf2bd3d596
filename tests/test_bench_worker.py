"""bench worker --quick follows the contract and reports the issue's metric and reference names."""
from bench_support import run_suite
from datapath.serving import kvdelta


def test_worker_suite_names_and_ratios(tmp_path):
    data, _ = run_suite("worker", tmp_path, timeout=120)
    m, refs, ratios = data["metrics"], data["references"], data["ratios"]
    for b in (1, 8, 32):
        for ctx in (128, 2048):
            assert f"step_ms_b{b}_ctx{ctx}" in m
    for codec in ("raw", "zstd", "lz4", "int8_zstd"):
        for name in (f"delta_bytes_decode_step_{codec}", f"delta_bytes_chunk128_{codec}",
                     f"codec_encode_ns_per_kib_{codec}", f"codec_decode_ns_per_kib_{codec}"):
            assert name in m, name
    for ctx in (512, 2048):
        assert f"restore_ms_ctx{ctx}_vs_recompute_ms_ctx{ctx}" in ratios and f"recompute_ms_ctx{ctx}" in refs
    assert any("8192 skipped" in n for n in data["notes"]), "quick mode says what it skipped"
    hdr = kvdelta.HEADER_LEN
    assert m["delta_bytes_decode_step_raw"] == hdr + 1024 and m["delta_bytes_chunk128_raw"] == hdr + 128 * 1024
    assert 0 <= m["int8_greedy_mismatch_rate_per_step"] <= 1
    for name, value in ratios.items():
        metric, ref = name.split("_vs_")
        assert abs(value - m[metric] / refs[ref]) < 1e-9
