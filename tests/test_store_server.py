"""One store process, several worker processes: a session one writes, another restores."""
import json
import multiprocessing
import time

import pytest

from snapshotstore import Delta, DeviceError, SessionChanged, SnapshotError, TooLarge, WorkerStore, session_key
from snapshotstore.device import create_image
from snapshotstore.log import format_device
from snapshotstore.server import RemoteStore, serve

ctx = multiprocessing.get_context("fork")
SECRET = b"test-tenant-secret-0123456789ab"


def _server(tmp_path, endpoint, **kw):
    path = str(tmp_path / "shared.img")   # tmp_path is on the real disk: O_DIRECT works there
    create_image(path, 64 << 20)
    format_device(path)
    stop, ready = ctx.Event(), ctx.Event()
    p = ctx.Process(target=serve, args=(path, endpoint, stop), kwargs={"ready": ready, **kw})
    p.start()
    assert ready.wait(30), "the store server did not start"
    return stop, p


def _stop(stop, p):
    stop.set()
    p.join(10)
    if p.is_alive():
        p.kill()
        p.join(5)


@pytest.fixture
def server(tmp_path):
    endpoint = f"ipc://{tmp_path}/store.sock"
    running = _server(tmp_path, endpoint)
    yield endpoint
    _stop(*running)


def writer(endpoint, q):
    store = WorkerStore(RemoteStore(endpoint), SECRET)
    for i in range(3):
        store.put((0, 42), bytes([i]) * 1000, {"token_start": 10 * i, "token_end": 10 * i + 10, "codec": "raw"})
    q.put("written")


def reader(endpoint, q):
    q.put(WorkerStore(RemoteStore(endpoint), SECRET).restore((0, 42)))


def test_a_session_written_by_one_process_restores_in_another(server):
    q = ctx.Queue()
    w = ctx.Process(target=writer, args=(server, q))
    w.start()
    assert q.get(timeout=30) == "written"
    w.join(10)
    r = ctx.Process(target=reader, args=(server, q))
    r.start()
    parts = q.get(timeout=30)
    r.join(10)
    assert parts == [bytes([i]) * 1000 for i in range(3)]


def test_store_errors_cross_the_socket(server):
    with RemoteStore(server) as store:
        key = session_key(SECRET, 7)
        assert store.restore(key) is None and store.delete(key) is False
        store.put(key, Delta(b"x" * 100, tokens=(0, 5), codec="raw"))
        assert store.list() == [key] and store.restore(key).payload == b"x" * 100 and store.held(key)[0] == 5
        with pytest.raises(SessionChanged):                   # a chain must continue where it ended
            store.put(key, Delta(b"y", tokens=(9, 10), codec="raw"))
        with pytest.raises(TooLarge):
            store.put(key, Delta(b"z" * (32 << 20), tokens=(5, 6), codec="raw"))
        replaced = store.put(key, Delta(b"w" * 50, tokens=(0, 3), codec="raw"), replace=True)   # the whole chain now
        assert store.restore(key).parts == (b"w" * 50,) and store.held(key) == (3, replaced)
        assert store.restore(key).seq == replaced
        assert store.stats()


def test_a_malformed_message_does_not_stop_the_server(server):
    """A client that skips the REQ envelope (a DEALER sending bare frames) once raised in the
    serve loop, which closed the store under every worker."""
    import zmq
    with zmq.Context() as zctx, zctx.socket(zmq.DEALER) as rogue:
        rogue.linger = 0
        rogue.connect(server)
        for msg in ([b""], [b"held"], [b"x", b"y"]):
            rogue.send_multipart(msg)
        with RemoteStore(server) as store:
            key = session_key(SECRET, 8)
            store.put(key, Delta(b"x" * 10, tokens=(0, 1), codec="raw"))
            assert store.held(key)[0] == 1


def test_one_clients_calls_run_in_the_order_it_sent_them(server):
    """A restore sent right behind a put (a worker's, after the put timed out) runs after it and
    sees it: what a server running calls at once must keep too."""
    import zmq
    key = session_key(SECRET, 9)
    meta = json.dumps({"tokens": [0, 1], "layers": [0, 0], "codec": "raw"}).encode()
    with zmq.Context() as zctx, zctx.socket(zmq.DEALER) as client:
        client.linger = 0
        client.connect(server)
        client.send_multipart([b"", (1).to_bytes(8, "little"), b"put", key, b"p" * (1 << 20), meta])
        client.send_multipart([b"", (2).to_bytes(8, "little"), b"restore", key])
        replies = []
        for _ in range(2):
            assert client.poll(30_000), "the store server did not answer"
            replies.append(client.recv_multipart())
    assert [r[1] for r in replies] == [(1).to_bytes(8, "little"), (2).to_bytes(8, "little")]
    assert replies[0][2] == b"ok" and replies[1][2] == b"ok" and replies[1][4] == b"p" * (1 << 20)


def test_no_server_is_a_clear_error_and_is_waited_for_once_per_timeout(tmp_path):
    """A step's many calls to a dead store each waited the whole timeout: the step outlived the
    pipeline's hang timeout and the worker was killed. Now the calls right after a timeout fail
    at once, and one waits again once the timeout has passed."""
    with RemoteStore(f"ipc://{tmp_path}/nobody.sock", timeout_s=0.3) as store:
        t0 = time.monotonic()
        with pytest.raises(DeviceError, match=r"could not be reached .*within 0.3 s: is its server running"):
            store.restore(session_key(SECRET, 1))
        assert time.monotonic() - t0 >= 0.25        # it waited (zmq's poll may wake a little early)
        t0 = time.monotonic()
        for n in range(50):
            with pytest.raises(DeviceError, match="not asked again yet"):
                store.held(session_key(SECRET, n))
        assert time.monotonic() - t0 < 0.2
        time.sleep(0.3)
        with pytest.raises(DeviceError, match="could not be reached"):
            store.held(session_key(SECRET, 1))


def test_a_late_answer_is_dropped_and_a_call_after_a_timeout_runs_after_it(tmp_path):
    """A timed-out call's socket was replaced by a fresh one, whose next call (the worker's
    restore, asking whether the timed-out put had landed) could be served first and say no, then
    the put landed. One connection now: the server sees the calls in order, and the late answer
    is not taken for the next call's."""
    import threading

    import zmq
    endpoint = f"ipc://{tmp_path}/slow.sock"
    seen = []
    with zmq.Context() as zctx, zctx.socket(zmq.ROUTER) as slow:
        slow.linger = 0
        slow.bind(endpoint)

        def answer_late():                   # holds the first call until the second has come
            first = slow.recv_multipart()
            second = slow.recv_multipart()
            seen.extend([first[3], second[3]])
            slow.send_multipart([*first[:3], b"ok", b"1"])     # the first's answer, late
            slow.send_multipart([*second[:3], b"ok", b"2"])
        t = threading.Thread(target=answer_late)
        t.start()
        with RemoteStore(endpoint, timeout_s=0.3) as store:
            key = session_key(SECRET, 3)
            with pytest.raises(DeviceError, match="did not answer within 0.3 s"):
                store.held(key)
            time.sleep(0.35)                 # past its quiet spell
            assert store.delete(key) == 2    # its own answer, not the late 1
        t.join(5)
    assert seen == [b"held", b"delete"]


def test_a_store_with_a_secret_answers_only_clients_holding_it(tmp_path):
    """Anyone who reached the server's socket could list, restore and delete every tenant's
    sessions. With a secret the connection is CURVE, keyed by it; a tcp:// endpoint off loopback
    without one is refused."""
    with pytest.raises(SnapshotError, match="needs a secret"):
        serve(str(tmp_path / "unused.img"), "tcp://198.18.0.1:5600", ctx.Event())
    endpoint = f"ipc://{tmp_path}/secret.sock"
    running = _server(tmp_path, endpoint, secret=b"store-transport-secret-0123456789")
    try:
        key = session_key(SECRET, 4)
        with RemoteStore(endpoint, secret=b"store-transport-secret-0123456789") as store:
            store.put(key, Delta(b"x" * 10, tokens=(0, 1), codec="raw"))
            assert store.held(key)[0] == 1
        for secret in (None, b"another-secret-0123456789abcdef"):
            with RemoteStore(endpoint, timeout_s=0.5, secret=secret) as store:
                with pytest.raises(DeviceError, match="could not be reached"):
                    store.list()
    finally:
        _stop(*running)


@pytest.mark.root
def test_a_store_that_failed_a_write_is_reopened_once_its_device_writes_again(tmp_path):
    """A write error left the server's store refusing every call ("reopen it") until someone
    restarted the server: every later turn was a 503. Its device is made read-only under it here
    (blockdev --setro on a loop device), then writable again."""
    import subprocess

    from snapshotstore.loop import loop_device
    image = str(tmp_path / "faulty.img")
    create_image(image, 64 << 20)
    with loop_device(image, sector_size=4096) as dev:
        format_device(dev)
        endpoint = f"ipc://{tmp_path}/faulty.sock"
        stop, ready = ctx.Event(), ctx.Event()
        p = ctx.Process(target=serve, args=(dev, endpoint, stop), kwargs={"ready": ready})
        p.start()
        try:
            assert ready.wait(30)
            a, b = session_key(SECRET, 1), session_key(SECRET, 2)
            with RemoteStore(endpoint) as store:
                store.put(a, Delta(b"a" * 100, tokens=(0, 5), codec="raw"))
                subprocess.run(["blockdev", "--setro", dev], check=True)
                try:
                    with pytest.raises(SnapshotError):
                        store.put(b, Delta(b"b" * 100, tokens=(0, 5), codec="raw"))
                    with pytest.raises(DeviceError, match="could not be reopened yet"):
                        store.held(a)
                finally:
                    subprocess.run(["blockdev", "--setrw", dev], check=True)
                assert store.held(a)[0] == 5                   # reopened: what was durable is there
                store.put(b, Delta(b"b" * 100, tokens=(0, 5), codec="raw"))
                assert store.restore(b).payload == b"b" * 100
        finally:
            _stop(stop, p)


def test_a_server_on_an_nvme_tcp_target_reopens_it_once_the_target_is_back(tmp_path):
    """Only a write error failed the server's store: after its NVMe/TCP target was killed and
    restarted, every restore went on to the lost connection's closed socket ("Bad file
    descriptor") until a put happened to fail too (found by review). A device whose connection
    is lost fails the store, and the server reopens it at the next call once the target is back."""
    from snapshotstore.nvmetcp.process import TargetProcess
    image = str(tmp_path / "remote.img")
    create_image(image, 64 << 20)
    target = TargetProcess(image)
    stop = p = None
    try:
        format_device(target.url)
        port = target.url.split("://")[1].split("/")[0].rsplit(":", 1)[1]
        endpoint = f"ipc://{tmp_path}/remote.sock"
        stop, ready = ctx.Event(), ctx.Event()
        p = ctx.Process(target=serve, args=(target.url, endpoint, stop), kwargs={"ready": ready})
        p.start()
        assert ready.wait(30)
        a = session_key(SECRET, 1)
        with RemoteStore(endpoint) as store:
            store.put(a, Delta(b"a" * 100, tokens=(0, 5), codec="raw"))
            target.kill()
            with pytest.raises(DeviceError):
                store.restore(a)
            target = TargetProcess(image, listen=f"127.0.0.1:{port}")
            for _ in range(3):               # restores alone: no put to fail and reopen it
                assert store.restore(a).payload == b"a" * 100
    finally:
        if stop is not None:
            _stop(stop, p)
        target.stop()
