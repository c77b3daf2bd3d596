"""The worker: one model step per micro-batch, sessions' KV in a budget, snapshots and restores.

A micro-batch arrives from the worker's lane as consecutive dp_chunk records
(native/chunk.h, viewed as datapath.chunk.CHUNK_DTYPE). Worker.step runs one
forward pass over every prompt chunk in the batch and one decode token for
every request already generating (continuous batching), then returns the
requests that finished. A finished request's new KV entries (its prompt and
all but its last output token) go to the store as one delta; only once put()
has returned, i.e. the delta is durable, may the session be evicted (LRU)
when the KV budget is exceeded. A chunk for a session this worker does not
hold is served after restoring the session's chain of deltas from the store,
whichever worker wrote them.

The two interfaces other stages plug in:

    SnapshotStore  put(key, delta, meta) -> None   returns only once durable
                   restore(key) -> list[bytes]     the chain, oldest first; [] if none
                   delete(key) -> None
    Lane           recv_batch(timeout_ms) -> records | None   raises LaneClosed at the end
                   send_completions(completions) -> None

Worker.step reads the records only during the call (prompt tokens are copied
into the KV cache), so a ring lane may hand out views of its slots and reuse
them once step returns. The KV budget counts allocated cache bytes; it is
exceeded (and counted in stats["over_budget_steps"]) only when every resident
session is generating or not yet durable.

ZmqWorkerLane/ZmqLaneDriver are the ZeroMQ lane (one message per micro-batch);
the shared-memory ring lane implements the same two methods.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np

from .. import wire
from ..chunk import CHUNK_DTYPE, STAMPS, batch_from_bytes
from . import kvdelta
from .devices import SimulatedDevice
from .model import KVCache, Model, ModelConfig, sample


class SnapshotStore(Protocol):
    def put(self, key: int, delta: bytes, meta: dict) -> None: ...
    def restore(self, key: int) -> list[bytes]: ...
    def delete(self, key: int) -> None: ...


class LaneClosed(Exception):
    """The lane's producer said it is done."""


@dataclass
class Completion:
    session_id: int
    request_id: int
    status: str                       # "ok", or why the request failed
    tokens: list[int] = field(default_factory=list)
    stamps: dict[str, int] = field(default_factory=dict)   # CLOCK_MONOTONIC ns per stage
    kv_bytes_resident: int = 0        # the worker's, after this request's step
    context_tokens: int = 0           # the session's KV length at completion
    restored_tokens: int = 0          # tokens this request's session got from the store
    snapshot_bytes: int = 0           # stored size of the delta written at completion
    snapshot_error: str | None = None
    logits: np.ndarray | None = None  # (tokens, vocab) the outputs were sampled from, if asked for

    def to_frames(self) -> list[bytes]:
        """One JSON frame, plus the logits' float32 bytes when present (shape in the JSON)."""
        d = asdict(self)
        logits = d.pop("logits")
        if logits is None:
            return [json.dumps(d).encode()]
        d["logits_shape"] = list(logits.shape)
        return [json.dumps(d).encode(), np.ascontiguousarray(logits, np.float32).tobytes()]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> "Completion":
        d = json.loads(frames[0])
        shape = d.pop("logits_shape", None)
        c = cls(**d)
        if shape is not None:
            c.logits = np.frombuffer(frames[1], np.float32).reshape(shape)
        return c


class Lane(Protocol):
    def recv_batch(self, timeout_ms: int) -> np.ndarray | None: ...
    def send_completions(self, completions: list[Completion]) -> None: ...


@dataclass
class _Request:
    request_id: int
    chunk_count: int
    max_output_tokens: int
    stamps: dict[str, int]
    restored_tokens: int
    next_chunk: int = 0
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)

    @property
    def decoding(self) -> bool:
        return self.next_chunk == self.chunk_count and len(self.tokens) < self.max_output_tokens


@dataclass
class _Session:
    cache: KVCache
    request: _Request | None = None
    restored_tokens: int = 0  # handed to the next request, which reports them
    restored_at: int = 0


class Worker:
    def __init__(self, model: Model, store: SnapshotStore | None = None, *, kv_budget_bytes: int = 256 << 20,
                 codec: str = "zstd", temperature: float = 0.0, seed: int = 0,
                 device: SimulatedDevice | None = None, return_logits: bool = False):
        if codec not in kvdelta.CODECS:
            raise ValueError(f"unknown KV codec {codec!r}: choose one of {', '.join(kvdelta.CODECS)}")
        self.model, self.store, self.kv_budget_bytes, self.codec = model, store, kv_budget_bytes, codec
        self.temperature, self.seed, self.device, self.return_logits = temperature, seed, device, return_logits
        self.sessions: OrderedDict[int, _Session] = OrderedDict()  # least recently used first
        self.stats = dict(steps=0, snapshots=0, snapshot_failures=0, restores=0, evictions=0,
                          over_budget_steps=0, ignored_records=0, simulated_s=0.0)

    @property
    def busy(self) -> bool:
        """Some request is generating, so the worker should step even without a new batch."""
        return any(s.request is not None and s.request.decoding for s in self.sessions.values())

    @property
    def kv_bytes_resident(self) -> int:
        return sum(s.cache.nbytes for s in self.sessions.values())

    def holds(self, session_id: int) -> bool:
        return session_id in self.sessions

    def step(self, batch: np.ndarray | None = None) -> list[Completion]:
        """One model step: the batch's prompt chunks plus one token for each generating request."""
        t_pick = time.monotonic_ns()
        done: list[Completion] = []
        prompt: dict[int, list[np.ndarray]] = {}
        for rec in (batch if batch is not None else ()):
            sid = int(rec["session_id"])
            if rec["kind"] == wire.KIND_CLOSE:
                done += self._close(sid)
            elif rec["kind"] != wire.KIND_CHUNK:
                self.stats["ignored_records"] += 1
            else:
                err = self._admit(rec, t_pick)
                if err:
                    done.append(Completion(sid, int(rec["request_id"]), err))
                else:
                    prompt.setdefault(sid, []).append(rec["tokens"][:rec["n_tokens"]])

        # Chunks of one session in one batch are one segment: a cache may appear once per step.
        segments, kinds = [], []
        for sid, chunks in prompt.items():
            if sid not in self.sessions:
                continue  # closed later in the same batch
            segments.append((self.sessions[sid].cache, np.concatenate(chunks)))
            kinds.append((sid, "prefill"))
        for sid, s in self.sessions.items():
            if sid not in prompt and s.request is not None and s.request.decoding:
                segments.append((s.cache, np.array([s.request.tokens[-1]])))
                kinds.append((sid, "decode"))
        if not segments:
            return done
        contexts = [cache.length for cache, _ in segments]
        logits = self.model.forward(segments)
        self.stats["steps"] += 1
        if self.device is not None:
            sim = self.device.profile.step_s(
                prefill=[(len(t), ctx) for (_, t), ctx, (_, k) in zip(segments, contexts, kinds) if k == "prefill"],
                decode_contexts=[ctx for ctx, (_, k) in zip(contexts, kinds) if k == "decode"])
            self.stats["simulated_s"] += sim
            self.device.spend_until(t_pick + int(sim * 1e9))
        t_step = time.monotonic_ns()

        for (sid, kind), lg in zip(kinds, logits):
            s = self.sessions[sid]
            req = s.request
            self.sessions.move_to_end(sid)
            if kind == "prefill" and req.next_chunk < req.chunk_count:
                continue  # more prompt chunks to come
            if kind == "prefill":
                req.stamps["t_prefill_done"] = t_step
            if len(req.tokens) < req.max_output_tokens:
                pos = s.cache.length
                req.tokens.append(sample(lg, self.temperature, (self.seed, sid, pos)))
                if self.return_logits:
                    req.logits.append(lg)
                req.stamps.setdefault("t_first_token", t_step)
            if len(req.tokens) >= req.max_output_tokens:
                done.append(self._finish(sid, s))
        self._evict()
        return done

    def _admit(self, rec, t_pick: int) -> str | None:
        """Take a prompt chunk into its session (restoring it if needed); an error string if it cannot be."""
        sid, idx, count = int(rec["session_id"]), int(rec["chunk_index"]), int(rec["chunk_count"])
        if not 1 <= rec["n_tokens"] <= wire.MAX_CHUNK_TOKENS or idx >= count:
            return f"malformed chunk: n_tokens {rec['n_tokens']}, chunk {idx} of {count}"
        s = self.sessions.get(sid)
        if s is None:
            try:
                s = self._restore(sid)
            except kvdelta.DeltaError as e:
                return f"restore failed: {e}"
        req = s.request
        if idx == 0:
            if req is not None:
                return f"session busy with request {req.request_id}"
            stamps = {name: int(rec[name]) for name in STAMPS if rec[name]}
            stamps["t_worker"] = t_pick
            if s.restored_tokens:
                stamps["t_restored"] = s.restored_at
            s.request = req = _Request(int(rec["request_id"]), count, int(rec["max_output_tokens"]), stamps,
                                       s.restored_tokens)
            s.restored_tokens = 0
        elif req is None or req.request_id != rec["request_id"] or req.next_chunk != idx:
            return f"chunk {idx} of request {int(rec['request_id'])} arrived out of order"
        req.next_chunk += 1
        return None

    def _restore(self, sid: int) -> _Session:
        chain = self.store.restore(sid) if self.store is not None else []
        cache = kvdelta.restore(chain, self.model.config) if chain else KVCache(self.model.config)
        s = _Session(cache, restored_tokens=cache.length, restored_at=time.monotonic_ns())
        if chain:
            self.stats["restores"] += 1
        self.sessions[sid] = s
        return s

    def _finish(self, sid: int, s: _Session) -> Completion:
        req, s.request = s.request, None
        c = Completion(sid, req.request_id, "ok", req.tokens, req.stamps, restored_tokens=req.restored_tokens,
                       context_tokens=s.cache.length,
                       logits=np.array(req.logits, np.float32).reshape(len(req.tokens), self.model.config.vocab)
                       if self.return_logits else None)
        if self.store is not None and s.cache.length > s.cache.snapshot_len:
            blob = kvdelta.encode(kvdelta.export_delta(s.cache), self.model.config, self.codec)
            meta = dict(token_start=s.cache.snapshot_len, token_end=s.cache.length, codec=self.codec,
                        request_id=req.request_id)
            try:
                self.store.put(sid, blob, meta)
            except Exception as e:  # the session stays resident and unsnapshotted, so it is never evicted
                self.stats["snapshot_failures"] += 1
                c.snapshot_error = f"{type(e).__name__}: {e}"
            else:
                s.cache.snapshot_len = s.cache.length
                self.stats["snapshots"] += 1
                c.snapshot_bytes = len(blob)
                c.stamps["t_snapshot"] = time.monotonic_ns()
        c.stamps["t_done"] = time.monotonic_ns()
        c.kv_bytes_resident = self.kv_bytes_resident
        return c

    def _close(self, sid: int) -> list[Completion]:
        """The client is done with the session: free it here and in the store."""
        s = self.sessions.pop(sid, None)
        if self.store is not None:
            self.store.delete(sid)
        if s is not None and s.request is not None:
            return [Completion(sid, s.request.request_id, "session closed before the request finished")]
        return []

    def _evict(self):
        """Least recently used first, and only sessions that are idle and fully in the store."""
        while self.kv_bytes_resident > self.kv_budget_bytes:
            victim = next((sid for sid, s in self.sessions.items()
                           if s.request is None and s.cache.snapshot_len == s.cache.length), None)
            if victim is None:
                self.stats["over_budget_steps"] += 1
                return
            del self.sessions[victim]
            self.stats["evictions"] += 1


def serve(worker: Worker, lane: Lane, idle_timeout_ms: int = 50):
    """Step on every micro-batch, and without one while requests are generating, until the lane closes."""
    while True:
        try:
            batch = lane.recv_batch(0 if worker.busy else idle_timeout_ms)
        except LaneClosed:
            return
        if batch is None and not worker.busy:
            continue
        completions = worker.step(batch)
        if completions:
            lane.send_completions(completions)


class ZmqWorkerLane:
    """The worker's end of a ZeroMQ lane: PULL micro-batches (one message each), PUSH completions.

    An empty message closes the lane.
    """

    def __init__(self, batches: str, completions: str):
        import zmq
        self._zmq = zmq
        self.ctx = zmq.Context.instance()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(batches)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(completions)

    def recv_batch(self, timeout_ms: int) -> np.ndarray | None:
        if not self.pull.poll(timeout_ms):
            return None
        msg = self.pull.recv(copy=False)
        if len(msg) == 0:
            raise LaneClosed
        return batch_from_bytes(msg.buffer)

    def send_completions(self, completions: list[Completion]):
        for c in completions:
            self.push.send_multipart(c.to_frames())

    def close(self):
        self.pull.close(linger=0)
        self.push.close(linger=1000)


class ZmqLaneDriver:
    """The router's end of a ZeroMQ lane (binds both sockets): send micro-batches, receive completions."""

    def __init__(self, batches: str, completions: str):
        import zmq
        self.ctx = zmq.Context.instance()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.bind(batches)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(completions)

    def send_batch(self, records: np.ndarray):
        if records.dtype != CHUNK_DTYPE or len(records) == 0:
            raise ValueError("a micro-batch is one or more dp_chunk records (CHUNK_DTYPE)")
        self.push.send(records.tobytes())

    def recv_completion(self, timeout_ms: int) -> Completion | None:
        if not self.pull.poll(timeout_ms):
            return None
        return Completion.from_frames(self.pull.recv_multipart())

    def close_lane(self):
        self.push.send(b"")

    def close(self):
        self.push.close(linger=0)
        self.pull.close(linger=0)


@dataclass
class WorkerOptions:
    """What a worker process needs to build its model and worker (picklable, for multiprocessing)."""
    config: dict = field(default_factory=dict)
    seed: int = 0
    kv_budget_bytes: int = 256 << 20
    codec: str = "zstd"
    temperature: float = 0.0
    device: str | None = None
    sim_mode: str = "sleep"
    return_logits: bool = False

    def build(self, store: SnapshotStore | None) -> Worker:
        from .devices import profile
        model = Model(ModelConfig(**self.config), self.seed)
        device = SimulatedDevice(profile(self.device), self.sim_mode) if self.device else None
        return Worker(model, store, kv_budget_bytes=self.kv_budget_bytes, codec=self.codec,
                      temperature=self.temperature, seed=self.seed, device=device, return_logits=self.return_logits)


def worker_process(batches: str, completions: str, store: SnapshotStore | None, options: WorkerOptions):
    """Entry point of a worker process on a ZeroMQ lane (multiprocessing target, and `datapath worker`)."""
    worker = options.build(store)
    lane = ZmqWorkerLane(batches, completions)
    try:
        with one_blas_thread():
            serve(worker, lane)
    finally:
        lane.close()


def one_blas_thread():
    """A worker is one core's worth of compute: BLAS threads would fight the router and the other
    workers for the cores, and on 2 shared cores they make a tiny model's matmuls slower, not faster."""
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=1, user_api="blas")
