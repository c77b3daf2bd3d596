"""The responder: egress records become response packets a client can decode."""
import itertools
import os
import socket

import numpy as np
import pytest

from datapath import records, wire
from datapath._dataplane import lib
from datapath.egress import Responder
from datapath.ring import Ring, unlink

DP_HELD = lib.DP_EGRESS_HELD

_seq = itertools.count()


class Link:
    """An egress ring a test fills, the responder's socket and a client socket that receives."""

    def __init__(self):
        self.name = f"eg{os.getpid()}-{next(_seq)}"
        self.egress = Ring.create(self.name, records.RESPONSE.itemsize, 64, role="producer")
        self.rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.rx.bind(("127.0.0.1", 0))
        self.rx.settimeout(5)
        self.tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def responder(self, **kw) -> Responder:
        return Responder(Ring.attach(self.name, "consumer"), self.tx, "127.0.0.1", self.rx.getsockname()[1], **kw)

    def close(self):
        self.rx.close(), self.tx.close(), self.egress.close()
        unlink(self.name)


@pytest.fixture
def link():
    made = Link()
    yield made
    made.close()


def test_responses_reach_the_client_intact(link):
    recs = np.zeros(3, dtype=records.RESPONSE)
    recs["request_id"] = [1, 2, 3]
    recs["session_id"] = 77
    recs["tenant"] = 5
    recs["status"] = [200, 429, 200]
    recs["n_out"] = [3, 0, 256]
    recs["t_send"] = [10, 20, 30]
    recs[0]["tokens"][:3] = [7, 8, 9]
    recs[2]["tokens"][:] = np.arange(256)
    link.egress.enqueue(recs.tobytes())
    resp = link.responder(trace_cap=2)
    assert resp.poll() == 3
    got = [wire.decode_response(link.rx.recv(2048)) for _ in range(3)]
    assert [g.request_id for g in got] == [1, 2, 3]
    assert [g.status for g in got] == [200, 429, 200]
    assert np.frombuffer(got[0].body, "<u4").tolist() == [7, 8, 9] and got[1].body == b""
    assert np.frombuffer(got[2].body, "<u4").tolist() == list(range(256))
    assert got[0].send_ns == 10 and got[0].session_id == 77 and got[0].tenant == 5
    st = resp.stats()
    assert st["sent"] == 3 and st["by_status"] == {200: 2, 429: 1} and st["traced"] == 2
    tr = resp.trace()
    assert tr["request_id"].tolist() == [1, 2] and (tr["t_out"] > 0).all()
    assert link.egress.stats()["depth"] == 0


def test_each_response_goes_to_the_client_its_request_came_from():
    name = f"eg{os.getpid()}-{next(_seq)}"
    egress = Ring.create(name, records.RESPONSE.itemsize, 64, role="producer")
    default, client = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2))
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for s in (default, client):
            s.bind(("127.0.0.1", 0))
            s.settimeout(5)
        recs = np.zeros(2, dtype=records.RESPONSE)
        recs["request_id"] = [1, 2]
        recs["status"] = 200
        recs[1]["client_ip"] = int.from_bytes(socket.inet_aton("127.0.0.1"), "little")
        recs[1]["client_port"] = socket.htons(client.getsockname()[1])
        egress.enqueue(recs.tobytes())
        resp = Responder(Ring.attach(name, "consumer"), tx, "127.0.0.1", default.getsockname()[1])
        assert resp.poll() == 2
        assert wire.decode_response(default.recv(2048)).request_id == 1
        assert wire.decode_response(client.recv(2048)).request_id == 2
    finally:
        default.close(), client.close(), tx.close(), egress.close()
        unlink(name)


def test_a_response_the_socket_refuses_costs_only_itself(link):
    """The second of three goes to port 0, which the kernel refuses (EINVAL; a client address this
    socket cannot reach does the same): before, the whole rest of the burst was counted a send
    error and dropped with it."""
    recs = np.zeros(3, dtype=records.RESPONSE)
    recs["request_id"] = [1, 2, 3]
    recs["status"] = 200
    recs[1]["client_ip"] = int.from_bytes(socket.inet_aton("127.0.0.1"), "little")
    recs[1]["client_port"] = 0
    link.egress.enqueue(recs.tobytes())
    resp = link.responder()
    assert resp.poll() == 3
    got = [wire.decode_response(link.rx.recv(2048)).request_id for _ in range(2)]
    assert got == [1, 3]
    st = resp.stats()
    assert st["sent"] == 2 and st["send_errors"] == 1
    assert st["by_status"] == {200: 2} and resp.trace()["request_id"].tolist() == [1, 3]   # what went out


@pytest.mark.root
def test_an_answer_refused_for_want_of_a_route_is_held_and_sent_once_the_route_is_back(topology):
    """ENETUNREACH (a route being changed, a link down) and EPERM (a firewall's drop) may pass: the
    answer was dropped for good, its request already run and charged, and the client's retry of it
    was a late duplicate (found by review). It is held aside, the others not held back, and sent
    once the route is there; one whose route never comes is dropped at its deadline."""
    import time

    from pyroute2 import NetNS

    from datapath.egress import Responder
    from datapath.topology import socket_in
    far, never = "198.19.77.7", "198.19.88.8"       # no route to either from the host namespace yet
    with NetNS(topology.client_ns[0]) as ns:
        ns.addr("add", index=ns.link_lookup(ifname="lo")[0], address=far, prefixlen=32)
    name = f"eg{os.getpid()}-{next(_seq)}"
    egress = Ring.create(name, records.RESPONSE.itemsize, 64, role="producer")
    rx, near = socket_in(topology.client_ns[0]), socket_in(topology.client_ns[0])
    tx = socket_in(topology.host_ns)
    try:
        rx.bind((far, 0))
        near.bind((topology.client_ip[0], 0))
        for sock in (rx, near):
            sock.settimeout(5)
        recs = np.zeros(3, dtype=records.RESPONSE)
        recs["request_id"] = [1, 2, 3]
        recs["status"] = 200
        for i, (ip, port) in enumerate(((far, rx.getsockname()[1]), (topology.client_ip[0], near.getsockname()[1]),
                                        (never, 9))):
            recs[i]["client_ip"] = int.from_bytes(socket.inet_aton(ip), "little")
            recs[i]["client_port"] = socket.htons(port)
        egress.enqueue(recs.tobytes())
        resp = Responder(Ring.attach(name, "consumer"), tx, topology.client_ip[0], 9)
        assert resp.poll() == 3
        assert wire.decode_response(near.recv(2048)).request_id == 2, "the others are not held back"
        st = resp.stats()
        assert st["sent"] == 1 and st["send_held"] == 2 and st["held"] == 2 and st["send_errors"] == 0
        with NetNS(topology.host_ns) as ns:
            ns.route("add", dst=f"{far}/32", gateway=topology.client_ip[0])
        for _ in range(200):                          # tried again 1 ms after the refusal, then at doubling waits
            if resp.stats()["sent"] == 2:
                break
            resp.poll()
            time.sleep(0.001)
        assert wire.decode_response(rx.recv(2048)).request_id == 1
        st = resp.stats()
        assert st["sent"] == 2 and st["held"] == 1 and st["send_errors"] == 0
        assert resp.trace()["request_id"].tolist() == [2, 1]
        time.sleep(0.25)                              # past the hold (200 ms): the unroutable one goes
        assert resp.poll() == 1
        st = resp.stats()
        assert st["held"] == 0 and st["send_errors"] == 1 and st["sent"] == 2
    finally:
        rx.close(), near.close(), tx.close(), egress.close()
        unlink(name)


@pytest.mark.root
def test_held_answers_are_tried_again_at_doubling_waits_not_at_every_pass(topology):
    """The poll loop's passes run every few hundred ns, the router and the ingress consumer in the
    same thread: a held answer tried again at each one cost every pass a failing sendto, 32 of them
    ~5 us a pass (found by review). Each is tried 1 ms after its refusal, then at doubling waits:
    7 tries in its 200 ms, however many passes run, and a pass with nothing due does no send."""
    import time

    from datapath.egress import Responder
    from datapath.topology import socket_in
    name = f"eg{os.getpid()}-{next(_seq)}"
    egress = Ring.create(name, records.RESPONSE.itemsize, 64, role="producer")
    tx = socket_in(topology.host_ns)
    try:
        recs = np.zeros(DP_HELD, dtype=records.RESPONSE)
        recs["request_id"] = np.arange(1, DP_HELD + 1)
        recs["status"] = 200
        recs["client_ip"] = int.from_bytes(socket.inet_aton("198.19.88.8"), "little")   # no route to it
        recs["client_port"] = socket.htons(9)
        egress.enqueue(recs.tobytes())
        resp = Responder(Ring.attach(name, "consumer"), tx, topology.client_ip[0], 9)
        assert resp.poll() == DP_HELD and resp.stats()["held"] == DP_HELD
        passes, end = 0, time.monotonic() + 0.3
        while resp.stats()["held"] and passes < 5_000_000 and time.monotonic() < end:
            resp.poll()
            passes += 1
        st = resp.stats()
        assert st["held"] == 0 and st["send_errors"] == DP_HELD and st["sent"] == 0
        assert passes > 1000, "the loop ran"
        # 1, 3, 7, 15, 31, 63, 127 ms after the refusal: 7 each (a slow pass may skip one)
        assert DP_HELD <= st["held_tries"] <= 7 * DP_HELD, st
    finally:
        tx.close(), egress.close()
        unlink(name)


def test_an_admission_body_reaches_the_client_whole(link):
    body = ('{"status":422,"cost_breakdown":{"estimate_micro_usd":12},"suggestions":["lower max_output_tokens'
            ' to 3"],"pad":"' + "x" * 900 + '"}').encode()
    assert len(body) <= wire.MAX_RESP_BODY == records.RESPONSE.fields["body"][0].itemsize
    rec = np.zeros(1, dtype=records.RESPONSE)
    rec["request_id"], rec["status"], rec["body_len"] = 9, 422, len(body)
    rec[0]["body"][:len(body)] = np.frombuffer(body, np.uint8)
    link.egress.enqueue(rec.tobytes())
    link.responder().poll()
    got = wire.decode_response(link.rx.recv(2048))
    assert got.status == 422 and got.body == body
    doc = wire.decode_admission_body(got.body)
    assert doc.cost_breakdown == {"estimate_micro_usd": 12} and doc.fields["pad"] == "x" * 900


def test_the_response_record_carries_tokens_and_body_in_the_same_bytes():
    from datapath._dataplane import ffi
    f = records.RESPONSE.fields
    assert f["tokens"][1] == f["body"][1] == ffi.offsetof("struct dp_response_rec", "body")
    assert f["body"][0].itemsize == wire.MAX_RESP_BODY == 4 * records.MAX_OUTPUT_TOKENS
    assert records.RESPONSE.itemsize == ffi.sizeof("struct dp_response_rec") == f["body"][1] + wire.MAX_RESP_BODY


def test_a_traced_request_gets_its_stamps_after_the_body_unless_the_body_is_full(link):
    recs = np.zeros(3, dtype=records.RESPONSE)
    recs["request_id"] = [1, 2, 3]
    recs["status"] = 200
    recs["flags"] = [wire.FLAG_TRACE, wire.FLAG_TRACE, 0]
    recs["n_out"] = [2, 256, 2]
    recs["t_xdp"], recs["t_first_lane"], recs["t_done"] = 100, 200, 300
    recs["worker"], recs["pool"] = 1, 0
    recs[0]["tokens"][:2] = [7, 8]
    recs[1]["tokens"][:] = np.arange(256)
    recs[2]["tokens"][:2] = [7, 8]
    link.egress.enqueue(recs.tobytes())
    resp = link.responder()
    assert resp.poll() == 3
    traced, full, plain = (wire.decode_response(link.rx.recv(2048)) for _ in range(3))
    assert np.frombuffer(traced.body, "<u4").tolist() == [7, 8] and traced.flags == wire.FLAG_TRACE
    t = traced.trace
    assert (t["t_xdp"], t["t_first_lane"], t["t_done"], t["worker"], t["pool"]) == (100, 200, 300, 1, 0)
    assert t["t_egress"] > 0
    # 256 tokens fill the body: the trace is left out (and the flag says so), the tokens are not cut
    assert full.flags == 0 and full.trace is None and np.frombuffer(full.body, "<u4").tolist() == list(range(256))
    assert plain.flags == 0 and plain.trace is None


def test_a_stopped_poll_loop_sends_what_the_egress_ring_still_holds():
    """Stopped at once with 500 answers in the egress ring, the loop drains them before its thread
    ends: it ran two passes after stop, 64 answers at most, and the rest were never sent nor
    counted (found by review)."""
    from datapath import _dataplane
    from datapath.loop import PollLoop
    name = f"eg{os.getpid()}-{next(_seq)}"
    egress = Ring.create(name, records.RESPONSE.itemsize, 1024, role="producer")
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.bind(("127.0.0.1", 0))
        recs = np.zeros(500, dtype=records.RESPONSE)
        recs["request_id"] = np.arange(500)
        recs["status"] = 200
        assert egress.enqueue(recs.tobytes()) == 500
        resp = Responder(Ring.attach(name, "consumer"), tx, "127.0.0.1", rx.getsockname()[1])
        loop = PollLoop()
        loop.add(_dataplane, "dp_responder_poll", resp.handle, owner=resp)
        loop.start()
        loop.stop()
        assert resp.stats()["sent"] == 500 and egress.stats()["depth"] == 0
    finally:
        rx.close(), tx.close(), egress.close()
        unlink(name)


@pytest.mark.parametrize("cpu", [os.cpu_count() + 1000, 1 << 20])
def test_a_poll_loop_pinned_to_a_cpu_it_cannot_run_on_does_not_start(cpu):
    """Pinned after the start and unchecked, the loop ran on some other core, said nowhere."""
    from datapath import _dataplane
    from datapath.loop import PollLoop
    from datapath.router import Router
    loop = PollLoop(cpu=cpu)
    with pytest.raises(RuntimeError, match="no stages"):
        loop.start()
    router = Router()                                    # a stage with nothing to do
    try:
        loop.add(_dataplane, "dp_router_poll", router.handle, owner=router)
        with pytest.raises(RuntimeError, match=f"cannot start the poll loop pinned to CPU {cpu}: Invalid argument"):
            loop.start()
    finally:
        loop.stop()
        router.close()
