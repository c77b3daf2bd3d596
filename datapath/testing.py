"""pytest plugin: the markers' skip rules and the namespace/XDP fixtures.

Markers: root (needs root), bpf (needs a working bcc), tshark (needs tshark),
vm (needs qemu), slow. A test whose need is missing is skipped with the reason
-- except under CI (CI set in the environment), where a missing root, bcc or
tshark fails the test: CI runs as root with them installed (scripts/setup.sh),
so a skip there would hide a broken setup.

Fixtures:
    topology      a host netns joined to one client netns by a veth pair
                  (198.18.0.1 <-> 198.18.0.2), removed on teardown
    xdp_program   factory: xdp_program("count.bpf.c", "xdp_count", ifname, netns)
                  compiles with bcc, attaches, and always detaches
"""
from __future__ import annotations

import functools
import os
import shutil

import pytest


@functools.lru_cache(maxsize=None)
def bpf_problem() -> str | None:
    """Why bcc cannot compile and load a program here, or None if it can."""
    from .xdp import BpfUnavailable, load_xdp
    if os.geteuid() != 0:
        return "needs root to load BPF programs"
    try:
        b, _ = load_xdp("count.bpf.c", "xdp_count")
        b.cleanup()
    except BpfUnavailable as e:
        return str(e)
    return None


def _need(item, reason: str):
    if os.environ.get("CI") and not item.get_closest_marker("vm"):
        pytest.fail(f"CI must run this test but cannot: {reason}", pytrace=False)
    pytest.skip(reason)


def pytest_runtest_setup(item):
    if item.get_closest_marker("root") and os.geteuid() != 0:
        _need(item, "needs root: run `sudo make test`")
    if item.get_closest_marker("bpf"):
        problem = bpf_problem()
        if problem:
            _need(item, f"needs a working bcc: {problem}")
    if item.get_closest_marker("tshark") and not shutil.which("tshark"):
        _need(item, "needs tshark: run `sudo scripts/setup.sh` (or apt-get install tshark)")
    if item.get_closest_marker("vm") and not shutil.which("qemu-system-x86_64"):
        pytest.skip("needs qemu-system-x86_64: `sudo make vm-test` installs it and runs the vm tests")


@pytest.fixture
def topology():
    from .topology import Topology
    with Topology(clients=1) as topo:
        yield topo


@pytest.fixture
def xdp_program():
    from .xdp import XdpAttachment, load_xdp
    loaded = []

    def attach(src: str, fn_name: str, ifname: str, netns: str, mode: str = "auto", cflags=()):
        b, fn = load_xdp(src, fn_name, cflags)
        att = XdpAttachment(fn.fd, ifname, netns, mode)
        loaded.append((b, att))
        att.__enter__()
        return b, fn, att

    yield attach
    for b, att in reversed(loaded):
        att.detach()
        b.cleanup()
