"""One process owns a store's device and serves it to many worker processes over ZeroMQ.

A LogStore holds its device exclusively (one process has the index and the log
head), so workers that must restore each other's sessions share it through
this server:

    server = ctx.Process(target=serve, args=(store_path, "ipc:///run/zl-store", stop_event))
    store = RemoteStore("ipc:///run/zl-store")         # in each worker: the SnapshotStore interface
    worker = Worker(model, store=WorkerStore(store, master_secret))

Requests are served one at a time, each client's in the order it sent them (one
connection each: a call after one that timed out runs after it, so a restore
sees whether that put landed); a put is answered only once the store has made
it durable, so RemoteStore.put keeps the SnapshotStore promise. Store errors
cross the socket by name and are raised again on the client's side.

With a secret (both ends hold the same one: datapath worker --store-secret-file,
snapshotstore serve --secret-file) the connection is ZeroMQ CURVE, its keys
derived from the secret: only a peer holding it connects, and what crosses is
encrypted. A tcp:// endpoint off loopback is refused without one: it would give
any peer that reaches it every tenant's sessions (list, restore, delete).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import sys
import time

from . import errors
from .api import MIN_SECRET_BYTES, Delta, Snapshot, check_key

POLL_MS = 100
RCVHWM = 2                  # requests queued per client connection: its calls come one at a time (a
                            # late one after a timeout); 64 of up to maxmsgsize each let one client
                            # make the server buffer GBs (found by review)


def read_secret(path: str) -> bytes:
    """The secret a store's clients and its server share, from a file (its line end not part of it)."""
    try:
        with open(path, "rb") as f:
            secret = f.read().rstrip(b"\r\n")
    except OSError as e:
        raise errors.SnapshotError(f"secret file {path}: {e.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise errors.SnapshotError(f"the secret in {path} is {len(secret)} bytes: at least {MIN_SECRET_BYTES}")
    return secret


def curve_keys(secret: bytes) -> dict[str, tuple[bytes, bytes]]:
    """The server's and the client's CURVE key pairs (public, secret; Z85), derived from the secret."""
    import zmq
    from zmq.utils import z85
    out = {}
    for role in ("server", "client"):
        # HMAC(secret, label), as the tenant and session keys are derived (api.py)
        sk = z85.encode(hmac.new(secret, b"zerolayer-store-curve\0" + role.encode(), hashlib.sha256).digest())
        out[role] = (zmq.curve_public(sk), sk)
    return out


def check_endpoint(endpoint: str) -> str:
    """A ZeroMQ endpoint as these tools bind and connect them: tcp://HOST:PORT, the port 1..65535,
    or ipc://PATH; ValueError saying which part is wrong. (ZeroMQ took tcp://HOST:99999 and bound
    port 34463, 99999 mod 65536, and tcp://HOST:0 bound a port no one was told: found by review.)"""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"{endpoint!r}: give tcp://HOST:PORT or ipc://PATH")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not (sep and host and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{endpoint!r}: give tcp://HOST:PORT, the port a number from 1 to 65535")
    return endpoint


def off_loopback(endpoint: str) -> bool:
    """A tcp:// endpoint bound on something other than loopback."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True          # a name or an interface (tcp://eth0:5600, tcp://*:5600)


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
            meta = {"tokens": snap.tokens, "layers": snap.layers, "codec": snap.codec, "records": snap.records,
                    "seq": snap.seq}
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


def serve(path: str, endpoint: str, stop, eviction: str = "lru", ready=None, secret: bytes | None = None):
    """Open the store at `path` and answer requests on `endpoint` until stop.is_set(); with a
    secret, only to clients holding it (CURVE)."""
    import zmq
    from .log import LogStore
    if secret is None and off_loopback(endpoint):
        raise errors.SnapshotError(f"{endpoint} is on the network: serving it needs a secret both ends hold "
                                   f"(--secret-file), or any peer could read and delete every tenant's sessions")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    auth = store = None
    try:
        if secret is not None:
            from zmq.auth.thread import ThreadAuthenticator
            keys = curve_keys(secret)

            class OnlyTheClientKey:
                def callback(self, domain, key):
                    return key == keys["client"][0]
            auth = ThreadAuthenticator(ctx)
            auth.start()
            auth.configure_curve_callback(domain="*", credentials_provider=OnlyTheClientKey())
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = keys["server"]
        store = LogStore(path, eviction=eviction)
        # a frame far past the largest record drops its connection before it is buffered whole
        # here (one of many GB ran the store out of memory); one a little past it is refused,
        # TooLarge, as a local store refuses it
        sock.maxmsgsize = max(2 * store.max_payload, 64 << 20)
        sock.rcvhwm = RCVHWM
        sock.bind(endpoint)
        if ready is not None:
            ready.set()
        while not stop.is_set():
            if not sock.poll(POLL_MS):
                continue
            msg = sock.recv_multipart()
            if len(msg) < 4 or msg[1] != b"" or len(msg[2]) != 8:   # not [identity, b"", call id, op, ...]:
                continue                                            # dropped, the others still served
            ident, empty, call, *frames = msg
            if store is None:
                # a write error left the index ahead of the device, and every later call was
                # refused ("reopen it") for good, the workers' turns with them: reopened, recovery
                # reads back what is durable. While it cannot be (the fault lasts), each call is
                # answered that, and the next one tries again.
                try:
                    store = LogStore(path, eviction=eviction)
                except (errors.SnapshotError, OSError) as e:
                    sock.send_multipart([ident, empty, call, *_err(errors.DeviceError(
                        f"the store failed ({failed}) and could not be reopened yet: {e}"))])
                    continue
                print(f"snapshot store server: {path} reopened after an error ({failed})",
                      file=sys.stderr, flush=True)
            sock.send_multipart([ident, empty, call, *handle(store, frames)])
            if store.failed is not None:
                failed = store.failed
                try:
                    store.close()        # (its hold on the device too, so it can be opened again)
                except (OSError, errors.SnapshotError):
                    pass                 # (the fault, again: the device is closed all the same)
                store = None
    finally:
        try:
            if store is not None:
                store.close()
        finally:
            sock.close(0)
            if auth is not None:
                auth.stop()
            ctx.term()


class RemoteStore:
    """The SnapshotStore interface on a store that another process serves (see serve). Not
    thread-safe: one per thread. With a secret (the server's), the connection is CURVE keyed by it.

    A call the server does not answer within timeout_s raises DeviceError, and so does every call
    for the next timeout_s without asking (then one asks again): a worker's step makes up to two
    calls for each of its records, and waiting out each (30 s before) took a step past the
    pipeline's hang timeout (worker_hang_s, 30 s), whose kill then went round every worker. A dead
    store costs each request its 503, at most one wait per timeout_s.

    One connection for every call, each call numbered: the answer to one that timed out is
    dropped when it comes, and a later call is served after it. (A fresh socket per timed-out
    call, as before, could overtake it: a restore sent to learn whether a put had landed ran
    first and said no, then the put landed, found by review.) That holds on one connection: one
    that drops (TCP) and reconnects may let a later call pass one still queued at the server."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0, secret: bytes | None = None):
        import zmq
        self._zmq, self.endpoint, self.timeout_ms = zmq, endpoint, int(timeout_s * 1000)
        self._silent_until = 0.0             # monotonic: calls fail at once until then
        self._calls = 0
        self.ctx = zmq.Context()
        try:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.linger = 0
            self.sock.immediate = True           # queued only to a live connection, never to wait for one
            if secret is not None:
                keys = curve_keys(secret)
                self.sock.curve_serverkey = keys["server"][0]
                self.sock.curve_publickey, self.sock.curve_secretkey = keys["client"]
            self.sock.connect(endpoint)
        except BaseException:
            self.ctx.destroy(0)
            raise

    def _silent(self, why: str) -> errors.DeviceError:
        self._silent_until = time.monotonic() + self.timeout_ms / 1000
        return errors.DeviceError(f"the snapshot store at {self.endpoint} {why}")

    def _call(self, *frames: bytes) -> list[bytes]:
        zmq = self._zmq
        if time.monotonic() < self._silent_until:
            raise errors.DeviceError(f"the snapshot store at {self.endpoint} did not answer (or could not be "
                                     f"reached) within {self.timeout_ms / 1000:g} s a moment ago: not asked "
                                     f"again yet")
        self._calls += 1
        call = self._calls.to_bytes(8, "little")
        deadline = time.monotonic() + self.timeout_ms / 1000
        try:
            self.sock.send_multipart([b"", call, *frames], zmq.NOBLOCK)
        except zmq.Again:
            # no connection (yet: connecting takes a moment; or no server, or a key it refuses):
            # the timeout is waited out for one, as for a reply (polled only then: a call on a live
            # connection pays no extra poll)
            if not self.sock.poll(self.timeout_ms, zmq.POLLOUT):
                raise self._silent(f"could not be reached (or took no more calls) within "
                                   f"{self.timeout_ms / 1000:g} s: is its server running (and its secret "
                                   f"this one's)?") from None
            try:
                self.sock.send_multipart([b"", call, *frames], zmq.NOBLOCK)
            except zmq.Again:
                raise self._silent("dropped the connection as the call was sent: not sent") from None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(max(1, int(left * 1000))):
                raise self._silent(f"did not answer within {self.timeout_ms / 1000:g} s: is its server running?")
            msg = self.sock.recv_multipart()
            if len(msg) >= 3 and msg[0] == b"" and msg[1] == call:
                reply = msg[2:]
                break                        # (else the late answer of a call that timed out)
        if reply[0] == b"err":
            name = reply[1].decode()
            cls = getattr(errors, name, None) or {"ValueError": ValueError, "TypeError": TypeError}.get(name)
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
                        meta["records"], parts, meta["seq"])

    def held(self, key: bytes) -> tuple[int, int]:
        return tuple(json.loads(self._call(b"held", check_key(key))[1]))

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
