"""Run a benchmark suite as a user would and read the JSON it writes (for the suites' contract tests)."""
import json
import subprocess
import sys

import pytest


def run_suite(suite: str, tmp_path, *extra: str, timeout: float = 300,
              env: dict | None = None) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / f"{suite}.json"
    r = subprocess.run([sys.executable, "-m", "bench", suite, "--quick", "--json", str(out), *extra],
                       capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text()), r


def disk_dir(path) -> str:
    """path, for a suite's image files, if it is on a disk (the suites refuse a filesystem in memory)."""
    from bench.snapshot import MEMORY_FILESYSTEMS, _mount
    fstype = _mount(str(path))[1]
    if fstype in MEMORY_FILESYSTEMS:
        pytest.skip(f"the suite's images need a disk: {path} is on {fstype}")
    return str(path)
