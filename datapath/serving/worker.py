"""The worker: one model step per micro-batch, sessions' KV in a budget, snapshots and restores.

The router (native/router.c) drives it. A micro-batch arrives on the lane as
consecutive dp_chunk records (datapath.records.CHUNK): prompt pieces
(KIND_CHUNK, the request's last one flagged CHUNK_F_FINAL) and decode steps
(KIND_DECODE, no tokens), and KIND_CLOSE records (the client is done with the
session: its KV and snapshots are freed). Worker.step runs them all as one forward pass and
answers with one dp_completion whose entry i answers record i: the token
sampled after a final piece or a decode step, a status, and the step's start
and end stamps and the KV bytes resident.

A request is finished once it has sampled max_output_tokens tokens. Its new KV
entries (its prompt and all but its last output token) then go to the store
as one delta; only once put() has returned, i.e. the delta is durable, may the
session be evicted (least recently used first) when the KV budget is
exceeded. A record for a session this worker does not hold restores the
session's chain of deltas from the store, whichever worker wrote them; one it
holds is dropped for the store's copy if another worker has continued it since.

The two interfaces other stages plug in:

    SnapshotStore  put(key, delta, meta) -> int    returns only once durable: the number of
                                                   the record it wrote (never handed out twice);
                                                   raises SessionChanged if the store does not
                                                   hold the session up to meta["token_start"]
                   restore(key) -> list[bytes]     the chain, oldest first ([] if none), with
                                                   .seq, its last record's number (0: none)
                   held(key) -> (n, seq)           tokens [0, n) of the session it holds, and
                                                   the number of the record that ends them
                   delete(key) -> None
    Lane           recv_batch(timeout_s) -> CHUNK records | None
                   send_completion(comp) -> bool                    one COMPLETION record

as datapath.lanes.ShmWorkerLane (shared memory) and ZmqWorkerLane (ZeroMQ) do.

Worker.step reads the records only during the call (prompt tokens are copied
into the KV cache), so a lane may hand out views of its slots. The KV budget
counts allocated cache bytes; it is exceeded (counted in
stats["over_budget_steps"]) only while every resident session is in a
request or not yet durable. A worker without a store, which can evict
nothing, refuses new sessions 503 while over it (stats["kv_full_refused"]).
A verbatim repeat of one of a session's last 8 answered requests (its id and
client send stamp) is refused 409 (stats["duplicates_refused"]), never run on
top of its own turn. A request one of whose records is refused (any status: the router
answers its client with it) leaves nothing in the session: its pieces so far are
cut off and its later records refused alike (stats["cut_on_refusal"]).
"""
from __future__ import annotations

import gc
import numbers
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from snapshotstore.errors import DamagedRecord, SessionChanged, SnapshotError, TooLarge

from .. import records, wire
from . import kvdelta
from .devices import SimulatedDevice
from .model import KVCache, Model, ModelConfig, sample


SessionKey = tuple[int, int]   # (tenant, session_id): sessions of different tenants never meet
# A live request's next record comes within the router's reassembly timeout (1 s) plus the wait
# behind its worker's queue (seconds, at saturation): one untouched this long is taken as given
# up on (_release_abandoned), and its later records, if any come, are refused.
ABANDONED_NS = 60_000_000_000
ABANDONED_KEPT = 4096      # released requests remembered (per session); the oldest forgotten first
SETTLE_EVERY_NS = 1_000_000_000   # an idle unsure session settled to be evicted: one a second at most
ANSWERED_KEPT = kvdelta.MAX_ANSWERED   # a session's answered requests a verbatim repeat of is refused 409 (8:
                                      # a delta that begins a chain again carries them)


class SnapshotStore(Protocol):
    def put(self, key: SessionKey, delta: bytes, meta: dict) -> int: ...   # SessionChanged: see above;
    # meta: token_start, token_end, codec, request_id, and replace (the delta, from 0, is the whole chain)
    def restore(self, key: SessionKey) -> list[bytes]: ...   # with .seq (snapshotstore.api.Deltas)
    def held(self, key: SessionKey) -> tuple[int, int]: ...  # tokens [0, n) of the session, last record's number
    def delete(self, key: SessionKey) -> None: ...


class Lane(Protocol):
    def recv_batch(self, timeout_s: float) -> np.ndarray | None: ...
    def send_completion(self, comp: np.ndarray) -> bool: ...


@dataclass
class RequestDone:
    """The worker's own account of a finished request (the router builds the client's response)."""
    tenant: int
    session_id: int
    request_id: int
    tokens: list[int]
    context_tokens: int               # the session's KV length when it finished
    restored_tokens: int              # KV tokens this request's session got from the store
    snapshot_bytes: int = 0           # stored size of the delta written at completion
    snapshot_error: str | None = None
    snapshot_flag: int = 0            # with snapshot_error: its 503's CE_STORE or CE_KV_LOST (_store_failed)
    stamps: dict[str, int] = field(default_factory=dict)  # CLOCK_MONOTONIC ns
    logits: np.ndarray | None = None  # (tokens, vocab) the outputs were sampled from, if asked for


@dataclass
class _Request:
    request_id: int
    max_output_tokens: int
    restored_tokens: int
    stamps: dict[str, int]
    start_len: int = 0       # the session's KV length before it: what it is cut back to if superseded
    last_step: int = 0       # the last step that ran any of it (monotonic ns): _release_abandoned
    prefill_done: bool = False
    replay: bool = False     # begun from a record flagged CHUNK_F_REPLAY
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)

    @property
    def attempt(self) -> tuple[int, int]:
        """(id, client send stamp): the request, told from a retry under its id sent anew."""
        return self.request_id, self.stamps.get("t_send", 0)

    def is_(self, attempt: tuple[int, int]) -> bool:
        """Is (id, send stamp) this request, not a retry of its id sent anew? (A stamp of 0, on
        either side, says nothing: the id decides.)"""
        (rid, sent), (_, mine) = attempt, self.attempt
        return self.request_id == rid and (not sent or not mine or sent == mine)


@dataclass
class _Session:
    cache: KVCache
    request: _Request | None = None
    restored_tokens: int = 0  # handed to the session's next request, which reports them
    unsure: tuple[int, int] | None = None  # (id, send stamp) of a request answered 503 whose put the
                                           # store could not confirm (_settle)
    answered: tuple[tuple[int, int], ...] = ()   # (request id, client send stamp) of its last turns answered
                                                 # 200, the newest last (ANSWERED_KEPT)


@dataclass
class _Segment:
    """One session's share of a step: its prompt pieces, or one decode token."""
    key: SessionKey
    decode: bool
    tokens: list[np.ndarray] = field(default_factory=list)
    answer: int | None = None  # the record whose entry carries the sampled token


def check_slowdown(factor: float):
    """A straggler's factor: a number from 1 (not slowed) to 1000 (ValueError otherwise)."""
    if isinstance(factor, bool) or not (isinstance(factor, numbers.Real) and 1 <= factor <= 1000):
        raise ValueError(f"a worker's slowdown must be a number from 1 (not slowed) to 1000, not {factor!r}")


def _answered_of(chain) -> tuple:
    """A stored session's last answered requests, (id, send stamp), oldest first: those its last
    deltas name, after the list a delta that began the chain again carries (kvdelta, format 4)."""
    newest_first: list = []
    for h in map(kvdelta.header, reversed(chain)):
        if h["request_id"] and h["sent_ns"]:
            newest_first.append((h["request_id"], h["sent_ns"]))
        newest_first += reversed(h["answered"])
        if h["answered"] or len(newest_first) >= ANSWERED_KEPT:
            break                        # (what came before is in its list, or older than kept)
    return tuple(reversed(newest_first[:ANSWERED_KEPT]))


class Worker:
    def __init__(self, model: Model, store: SnapshotStore | None = None, *, index: int = 0,
                 kv_budget_bytes: int = 256 << 20, codec: str = "zstd", temperature: float = 0.0, seed: int = 0,
                 device: SimulatedDevice | None = None, return_logits: bool = False, slowdown: float = 1.0):
        if codec not in kvdelta.CODECS:
            raise ValueError(f"unknown KV codec {codec!r}: choose one of {', '.join(kvdelta.CODECS)}")
        check_slowdown(slowdown)
        self.model, self.store, self.index, self.kv_budget_bytes = model, store, index, kv_budget_bytes
        self.codec, self.temperature, self.seed = codec, temperature, seed
        self.device, self.return_logits = device, return_logits
        self._slowdown = np.array([slowdown], dtype="<f8")   # read each step: see follow_slowdown
        self.sessions: OrderedDict[SessionKey, _Session] = OrderedDict()  # least recently used first
        self._kv_bytes = 0   # the sessions' cache bytes, kept as they change (not summed over all each step)
        self.finished: list[RequestDone] = []  # appended as requests finish; the caller drains it
        self.stats = dict(steps=0, records=0, refused=0, snapshots=0, snapshot_failures=0, snapshot_replies_lost=0,
                          restores=0, evictions=0, over_budget_steps=0, stale_dropped=0, replay_restored=0,
                          moved_without_store=0, closed=0, whole_reputs=0, superseded=0, context_full=0,
                          store_errors=0, replays_durable=0, abandoned=0, unsure_rolled_back=0, unsure_settled_idle=0,
                          kv_full_refused=0, damaged_rewritten=0,
                          duplicates_refused=0, cut_on_refusal=0, simulated_s=0.0, slowed_s=0.0)
        self.last_store_error: str | None = None
        self._abandoned: dict[SessionKey, tuple[int, int]] = {}   # the request (id, send stamp) released as
                                                                  # abandoned, per session
        self._next_settle_ns = 0      # _settle_idle_unsure
        self._last_release_ns = 0     # _evict's last _release_abandoned

    @property
    def kv_bytes_resident(self) -> int:
        return self._kv_bytes

    @property
    def slowdown(self) -> float:
        return float(self._slowdown[0])

    def follow_slowdown(self, slot: np.ndarray):
        """Read the slowdown from `slot` (one float64, shared) at each step: another process can
        turn this worker into a straggler, or back, while it serves (Pipeline.set_slowdown)."""
        self._slowdown = slot

    def holds(self, session_id: int, tenant: int = 0) -> bool:
        return (tenant, session_id) in self.sessions

    def step(self, batch: np.ndarray) -> np.ndarray:
        """Run one micro-batch as one model step; its completion record."""
        t_start = time.monotonic_ns()
        comp = np.zeros(1, dtype=records.COMPLETION)
        entries = comp["e"][0]
        n = len(batch)
        entries["request_id"][:n] = batch["request_id"]
        entries["status"][:n] = wire.STATUS_OK
        segments: dict[SessionKey, _Segment] = {}
        refused: dict[tuple[SessionKey, int], int] = {}   # requests refused a record in this batch
        for i, rec in enumerate(batch):
            key, rid = (int(rec["tenant"]), int(rec["session_id"])), int(rec["request_id"])
            status = refused.get((key, rid)) or self._take(i, rec, key, rid, segments, t_start, entries)
            if status != wire.STATUS_OK:
                entries["status"][i] = status
                self.stats["refused"] += 1
                if rec["kind"] != wire.KIND_CLOSE and (key, rid) not in refused:
                    refused[key, rid] = status
                    self._refused(key, rid, segments)
        self.stats["records"] += n
        if segments:
            self._run(list(segments.values()), entries, t_start)
        if self.store is None:        # the router keeps such a worker's moved sessions where they run
            entries["flags"][:n] |= records.CE_NO_STORE
        comp["batch_seq"] = batch["batch_seq"][0] if n else 0
        comp["worker"], comp["n"], comp["t_start"] = self.index, n, t_start
        self._evict()
        comp["kv_bytes"] = self.kv_bytes_resident
        comp["t_end"] = time.monotonic_ns()
        return comp

    def _take(self, i: int, rec, key: SessionKey, rid: int, segments: dict[SessionKey, _Segment], t_start: int,
              entries) -> int:
        """Place record i (of session key, request rid) in its session's segment; the status its entry
        gets (and flags, on a refusal the router tells the client the reason of)."""
        kind = int(rec["kind"])
        attempt = (rid, int(rec["t_send"]))   # the router stamps every record with its request's send stamp
        if kind == records.KIND_DECODE:
            if self._abandoned.get(key) == attempt:
                return wire.STATUS_UNAVAILABLE   # released as abandoned, as its pieces are (it was 422)
            s = self.sessions.get(key)
            req = s.request if s is not None else None
            if req is None or not req.is_(attempt) or not req.prefill_done or key in segments:
                return wire.STATUS_UNPROCESSABLE  # no such request generating here, or twice in one step
            segments[key] = _Segment(key, True, [np.array([req.tokens[-1]])], answer=i)
            return wire.STATUS_OK
        if kind == wire.KIND_CLOSE:           # the client is done with the session (after its requests)
            if key in segments:
                return wire.STATUS_UNPROCESSABLE
            try:
                self.close(key[1], key[0])
            except Exception as e:           # dropped here, but the store may still hold it: say so
                entries["flags"][i] |= self._store_failed(e)
                return wire.STATUS_UNAVAILABLE
            self.stats["closed"] += 1
            return wire.STATUS_OK
        if kind != wire.KIND_CHUNK or not 1 <= rec["n_tokens"] <= wire.MAX_CHUNK_TOKENS:
            return wire.STATUS_BAD_REQUEST
        tokens = rec["tokens"][:rec["n_tokens"]]
        if tokens.max() >= self.model.config.vocab:
            return wire.STATUS_BAD_REQUEST  # one bad record must not fail the whole step
        # a client's retry of a try lost in a failover, sent under that try's stamp (router.c,
        # lost_retake): the request begins again with this record, whatever of that try is here
        retake = bool(rec["flags"] & records.CHUNK_F_RETAKE)
        if key in self._abandoned:
            if self._abandoned[key] == attempt and not retake:
                return wire.STATUS_UNAVAILABLE   # released as abandoned: never run on a cut context
            del self._abandoned[key]             # (a retry, stamped anew or retaken, runs)
        s = self.sessions.get(key)
        # The store is another component (a remote one times out): its failure is this request's
        # 503, never the worker's death, which would replay the request onto the next worker.
        try:
            if s is not None and s.unsure is not None and s.request is None:
                s = self._settle(key, s)
            if s is not None and (s.request is None or not s.request.is_(attempt)) and self._moved_on(key, s, rec):
                self._drop(key)                  # another worker continued it: the store's copy is newer
                self.stats["stale_dropped"] += 1
                s = None
            elif s is not None and s.request is None and self.store is not None and rec["flags"] & records.CHUNK_F_REPLAY:
                # A replay back on a worker holding the session idle: this copy may end with the
                # request's own turn (it finished here and its answer was lost on the way), and it
                # ran again on top of it: the prompt twice, other tokens, the turn put twice (found
                # by review). The store's chain, without that turn if it is its last, is the context.
                self._drop(key)
                self.stats["replay_restored"] += 1
                s = None
            if s is None and self.store is None and self._kv_bytes > self.kv_budget_bytes:
                # Nothing to evict to: a new session would only grow the KV past its budget. The
                # sessions held go on; a CLOSE frees one. Before, the KV grew without bound.
                self.stats["kv_full_refused"] += 1
                entries["flags"][i] |= records.CE_KV_FULL
                return wire.STATUS_UNAVAILABLE
            if s is None:
                s = self._restore(key, (rid, int(rec["t_send"])) if rec["flags"] & records.CHUNK_F_REPLAY else None)
        except Exception as e:               # kvdelta.DeltaError (a corrupt delta) among them
            entries["flags"][i] |= self._store_failed(e)
            return wire.STATUS_UNAVAILABLE
        replay = bool(rec["flags"] & records.CHUNK_F_REPLAY)
        if (not replay and (s.request is None or not s.request.is_(attempt)) and rec["t_send"]
                and attempt in s.answered):
            # One of the session's last answered requests again, its id and send stamp (a client's
            # verbatim resend, a late duplicate the router no longer remembered): it ran, and its
            # turn is in the context. Run again, it added its prompt to the context a second time
            # and the session went on from a history its client never had.
            self.stats["duplicates_refused"] += 1
            return wire.STATUS_CONFLICT
        if s.request is not None and (not s.request.is_(attempt) or (replay and not s.request.replay) or retake):
            # A new request on the session: one the router gave up on (refused, expired: its client
            # got an error) is superseded, and the KV its pieces added is cut off (not the
            # session's) before this one's room is judged. So is a retry of it under its id, sent
            # anew (its stamp differs: it ran on top of the first try's pieces, the prompt twice,
            # and was answered 200; found by review), and this very request when the router
            # replays it from its first chunk (it gave up on this worker, a zmq one, for a stall,
            # then the request came back to it): its pieces so far would have been run twice. And a
            # retake, under the stamp of the try whose pieces are here (a zmq worker given up on for a
            # stall, come back): they were run twice (a review's probe: 368 tokens of context, not 240).
            self.stats["superseded"] += 1
            s = self._cut_back(key, s)
        queued = sum(len(x) for x in segments[key].tokens) if key in segments else 0
        if s.cache.length + queued + len(tokens) > self.model.config.max_context:
            return wire.STATUS_TOO_LARGE
        if s.request is None:
            if self.store is None and rec["flags"] & records.CHUNK_F_MOVED:
                self.stats["moved_without_store"] += 1   # its turns elsewhere are in no store: not here
            stamps = {name: int(rec[name]) for name in ("t_send", "t_xdp", "t_router", "t_lane") if rec[name]}
            stamps["t_worker"] = t_start
            s.request = _Request(rid, int(rec["max_output_tokens"]), s.restored_tokens, stamps, s.cache.length,
                                 last_step=t_start, replay=replay)
            s.restored_tokens = 0
        seg = segments.get(key)
        if s.request.prefill_done or (seg is not None and (seg.decode or seg.answer is not None)):
            return wire.STATUS_UNPROCESSABLE  # prompt after the final piece
        seg = segments.setdefault(key, _Segment(key, False))
        seg.tokens.append(tokens)
        if rec["flags"] & records.CHUNK_F_FINAL:
            seg.answer = i
        return wire.STATUS_OK

    def _refused(self, key: SessionKey, rid: int, segments: dict[SessionKey, _Segment]):
        """One of request rid's records was refused, and the router answers its client with that
        error: none of it may stay in the session. Its pieces so far are cut off, and its later
        records in this batch get the same answer (the router sends no more of it). Before, a piece
        refused 413 left its neighbours running: the request finished on a prompt with a hole in it
        and its turn was put in the store, under a client that was told 413."""
        s = self.sessions.get(key)
        if s is not None and s.request is not None and s.request.request_id == rid:
            segments.pop(key, None)
            self._cut_back(key, s)
            self.stats["cut_on_refusal"] += 1

    def _run(self, segs: list[_Segment], entries, t_start: int):
        """The forward pass over all segments, then sampling, finishing and the simulated device time."""
        caches = [self.sessions[s.key].cache for s in segs]
        contexts = [c.length for c in caches]
        tokens = [np.concatenate(s.tokens) for s in segs]
        slowdown = self.slowdown          # once a step: another process may change it (follow_slowdown)
        before = sum(c.nbytes for c in caches)
        t_forward = time.monotonic_ns()
        try:
            logits = self.model.forward(list(zip(caches, tokens)))
        finally:
            self._kv_bytes += sum(c.nbytes for c in caches) - before   # the caches that grew
        self.stats["steps"] += 1
        if self.device is not None:
            sim = self.device.profile.step_s(
                prefill=[(len(t), ctx) for s, t, ctx in zip(segs, tokens, contexts) if not s.decode],
                decode_contexts=[ctx for s, ctx in zip(segs, contexts) if s.decode])
            self.stats["simulated_s"] += sim
            # a straggler (a throttled or shared device): its device takes `slowdown` times as long
            self.stats["slowed_s"] += sim * (slowdown - 1)
            self.device.spend_until(t_start + int(sim * slowdown * 1e9))
        elif slowdown > 1:
            # no device: the forward pass lasts `slowdown` times what it took (waiting for the core
            # included), the rest asleep, so the host's cores stay with the others; store restores
            # and puts are not slowed: they are the store's time, not this worker's device's
            extra = (time.monotonic_ns() - t_forward) * (slowdown - 1) / 1e9
            self.stats["slowed_s"] += extra
            time.sleep(extra)
        t_step = time.monotonic_ns()
        for seg, lg in zip(segs, logits):
            s = self.sessions[seg.key]
            self.sessions.move_to_end(seg.key)
            s.request.last_step = t_start
            if seg.answer is None:
                continue  # prompt pieces before the final one
            req = s.request
            if not seg.decode:
                req.prefill_done = True
                req.stamps["t_prefill_done"] = t_step
            if len(req.tokens) < req.max_output_tokens:
                # (the tenant too: two tenants whose session ids match drew alike)
                tok = sample(lg, self.temperature, (self.seed, *seg.key, s.cache.length))
                req.tokens.append(tok)
                entries["token"][seg.answer] = tok
                if self.return_logits:
                    req.logits.append(lg)
            if len(req.tokens) < req.max_output_tokens and s.cache.length >= self.model.config.max_context:
                # no room to feed that token back: the sequence ends here (a "length" stop), and the
                # router, told so by the flag, answers with the tokens so far
                entries["flags"][seg.answer] |= records.CE_EOS
                self.stats["context_full"] += 1
            elif len(req.tokens) < req.max_output_tokens:
                continue
            done = self._finish(seg.key, s, t_step)
            if done.snapshot_error is not None:
                entries["status"][seg.answer] = wire.STATUS_UNAVAILABLE    # its turn is in no store
                entries["flags"][seg.answer] |= done.snapshot_flag
            else:
                s.answered = (s.answered + (req.attempt,))[-ANSWERED_KEPT:]
            self.finished.append(done)

    def _moved_on(self, key: SessionKey, s: _Session, rec) -> bool:
        """At a new request of a resident session: has another worker put more of it in the store
        since (a policy that spreads sessions, a bounded-load spill, a failover)? Then this copy
        is stale and continuing from it would answer from a context without those turns. Asked
        only when the router flags that the session last ran elsewhere (CHUNK_F_MOVED): one store
        lookup (a ~0.2 ms RPC to a shared store's server) per moved request, none otherwise."""
        # != and not >: the store may hold less too, when the session was closed on the other
        # worker (deleted: a reused id starts fresh) or ran there anew; this copy is stale then.
        # The record number too: a session closed there and its reused id grown to exactly this
        # copy's length passed a check of the length alone. A number this copy has missed (a put
        # whose reply was lost, in a turn that then failed) makes it stale too: a restore, never
        # a wrong answer.
        return (self.store is not None and bool(rec["flags"] & records.CHUNK_F_MOVED)
                and self.store.held(key) != (s.cache.snapshot_len, s.cache.snapshot_seq))

    def _store_failed(self, e: Exception) -> int:
        """Counted; the flag of the 503 it costs a record, which the client's body says: the
        session's stored KV cannot be used (a corrupt or foreign delta, a damaged record, a chain
        too large for one record), which a retry meets again (CE_KV_LOST); or the store failed (a
        device, a timeout: CE_STORE); or neither is known (a bug here: no flag, no body)."""
        self.stats["store_errors"] += 1
        self.last_store_error = f"{type(e).__name__}: {e}"
        if isinstance(e, (kvdelta.DeltaError, TooLarge, DamagedRecord)):
            return records.CE_KV_LOST
        return records.CE_STORE if isinstance(e, (SnapshotError, OSError)) else 0

    def _restore(self, key: SessionKey, replay: tuple[int, int] | None = None) -> _Session:
        """The session from the store. replay: (request id, client send stamp) of the request it is
        restored for, when the router replays it (a failover). If the store's last delta is that
        request's own (its id, and its send stamp where both have one: an id alone also matched an
        earlier, answered request of the session that reused it), its worker put its turn and died
        before the router had the answer. The turn is taken back out of the store first (the chain
        replaced by the context before it, in one put); the request runs again from there and
        puts its own turn when it ends. Before session 18 the replay kept the first run's turn and
        put none, so a replay the router then gave up on (the client told 503) left that turn
        behind, and the client's retry ran on top of it (found by review). If the take-back fails,
        this record is answered 503 and the turn stays. Earlier still, a replay ran on top of
        its own turn: a context holding the prompt twice, and other tokens."""
        chain = self.store.restore(key) if self.store is not None else []
        seq = chain.seq if chain else 0
        taken_back = False
        if chain and replay and replay[0]:    # 0 names no request: a whole re-put's first delta has it
            last, (rid, sent) = kvdelta.header(chain[-1]), replay
            taken_back = last["request_id"] == rid and (not last["sent_ns"] or not sent or last["sent_ns"] == sent)
            if taken_back:
                chain = chain[:-1]
        cache = kvdelta.restore(chain, self.model.config) if chain else KVCache(self.model.config)
        cache.snapshot_seq = seq
        # its later deltas go in the chain's codec, which a worker started with another (a restart
        # with --codec, a pool whose workers differ) does not choose: the store refuses a chain of
        # mixed codecs, and every turn of the session was answered 503 (found by review)
        cache.snapshot_codec = kvdelta.header(chain[0])["codec"] if chain else None
        answered = _answered_of(chain)
        if taken_back:
            self._rewrite_whole(key, cache, answered)
            self.stats["replays_durable"] += 1
        if chain:
            self.stats["restores"] += 1
        s = self.sessions[key] = _Session(cache, restored_tokens=cache.length)
        s.answered = answered
        self._kv_bytes += cache.nbytes
        return s

    def _finish(self, key: SessionKey, s: _Session, t_step: int) -> RequestDone:
        req, s.request = s.request, None
        vocab = self.model.config.vocab
        done = RequestDone(*key, req.request_id, req.tokens, s.cache.length, req.restored_tokens, stamps=req.stamps,
                           logits=np.array(req.logits, np.float32).reshape(len(req.tokens), vocab)
                           if self.return_logits else None)
        done.stamps["t_last_token"] = t_step
        if self.store is not None and s.cache.length > s.cache.snapshot_len:
            try:
                done.snapshot_bytes = self._put_turn(key, s.cache, req, s.answered)
            except Exception as e:
                held, last, seq = self._store_end(key)
                # this request's own turn, by its id and send stamp: by the id alone a retry of
                # it, stamped anew, whose put landed from another worker read as this one's (found
                # by review: answered 200 with a turn the store then gave back)
                if held == s.cache.length and last == req.attempt:
                    self.stats["snapshot_replies_lost"] += 1   # it landed: a snapshot, its reply lost
                    s.cache.snapshot_seq = seq
                else:
                    self.stats["snapshot_failures"] += 1
                    done.snapshot_flag = self._store_failed(e)
                    done.snapshot_error = f"{type(e).__name__}: {e}"
                    self._unwind(key, s, req, held)
                    return done
            s.cache.snapshot_len = s.cache.length
            self.stats["snapshots"] += 1
            done.stamps["t_snapshot"] = time.monotonic_ns()
        return done

    def _put_turn(self, key: SessionKey, cache: KVCache, req: _Request, answered: tuple) -> int:
        """The request's turn (and anything before it the store lacks) into the store; its stored
        bytes. answered: the session's last answered requests, which a chain begun again carries."""
        try:
            return self._put_from(key, cache, cache.snapshot_len, req, answered)
        except SessionChanged:
            # The store no longer holds what this copy put last (its LRU evicted the chain while
            # the session stayed resident here): this copy is the whole session, so it goes in
            # whole, from token 0 (refused too if the store holds another history of it).
            n = self._put_from(key, cache, 0, req, answered)
            self.stats["whole_reputs"] += 1
            return n
        except DamagedRecord:
            if not req.start_len:
                raise
            # The store's chain of the session is damaged (a record failed its CRC: an append that
            # compacts the chain read it), so no worker can restore it; this copy, which the append
            # continued, is the session's best. It replaces the chain, then the turn goes in as its
            # own delta. Before, the failure left the session unsure, every later request of it read
            # the damaged chain again and was answered 503, and it was never evicted (review).
            n = self._put(key, cache, 0, 0, req.start_len, replace=True, answered=answered)
            self.stats["damaged_rewritten"] += 1
            return n + self._put(key, cache, req.start_len, req.request_id, sent_ns=req.stamps.get("t_send", 0))

    def _put_from(self, key: SessionKey, cache: KVCache, start: int, req: _Request, answered: tuple) -> int:
        """Entries [start, length): what precedes the request's turn as a delta of its own, naming no
        request (from token 0: carrying `answered` instead), then the turn, so a replay of the
        request finds its turn as the last delta and takes back exactly that (_restore)."""
        n = (self._put(key, cache, start, 0, req.start_len, answered=answered if start == 0 else ())
             if start < req.start_len else 0)
        return n + self._put(key, cache, max(start, req.start_len), req.request_id,
                             sent_ns=req.stamps.get("t_send", 0))

    def _last_delta(self, key: SessionKey) -> tuple[dict | None, int]:
        """The header of the store's last delta of the session (None: it holds none), and its
        record's number. It reads the chain: after a failed put only."""
        chain = self.store.restore(key)
        return (kvdelta.header(chain[-1]), chain.seq) if chain else (None, 0)

    def _store_end(self, key: SessionKey) -> tuple[int | None, tuple[int, int], int | None]:
        """Where the store's copy of the session ends, the request its last delta names, and
        that delta's record number; (None, (0, 0), None) if the store cannot say. The request is
        its (id, send stamp)."""
        try:
            last, seq = self._last_delta(key)
        except Exception:
            return None, (0, 0), None
        return (last["token_end"], (last["request_id"], last.get("sent_ns", 0)), seq) if last else (0, (0, 0), 0)

    def _unwind(self, key: SessionKey, s: _Session, req: _Request, held: int | None):
        """The request's turn did not become durable and the request is answered 503: the session
        keeps resident only what the store holds, so the client's retry runs on the context it
        had and a later restore anywhere agrees with it. Cut back to the turn's start when the
        store holds exactly that (this copy put it, or restored it), or when the store cannot say
        (then settled at the next request); else (another history of the session there) the copy
        goes and the next request restores the store's. Before, such a request was answered 200
        with its turn in no store: a failover
        or a spill lost it silently, later puts spanned several turns under one request's id, and
        the session, never durable, could never be evicted."""
        if held == req.start_len:
            s.cache.length = s.cache.snapshot_len = req.start_len
        elif held is None and s.cache.snapshot_len == req.start_len:
            # The store cannot say (a remote one that timed out: the put may still land there):
            # cut back too, and settle with the store before the session's next request (_settle).
            s.cache.length = req.start_len
            s.unsure = req.attempt
        else:
            self._drop(key)

    def _settle(self, key: SessionKey, s: _Session) -> _Session | None:
        """The session's last request was answered 503 while the store could not say whether its
        turn had landed. If it has since, it is taken back out (the chain replaced by the
        session put again whole without it), so the store agrees with what the client was told
        and its retry does not run on top of that turn. None: the store holds another history
        of the session, whose copy then goes. Raises (this record's 503) while the store still
        cannot say."""
        try:
            last, _ = self._last_delta(key)
        except DamagedRecord:
            # the store's chain is damaged: nobody can restore it, and this copy is what the client
            # was told (_put_turn's reason); it replaces the chain
            self._rewrite_whole(key, s.cache, s.answered)
            self.stats["damaged_rewritten"] += 1
            s.unsure = None
            return s
        # that request's own turn, by its id and send stamp: a retry of it (stamped anew) that ran
        # on another worker and was answered 200 named the same id, and was taken out of the store
        if (last is not None and (last["request_id"], last.get("sent_ns", 0)) == s.unsure
                and last["token_start"] == s.cache.length):
            # It landed: this copy, without that turn, replaces the chain in one record. A delete then
            # a put left the store empty between them, and a failed put or a kill there lost the
            # session for every other worker (found by review). If the put fails, still unsure.
            self._rewrite_whole(key, s.cache, s.answered)
            self.stats["unsure_rolled_back"] += 1
        elif (last["token_end"] if last else 0) != s.cache.length:
            self._drop(key)
            return None
        s.unsure = None
        return s

    def _rewrite_whole(self, key: SessionKey, cache: KVCache, answered: tuple):
        """The store's chain replaced by this copy of the session, in one put carrying the session's
        last answered requests (none left if the copy is empty): a turn taken back out of it."""
        if cache.length:
            self._put(key, cache, 0, 0, replace=True, answered=answered)
        else:
            self.store.delete(key)
            cache.snapshot_seq, cache.snapshot_codec = 0, None
        cache.snapshot_len = cache.length

    def _put(self, key: SessionKey, cache: KVCache, start: int, request_id: int, end: int | None = None,
             replace: bool = False, sent_ns: int = 0, answered: tuple = ()) -> int:
        """Put the session's entries [start, end or length) as one delta (replace: as the whole chain);
        its stored size once durable. answered: see kvdelta (a delta from token 0 only)."""
        end = cache.length if end is None else end
        # a delta continues its chain in the chain's codec; one from token 0 begins a chain in this worker's
        codec = cache.snapshot_codec if start and cache.snapshot_codec else self.codec
        blob = kvdelta.encode(kvdelta.export_delta(cache, start, end), self.model.config, codec, request_id,
                              sent_ns, answered)
        meta = dict(token_start=start, token_end=end, codec=codec, request_id=request_id)
        cache.snapshot_seq = self.store.put(key, blob, {**meta, "replace": True} if replace else meta)
        cache.snapshot_codec = codec
        return len(blob)

    def close(self, session_id: int, tenant: int = 0):
        """The client is done with the session (its CLOSE record, or a control-plane call): free it
        here and in the store."""
        self._drop((tenant, session_id))
        self._abandoned.pop((tenant, session_id), None)   # a reused id's first request is not that one
        if self.store is not None:
            self.store.delete((tenant, session_id))

    def _cut_back(self, key: SessionKey, s: _Session) -> _Session:
        """The session without its unfinished request's KV (the store holds none of it)."""
        req, s.request = s.request, None
        s.cache.length = req.start_len
        return s

    def _release_abandoned(self):
        """Requests no step has touched for ABANDONED_NS: the router gave up on them (expired one still
        missing chunks, failed one on a refusal) and nothing tells this worker so. Their KV is cut
        back off the session, which may be evicted again, and their later records, should any come,
        are refused 503. Before, such a session stayed pinned until its next request came here."""
        now = time.monotonic_ns()
        for key, s in list(self.sessions.items()):
            if s.request is not None and now - s.request.last_step > ABANDONED_NS:
                self._abandoned.pop(key, None)   # (re-inserted: the oldest go first, below)
                self._abandoned[key] = s.request.attempt
                if len(self._abandoned) > ABANDONED_KEPT:    # sessions that never came back (review)
                    del self._abandoned[next(iter(self._abandoned))]
                self._cut_back(key, s)
                self.stats["abandoned"] += 1

    def _evict(self):
        """Least recently used first, and only sessions that are idle and fully in the store."""
        now = time.monotonic_ns()
        if self.kv_bytes_resident > self.kv_budget_bytes and now - self._last_release_ns >= ABANDONED_NS // 60:
            # a scan of every session: once a 60th of the wait at most, not at every step over
            # budget (a 1-token step took 0.5 -> 1.1 ms with 2,000 sessions resident: review)
            self._last_release_ns = now
            self._release_abandoned()
        while self.kv_bytes_resident > self.kv_budget_bytes:
            victim = next((key for key, s in self.sessions.items()
                           if s.request is None and s.unsure is None and s.cache.snapshot_len == s.cache.length),
                          None)
            if victim is None:
                if self._settle_idle_unsure():
                    continue
                self.stats["over_budget_steps"] += 1
                return
            self._drop(victim)
            self.stats["evictions"] += 1

    def _settle_idle_unsure(self) -> bool:
        """Over budget with nothing else to evict: the least recently used idle unsure session settled
        with the store (_settle), after which it may be evicted (or it is gone, the store holding
        another history of it). One a second at most: a store that still cannot say may take its
        timeout to answer. Before, only the session's own next request here settled it, and one whose
        client never came back (or whose retry went to another worker) stayed resident for good
        (found by review). True if one was settled."""
        now = time.monotonic_ns()
        key = next((k for k, s in self.sessions.items() if s.request is None and s.unsure is not None), None)
        if key is None or now < self._next_settle_ns:
            return False
        self._next_settle_ns = now + SETTLE_EVERY_NS
        try:
            self._settle(key, self.sessions[key])
        except Exception as e:
            self._store_failed(e)
            return False
        self.stats["unsure_settled_idle"] += 1
        return True

    def _drop(self, key: SessionKey):
        s = self.sessions.pop(key, None)
        if s is not None:
            self._kv_bytes -= s.cache.nbytes


def serve(worker: Worker, lane: Lane, stop: Callable[[], bool] = lambda: False, timeout_s: float = 0.05):
    """Answer micro-batches until stop() says so."""
    # Everything built so far (the model, and all a forked worker inherits: ~86k objects) is
    # kept out of the cyclic GC: a full collection over it took ~19 ms here, a pause in the
    # middle of some request's step; new garbage is still collected.
    gc.freeze()
    while not stop():
        batch = lane.recv_batch(timeout_s)
        if batch is None:
            continue
        comp = worker.step(batch)
        while not lane.send_completion(comp):  # completion ring full: the router is behind
            if stop():
                return
            time.sleep(1e-4)
        worker.finished.clear()  # the router builds responses from the completions (a tracing lane
                                 # has read the requests' stamps)


@dataclass
class WorkerOptions:
    """What a worker process needs to build its model and worker (picklable, for multiprocessing)."""
    config: dict = field(default_factory=dict)
    seed: int = 0
    index: int = 0
    kv_budget_bytes: int = 256 << 20
    codec: str = "zstd"
    temperature: float = 0.0
    device: str | None = None
    sim_mode: str = "sleep"
    slowdown: float = 1.0      # a straggler: its device's step time (without a device, its forward
                               # pass) lasts this many times as long (1 to 1000)

    def build(self, store: SnapshotStore | None, return_logits: bool = False) -> Worker:
        from .devices import profile
        model = Model(ModelConfig(**self.config), self.seed)
        device = SimulatedDevice(profile(self.device), self.sim_mode) if self.device else None
        return Worker(model, store, index=self.index, kv_budget_bytes=self.kv_budget_bytes, codec=self.codec,
                      temperature=self.temperature, seed=self.seed, device=device, return_logits=return_logits,
                      slowdown=self.slowdown)


def one_blas_thread():
    """A worker is one core's worth of compute: BLAS threads would fight the router and the other
    workers for the cores, and on 2 shared cores they make a tiny model's matmuls slower, not faster."""
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=1, user_api="blas")


def worker_process(lane_spec: tuple, store: SnapshotStore | None, options: WorkerOptions,
                   stop: Callable[[], bool] = lambda: False, serving: Callable[[], None] | None = None):
    """Entry point of a worker process (multiprocessing target, and `datapath worker`).

    lane_spec: ("shm", name) to attach a lane the router created, or ("zmq", endpoint) to bind
    one the router connects to. stop() says when to stop (an Event's is_set, a signal's flag);
    serving(), if given, is called once the lane is attached, before the first batch.
    """
    from ..lanes import ShmWorkerLane, ZmqWorkerLane
    worker = options.build(store)
    kind, where = lane_spec
    lane = ShmWorkerLane(where) if kind == "shm" else ZmqWorkerLane(where)
    try:
        if serving is not None:
            serving()
        with one_blas_thread():
            serve(worker, lane, stop)
    finally:
        lane.close()
        close = getattr(store, "close", None)
        if close is not None:
            close()      # a remote store's socket: left open, zmq's exit could wait on it
