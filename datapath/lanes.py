"""Lanes: how a micro-batch reaches a worker and its completion comes back.

Every lane has the same worker-side interface:

    batch = lane.recv_batch(timeout_s)    # numpy array of records.CHUNK, one whole batch, or None
    lane.t_pickup                         # the clock when that batch reached the worker
    lane.send_completion(comp)            # one records.COMPLETION answering that batch

`shm`: two rings in shared memory for a worker on the same host:
    <name>.lane (router -> worker, dp_chunk slots) and <name>.done (worker -> router).
The router publishes a batch's slots last to first (each slot's sequence
word), so a worker never sees half a batch.

`zmq`: a DEALER socket the worker binds (tcp:// for another host, ipc:// for
another process); the router's DEALER connects to it. One message per
micro-batch (its dp_chunk records back to back, read in place without a
copy), one dp_completion message back.
"""
from __future__ import annotations

import time

import numpy as np

from . import records
from ._dataplane import ffi, lib
from .ring import Ring

DEFAULT_LANE_SLOTS = 256


def free_tcp_endpoint(host: str = "127.0.0.1") -> str:
    """tcp://host:port with a port the kernel just handed out (for a lane the caller binds at once)."""
    import socket
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def lane_names(name: str) -> tuple[str, str]:
    return f"{name}.lane", f"{name}.done"


def create_shm_lane(name: str, slots: int = DEFAULT_LANE_SLOTS, wait: str = "sleep") -> tuple[Ring, Ring]:
    """Create a worker's lane and completion ring; returns (lane, done) for the router."""
    if slots < records.MAX_BATCH_CHUNKS:
        raise ValueError(f"a lane needs at least {records.MAX_BATCH_CHUNKS} slots (one full batch), not {slots}")
    lane_name, done_name = lane_names(name)
    lane = Ring.create(lane_name, records.CHUNK.itemsize, slots, wait=wait, role="producer")
    try:
        done = Ring.create(done_name, records.COMPLETION.itemsize, 64, wait="spin", role="consumer")
    except BaseException:
        lane.close()
        lane.unlink()
        raise
    return lane, done


def unlink_shm_lane(name: str):
    from .ring import unlink
    for n in lane_names(name):
        unlink(n)


class ShmWorkerLane:
    """The worker's end of an shm lane (attaches by name)."""

    def __init__(self, name: str):
        lane_name, done_name = lane_names(name)
        self.lane = Ring.attach(lane_name, "consumer")
        self._t_pickup, self.t_pickup = ffi.new("uint64_t *"), 0
        self.done = None
        try:
            self.done = Ring.attach(done_name, "producer")
            # each slot is read (and written) as a whole record: a lane of smaller slots was read
            # across them, past the mapping at the last (found by review; the router checks its side)
            for ring, rec in ((self.lane, records.CHUNK), (self.done, records.COMPLETION)):
                if ring.slot_size < rec.itemsize:
                    raise ValueError(f"ring {ring.name!r} has {ring.slot_size}-byte slots: a lane needs "
                                     f"{rec.itemsize}")
        except BaseException:
            self.lane.close()
            if self.done is not None:
                self.done.close()
            raise

    def recv_batch(self, timeout_s: float) -> np.ndarray | None:
        # one C call waits, copies the whole batch and stamps it: after an idle spell every
        # Python step here ran cold (~50 us each, measured at 10 req/s), the pickup with them
        out = np.empty(records.MAX_BATCH_CHUNKS, dtype=records.CHUNK)
        n = lib.dp_lane_recv(self.lane.ptr, ffi.from_buffer("struct dp_chunk[]", out), len(out),
                             int(timeout_s * 1e9) if timeout_s >= 0 else -1, self._t_pickup)
        if not n:
            return None
        self.t_pickup = self._t_pickup[0]
        return out[:n]

    def send_completion(self, comp: np.ndarray) -> bool:
        return self.done.enqueue(np.ascontiguousarray(comp, dtype=records.COMPLETION).tobytes()) == 1

    def close(self):
        self.lane.close()
        self.done.close()


def completion_for(batch: np.ndarray, tokens, worker: int = 0, t_start: int = 0, t_end: int = 0,
                   kv_bytes: int = 0, eos=None) -> np.ndarray:
    """A completion answering `batch`: tokens[i] is what record i sampled."""
    comp = np.zeros(1, dtype=records.COMPLETION)
    n = len(batch)
    comp["batch_seq"] = batch["batch_seq"][0]
    comp["worker"] = worker
    comp["n"] = n
    comp["t_start"], comp["t_end"], comp["kv_bytes"] = t_start, t_end, kv_bytes
    e = comp["e"][0]
    e["request_id"][:n] = batch["request_id"]
    e["token"][:n] = tokens
    e["status"][:n] = 200
    if eos is not None:
        e["flags"][:n] = np.where(eos, records.CE_EOS, 0)
    return comp


class ZmqWorkerLane:
    """The worker's end of a zmq lane: binds `endpoint`, the router connects."""

    def __init__(self, endpoint: str):
        import zmq
        self._zmq = zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise OSError(f"cannot bind zmq lane at {endpoint}: {e}") from None
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.t_pickup = 0
        self.malformed = 0       # messages dropped: not 1..MAX_BATCH_CHUNKS whole chunk records
        self.probes = 0          # the router's probes answered (it had marked this worker down)

    def recv_batch(self, timeout_s: float) -> np.ndarray | None:
        if not self.sock.poll(int(timeout_s * 1000) if timeout_s >= 0 else None):
            return None
        frame = self.sock.recv(copy=False)
        if not len(frame.buffer):
            # the router's probe of a worker it marked down (router.c, zmq_health): answered from
            # here, the loop that takes batches, so a worker comes back only once it takes them
            try:
                self.sock.send(b"", self._zmq.NOBLOCK)
            except self._zmq.Again:
                pass                 # no router connected: its next probe
            self.probes += 1
            return None
        n, odd = divmod(len(frame.buffer), records.CHUNK.itemsize)
        if odd or not 1 <= n <= records.MAX_BATCH_CHUNKS:
            # a stray peer's message (the endpoint takes any): dropped, not the worker's death
            self.malformed += 1
            return None
        self.t_pickup = time.monotonic_ns()
        return np.frombuffer(frame.buffer, dtype=records.CHUNK)

    def send_completion(self, comp: np.ndarray) -> bool:
        """False when it would block (no router connected: gone, or not yet): the caller retries
        and checks its stop flag meanwhile. A blocking send hung a worker whose router had gone."""
        try:
            self.sock.send(np.ascontiguousarray(comp, dtype=records.COMPLETION).tobytes(), self._zmq.NOBLOCK,
                           copy=False)
        except self._zmq.Again:
            return False
        return True

    def close(self):
        self.sock.close(0)
        self.ctx.term()
