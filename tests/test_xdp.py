"""The reference XDP program through the kernel's test runner and live on a veth."""
import os
import socket
import time

import pytest

from datapath import packet, topology, wire
from datapath.xdp import XDP_PASS, BpfUnavailable, load_xdp, prog_test_run

pytestmark = [pytest.mark.root, pytest.mark.bpf]
PORT = wire.DEFAULT_PORT
PAYLOAD = b"\0" * 48

# (name, frame, counter expected to go up): the count program passes everything.
CASES = [
    ("udp to port", packet.udp_frame(PAYLOAD, PORT), "dp"),
    ("udp other port", packet.udp_frame(PAYLOAD, 53), "other"),
    ("vlan udp to port", packet.udp_frame(PAYLOAD, PORT, vlan=10), "dp"),
    ("ipv6 udp to port", packet.udp_frame(PAYLOAD, PORT, v6=True), "dp"),
    ("ipv4 options", packet.udp_frame(PAYLOAD, PORT, ip_options=b"\x01\x01\x01\x00"), "dp"),
    ("first fragment", packet.udp_frame(PAYLOAD, PORT, mf=True), "other"),
    ("tcp", packet.ethernet(packet.ETH_P_IP, packet.ipv4(packet.IPPROTO_TCP, b"\0" * 20)), "other"),
    ("ethernet header only", b"\0" * 14, "other"),
]


@pytest.fixture(scope="module")
def count_prog():
    b, fn = load_xdp("count.bpf.c", "xdp_count")
    yield b, fn
    b.cleanup()


def counters(b):
    return b[b"counts"].sum(0).value, b[b"counts"].sum(1).value


@pytest.mark.parametrize("name,frame,which", CASES, ids=[c[0] for c in CASES])
def test_count_table(count_prog, name, frame, which):
    b, fn = count_prog
    before = counters(b)
    verdict, ns, out = prog_test_run(fn.fd, frame, repeat=1)
    after = counters(b)
    assert verdict == XDP_PASS
    assert out == frame, "the count program never rewrites a packet"
    assert after[0] - before[0] == (which == "dp")
    assert after[1] - before[1] == (which == "other")


def test_live_on_a_veth(topology, xdp_program):
    b, fn, att = xdp_program("count.bpf.c", "xdp_count", topology.host_if[0], topology.host_ns)
    assert att.mode in ("native", "generic") and att.prog_id()
    sent = 25
    pid = os.fork()
    if pid == 0:
        try:
            from datapath.topology import enter
            enter(topology.client_ns[0])
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            for _ in range(sent):
                s.sendto(PAYLOAD, (topology.host_ip[0], PORT))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    deadline = time.monotonic() + 5
    while counters(b)[0] < sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert counters(b)[0] == sent
    att.detach()
    assert att.prog_id() is None


def test_missing_source_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_xdp("no-such.bpf.c", "x")


def test_compile_error_is_a_clear_error(tmp_path):
    with pytest.raises(BpfUnavailable, match="could not compile"):
        load_xdp("count.bpf.c", "xdp_count", cflags=["-DDP_PORT=this_is_not_a_number("])


@pytest.mark.parametrize("mode", ["native", "generic"])
def test_the_mode_asked_for_is_the_mode_attached(topology, xdp_program, mode):
    b, fn, att = xdp_program("count.bpf.c", "xdp_count", topology.host_if[0], topology.host_ns, mode=mode)
    assert att.mode == att.attached_mode() == mode
    att.detach()
    assert att.prog_id() is None


def test_an_attach_never_replaces_another_program_and_a_detach_never_removes_one(topology, xdp_program):
    """The attach replaced whatever program the device had (an operator's filter), and the detach
    removed whatever was there at the time. Now a second attach fails and leaves the first, and an
    attachment whose program another replaced leaves that one in place."""
    from datapath.xdp import XdpAttachment
    ifname, ns = topology.host_if[0], topology.host_ns
    b, fn, first = xdp_program("count.bpf.c", "xdp_count", ifname, ns, mode="native")
    theirs = first.prog_id()
    b2, fn2 = load_xdp("count.bpf.c", "xdp_count")
    try:
        with pytest.raises(BpfUnavailable, match="cannot attach"):
            XdpAttachment(fn2.fd, ifname, ns, "native").__enter__()
        assert first.prog_id() == theirs, "the program already there stays"
        late = XdpAttachment(fn2.fd, ifname, ns, "native")
        first.detach()
        late.__enter__()                                    # another's program, put there meanwhile
        mine = XdpAttachment(fn.fd, ifname, ns, "native")
        mine.mode, mine.ifindex = "native", late.ifindex    # as if ours were still attached
        mine.detach()
        assert late.prog_id() not in (None, theirs), "another's program is not removed by our detach"
        late.detach()
        assert late.prog_id() is None
    finally:
        b2.cleanup()


# a process that attaches the count program to a veth and waits to be killed (bounded: 60 s)
ATTACHED_AND_WAITING = """
import sys, time
from datapath.xdp import XdpAttachment, load_xdp
b, fn = load_xdp("count.bpf.c", "xdp_count")
with XdpAttachment(fn.fd, sys.argv[1], sys.argv[2], "native") as att:
    print(att.prog_id(), flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGHUP"])
def test_a_process_killed_however_it_dies_leaves_no_program_attached(topology, sig):
    """The attachment was a netlink one, which outlives its process: a SIGKILL, a SIGHUP (a closed
    terminal), an OOM kill left the program on the device, dropping every request to its port with
    nothing reading the rings, and the next run could not attach (found by review). It is a BPF
    link now, held by the process's fd alone: the kernel detaches it as the process ends."""
    import signal
    import subprocess
    import sys
    from datapath.xdp import attached_prog_id
    ifname, ns = topology.host_if[0], topology.host_ns
    proc = subprocess.Popen([sys.executable, "-c", ATTACHED_AND_WAITING, ifname, ns], stdout=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.isdigit(), line
        assert attached_prog_id(ifname, ns) == int(line)
        proc.send_signal(getattr(signal, sig))
        proc.wait(20)
        deadline = time.monotonic() + 5       # (the kernel releases the link as the fd table goes)
        while attached_prog_id(ifname, ns) is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert attached_prog_id(ifname, ns) is None, f"left attached after {sig}"
    finally:
        proc.kill()
        proc.wait(20)
        proc.stdout.close()


def test_a_forked_child_does_not_keep_the_program_attached(topology, xdp_program):
    """A child forked while the program is attached (the pipeline forks its workers, the load
    generator) held a copy of the link's fd, so the parent's detach left the program there until
    every child had exited: children close their copies as they start."""
    b, fn, att = xdp_program("count.bpf.c", "xdp_count", topology.host_if[0], topology.host_ns, mode="native")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: waits for the parent's word, then exits
        try:
            os.close(w)
            os.read(r, 1)
        finally:
            os._exit(0)
    os.close(r)
    try:
        att.detach()
        assert att.prog_id() is None, "the child's copy kept it attached"
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)



def test_a_forked_child_leaving_the_with_block_closes_none_of_its_own_files(topology, xdp_program, tmp_path):
    """The child closed its copy of the link's fd as it started, and may have reused the number:
    its detach, leaving the with-block, closed that file of its own (found by review)."""
    b, fn, att = xdp_program("count.bpf.c", "xdp_count", topology.host_if[0], topology.host_ns, mode="native")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            files = [open(tmp_path / f"f{i}", "w") for i in range(64)]
            mine = next(f for f in files if f.fileno() == att.link_fd)   # its number, reused
            att.__exit__(None, None, None)
            mine.write("still mine")
            mine.flush()
            code = 0
        finally:
            os.write(w, bytes([code]))
            os._exit(code)
    os.close(w)
    try:
        assert os.read(r, 1) == b"\0", "the child's own file was closed under it"
        assert att.prog_id() is not None, "the parent's attachment stays"
    finally:
        os.close(r)
        os.waitpid(pid, 0)
