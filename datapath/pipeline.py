"""The whole data path, assembled: what `python -m bench e2e` runs.

    client netns --UDP--> veth --XDP steer--> BPF ring buffers
        --> [one native poll loop: router (its feed: the ingress consumer) -> responder]
        --> shm lanes (or ZeroMQ) --> worker processes (tiny model, KV caches, snapshots)
        --> completions --> router --> egress ring --> responder --UDP--> client

The router admits each request (native/admission.h: price, budget, limits;
PipelineConfig.tenants) and places it on a worker pool (PipelineConfig.pools)
before its policy picks the worker. The consumer, the router and the
responder run in one native thread (datapath.loop; the router's pass runs the
consumer, its feed, so a record goes from the BPF ring buffer into the router
with no input ring between), so the data path costs one core and the workers
get the rest; nothing per chunk runs in Python. Every worker records each
record's stamps (XDP, consumer, router, lane, pickup, step start and end)
into shared memory, so the stages can be read off afterwards. Everything is
torn down on exit, also on error and Ctrl-C.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import mmap
import multiprocessing
import numbers
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from . import _dataplane, client, lanes, records, wire
from .egress import Responder
from .ingress import SigtermExit, signals_held
from .loop import PollLoop
from .ring import WAIT_MODES, Ring, unlink
from .router import HOLD_MAX_S, MAX_POOLS, Router
from .serving.devices import profile
from .topology import Topology, socket_in

_seq = itertools.count()
LANES = ("shm", "zmq")
ctx = multiprocessing.get_context("fork")

# per record, what the worker saw: the chunk's stamps plus its own; on the record that finished a
# request whose turn went into the snapshot store, its last token's step and the store's durable ack
TRACE = np.dtype([("request_id", "<u8"), ("session_id", "<u8"), ("kind", "u1"), ("n_tokens", "<u2"), ("t_send", "<u8"),
                  ("t_xdp_in", "<u8"), ("t_xdp", "<u8"), ("t_consumer", "<u8"), ("t_router", "<u8"), ("t_lane", "<u8"),
                  ("t_pickup", "<u8"), ("t_start", "<u8"), ("t_end", "<u8"), ("kv_bytes", "<u8"),
                  ("t_last_token", "<u8"), ("t_snapshot", "<u8")])
STAMPS = ("request_id", "session_id", "kind", "n_tokens", "t_send", "t_xdp_in", "t_xdp", "t_consumer", "t_router",
          "t_lane")


@dataclass
class PipelineConfig:
    workers: int = 2
    queues: int = 2
    policy: str = "affinity"           # a session's requests on the worker holding its KV; a policy that
                                       # spreads them needs shared_store, or a moved request runs on a
                                       # context without its session's earlier turns
    policy_param: float = 0.0          # the policy's parameter (0: its default; affinity: the load bound, 0.25)
    key_secret: int | None = None      # the router's key hash secret (random if None): compare fixes it, so
                                       # every policy's run sees the same sessions collide in its tables
    batching: str = "dynamic"          # or "static"
    token_budget: int = 512            # dynamic: tokens per step (a worker on a simulated device: see below)
    budget_at_knee: bool = True        # a simulated device's worker steps up to its profile's knee_tokens
                                       # (where its step stops being flat in tokens; measured in bench e2e:
                                       # a flatter p95 near saturation than 512), not token_budget
    split_slack: int = 32              # dynamic: a prompt piece over the budget by <= this goes whole (router.h)
    max_chunks: int = 64
    max_batch_size: int = 32           # static
    batch_timeout_s: float = 0.05      # static
    xdp_mode: str = "auto"
    lane: str = "shm"                  # how batches reach the workers: "shm" (a lane ring and a completion
                                       # ring in shared memory) or "zmq" (ZeroMQ over ipc://, as a remote
                                       # worker's tcp:// lane runs: datapath worker --zmq); lane_wait is shm's
    lane_wait: str = "sleep"           # how workers wait on their lanes: "sleep" (poll ~1-2 us, then a futex
                                       # the router wakes), "yield" (poll, yielding the core to whatever else
                                       # is runnable: a core's worth of polling) or "spin"
    device: str | None = None          # simulated device profile of the workers (serving.devices)
    sim_mode: str = "sleep"
    stragglers: dict = field(default_factory=dict)   # worker index -> slowdown: its device's steps (its
                                       # forward passes, without a device) last that many times as long
                                       # (a throttled or shared device; its replacements too; its
                                       # worker_hang_s that many times too), for policies that must
                                       # notice a slow worker; the factors they start with
                                       # (set_slowdown changes one while it serves)
    kv_budget_bytes: int = 256 << 20
    worker_hang_s: float = 30.0        # a worker holding a batch this long without a completion is killed
                                       # and failed over (0: never; a step is ms, a simulated L4's ~70 ms;
                                       # a shared store that stopped answering costs a step one
                                       # RemoteStore timeout, 5 s, well inside it)
    worker_stall_s: float = 0.5        # a worker holding a batch this long (or 4x its recent longest batch,
                                       # if longer; times the largest straggler factor) is stalled: new
                                       # requests go to the others until it answers (router.h, stall_ns;
                                       # 0: never). What it holds waits for it, or for worker_hang_s
    worker_respawns: int = 3           # a worker process that exits is replaced by a fresh one on a fresh
                                       # lane, up to this many times in a row per worker (0: never): a crash
                                       # loop stops there, and the worker stays down; one that served
                                       # CRASH_LOOP_S first starts the count again (a long run is not
                                       # left short of a worker by crashes hours apart)
    worker_hold_s: float = 2.0         # while no worker is up and a replacement is starting, a request
                                       # waits for it up to this long rather than being answered 503
                                       # (router.h, dp_router_hold; 0: answered at once). A spawner's
                                       # heir forked every worker again in ~150 ms (bench e2e scenario 6)
    codec: str = "zstd"
    store_factory: object = None       # callable(worker index) -> SnapshotStore, called in the worker
    shared_store: str | None = None    # an image path: one store process serves it to every worker
                                       # (so any worker restores any session); None: store_factory or none
    datapath_cpu: int | None = None    # pin the poll loop here
    loop_yield_after: int = 256        # idle passes before the poll loop yields its core
    worker_cpus: list = field(default_factory=list)
    trace_records: int = 1 << 18       # per worker
    pools: list | None = None          # [(device profile, workers[, nice]), ...]: heterogeneous pools, each
                                       # priced by admission.pool_price_per_1k (replaces workers and device);
                                       # nice: the pool's worker processes' CPU niceness (simulated devices
                                       # share the host's cores; a real one would not take them from
                                       # another pool); None: one pool of `workers` on `device`
    pool_room_per_worker: int = 0      # queued chunks per up worker before a pool passes new requests on
    require_tags: bool = False         # XDP drops a request whose tag is not its tenant's (wire, "tags"); offer()
                                       # tags its packets with keys the pipeline issues (issue_tenant_key)
    tenants: dict = field(default_factory=dict)   # tenant -> admission.TenantPolicy
    default_tenant: object = None      # TenantPolicy of every other tenant (None: no limits, free)


class TracingLane:
    """A worker's lane (datapath.lanes: one that stamps t_pickup) that also writes each record's
    stamps into a shared trace buffer; with the worker, on the last record of each request its
    step finished, its last token's stamp and its snapshot's durable ack, if it made one
    (worker.finished, read before serve clears it)."""

    def __init__(self, lane, trace: np.ndarray, count: np.ndarray, worker=None):
        self.lane, self.trace, self.count, self.worker = lane, trace, count, worker
        self._batch = None

    def recv_batch(self, timeout_s: float):
        batch = self.lane.recv_batch(timeout_s)
        if batch is not None:
            self._batch = (batch[list(STAMPS)].copy(), self.lane.t_pickup)
        return batch

    def send_completion(self, comp: np.ndarray) -> bool:
        if self._batch is not None:
            stamps, t_pickup = self._batch
            self._batch = None
            i = int(self.count[0])
            n = max(0, min(len(stamps), len(self.trace) - i))
            self.count[1] += len(stamps) - n       # past trace_records: counted, not traced
            if n:
                rows = self.trace[i:i + n]
                for name in STAMPS:
                    rows[name] = stamps[name][:n]
                rows["t_pickup"] = t_pickup
                rows["t_start"], rows["t_end"], rows["kv_bytes"] = comp["t_start"][0], comp["t_end"][0], comp["kv_bytes"][0]
                rows["t_last_token"] = rows["t_snapshot"] = 0      # a reset trace's rows are reused
                for done in self.worker.finished if self.worker is not None else ():
                    hit = np.flatnonzero((rows["request_id"] == done.request_id)
                                         & (rows["session_id"] == done.session_id))
                    if len(hit):                     # its last record in this batch answers it
                        rows["t_last_token"][hit[-1]] = done.stamps["t_last_token"]
                        rows["t_snapshot"][hit[-1]] = done.stamps.get("t_snapshot", 0)
                self.count[0] = i + n
        return self.lane.send_completion(comp)

    def close(self):
        self.lane.close()


def child_of_this_process(parent: int):
    """In a forked child of process `parent`: die with it (even a SIGKILLed one), and leave Ctrl-C
    to it."""
    import ctypes
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        # the parent died before prctl took effect. (Asked as "is my parent init?" before: a
        # pipeline that is PID 1, in a container, lost every child at once, and under a subreaper
        # an orphan went on; found by review)
        os._exit(1)


START_TIMEOUT_S = 120.0   # a worker process builds its model and attaches its lane in this, or is given up
CRASH_LOOP_S = 60.0       # a worker that dies sooner after it began serving is a crash loop's (worker_respawns)


class SharedFlag:
    """An Event's set and is_set on one byte shared with forked children (the workers' stop, the
    store server's stop and ready). A multiprocessing.Event's is_set takes a lock, and a child
    SIGKILLed while holding it (the failover scenario; the store server polls every 100 ms) left
    every later set() and is_set() hung for good (found by review, the store's in session 24)."""

    def __init__(self):
        self._byte = mmap.mmap(-1, 1)

    def set(self):
        self._byte[0] = 1

    def is_set(self) -> bool:
        return self._byte[0] == 1


def _worker_main(lane_name: str, options, store_factory, trace_buf, slowdown_slot, stop, cpu, nice, ready,
                 parent: int):
    """Worker process: build the worker, attach its lane, say ready(), serve until stop is set; its
    slowdown read from the pipeline's shared slot (set_slowdown)."""
    from .serving.worker import one_blas_thread, serve
    child_of_this_process(parent)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    if nice:
        os.nice(nice)
    count = np.frombuffer(trace_buf, dtype="<u8", count=2)      # records traced, records past the buffer
    trace = np.frombuffer(trace_buf, dtype=TRACE, offset=64)
    store = store_factory(options.index) if store_factory else None
    worker = options.build(store)
    worker.follow_slowdown(slowdown_slot)
    inner = lanes.ZmqWorkerLane(lane_name) if lane_name.startswith("ipc://") else lanes.ShmWorkerLane(lane_name)
    lane = TracingLane(inner, trace, count, worker)
    try:
        ready()
        with one_blas_thread():
            serve(worker, lane, stop.is_set)
    finally:
        lane.close()
        if store is not None and hasattr(store, "close"):
            store.close()


class _BecomeHeir(BaseException):
    """Raised in a freshly forked heir, out of the loop of the spawner it was forked from, which
    it leaves behind for a loop of its own: so a generation of heirs adds nothing to the stack."""

    def __init__(self, conn):
        self.conn = conn


def _spawner_main(conn, parent_end, specs, store_factory, traces, slowdowns, stop, parent):
    """The process that forks the workers (WorkerSpawner), itself forked while the pipeline had one
    thread: a worker forked later from the pipeline (a replacement) would copy a process whose poll
    loop, watcher and client threads may hold locks (stdio's, the allocator's) that no thread of
    the child ever releases. It exits when the pipeline closes its end or exits (a pidfd of it
    watched), and its workers die with it (child_of_this_process).

    Requests: ("spawn", sid, k, lane name), ("heir", sid). Messages back: ("spawned", sid, pid)
    followed by the worker's pidfd (SCM_RIGHTS: opened here, before this process can reap it, so
    it names that process and no later one with its pid); ("ready", sid) once it serves its lane;
    ("exit", sid, exit code as multiprocessing gives it); ("heir", sid, pid) followed by the heir's
    end of a fresh pipe and its pidfd; ("failed", sid, why) if it could not fork (or open a
    pidfd). An heir is a spawner forked from this one (which has one thread too), idle until
    this one dies: then the pipeline makes it the spawner and has it fork the workers again.
    The heir outlives its parent (a fork does not inherit the parent's death signal): it is
    tied to the pipeline, not to the spawner."""
    parent_end.close()                               # else the pipeline's close() is no EOF here
    child_of_this_process(parent)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)    # not the pipeline's unwinding handler
    try:
        pipeline_fd = os.pidfd_open(parent)
    except ProcessLookupError:
        os._exit(1)
    while True:
        try:
            _spawner_loop(conn, specs, store_factory, traces, slowdowns, stop, parent, pipeline_fd)
        except _BecomeHeir as heir:                  # this process is a new heir, on its own pipe
            conn = heir.conn


def _spawner_loop(conn, specs, store_factory, traces, slowdowns, stop, parent, pipeline_fd):
    """_spawner_main's requests until the pipeline is gone (then the process exits); raises
    _BecomeHeir in an heir it forks."""
    import traceback
    from multiprocessing.connection import Connection, Pipe, wait
    from multiprocessing.reduction import send_handle
    me = os.getpid()
    children: dict[int, tuple[int, int]] = {}        # pidfd -> (sid, pid)
    waiting: dict[int, int] = {}                     # a child's ready pipe -> sid
    heirs: dict[int, int] = {}                       # an heir's pidfd -> pid (reaped here if it dies first)

    def fork(sid: int, *parents: int | Connection) -> int | None:
        """os.fork; in the child, this loop's fds closed (pipeline_fd kept) and the parent's ends
        given (a child that failed to would carry on as a second spawner: it exits); None (said to
        the pipeline) if it could not."""
        try:
            pid = os.fork()
        except OSError as e:                 # (out of memory, of processes): this one
            conn.send(("failed", sid, f"{type(e).__name__}: {e}"))
            return None
        if pid == 0:
            try:
                for end in (conn, *parents):
                    end.close() if isinstance(end, Connection) else os.close(end)
                for fd in (*children, *waiting, *heirs):
                    os.close(fd)
            except BaseException:
                os._exit(1)
        return pid

    def pidfd_of(sid: int, pid: int) -> int | None:
        try:
            return os.pidfd_open(pid)    # our unreaped child: its pid is still its own
        except OSError as e:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            conn.send(("failed", sid, f"pidfd_open: {e}"))
            return None

    def run_worker(k: int, lane_name: str, ready_w: int):
        """In the forked worker: serve, then exit (never returns)."""
        code = 1
        try:
            os.close(pipeline_fd)

            def ready():
                os.write(ready_w, b"r")
                os.close(ready_w)
            opts, cpu, nice = specs[k]
            _worker_main(lane_name, opts, store_factory, traces[k], slowdowns[k:k + 1], stop, cpu, nice, ready, me)
            code = 0
        except Exception as e:               # one sentence (the pipeline says which worker)
            print(f"pipeline: worker {k} ({lane_name}): {type(e).__name__}: {e}", file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    try:
        while True:
            # one ready fd per wait: handling one closes fds whose numbers the next fork reuses
            fd = wait([conn, pipeline_fd, *children, *waiting, *heirs])[0]
            if fd == pipeline_fd:
                os._exit(0)                  # the pipeline is gone: its workers die with this process
            if fd in waiting:
                sid = waiting.pop(fd)
                if os.read(fd, 1):           # (EOF: it died first; its exit says so)
                    conn.send(("ready", sid))
                os.close(fd)
            elif fd in children:
                sid, pid = children.pop(fd)
                os.close(fd)
                for r in [r for r, of in waiting.items() if of == sid]:
                    del waiting[r]           # dead: its "ready", if it wrote one, is void
                    os.close(r)
                _, status = os.waitpid(pid, 0)
                conn.send(("exit", sid, os.waitstatus_to_exitcode(status)))
            elif fd in heirs:
                os.waitpid(heirs.pop(fd), 0)  # a standby heir that died: the pipeline's watcher sees it
                os.close(fd)
            elif (msg := conn.recv())[0] == "heir":
                sid = msg[1]
                mine, theirs = Pipe()
                pid = fork(sid, mine)
                if pid == 0:
                    raise _BecomeHeir(theirs)
                theirs.close()
                pidfd = pidfd_of(sid, pid) if pid is not None else None
                if pidfd is not None:
                    heirs[pidfd] = pid
                    conn.send(("heir", sid, pid))
                    send_handle(conn, mine.fileno(), parent)
                    send_handle(conn, pidfd, parent)
                mine.close()
            else:
                _, sid, k, lane_name = msg
                ready_r, ready_w = os.pipe()
                pid = fork(sid, ready_r)
                if pid == 0:
                    run_worker(k, lane_name, ready_w)
                os.close(ready_w)
                pidfd = pidfd_of(sid, pid) if pid is not None else None
                if pidfd is None:
                    os.close(ready_r)
                    continue
                children[pidfd] = (sid, pid)
                waiting[ready_r] = sid
                conn.send(("spawned", sid, pid))
                send_handle(conn, pidfd, parent)
    except (EOFError, BrokenPipeError, ConnectionResetError):   # the pipeline is done (or gone):
        for pid in heirs.values():                               # its workers die with this process
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)    # an heir already gone (closed first); one that is not is init's
        os._exit(0)


class WorkerProcess:
    """A worker the spawner forked, by the pidfd the spawner opened: signalled and waited for
    without the pid reuse a bare pid risks once the spawner has reaped it."""

    def __init__(self, k: int | None, sid: int, pid: int, pidfd: int):
        self.k, self.sid, self.pid, self.pidfd = k, sid, pid, pidfd
        self.t_ready: float | None = None            # when it said it serves its lane (monotonic)
        self.killed = False                          # by the watcher: a hang, or no start in time
        self.replacing: dict | None = None           # its entry in Pipeline.worker_replacements
        self.exitcode: int | None = None             # set by the watcher once it has exited
        self.gone = False                            # its pidfd read exited: marked down (before its
                                                     # spawner reports the exit, which it may not yet)
        self.t_retired: float | None = None          # when a replacement took its place

    @property
    def ready(self) -> bool:
        return self.t_ready is not None

    def kill(self):
        if self.pidfd < 0:
            return                                   # closed: reaped, nothing to signal
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def join(self, timeout: float | None = None) -> bool:
        """True once the process has exited (its pidfd reads ready)."""
        return not join_all([self], timeout)

    def is_alive(self) -> bool:
        return not self.join(0)

    def reap(self):
        """Wait for it if it has exited and is this process's child: the spawner's, until the
        spawner died and it was re-parented here (a pipeline that is PID 1, or a subreaper)."""
        if self.pidfd >= 0:
            _reap_orphan(self.pidfd)

    def close(self):
        """Once: a second close would close whatever file has the number by then."""
        fd, self.pidfd = self.pidfd, -1
        if fd >= 0:
            os.close(fd)


def _pidfd_exited(pidfd: int, timeout: float) -> bool:
    import select
    poll = select.poll()                             # (select.select refuses fds past 1023)
    poll.register(pidfd, select.POLLIN)
    return bool(poll.poll(max(0, math.ceil(timeout * 1000))))


def _reap_orphan(pidfd: int):
    """Reap the process of pidfd if it has exited and is this process's child, which a process the
    pipeline did not fork becomes if its parent died and the pipeline is PID 1 (a container's
    entry point) or a subreaper: else it stayed a zombie for the pipeline's life (review)."""
    with contextlib.suppress(OSError):                # (ECHILD: not ours)
        os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)


REAP_WAIT_S = 5.0     # a teardown waits this long for its workers to stop, then as long for the killed
RETIRED_S = 10.0      # a replaced worker's pidfd is closed this long after (kept for good, each takeover
                      # left one more open a worker: review)


def join_all(procs: list[WorkerProcess], timeout: float | None) -> list[WorkerProcess]:
    """Wait up to `timeout` s in all (None: for good) for every one of procs to exit (its pidfd
    reads ready); those still running."""
    import select
    deadline = None if timeout is None else time.monotonic() + timeout
    left = [p for p in procs if p.pidfd >= 0]        # a closed one cannot be waited for: gone
    while left:
        remaining = None if deadline is None else deadline - time.monotonic()
        poll = select.poll()
        for p in left:
            poll.register(p.pidfd, select.POLLIN)
        exited = {fd for fd, _ in poll.poll(None if remaining is None else max(0, math.ceil(remaining * 1000)))}
        left = [p for p in left if p.pidfd not in exited]
        if remaining is not None and remaining <= 0:
            break
    return left


class SpawnerDied(RuntimeError):
    """The worker spawner exited while asked for something (its workers died with it)."""


class WorkerSpawner:
    """The pipeline's end of _spawner_main. spawn() forks worker k (its spec, trace buffer and
    the stop flag inherited) on a lane; spawn_heir() forks a standby spawner; events() are the
    ("ready", sid) and ("exit", sid, code) messages since the last call. One thread at a time
    uses it: the build's, then the watcher's."""

    _sids = itertools.count(1)     # one count for every spawner: an heir's workers' never match a dead one's

    def __init__(self, conn, pid: int, pidfd: int, proc=None):
        self.conn, self.pid, self.pidfd, self.proc = conn, pid, pidfd, proc   # proc: the first one's
        self.t_start = time.monotonic()              # (an heir's is reset when it takes over)
        self._events: list[tuple] = []               # read while waiting for a spawn

    @classmethod
    def start(cls, specs, store_factory, traces, slowdowns, stop) -> WorkerSpawner:
        """The first spawner, the pipeline's child; forked now, so while the pipeline has one thread."""
        conn, child_conn = ctx.Pipe()                # a socketpair: it carries the pidfds too
        proc = ctx.Process(target=_spawner_main,
                           args=(child_conn, conn, specs, store_factory, traces, slowdowns, stop, os.getpid()),
                           name="worker-spawner", daemon=True)
        try:
            proc.start()
        except BaseException:
            conn.close()
            raise
        finally:
            child_conn.close()
        return cls(conn, proc.pid, os.pidfd_open(proc.pid), proc)   # (our unreaped child: its pid is its own)

    def spawn(self, k: int, lane_name: str, timeout_s: float = 30.0) -> WorkerProcess:
        return self._ask(("spawn", k, lane_name), k, f"fork worker {k}", timeout_s)

    def spawn_heir(self, timeout_s: float = 30.0) -> WorkerSpawner:
        """A standby spawner forked from this one: it takes over if this one dies (Pipeline)."""
        return self._ask(("heir",), None, "fork its heir", timeout_s)

    def _ask(self, request: tuple, k: int | None, what: str, timeout_s: float):
        sid = next(self._sids)
        deadline = time.monotonic() + timeout_s
        try:
            self.conn.send((request[0], sid, *request[1:]))
            while self.conn.poll(max(0.0, deadline - time.monotonic())):
                got = self._read(sid, k)
                if got is not None:
                    return got
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise self.died(f"asked to {what}") from None   # a bare EOFError('') was all it said (review)
        raise RuntimeError(f"the worker spawner did not {what} in {timeout_s:g} s")

    def exited(self, timeout: float = 0) -> bool:
        return self.pidfd < 0 or _pidfd_exited(self.pidfd, timeout)

    def exitcode(self) -> int | None:
        """As multiprocessing gives it; None while it runs, and for an heir (not the pipeline's
        child: init reaps it)."""
        return self.proc.exitcode if self.proc is not None and self.exited(1) else None

    def died(self, doing: str) -> SpawnerDied:
        code = self.exitcode()
        return SpawnerDied(f"the worker spawner (pid {self.pid}) exited when {doing}"
                            + (f" (code {code})" if code is not None else ""))

    def _read(self, sid: int | None = None, k: int | None = None):
        """One message: request sid's worker or heir, or its failure raised; another request's
        (late: its own _ask gave up) killed or closed; "ready" and "exit" kept for events()."""
        from multiprocessing.connection import Connection
        from multiprocessing.reduction import recv_handle
        msg = self.conn.recv()
        if msg[0] == "spawned":
            w = WorkerProcess(k if msg[1] == sid else None, msg[1], msg[2], recv_handle(self.conn))
            if msg[1] == sid:
                return w
            w.kill()
            w.close()
        elif msg[0] == "heir":
            conn = Connection(recv_handle(self.conn))
            try:
                pidfd = recv_handle(self.conn)
            except BaseException:
                conn.close()                         # (the spawner died between the two)
                raise
            heir = WorkerSpawner(conn, msg[2], pidfd)
            if msg[1] == sid:
                return heir
            heir.close()
        elif msg[0] == "failed":
            if msg[1] == sid:
                raise RuntimeError(f"the worker spawner could not fork: {msg[2]}")
        else:
            self._events.append(msg)
        return None

    def pending(self) -> bool:
        return bool(self._events) or self.conn.poll(0)

    def events(self) -> list[tuple]:
        """Messages since the last call; EOFError if the spawner itself is gone (its workers with it:
        what it sent before is left in unread())."""
        while self.conn.poll(0):
            self._read()
        out, self._events = self._events, []
        return out

    def unread(self) -> list[tuple]:
        out, self._events = self._events, []
        return out

    def close(self):
        """The spawner exits on EOF (its workers with it); waited for, killed if it does not."""
        self.conn.close()
        if self.pidfd < 0:
            return
        if not self.exited(5):
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            self.exited(5)
        fd, self.pidfd = self.pidfd, -1
        if self.proc is not None:
            self.proc.join(5)                        # reaped (an heir's parent, or init, reaps it)
        else:
            _reap_orphan(fd)                         # (unless it was re-parented here)
        os.close(fd)


MASTER_SECRET = b"pipeline-master-secret-0123456789"   # tenants get HMAC(master, tenant) (WorkerStore)


def _store_main(path, endpoint, stop, ready, parent):
    child_of_this_process(parent)                   # first: a Ctrl-C in the imports is the parent's
    import zmq
    from snapshotstore.errors import SnapshotError
    from snapshotstore.server import serve
    try:
        serve(path, endpoint, stop, ready=ready)
    except (SnapshotError, zmq.ZMQError) as e:   # one sentence, not a traceback
        print(f"snapshot store server: {e}", file=sys.stderr)
        os._exit(1)


def _remote_store(endpoint: str, index: int):
    from snapshotstore import WorkerStore
    from snapshotstore.server import RemoteStore
    return WorkerStore(RemoteStore(endpoint), MASTER_SECRET)


def _placement(cfg: PipelineConfig) -> list[tuple]:
    """(pool, device, nice) of each worker: the pools in order, or one pool of cfg.workers."""
    if not cfg.pools:
        return [(0, cfg.device, 0)] * cfg.workers
    if len(cfg.pools) > MAX_POOLS or any(len(spec) not in (2, 3) or spec[1] < 1 for spec in cfg.pools):
        raise ValueError(f"pools: at most {MAX_POOLS} (device, workers >= 1[, nice]), not {cfg.pools}")
    return [(p, dev, nice) for p, (dev, n, nice) in enumerate((*spec, 0)[:3] for spec in cfg.pools) for _ in range(n)]


class Pipeline:
    def __init__(self, cfg: PipelineConfig | None = None):
        self.cfg = cfg or PipelineConfig()
        self.tag = f"pl{os.getpid()}-{next(_seq)}"
        self._stack = contextlib.ExitStack()
        self._sigterm: SigtermExit | None = None
        self._ids = itertools.count(1)   # request ids never repeat within a pipeline
        self.workers: list[WorkerProcess] = []   # worker k's current process
        self._spawner: WorkerSpawner | None = None
        self._heir: WorkerSpawner | None = None   # the spawner's standby: the spawner if it dies
        self._retired: list[WorkerProcess] = []  # replaced ones: their pidfds closed RETIRED_S later,
                                                 # or at teardown (a kill_worker racing the replacement
                                                 # must not find the number reused)
        self._store_endpoint = None      # the shared store server's, when shared_store is given
        self._store_proc = None          # its process, the current one (it is started again if it dies)
        self.store_restarts: list[dict] = []   # each death of the store server: exitcode, t_exit, t_up
        self.traces: list = []
        self._untraced_said = 0
        self._building = ""              # the build's stage, named on an error that does not say it

    def __enter__(self):
        # SIGTERM unwinds the whole pipeline (namespaces, rings, processes) from here on, not only
        # while the ingress is open: before, one during the topology's build or its teardown left
        # the namespaces behind
        self._sigterm = SigtermExit.install()
        try:
            self._build()
        except BaseException as e:
            if isinstance(e, Exception) and self._building:
                # a netlink errno or an EADDRINUSE says nothing of which part it was
                e.add_note(f"while building the pipeline: {self._building}")
            self._teardown()
            raise
        return self

    def __exit__(self, *exc):
        self._teardown()

    def _teardown(self):
        """Everything built, undone in reverse, with Ctrl-C and SIGTERM held until the end (a second
        one landing in a step left its namespaces and processes behind), then SIGTERM's handler
        as it was before the pipeline. One landing before the hold takes hold leaves the rest to a
        second pass, held too (it skipped the whole teardown: found by review)."""
        try:
            with signals_held(self._sigterm):
                self._stack.close()
        except BaseException:
            with signals_held(self._sigterm):
                self._stack.close()                  # nothing left to do once the first one ran
            raise

    def _ring(self, suffix, slot, capacity, role):
        name = f"{self.tag}.{suffix}"
        self._stack.callback(unlink, name)           # first: an interrupt in the create leaks nothing
        ring = Ring.create(name, slot, capacity, role=role)
        self._stack.callback(ring.close)
        return name, ring

    def _build(self):
        from .ingress import Ingress
        from .serving.worker import WorkerOptions, check_slowdown
        cfg, es = self.cfg, self._stack
        if cfg.lane_wait not in WAIT_MODES:
            raise ValueError(f"lane_wait must be one of {', '.join(WAIT_MODES)}, not {cfg.lane_wait!r}")
        if cfg.lane not in LANES:
            raise ValueError(f"lane must be one of {', '.join(LANES)}, not {cfg.lane!r}")
        if not (isinstance(cfg.worker_hold_s, numbers.Real) and 0 <= cfg.worker_hold_s <= HOLD_MAX_S):
            raise ValueError(f"worker_hold_s must be 0..{HOLD_MAX_S:g} seconds, not {cfg.worker_hold_s!r}")
        self.placement = _placement(cfg)      # (refused before anything is built)
        n = len(self.placement)
        for k, factor in cfg.stragglers.items():
            if isinstance(k, bool) or not (isinstance(k, numbers.Integral) and 0 <= k < n):
                raise ValueError(f"stragglers: worker {k!r} is not one of the {n} workers (0-based)")
            check_slowdown(factor)
        self._building = "its network namespaces and veths"
        self.topo = es.enter_context(Topology(clients=1))
        es.callback(client.stop_spawned, self.topo.client_ns[0])   # before the namespaces go: an offer
                                                                   # another thread runs
        topo = self.topo
        self._building = "the XDP program (compiled by bcc, attached to the host's veth)"
        self.ingress = es.enter_context(Ingress(queues=cfg.queues))
        self.ingress.stamp_validated()   # the trace's t_xdp_in (bench e2e's "xdp steer + ring write")
        self._tag_master, self._tag_keys = os.urandom(32), {}   # (require_tags) this run's: issue_tenant_key
        self.ingress.require_tags(cfg.require_tags)
        self.ingress.accept_only(topo.host_ip)    # the service's addresses: nothing else to its port is ours
        self.xdp_mode = self.ingress.attach(topo.host_if[0], topo.host_ns, cfg.xdp_mode,
                                            veth_peer=(topo.client_if[0], topo.client_ns[0]))
        self._building = "the router and its rings"
        out_name, out_ring = self._ring("out", records.RESPONSE.itemsize, 1 << 12, "producer")
        self.consumer = self.ingress.consumer(None)   # the router's feed: no input ring between them
        self.router = Router(policy=cfg.policy, policy_param=cfg.policy_param, batching=cfg.batching,
                             token_budget=cfg.token_budget, max_chunks=cfg.max_chunks, max_batch_size=cfg.max_batch_size,
                             batch_timeout_s=cfg.batch_timeout_s, split_slack=cfg.split_slack,
                             stall_s=cfg.worker_stall_s * max([1.0, *cfg.stragglers.values()]),
                             # zmq workers here are the pipeline's own processes, watched as shm
                             # ones are (their exits, worker_hang_s): not the router's timeouts
                             zmq_timeout_s=0)
        es.callback(self.router.close)
        if cfg.key_secret is not None:
            self.router.set_key_secret(cfg.key_secret)
        self.router.add_feed(self.consumer)
        self.router.set_egress(out_ring)
        self._stop_workers = SharedFlag()
        store_factory = cfg.store_factory
        if cfg.shared_store:
            self._building = f"the snapshot store server on {cfg.shared_store}"
            store_factory = self._start_store_server(cfg.shared_store)
        # before any worker starts (a half-built pipeline reaps what it started), and after the
        # store server's halt, so it runs first: the workers stop while their store still answers
        es.callback(self._reap_workers)
        self._building = "the pools' and tenants' admission settings"
        self._admission(cfg)
        self._building = "the workers and their lanes"
        self._lane_names: dict[int, str] = {}       # worker -> its current lane's name (zmq: endpoint)
        if cfg.lane == "zmq":
            # the workers' ipc endpoints (short: a socket path has 107 bytes at most); a
            # replacement binds its worker's again (libzmq unlinks what a dead one left)
            self._ipc_dir = tempfile.mkdtemp(prefix=f"zl-{self.tag}-lanes-")   # (topology.sweep_stale's)
            es.callback(shutil.rmtree, self._ipc_dir, True)
        else:
            es.callback(lambda: [lanes.unlink_shm_lane(n) for n in self._lane_names.values()])
        # each worker's slowdown, shared: a worker reads its own at every step (and a replacement
        # from the start), so set_slowdown turns one into a straggler, or back, while it serves
        self.slowdowns = np.frombuffer(mmap.mmap(-1, 8 * n), dtype="<f8")
        self.slowdowns[:] = [cfg.stragglers.get(k, 1.0) for k in range(n)]
        specs = []
        for k, (pool, device, nice) in enumerate(self.placement):
            self._lane_names[k] = name = self._lane_name(k, 0)   # first: an interrupt in the create leaks nothing
            if cfg.lane == "zmq":
                self.router.add_zmq_worker(name, pool=pool)
            else:
                self.router.add_worker(*lanes.create_shm_lane(name, wait=cfg.lane_wait), pool=pool)
            self.router.set_worker_store(k, store_factory is not None)
            if device and cfg.budget_at_knee:
                self.router.set_worker_budget(k, profile(device).knee_tokens)
            self.traces.append(mmap.mmap(-1, 64 + cfg.trace_records * TRACE.itemsize))
            opts = WorkerOptions(index=k, kv_budget_bytes=cfg.kv_budget_bytes, codec=cfg.codec, device=device,
                                 sim_mode=cfg.sim_mode)
            specs.append((opts, cfg.worker_cpus[k % len(cfg.worker_cpus)] if cfg.worker_cpus else None, nice))
        self._spawner = WorkerSpawner.start(specs, store_factory, self.traces, self.slowdowns, self._stop_workers)
        for k in range(len(specs)):
            self.workers.append(self._spawner.spawn(k, self._lane_names[k]))
        self._await_ready()
        if cfg.worker_respawns:                     # (none: a worker is never replaced, nor the spawner)
            self._heir = self._spawner.spawn_heir()
        self._watch_workers()
        # the response socket is made after the workers are forked, so none of them holds it
        self._building = f"the response socket on {topo.host_ip[0]}:{wire.DEFAULT_PORT}"
        sock = socket_in(topo.host_ns)
        es.callback(sock.close)
        # the responder never blocks on it (what a full buffer holds back waits in the egress ring):
        # room for a burst of answers while softirq drains them
        # (SO_SNDBUFFORCE, 32: past net.core.wmem_max, which caps SO_SNDBUF; root, as the pipeline is)
        sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_SNDBUFFORCE", 32), 4 << 20)
        sock.bind((topo.host_ip[0], wire.DEFAULT_PORT))   # answers come from where the requests went
        self.responder = Responder(Ring.attach(out_name, "consumer"), sock, topo.client_ip[0], wire.DEFAULT_PORT)
        self._building = "the data path's polling thread"
        self.loop = PollLoop(cpu=cfg.datapath_cpu, yield_after=cfg.loop_yield_after)
        self.loop.add(_dataplane, "dp_router_poll", self.router.handle, owner=self.router)   # (runs the consumer)
        self.loop.add(_dataplane, "dp_responder_poll", self.responder.handle, owner=self.responder)
        es.callback(self.loop.stop)       # first: the thread must never outlive what it polls
        self.loop.start()
        self._building = ""

    def _lane_name(self, k: int, replacement: int) -> str:
        """Worker k's shm lane; a replacement's is a fresh one (the old may hold a replayed batch).
        A zmq worker's endpoint, the same for its replacements: the router closed its socket to
        the endpoint (linger 0: what it held dropped) as the worker went down, and connects a
        fresh one as the replacement comes up."""
        if self.cfg.lane == "zmq":
            return f"ipc://{self._ipc_dir}/w{k}"
        return f"{self.tag}.w{k}" + (f".{replacement}" if replacement else "")

    def _admission(self, cfg: PipelineConfig):
        """The pools' prices and room, and the tenants' admission settings."""
        from .admission import pool_price_per_1k
        if cfg.pools:
            for p, (dev, *_) in enumerate(cfg.pools):
                self.router.set_pool(p, pool_price_per_1k(dev), cfg.pool_room_per_worker)
        else:
            if cfg.pool_room_per_worker:
                self.router.set_pool(0, 0, cfg.pool_room_per_worker)
        if cfg.default_tenant is not None:
            self.router.set_default_tenant(cfg.default_tenant)
        for tenant, policy in cfg.tenants.items():
            self.router.set_tenant(tenant, policy)

    def _start_store_server(self, path: str):
        """The store's own process (snapshotstore.server); returns the workers' store factory. The
        worker watcher restarts it on the same image and endpoint if it dies (_restart_store)."""
        import functools
        import shutil
        import tempfile
        with signals_held():     # made and its removal registered as one (a Ctrl-C between left it)
            sockdir = tempfile.mkdtemp(prefix=f"zl-{self.tag}-")     # topology.sweep_stale knows the name
            self._stack.callback(shutil.rmtree, sockdir, ignore_errors=True)
        endpoint = f"ipc://{sockdir}/store"
        self._store_path, self._store_stop = path, SharedFlag()
        self._store_proc = None

        def halt():
            self._store_stop.set()
            server = self._store_proc
            if server is None or server.pid is None:
                return                    # interrupted before it started
            server.join(10)
            if server.is_alive():
                server.kill()
                server.join(5)
        self._stack.callback(halt)
        self._store_endpoint = endpoint
        self._store_server_start()
        return functools.partial(_remote_store, endpoint)

    def _store_server_start(self):
        """A store server process on the image and endpoint, serving once this returns."""
        ready = SharedFlag()
        server = ctx.Process(target=_store_main, name="store", daemon=True,
                             args=(self._store_path, self._store_endpoint, self._store_stop, ready, os.getpid()))
        self._store_proc = server
        server.start()
        self._store_started = time.monotonic()
        deadline = time.monotonic() + 30
        while not ready.is_set():
            time.sleep(0.01)
            if not server.is_alive() or time.monotonic() > deadline:
                if server.is_alive():     # hung starting: not left running beside the next one
                    server.kill()
                    server.join(5)
                raise RuntimeError(f"the snapshot store server on {self._store_path} did not start "
                                   f"(see its message above)")

    def _restart_store(self, quick: list):
        """The shared store server died (a crash, the OOM killer, a SIGKILL): every worker's store
        call then timed out and every request was answered 503 for good, nothing said (found by
        review). It is started again on the same image, whose log it recovers, and endpoint, which
        the workers' sockets reconnect to: a call in flight at the death times out (RemoteStore,
        5 s), the next ones are served. worker_respawns times in a row at most, counting deaths
        within CRASH_LOOP_S of starting, as for workers."""
        dead = self._store_proc
        t_exit = time.monotonic()
        quick[0] = 0 if t_exit - self._store_started >= CRASH_LOOP_S else quick[0] + 1
        event = {"exitcode": dead.exitcode, "t_exit": t_exit, "t_up": None}
        self.store_restarts.append(event)
        if quick[0] > self.cfg.worker_respawns:
            print(f"pipeline: the snapshot store server exited (code {dead.exitcode}) {quick[0]} times in a row "
                  f"within {CRASH_LOOP_S:g} s of starting: not started again; every store call fails",
                  file=sys.stderr, flush=True)
            self._store_proc = None
            return
        print(f"pipeline: the snapshot store server exited (code {dead.exitcode}): starting it again on "
              f"{self._store_path}", file=sys.stderr, flush=True)
        try:
            self._store_server_start()
        except Exception as e:
            print(f"pipeline: the snapshot store server could not be started again ({e}): every store call "
                  f"fails", file=sys.stderr, flush=True)
            return
        event["t_up"] = time.monotonic()
        print(f"pipeline: the snapshot store server is up again (pid {self._store_proc.pid})",
              file=sys.stderr, flush=True)

    def _await_ready(self, timeout_s: float = START_TIMEOUT_S):
        """Until every worker serves its lane: one that exits first fails the build, in one sentence."""
        deadline = time.monotonic() + timeout_s
        by_sid = {w.sid: w for w in self.workers}
        while not all(w.ready for w in self.workers):
            if not self._spawner.pending() and not self._spawner.conn.poll(max(0.0, deadline - time.monotonic())):
                slow = ", ".join(str(w.k) for w in self.workers if not w.ready)
                raise RuntimeError(f"worker(s) {slow} did not start in {timeout_s:g} s")
            try:
                events = self._spawner.events()
            except EOFError:
                raise self._spawner.died("the workers were starting") from None
            for kind, sid, *rest in events:
                if kind == "ready":
                    by_sid[sid].t_ready = time.monotonic()
                else:
                    raise RuntimeError(f"worker {by_sid[sid].k} exited while starting (code {rest[0]}; its "
                                       f"reason, if it gave one, is above)")

    def _reap_workers(self):
        self._stop_workers.set()
        # one deadline for all (joined one at a time, each worker that ignored the stop cost 5 s,
        # and 5 more for its kill)
        left = join_all(self.workers, REAP_WAIT_S)
        errors = []
        for p in left:
            try:
                p.kill()
            except OSError as e:
                errors.append(e)
        join_all(left, REAP_WAIT_S)
        # every pidfd and the spawner, whatever one of them raises (it stopped the teardown there)
        for p in self.workers + self._retired:
            try:
                p.close()
            except OSError as e:
                errors.append(e)
        # the heir first, while its parent (the spawner, if alive) is there to reap it
        for spawner in (self._heir, self._spawner):
            if spawner is not None:
                try:
                    spawner.close()
                except Exception as e:           # (each one closed, whatever the other raises)
                    errors.append(e)
        if errors:
            raise errors[0]

    def _watch_workers(self):
        """A worker process that exits while the pipeline runs (a crash, the OOM killer, a SIGKILL)
        is marked down at once, so the router replays its unfinished requests on the others:
        failover waits for no one to announce the death. Then a fresh process on a fresh lane takes
        its place (cfg.worker_respawns times in a row at most), set up again once it serves. A worker that
        holds a batch without completing anything for cfg.worker_hang_s (a hang, a SIGSTOP) is
        killed, and so goes the same way. If the spawner dies, its workers die with it: each is
        marked down once gone, and the spawner's heir takes its place and forks them again (and
        a new heir), cfg.worker_respawns times in a row at most."""
        import threading
        from multiprocessing.connection import wait
        wake_r, wake_w = os.pipe()
        stopping = threading.Event()
        self.worker_exits: list[tuple[int, int | None]] = []   # (worker, exit code) as the watcher saw them
        self.worker_hangs: list[int] = []                      # workers killed for holding a batch too long
        self.worker_replacements: list[dict] = []              # each replacement: worker, pid, when, ...
        self.spawner_takeovers: list[dict] = []                # each spawner that died: pid, its heir, ...
        hang_s = self.cfg.worker_hang_s
        # a straggler's is its factor's: the larger of the one when its busy stretch began and the
        # one now (lowered mid-step, a step begun slow would be killed as hung)
        patience = lambda k, seen: hang_s * max(seen[k][2], self.slowdowns[k])
        quick: dict[int, int] = {}                             # worker -> its exits in a row soon after serving
        quick_spawners = [0]                                   # spawners and heirs lost in a row, soon after start
        # when the next heir is to be forked (None: not wanted, one stands by or none may), and the
        # wait after a failed fork
        heir_due: list = [None if self._heir is not None or not self.cfg.worker_respawns else time.monotonic()]
        heir_backoff = [1.0]
        store_quick = [0]                                      # store server deaths in a row soon after start

        def hung(k: int, seen: dict) -> bool:
            st = self.router.worker_stats(k)
            now = time.monotonic()
            if not st["busy"] or seen.get(k, (None,))[0] != st["completions"]:
                seen[k] = (st["completions"], now, self.slowdowns[k])   # idle, or it completed something since
                return False
            return now - seen[k][1] > patience(k, seen)

        def replace(k: int, t_exit: float, seen: dict, blameless: bool = False):
            """Worker k's fresh process on a fresh lane (the old lane may hold a batch the router
            has replayed elsewhere, which the new process must not run); up once it is ready.
            blameless: it died with its spawner (not counted, unless it was given up already)."""
            dead = self.workers[k]
            if blameless:
                if quick.get(k, 0) > self.cfg.worker_respawns:
                    return
            else:
                served = t_exit - dead.t_ready if dead.t_ready is not None else 0.0
                quick[k] = 0 if served >= CRASH_LOOP_S else quick.get(k, 0) + 1
            if quick.get(k, 0) > self.cfg.worker_respawns:
                print(f"pipeline: worker {k} exited {quick[k]} times in a row within {CRASH_LOOP_S:g} s of "
                      f"serving: not replaced again, it stays down", file=sys.stderr, flush=True)
                return
            n = sum(r["worker"] == k for r in self.worker_replacements) + 1     # (its lane's number)
            name = self._lane_name(k, n)
            if self.cfg.lane != "zmq":
                lanes.unlink_shm_lane(self._lane_names[k])
                self._lane_names[k] = name             # first: the teardown unlinks it, made or not
                fresh = lanes.create_shm_lane(name, wait=self.cfg.lane_wait)
                try:
                    old = self.router.replace_lane(k, *fresh)
                except BaseException:
                    for ring in fresh:
                        ring.close()
                    raise
                for ring in old:
                    ring.close()
            completions = self.router.worker_stats(k)["completions"]
            w = self._spawner.spawn(k, name)
            self.workers[k].t_retired = time.monotonic()
            self._retired.append(self.workers[k])
            self.workers[k] = w
            seen.pop(k, None)
            w.replacing = {"worker": k, "pid": w.pid, "t_exit": t_exit, "t_up": None,   # t_up: once ready
                           "completions_before": completions}
            self.worker_replacements.append(w.replacing)

        def on_event(kind: str, sid: int, *rest) -> int | None:
            """The worker that exited, if one did."""
            k = next((k for k, w in enumerate(self.workers) if w.sid == sid), None)
            if k is None:
                return None                        # a replaced process's
            w = self.workers[k]
            if kind == "ready":                    # (the first workers' were the build's)
                if w.exitcode is not None or w.gone:
                    return None                    # (the spawner drops it; belt and braces)
                t_ready = time.monotonic()
                self.router.set_up(k, True)        # (what waited for a worker goes to k)
                w.t_ready = w.replacing["t_up"] = t_ready      # after: a caller seeing t_up finds it up
                print(f"pipeline: worker {k} replaced by a fresh process (pid {w.pid}) on a fresh lane, "
                      f"up again", file=sys.stderr, flush=True)
                unhold_unless_coming()
                return None
            if not w.gone:                         # (else marked down already, by its pidfd)
                hold()                             # (first: the router parks what k held)
                self.router.set_up(k, False)
            w.exitcode = rest[0]                   # after: kill_worker waits for it
            self.worker_exits.append((k, w.exitcode))
            print(f"pipeline: worker {k} exited (code {w.exitcode}): marked down, its unfinished requests "
                  f"replayed on the others", file=sys.stderr, flush=True)
            return k

        def hold():
            """A worker is going down, and may be replaced: while none is up, what it held and new
            requests wait for the replacement, worker_hold_s at most (router.h, dp_router_hold)."""
            if self.cfg.worker_respawns and self.cfg.worker_hold_s > 0:
                self.router.hold(self.cfg.worker_hold_s)

        def unhold_unless_coming():
            """No replacement starting: what waits for one is answered now (503, none up)."""
            if not any(w.replacing is not None and not w.ready and w.exitcode is None for w in self.workers):
                self.router.hold(0)

        def close_dead(spawner: WorkerSpawner):
            try:
                spawner.close()
            except Exception as e:
                print(f"pipeline: closing a dead worker spawner (pid {spawner.pid}): {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)

        def want_heir(lost: WorkerSpawner):
            """An heir is due now, `lost` (the spawner or heir it replaces) gone; none once they go
            in a row soon after they start (a crash loop): then the spawner's death is the end."""
            age = time.monotonic() - lost.t_start
            quick_spawners[0] = 0 if age >= CRASH_LOOP_S else quick_spawners[0] + 1
            if quick_spawners[0] > self.cfg.worker_respawns:
                heir_due[0] = None
                print(f"pipeline: {quick_spawners[0]} worker spawners or heirs lost in a row within "
                      f"{CRASH_LOOP_S:g} s of starting: no new heir (if the spawner dies, every worker "
                      f"stays down)", file=sys.stderr, flush=True)
            else:
                heir_due[0], heir_backoff[0] = time.monotonic(), 1.0

        def fork_heir():
            """The heir that is due; one that cannot be forked (out of processes, say) is tried
            again after 1 s, then 2, ... up to 30 (a failed fork is no heir lost: not counted)."""
            try:
                self._heir = self._spawner.spawn_heir()
                heir_due[0] = None
            except SpawnerDied:
                raise EOFError from None           # (watch: the takeover's, not a fork to try again)
            except Exception as e:
                heir_due[0] = time.monotonic() + heir_backoff[0]
                print(f"pipeline: the worker spawner could not fork an heir ({type(e).__name__}: {e}): tried "
                      f"again in {heir_backoff[0]:g} s", file=sys.stderr, flush=True)
                heir_backoff[0] = min(30.0, 2 * heir_backoff[0])

        def heir_lost():
            """The standby heir exited (it never speaks unasked: its end reads EOF): another is due."""
            lost, self._heir = self._heir, None
            close_dead(lost)
            print(f"pipeline: the worker spawner's heir (pid {lost.pid}) exited: forking another",
                  file=sys.stderr, flush=True)
            want_heir(lost)

        def take_over(seen: dict) -> bool:
            """The spawner died, and its workers with it (they die with their parent): each is
            marked down once gone, so nothing the router replays runs twice; then the heir becomes
            the spawner and forks them again. False if there is no heir: they stay down."""
            dead, heir = self._spawner, self._heir
            t = time.monotonic()
            crashed = set()                        # exits it said before it went: theirs, counted
            for event in dead.unread():
                if event[0] == "exit" and (k := on_event(*event)) is not None:
                    crashed.add(k)
            gone = [w for w in self.workers if w.exitcode is None]
            left = join_all(gone, REAP_WAIT_S)
            for w in left:
                w.kill()
            join_all(left, REAP_WAIT_S)
            down = [k for k, w in enumerate(self.workers) if w in gone]
            for k in down:
                self.workers[k].reap()             # (re-parented here if the pipeline is PID 1)
            hold()                                 # (after the wait for them, which may be long: REAP_WAIT_S)
            self.router.set_down(down)             # at once: none's requests move onto another of them
            for k in down:
                self.workers[k].exitcode = -signal.SIGKILL   # its spawner's death's (not ours to reap)
                self.worker_exits.append((k, self.workers[k].exitcode))
            code = dead.exitcode()
            close_dead(dead)
            promoted = heir is not None and not heir.exited()
            self.spawner_takeovers.append({"pid": dead.pid, "code": code, "t_exit": t, "workers": len(gone),
                                           "heir": heir.pid if promoted else None})
            said = (f"pipeline: the worker spawner (pid {dead.pid}) died" + (f" (code {code})" if code is not None
                    else "") + f": its {len(gone)} worker(s) with it, marked down, their unfinished requests "
                    + (f"replayed (held for the new workers, {self.cfg.worker_hold_s:g} s at most)"
                       if self.cfg.worker_hold_s and self.cfg.worker_respawns else "replayed (503 while no worker is up)"))
            if not promoted:
                if heir is not None:
                    self._heir = None
                    close_dead(heir)
                print(f"{said}; no heir: they stay down", file=sys.stderr, flush=True)
                self.router.hold(0)
                return False
            print(f"{said}; its heir (pid {heir.pid}) takes over and forks them again", file=sys.stderr, flush=True)
            self._spawner, self._heir, heir.t_start = heir, None, t
            want_heir(dead)
            for k in range(len(self.workers)):
                if stopping.is_set():
                    break                          # the teardown: nothing to start now
                try:
                    replace(k, t, seen, blameless=k not in crashed)
                except Exception as e:
                    print(f"pipeline: worker {k} could not be replaced ({type(e).__name__}: {e}): it "
                          f"stays down", file=sys.stderr, flush=True)
            unhold_unless_coming()
            return True

        def one_pass(seen: dict) -> bool:
            """False once the pipeline is being torn down."""
            if not self._spawner.pending():
                # a replacement not yet serving is timed (START_TIMEOUT_S) whatever hang_s: with no
                # timeout one stuck before its ready sent no event, and was never killed (review)
                starting = any(not w.ready and w.replacing is not None for w in self.workers)
                timeout = min(1.0, hang_s / 4) if hang_s > 0 else 1.0 if starting else None
                if heir_due[0] is not None:
                    timeout = max(0.0, min(heir_due[0] - time.monotonic(), timeout or math.inf))
                heir = [self._heir.conn] if self._heir is not None else []
                store = [self._store_proc.sentinel] if self._store_proc is not None else []
                alive = [w.pidfd for w in self.workers if w.pidfd >= 0 and w.exitcode is None and not w.gone]
                ready = wait([self._spawner.conn, wake_r, *heir, *store, *alive], timeout=timeout)
                if wake_r in ready:
                    return False                   # teardown: the workers are being stopped
            if (self._store_proc is not None and self._store_proc.exitcode is not None
                    and not stopping.is_set() and not self._store_stop.is_set()):
                self._restart_store(store_quick)
            # a worker whose process is gone is marked down at once, by its pidfd: its death came
            # only as the spawner's report, and a spawner stopped or slow (a SIGSTOP, a host that
            # does not schedule it) left it up, what it held unanswered meanwhile (found by review).
            # Its replacement still waits for that report (the spawner reaps it and forks anew).
            # All marked down at once (set_down): one by one, a request of the first moved onto the
            # next, dead too (the spawner's death takes them all: found by review).
            gone = [k for k, w in enumerate(self.workers)
                    if w.pidfd >= 0 and w.exitcode is None and not w.gone and not stopping.is_set()
                    and _pidfd_exited(w.pidfd, 0)]
            if gone:
                for k in gone:
                    self.workers[k].gone = True
                hold()                             # (first: the router parks what they held)
                self.router.set_down(gone)
            if self._heir is not None and self._heir.conn.poll(0) and not stopping.is_set():
                heir_lost()
            if self._heir is None and heir_due[0] is not None and time.monotonic() >= heir_due[0]:
                fork_heir()
            events = self._spawner.events()
            if stopping.is_set():
                return False
            if self._retired and time.monotonic() - self._retired[0].t_retired > RETIRED_S:
                done = [w for w in self._retired if time.monotonic() - w.t_retired > RETIRED_S]
                self._retired = [w for w in self._retired if w not in done]
                for w in done:
                    w.close()
            t = time.monotonic()
            dead = [k for event in events if (k := on_event(*event)) is not None]   # every death marked
            for k in dead:                                                          # down first
                try:                               # each on its own: one that fails leaves k down
                    replace(k, t, seen)
                except SpawnerDied:
                    raise EOFError from None       # (watch: the takeover forks every worker again)
                except Exception as e:
                    print(f"pipeline: worker {k} could not be replaced ({type(e).__name__}: {e}): it "
                          f"stays down", file=sys.stderr, flush=True)
            if dead:
                unhold_unless_coming()
            for k, w in enumerate(self.workers):
                if (not w.ready and w.exitcode is None and not w.killed and w.replacing is not None
                        and time.monotonic() - w.replacing["t_exit"] > START_TIMEOUT_S):
                    w.killed = True                # (its exit is replaced in turn, to the limit)
                    w.kill()
                    print(f"pipeline: worker {k}'s replacement did not start in {START_TIMEOUT_S:g} s: killed",
                          file=sys.stderr, flush=True)
            for k, w in enumerate(self.workers) if hang_s > 0 else ():
                if (w.ready and w.exitcode is None and not w.killed and not stopping.is_set()
                        and self.router.worker_stats(k)["up"] and hung(k, seen)):
                    w.killed = True
                    self.worker_hangs.append(k)
                    w.kill()                       # its exit is seen above on a later pass
                    print(f"pipeline: worker {k} held a batch {patience(k, seen):g} s without completing anything: "
                          f"killed", file=sys.stderr, flush=True)
            return True

        def watch():
            seen: dict = {}
            while not stopping.is_set():
                try:
                    if not one_pass(seen):
                        return
                    continue
                except EOFError:                   # the spawner died, and its workers with it
                    pass
                except Exception as e:             # the watcher must outlive one bad pass
                    if stopping.is_set():
                        return
                    print(f"pipeline: worker watcher: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    time.sleep(0.1)
                    continue
                try:                               # (outside the handler above: guarded too)
                    if stopping.is_set() or not take_over(seen):
                        return
                except Exception as e:
                    # the watcher ends: no worker is watched or replaced past here, and those of the
                    # dead spawner are dying. Every worker is marked down, so the router answers
                    # what they held (left up, it held requests unanswered: review)
                    print(f"pipeline: worker watcher: the spawner's takeover failed ({type(e).__name__}: {e}): "
                          f"every worker is marked down, and stays so", file=sys.stderr, flush=True)
                    with contextlib.suppress(Exception):
                        self.router.hold(0)
                    with contextlib.suppress(Exception):
                        self.router.set_down(range(len(self.workers)))
                    return
        watcher = threading.Thread(target=watch, name="worker-watch", daemon=True)

        def halt():        # before the workers are reaped and the router is closed (LIFO)
            stopping.set()
            os.write(wake_w, b"x")
            # unbounded: what it waits on is (a spawn, 30 s at most), and left running past a
            # timeout it went on calling into the router the teardown then freed (found by review)
            if watcher.ident is not None:
                watcher.join()
            os.close(wake_r)
            os.close(wake_w)
        # registered before it starts: an interrupt between the two left it running through the
        # teardown, replacing the workers being stopped, then calling into the freed router (review)
        self._stack.callback(halt)
        watcher.start()

    def kill_worker(self, k: int, timeout_s: float = 5.0):
        """SIGKILL worker k, as a crash would (the failover scenario): nobody tells the router; the
        pipeline's watcher sees the process exit and marks it down (then replaces it). Returns once
        it was marked down."""
        deadline = time.monotonic() + timeout_s
        while self.workers[k].exitcode is not None:     # killed before, its replacement not there yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {k} is down and was not replaced in {timeout_s:g} s")
            time.sleep(0.01)
        victim = self.workers[k]
        victim.kill()
        while victim.exitcode is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {k} was killed but the watcher had not seen it exit after {timeout_s:g} s")
            time.sleep(0.01)

    def kill_spawner(self, timeout_s: float = 10.0) -> dict:
        """SIGKILL the worker spawner, as a crash would: its workers die with it, the watcher
        marks them down and its heir takes over (or, with no heir, they stay down). Returns once
        it has: its entry in spawner_takeovers."""
        n = len(self.spawner_takeovers)
        signal.pidfd_send_signal(self._spawner.pidfd, signal.SIGKILL)   # (its pipe then reads EOF)
        deadline = time.monotonic() + timeout_s
        while len(self.spawner_takeovers) == n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker spawner was killed but the watcher had not seen it die after "
                                   f"{timeout_s:g} s")
            time.sleep(0.01)
        return self.spawner_takeovers[n]

    # --- load -------------------------------------------------------------------------------
    def offer(self, rate: float, count: int, prompt_tokens: int = 64, max_output_tokens: int = 4,
              sessions: int = 64, tenant: int | list = 1, drain_s: float = 2.0, merge: int = 1,
              prompts: list | None = None, seed: int = 1) -> dict:
        """Open-loop Poisson arrivals of `count` packets at `rate`/s from the client namespace.

        Each request is one chunk of prompt_tokens (<= 128) from one of `sessions`
        sessions, cycling; merge > 1 is client-side batching: requests arrive at `rate`
        and every `merge` of them leave as one request (their prompts joined) when the
        last has arrived; `count` counts those packets, and each answer gives `merge`
        latencies, from each request's arrival (the wait for its companions measured). `prompts` (token lists, one per session, any length)
        replaces them: a prompt over 128 tokens is several chunks, each a packet of
        the count. `tenant` may be a list, one per session in turn. `seed` picks the arrival
        times (the same seed, the same schedule). Safe to call from
        several threads at once (each offer is its own client process and socket).
        Returns the client's stats (rtt_ns per response) and the offer's seq_base.
        """
        if not rate > 0 or count < 1:
            raise ValueError(f"an offer needs a rate > 0 packets/s (requests/s when each is one chunk) and a "
                             f"count >= 1, not {rate} and {count}")
        if prompts is None:
            if not 1 <= prompt_tokens * merge <= wire.MAX_CHUNK_TOKENS:
                raise ValueError(f"a request here is one chunk: prompt_tokens x merge must be 1..{wire.MAX_CHUNK_TOKENS}")
            prompts = [[(s * 131 + i) % 509 for i in range(prompt_tokens * merge)] for s in range(sessions)]
        tenants = tenant if isinstance(tenant, (list, tuple)) else [tenant]
        base = next(self._ids) * 1_000_000_000   # ids of this offer: base + sequence number
        # sessions are this offer's own (base + n): they return within it, never across offers
        pkts = [pkt for s, prompt in enumerate(prompts)
                for pkt in client.request_packets(tenants[s % len(tenants)], base + s + 1, 0, prompt,
                                                  max_output_tokens=max_output_tokens * merge)]
        # The client runs beside the workers, off the data path's core, SCHED_FIFO: on the core
        # it shares with a worker it would otherwise wait for the worker's step to yield, and send
        # late exactly when the worker is busy. Its latency counts from the schedule either way
        # (a late send's lag counted); this keeps the lag that of the client's own wake-up.
        cpu = self.cfg.worker_cpus[0] if self.cfg.worker_cpus else None
        duration = count * merge / rate * 3 + 5
        res = client.spawn_in_netns(self.topo.client_ns[0], self.topo.host_ip[0], pkts, timeout=duration + 60,
                                    cpu=cpu, rt_priority=1, rate=rate, count=count, duration=duration,
                                    drain_ms=int(drain_s * 1000), seq_base=base, merge=merge, seed=seed,
                                    keys={t: self.issue_tenant_key(t) for t in tenants} if self.cfg.require_tags else None)
        return {**res, "seq_base": base}

    def set_slowdown(self, k: int, factor: float):
        """Worker k's steps (its device's, or its forward passes) last `factor` times as long from
        its next step on, and its replacements': a straggler that turns slow mid-run (1: back to
        normal). cfg.stragglers gives the factors the workers start with."""
        from .serving.worker import check_slowdown
        if isinstance(k, bool) or not (isinstance(k, numbers.Integral) and 0 <= k < len(self.slowdowns)):
            raise ValueError(f"set_slowdown: worker {k!r} is not one of the {len(self.slowdowns)} workers (0-based)")
        check_slowdown(factor)
        self.slowdowns[k] = factor

    def issue_tenant_key(self, tenant: int) -> bytes:
        """Tenant's tag key (wire.tenant_key of this run's master secret), installed in the ingress:
        the operator's issue of a key to a client, which offer() does for the tenants it sends as."""
        key = self._tag_keys.get(tenant)
        if key is None:
            key = self._tag_keys[tenant] = wire.tenant_key(self._tag_master, tenant)
            self.ingress.set_tenant_key(tenant, key)
        return key

    # --- what happened -----------------------------------------------------------------------
    def trace(self, worker: int | None = None) -> np.ndarray:
        """Every record the workers (or one worker) ran so far, with its stamps; says so on stderr
        when records went past a worker's trace buffer (cfg.trace_records) untraced."""
        parts, past = [], 0
        for buf in self.traces if worker is None else [self.traces[worker]]:
            n, untraced = (int(x) for x in np.frombuffer(buf, dtype="<u8", count=2))
            parts.append(np.frombuffer(buf, dtype=TRACE, offset=64, count=n).copy())
            past += untraced
        if past > self._untraced_said:           # said once per new overflow, not at every call
            self._untraced_said = past
            print(f"pipeline: {past} records ran past the trace buffers ({self.cfg.trace_records} a worker) "
                  f"untraced: the stage figures leave them out", file=sys.stderr)
        return np.concatenate(parts) if parts else np.zeros(0, TRACE)

    def kv_resident_bytes(self) -> tuple[int, int]:
        """KV cache bytes resident across the workers, as each step left them (after its
        evictions): (the mean over each worker's steps, summed; after their last steps)."""
        mean = last = 0
        for buf in self.traces:
            n = int(np.frombuffer(buf, dtype="<u8", count=1)[0])
            if n:
                rows = np.frombuffer(buf, dtype=TRACE, offset=64, count=n)
                # a row per record: a step's rows share its t_start, so one per step
                _, first = np.unique(rows["t_start"], return_index=True)
                kv = rows["kv_bytes"][np.sort(first)]
                mean += int(kv.mean())
                last += int(kv[-1])
        return mean, last

    def reset_trace(self):
        for buf in self.traces:
            np.frombuffer(buf, dtype="<u8", count=2)[:] = 0
        self._untraced_said = 0

    def store_stats(self) -> dict | None:
        """The shared store's counters (puts, restores, ...), asked of its server; None without one."""
        if self._store_endpoint is None:
            return None
        from snapshotstore.server import RemoteStore
        with RemoteStore(self._store_endpoint) as store:
            return store.stats()

    def stats(self) -> dict:
        pools = sorted({p for p, _, _ in self.placement})
        return {"router": self.router.stats(), "workers": [self.router.worker_stats(k) for k in range(len(self.workers))],
                "pools": {p: self.router.pool_stats(p) for p in pools},
                "tenants": {t: self.router.tenant_stats(t) for t in self.cfg.tenants},
                "responder": self.responder.stats(), "loop": self.loop.stats(), "ingress": self.ingress.counters(),
                "consumer_records": self.consumer.records, "xdp_mode": self.xdp_mode}
