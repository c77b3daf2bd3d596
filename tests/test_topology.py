"""Namespaces and veths: real traffic between them, and nothing left behind."""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
from pyroute2 import netns

from datapath import topology
from datapath import topology as topology_mod   # (tests below take a fixture of the module's name)
from datapath.topology import Topology, socket_in
from snapshotstore.device import state_dir

pytestmark = pytest.mark.root


def udp_echo_across(topo: Topology, n: int = 0) -> bytes:
    """Send one datagram from the client netns to a socket in the host netns; return what arrived."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # receiver in the host namespace
        try:
            os.close(r)
            topology.enter(topo.host_ns)
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((topo.host_ip[n], 9999))
            s.settimeout(5)
            os.write(w, b"R")
            data, _ = s.recvfrom(2048)
            os.write(w, data)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"R"
    sender = os.fork()
    if sender == 0:
        try:
            topology.enter(topo.client_ns[n])
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"hello", (topo.host_ip[n], 9999))
        finally:
            os._exit(0)
    os.waitpid(sender, 0)
    os.waitpid(pid, 0)
    data = os.read(r, 2048)
    os.close(r)
    return data


def test_traffic_crosses_the_veth(topology):
    assert udp_echo_across(topology) == b"hello"
    assert topology.host_ip[0] == "198.18.0.1" and topology.client_ip[0] == "198.18.0.2"


def test_several_clients_mtu_and_queues():
    with Topology(clients=3, mtu=9000, queues=2) as topo:
        assert set(topo.namespaces()) <= set(topology.ours())
        for n in range(3):
            assert udp_echo_across(topo, n) == b"hello"
        from pyroute2 import NetNS
        with NetNS(topo.host_ns) as ns:
            link = ns.get_links(ns.link_lookup(ifname="h2")[0])[0]
            assert link.get_attr("IFLA_MTU") == 9000
            assert link.get_attr("IFLA_NUM_RX_QUEUES") == 2
        names = topo.namespaces()
    assert not set(names) & set(topology.ours())


def test_bad_arguments_are_refused():
    for kw in (dict(clients=0), dict(clients=257), dict(mtu=10), dict(queues=0)):
        with pytest.raises(ValueError):
            Topology(**kw)


FAILING_TEST = textwrap.dedent("""
    import pytest

    @pytest.mark.root
    @pytest.mark.bpf
    def test_fails_with_everything_up(topology, xdp_program):
        b, fn, att = xdp_program("count.bpf.c", "xdp_count", topology.host_if[0], topology.host_ns)
        print("PROG_ID", att.prog_id(), "NETNS", " ".join(topology.namespaces()), flush=True)
        assert False, "deliberate failure"
""")


@pytest.mark.bpf
def test_failing_test_leaves_nothing_behind(tmp_path):
    path = tmp_path / "test_deliberate_failure.py"
    path.write_text(FAILING_TEST)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "datapath.testing", "-s", "-q",
                             "-p", "no:cacheprovider", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert "deliberate failure" in out
    line = next(l for l in out.splitlines() if l.startswith("PROG_ID"))
    words = line.split()
    prog_id, names = int(words[1]), words[3:]
    assert names and all(n.startswith(f"dp{proc.pid}t") for n in names)
    assert not set(names) & set(topology.ours()), "namespaces left behind"
    show = subprocess.run(["bpftool", "prog", "show", "id", str(prog_id)], capture_output=True, text=True)
    assert show.returncode != 0, f"program {prog_id} still loaded: {show.stdout}"


def test_sweep_removes_what_a_killed_run_left():
    code = ("from datapath.topology import Topology; import sys, time\n"
            "t = Topology(clients=2).__enter__(); print(' '.join(t.namespaces()), flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        names = proc.stdout.readline().split()
        assert len(names) == 3 and set(names) <= set(topology.ours())
        # a killed pipeline's ring and store socket directory, and a live one's ring
        ring = f"/dev/shm/dp-pl{proc.pid}-1.out"
        open(ring, "w").close()
        sockdir = tempfile.mkdtemp(prefix=f"zl-pl{proc.pid}-1-")
        zmq_dir = tempfile.mkdtemp(prefix=f"zl-pl{proc.pid}-1-lanes-")   # its zmq lanes' (lane="zmq")
        theirs = os.path.join(tempfile.gettempdir(), f"pl{proc.pid}-01.csv")   # a user's, named alike
        open(theirs, "w").close()
        demo_ring = f"/dev/shm/dp-zl-demo-{proc.pid}.in"               # datapath worker --demo's
        open(demo_ring, "w").close()
        os.makedirs(state_dir(), exist_ok=True)
        image_dir = tempfile.mkdtemp(prefix=f"e2e-store-{proc.pid}-", dir=state_dir())   # bench e2e's
        live_ring = f"/dev/shm/dp-pl{os.getpid()}-999.out"
        open(live_ring, "w").close()
        mine = Topology(clients=1).__enter__()  # a live run's namespaces must survive the sweep
        try:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            removed = topology.sweep_stale()
            assert set(names) <= set(removed)
            assert not set(mine.namespaces()) & set(removed)
            assert set(mine.namespaces()) <= set(topology.ours())
            assert not os.path.exists(ring) and not os.path.exists(sockdir) and not os.path.exists(image_dir)
            assert not os.path.exists(zmq_dir) and not os.path.exists(demo_ring)
            assert os.path.exists(theirs), "a file the project did not make is not swept"
            assert os.path.exists(live_ring)
        finally:
            mine.close()
            os.unlink(live_ring)
            os.unlink(theirs)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        topology.sweep_stale()
    assert not set(names) & set(topology.ours())


def test_socket_in_a_namespace_from_an_unmoved_process(topology):
    rx = socket_in(topology.host_ns)
    try:
        rx.bind((topology.host_ip[0], 9998))   # the address exists only in the host namespace
        rx.settimeout(5)
        tx = socket_in(topology.client_ns[0])
        tx.sendto(b"ping", (topology.host_ip[0], 9998))
        assert rx.recv(16) == b"ping"
        tx.close()
    finally:
        rx.close()


def _thread_netns() -> int:
    return os.stat("/proc/thread-self/ns/net").st_ino


def test_socket_in_leaves_the_calling_thread_in_its_own_namespace_not_the_main_threads(topology):
    """A thread living in the client namespace makes a socket in the host's (bound to the host's
    address, which exists only there) and is still in the client's after (pyroute2's pushns took
    it to the main thread's)."""
    client = os.stat(f"/var/run/netns/{topology.client_ns[0]}").st_ino
    seen = {}

    def in_client():
        topology_mod.enter(topology.client_ns[0])
        with socket_in(topology.host_ns) as sock:
            sock.bind((topology.host_ip[0], 0))
        seen["after"] = _thread_netns()
    t = threading.Thread(target=in_client)
    t.start()
    t.join()
    assert seen["after"] == client != _thread_netns()


def test_socket_in_a_missing_namespace_is_refused_and_creates_none(topology):
    missing = topology.host_ns + "x"
    before = _thread_netns()
    with pytest.raises(FileNotFoundError):
        socket_in(missing)
    assert missing not in netns.listnetns() and _thread_netns() == before
