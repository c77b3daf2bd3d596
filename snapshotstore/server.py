"""One process owns a store's device and serves it to many worker processes over ZeroMQ.

A LogStore holds its device exclusively (one process has the index and the log
head), so workers that must restore each other's sessions share it through
this server:

    server = ctx.Process(target=serve, args=(store_path, "ipc:///run/zl-store", stop_event))
    store = RemoteStore("ipc:///run/zl-store")         # in each worker: the SnapshotStore interface
    worker = Worker(model, store=WorkerStore(store, master_secret))

Requests are served in arrival order; a put is answered only once the store
has made it durable, so RemoteStore.put keeps the SnapshotStore promise. Store
errors cross the socket by name and are raised again on the client's side.
"""
from __future__ import annotations

import json
import time

from . import errors
from .api import Delta, Snapshot, check_key

POLL_MS = 100


def _err(e: BaseException) -> list[bytes]:
    return [b"err", type(e).__name__.encode(), str(e).encode()]


def handle(store, frames: list[bytes]) -> list[bytes]:
    """One request: [op, key?, args...] -> reply frames."""
    op = frames[0]
    try:
        if op == b"put":
            meta = json.loads(frames[3])
            seq = store.put(check_key(frames[1]), Delta(frames[2], tokens=tuple(meta["tokens"]),
                                                          layers=tuple(meta["layers"]), codec=meta["codec"]),
                            replace=bool(meta.get("replace", False)))
            return [b"ok", json.dumps(seq).encode()]
        if op == b"restore":
            snap = store.restore(check_key(frames[1]))
            if snap is None:
                return [b"none"]
            meta = {"tokens": snap.tokens, "layers": snap.layers, "codec": snap.codec, "records": snap.records}
            return [b"ok", json.dumps(meta).encode(), *snap.parts]
        if op == b"delete":
            return [b"ok", json.dumps(store.delete(check_key(frames[1]))).encode()]
        if op == b"held":
            return [b"ok", json.dumps(store.held(check_key(frames[1]))).encode()]
        if op == b"list":
            return [b"ok", *store.list()]
        if op == b"stats":
            return [b"ok", json.dumps(store.stats(), default=str).encode()]
        return [b"err", b"ValueError", f"unknown store request {op[:20]!r}".encode()]
    except Exception as e:  # the store's own errors go back to the caller, the server keeps serving
        return _err(e)


def serve(path: str, endpoint: str, stop, eviction: str = "lru", ready=None):
    """Open the store at `path` and answer requests on `endpoint` until stop.is_set()."""
    import zmq
    from .log import LogStore
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    try:
        with LogStore(path, eviction=eviction) as store:
            sock.bind(endpoint)
            if ready is not None:
                ready.set()
            while not stop.is_set():
                if not sock.poll(POLL_MS):
                    continue
                msg = sock.recv_multipart()
                if len(msg) < 3 or msg[1] != b"":      # not a REQ client's [identity, b"", op, ...]:
                    continue                            # dropped, the server keeps serving the others
                ident, empty, *frames = msg
                sock.send_multipart([ident, empty, *handle(store, frames)])
    finally:
        sock.close(0)
        ctx.term()


class RemoteStore:
    """The SnapshotStore interface on a store that another process serves (see serve).

    A call the server does not answer within timeout_s raises DeviceError, and so does every call
    for the next timeout_s without asking (then one asks again): a worker's step makes up to two
    calls for each of its records, and waiting out each (30 s before) took a step past the
    pipeline's hang timeout (worker_hang_s, 30 s), whose kill then went round every worker. A dead
    store costs each request its 503, at most one wait per timeout_s."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0):
        import zmq
        self._zmq, self.endpoint, self.timeout_ms = zmq, endpoint, int(timeout_s * 1000)
        self._silent_until = 0.0             # monotonic: calls fail at once until then
        self.ctx = zmq.Context()
        self._connect()

    def _connect(self):
        self.sock = self.ctx.socket(self._zmq.REQ)
        self.sock.linger = 0
        self.sock.connect(self.endpoint)

    def _call(self, *frames: bytes) -> list[bytes]:
        if time.monotonic() < self._silent_until:
            raise errors.DeviceError(f"the snapshot store at {self.endpoint} did not answer within "
                                     f"{self.timeout_ms / 1000:g} s a moment ago: not asked again yet")
        self.sock.send_multipart(list(frames))
        if not self.sock.poll(self.timeout_ms):
            self.sock.close(0)       # a REQ socket that missed its reply cannot be used again
            self._connect()
            self._silent_until = time.monotonic() + self.timeout_ms / 1000
            raise errors.DeviceError(f"the snapshot store at {self.endpoint} did not answer within "
                                     f"{self.timeout_ms / 1000:g} s: is its server running?")
        reply = self.sock.recv_multipart()
        if reply[0] == b"err":
            cls = getattr(errors, reply[1].decode(), None)
            cls = cls if isinstance(cls, type) and issubclass(cls, Exception) else errors.SnapshotError
            raise cls(reply[2].decode())
        return reply

    def put(self, key: bytes, delta: Delta, replace: bool = False) -> int:
        meta = {"tokens": list(delta.tokens), "layers": list(delta.layers), "codec": delta.codec, "replace": replace}
        return json.loads(self._call(b"put", check_key(key), bytes(delta.payload), json.dumps(meta).encode())[1])

    def restore(self, key: bytes) -> Snapshot | None:
        reply = self._call(b"restore", check_key(key))
        if reply[0] == b"none":
            return None
        meta, parts = json.loads(reply[1]), tuple(reply[2:])
        return Snapshot(b"".join(parts), tuple(meta["tokens"]), tuple(meta["layers"]), meta["codec"],
                        meta["records"], parts)

    def held(self, key: bytes) -> int:
        return json.loads(self._call(b"held", check_key(key))[1])

    def delete(self, key: bytes) -> bool:
        return json.loads(self._call(b"delete", check_key(key))[1])

    def list(self) -> list[bytes]:
        return self._call(b"list")[1:]

    def stats(self) -> dict:
        return json.loads(self._call(b"stats")[1])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
