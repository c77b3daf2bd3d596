"""scripts/setup.sh: idempotent, and clear when it cannot run."""
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SETUP = str(ROOT / "scripts/setup.sh")


@pytest.mark.root
@pytest.mark.slow
def test_second_setup_run_does_no_install_work():
    first = subprocess.run([SETUP], capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr
    again = subprocess.run([SETUP], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "installing" not in again.stdout + again.stderr, again.stdout
    assert "creating" not in again.stdout


@pytest.mark.root
def test_setup_without_root_says_use_sudo():
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SETUP],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    assert "run it with sudo" in r.stderr


@pytest.mark.root
def test_setup_on_a_non_debian_host_prints_what_to_install(tmp_path):
    # A PATH with the basic tools but no apt-get/dpkg-query: what a Fedora or Arch host looks like here.
    for tool in ("id", "dirname", "cat"):
        os.symlink(f"/usr/bin/{tool}", tmp_path / tool)
    r = subprocess.run(["/bin/bash", SETUP], capture_output=True, text=True, timeout=30,
                       env={"PATH": str(tmp_path)})
    assert r.returncode == 1
    assert "not a Debian/Ubuntu host" in r.stderr and "kernel headers" in r.stderr


def test_setup_h_says_what_it_installs_and_installs_nothing():
    """-h ran the whole install (found by review), as any argument did."""
    r = subprocess.run([SETUP, "-h"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "Debian packages" in r.stdout and "USAGE: sudo scripts/setup.sh" in r.stdout
    assert "setup:" not in r.stdout, "no install step ran"
    r = subprocess.run([SETUP, "--bogus"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "takes no arguments, not '--bogus'" in r.stderr
