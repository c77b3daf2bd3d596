"""The native router (native/router.h) from Python: build, wire, start, steer, read counters.

Python calls it per control action (add a worker, change the policy, read
stats) or, in tests, per poll pass; chunks never pass through Python.
"""
from __future__ import annotations

import errno
import math
import numbers
import os

from ._dataplane import ffi, lib
from .admission import TenantPolicy
from .ring import Ring

BATCHING = {"dynamic": lib.DP_BATCH_DYNAMIC, "static": lib.DP_BATCH_STATIC}
MAX_POOLS = lib.DP_MAX_POOLS


def _u32(what: str, v) -> int:
    """v as a C uint32 argument: a ValueError naming it, not cffi's OverflowError or TypeError."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v < 1 << 32:
        raise ValueError(f"{what} must be a whole number 0..2^32-1, not {v!r}")
    return int(v)


def _check_pool(pool):
    if isinstance(pool, bool) or not isinstance(pool, numbers.Integral) or not 0 <= pool < MAX_POOLS:
        raise ValueError(f"pool must be 0..{MAX_POOLS - 1}, not {pool!r}")


def policies() -> list[str]:
    return list(policy_params())


def policy_params() -> dict[str, str | None]:
    """Each registered policy: what its parameter means, or None if it takes none. RuntimeError
    for a name registered twice: the router runs the first, and a researcher's policy copied from
    another with its name string left as it was never ran, with nothing said (found by review)."""
    out, i = {}, 0
    while (p := lib.dp_policy_name(i)) != ffi.NULL:
        param, name = lib.dp_policy_param(i), ffi.string(p).decode()
        if name in out:
            raise RuntimeError(f"policy name {name!r} is registered twice (native/policies/registry.c): the "
                               f"router would run only the first; give each policy's ops its own name")
        out[name] = ffi.string(param).decode() if param != ffi.NULL else None
        i += 1
    return out


def check_policy(policy: str, param: float):
    """ValueError unless policy is known and takes param: a finite number >= 0 (0: the policy's
    default), none for a policy that reads none, and within what the policy's own init takes
    (dp_policy_check runs it: peak_ewma's decay time of a day at most). Before anything is built,
    so bench compare refuses a setting before it removes the last report or builds a pipeline (a
    decay time over a day was refused only by the pipeline's router, after both: found by
    review). (NaN or inf made affinity's load cap NaN or inf, its bound off, and -1 its default,
    silently: found by review.)"""
    if not math.isfinite(param) or param < 0:
        raise ValueError(f"a policy parameter is a finite number >= 0 (0: the policy's default), not {param!r}")
    if param and policy_params().get(policy, "") is None:
        raise ValueError(f"policy {policy!r} takes no parameter (it would be ignored), not {param:g}")
    _check(lib.dp_policy_check(policy.encode(), param), f"policy {policy!r}" + _param_said(policy, param))


def _param_said(policy: str, param: float) -> str:
    """For an error: the parameter given and what the policy says it means (its range, when its
    own init refuses it: peak_ewma's decay time over a day)."""
    meaning = policy_params().get(policy)
    return f" and parameter {param:g} ({meaning})" if param and meaning else ""


HOLD_MAX_S = 86_400.0      # Router.hold: a day (a replacement starts in seconds)


def _check(rc: int, what: str) -> int:
    if rc >= 0:
        return rc
    if -rc == errno.ENOENT:
        raise ValueError(f"{what}: unknown policy (known: {', '.join(policies())})")
    if -rc == errno.EINVAL:
        raise ValueError(f"{what}: invalid argument")
    if -rc == errno.EBUSY:
        raise RuntimeError(f"{what}: not while requests are in flight / already running")
    raise OSError(-rc, f"{what}: {os.strerror(-rc)}")


def _stall_ns(stall_s: float) -> int:
    if not 0 <= stall_s < 1e9:
        raise ValueError(f"stall_s must be 0 (never) or a positive number of seconds, not {stall_s}")
    return int(stall_s * 1e9)


def _struct_dict(cdata) -> dict:
    return {name: getattr(cdata, name) for name, _ in ffi.typeof(cdata[0]).fields}


class Router:
    def __init__(self, policy: str = "round_robin", batching: str = "dynamic", token_budget: int = 512,
                 max_chunks: int = 64, max_batch_size: int = 32, batch_timeout_s: float = 0.05,
                 max_requests: int = 4096, pool_chunks: int = 8192, seed: int = 1, policy_param: float = 0.0,
                 reassembly_timeout_s: float = 1.0, split_slack: int = 32, zmq_timeout_s: float = 30.0,
                 stall_s: float = 0.5):
        self._rt = None
        self._loop = None
        if batching not in BATCHING:
            raise ValueError(f"batching must be dynamic or static, not {batching!r}")
        for name, v, lo, hi in (("token_budget", token_budget, 1, 1 << 20), ("max_chunks", max_chunks, 1, 64),
                                ("max_batch_size", max_batch_size, 1, 64), ("pool_chunks", pool_chunks, 1, 1 << 22)):
            if not lo <= v <= hi:
                raise ValueError(f"{name} must be {lo}..{hi}, not {v}")
        if not 0 <= zmq_timeout_s < 1e9:
            raise ValueError(f"zmq_timeout_s must be 0 (never) or a positive number of seconds, not {zmq_timeout_s}")
        if not 0 <= split_slack <= 128:
            raise ValueError(f"split_slack must be 0..128 tokens, not {split_slack}")
        if max_requests < 8 or max_requests & (max_requests - 1):
            raise ValueError(f"max_requests must be a power of two >= 8, not {max_requests}")
        check_policy(policy, policy_param)
        cfg = ffi.new("struct dp_router_config *", dict(
            batching=BATCHING[batching], token_budget=token_budget, max_chunks=max_chunks,
            max_batch_size=max_batch_size, batch_timeout_ns=max(1, int(batch_timeout_s * 1e9)),
            max_requests=max_requests, pool_chunks=pool_chunks, seed=seed,
            reassembly_timeout_ns=max(1, int(reassembly_timeout_s * 1e9)), split_slack=split_slack,
            zmq_timeout_ns=int(zmq_timeout_s * 1e9), stall_ns=_stall_ns(stall_s)))
        err = ffi.new("int *")
        self._rt = lib.dp_router_create(cfg, policy.encode(), policy_param, err)
        if self._rt == ffi.NULL:
            self._rt = None
            _check(err[0], f"router with policy {policy!r}" + _param_said(policy, policy_param))
        self._rings: list[Ring] = []   # keep the rings alive as long as the router uses them
        self._lanes: dict[int, tuple[Ring, Ring]] = {}   # shm worker -> its (lane, done), kept alive too
        self.policy, self.batching = policy, batching
        self.n_workers = 0

    def add_input(self, ring: Ring) -> int:
        ring.act("consumer")        # the router drains it: a second consumer is refused (RingBusy)
        self._rings.append(ring)
        return _check(lib.dp_router_add_input(self._rt, ring.ptr), f"input ring {ring.name!r} (slots too small?)")

    def add_feed(self, consumer) -> None:
        """Records straight from an ingress consumer (datapath.ingress.Consumer made without an output
        ring): the router's pass runs the consumer, which hands it each record where XDP wrote it,
        stamped once for t_consumer and t_router (no input ring between). One feed per router."""
        if consumer.out is not None:
            raise ValueError("a router's feed is a consumer made without an output ring (ig.consumer(None)): "
                             "one with a ring may also run its own thread on the same ring buffers")
        fn, src = consumer.feed()
        _check(lib.dp_router_add_feed(self._rt, fn, src), "feed (one per router)")
        self._rings.append(consumer)   # kept alive as long as the router may call it
        consumer.fed = True
        if consumer.cuts_fd >= 0:
            self.watch_cuts(consumer.cuts_fd, consumer.buckets_fd, consumer.others_fd)

    def watch_cuts(self, map_fd: int, buckets_fd: int = -1, others_fd: int = -1) -> None:
        """The XDP program's `cuts` map (Ingress.table("cuts").map_fd; add_feed does this itself): a request
        its token bucket cut in the middle was answered 429 in the kernel, so the chunks of it that passed
        are dropped at the reassembly timeout without a second answer, the 400 (stats: xdp_cut); and one
        the router answers before its last chunk came is cut there, so the bucket does not answer it
        again. buckets_fd, the program's `buckets` map: only its tenants are checked (-1: all), and
        every tenant while others_fd's bucket (`others_bucket`) is set."""
        _check(lib.dp_router_watch_cuts(self._rt, map_fd, buckets_fd, others_fd), f"cuts map fd {map_fd}")

    def add_worker(self, lane: Ring, done: Ring, weight: int = 1, pool: int = 0) -> int:
        _check_pool(pool)        # before: a worker added, then its pool refused, served requests in pool 0
        lane.act("producer")
        done.act("consumer")
        k = _check(lib.dp_router_add_worker(self._rt, lane.ptr, done.ptr, weight),
                   f"worker lane {lane.name!r}/{done.name!r} (slot sizes or capacity too small?)")
        self._lanes[k] = (lane, done)
        self.n_workers += 1
        if pool:
            self.set_worker_pool(k, pool)
        return k

    def add_zmq_worker(self, endpoint: str, weight: int = 1, pool: int = 0) -> int:
        """A worker behind ZeroMQ (lanes.ZmqWorkerLane bound at endpoint: tcp://host:port or ipc://path)."""
        from snapshotstore.server import check_endpoint
        check_endpoint(endpoint)   # (ZeroMQ took port 99999 as 34463, and port 0: found by review)
        _check_pool(pool)
        k = _check(lib.dp_router_add_zmq_worker(self._rt, endpoint.encode(), weight), f"zmq worker at {endpoint}")
        self.n_workers += 1
        if pool:
            self.set_worker_pool(k, pool)
        return k

    def set_egress(self, ring: Ring):
        ring.act("producer")
        self._rings.append(ring)
        _check(lib.dp_router_set_egress(self._rt, ring.ptr), f"egress ring {ring.name!r}")

    def set_policy(self, policy: str, param: float = 0.0):
        check_policy(policy, param)
        _check(lib.dp_router_set_policy(self._rt, policy.encode(), param),
               f"policy {policy!r}" + _param_said(policy, param))
        self.policy = policy

    def set_weight(self, worker: int, weight: int):
        _check(lib.dp_router_set_weight(self._rt, _u32("worker", worker), _u32("weight", weight)),
               f"weight of worker {worker}")

    def set_key_secret(self, secret: int):
        """The secret request and session keys are hashed with (random otherwise): a test computes
        ids whose keys collide, bench compare gives every policy's run the same; refused once the
        router has made a pass."""
        _check(lib.dp_router_set_key_secret(self._rt, secret), "key secret (only before the first pass)")

    def set_stall(self, stall_s: float):
        """A worker whose batch goes unanswered this long (or 4x its recent longest batch) is
        stalled: new requests go to the others meanwhile (router.h, stall_ns). 0: never, and every
        stall ends now."""
        _check(lib.dp_router_set_stall(self._rt, _stall_ns(stall_s)), "stall threshold")

    def set_up(self, worker: int, up: bool):
        """Down: the worker is gone (its process died); its unfinished requests are replayed on
        the others, whole. Up again: new requests go to it. The router does not take back what it
        had published in the worker's lane (only its consumer may), so a worker set up again
        must be a fresh process on a fresh lane, or it first runs that old batch (its completion
        is then dropped as stale, but its side effects, KV and snapshots, happen)."""
        _check(lib.dp_router_set_up(self._rt, _u32("worker", worker), int(up)), f"health of worker {worker}")

    def set_down(self, workers):
        """Several workers gone at once (their spawner's death): all marked down before any one's
        requests move, so none moves onto another of them (set_up one by one, a request the first
        had some of moved onto the next, counted as run there, and was answered 503 at its death:
        its replay's worker died too)."""
        ks = [_u32("worker", k) for k in workers]
        _check(lib.dp_router_set_down(self._rt, ffi.new("uint32_t[]", ks) if ks else ffi.NULL, len(ks)),
               f"health of workers {ks}")

    def hold(self, hold_s: float):
        """A worker is coming (a replacement is starting): for hold_s from now (or to a later end
        already set), a request no worker is up to take, new or one a dead worker held, waits for
        the first worker set up or added instead of being answered 503 (stats: waiting_for_worker,
        waited_for_worker). 0 ends the hold: what still waits is answered 503 then, unless a worker
        is up."""
        if not 0 <= hold_s <= HOLD_MAX_S:
            raise ValueError(f"hold_s must be 0..{HOLD_MAX_S} seconds, not {hold_s!r}")
        _check(lib.dp_router_hold(self._rt, math.ceil(hold_s * 1e9)), "hold")   # (ceil: > 0 holds)

    def replace_lane(self, worker: int, lane: Ring, done: Ring) -> tuple[Ring, Ring]:
        """A down shm worker's fresh lane and completion ring, for the process that replaces it
        (set it up after). Returns the old pair, which the router no longer touches."""
        lane.act("producer")
        done.act("consumer")
        _check(lib.dp_router_replace_lane(self._rt, worker, lane.ptr, done.ptr),
               f"lane of worker {worker} (it must be an shm worker, and down)")
        old, self._lanes[worker] = self._lanes[worker], (lane, done)
        return old

    def set_worker_budget(self, worker: int, token_budget: int | None):
        """Dynamic batching's tokens per step on one worker (None: the router's token_budget),
        e.g. its device's knee (serving.devices DeviceProfile.knee_tokens)."""
        if token_budget is not None and not 1 <= token_budget <= 1 << 20:
            raise ValueError(f"token_budget must be 1..{1 << 20}, got {token_budget}")
        _check(lib.dp_router_set_worker_budget(self._rt, _u32("worker", worker), token_budget or 0),
               f"budget of worker {worker}")

    def set_worker_store(self, worker: int, has_store: bool):
        """Declare whether a worker (and each replacement on its lane) has a snapshot store. Its
        answers say so anyway; declared, a session a failover replays on it before its first
        answer stays there too (native/router.h)."""
        _check(lib.dp_router_set_worker_store(self._rt, _u32("worker", worker), int(bool(has_store))),
               f"store of worker {worker}")

    # --- pools: placement by price, health and room (native/router.h) -------------------------
    def set_pool(self, pool: int, price_per_1k: int, room_per_worker: int = 0):
        """Pool `pool` (0..MAX_POOLS-1) costs price_per_1k micro-USD per 1,000 tokens (the placement
        order: cheapest first, see admission.pool_price_per_1k) and takes up to room_per_worker
        queued chunks per up worker before the next pool gets new requests (0: no limit)."""
        _check_pool(pool)
        _u32("price_per_1k", price_per_1k)
        _u32("room_per_worker", room_per_worker)
        _check(lib.dp_router_set_pool(self._rt, pool, price_per_1k, room_per_worker),
               f"pool {pool} (0..{lib.DP_MAX_POOLS - 1})")

    def set_worker_pool(self, worker: int, pool: int):
        _check_pool(pool)
        _check(lib.dp_router_set_worker_pool(self._rt, _u32("worker", worker), pool), f"pool {pool} of worker {worker}")

    def pool_stats(self, pool: int) -> dict:
        _check_pool(pool)
        st = ffi.new("struct dp_pool_stats *")
        _check(lib.dp_router_pool_stats(self._rt, pool, st), f"pool {pool}")
        return _struct_dict(st)

    # --- admission (native/admission.h), per tenant, live --------------------------------------
    def set_tenant(self, tenant: int, policy: TenantPolicy):
        _check(lib.dp_router_set_tenant(self._rt, _u32("tenant", tenant), policy.cdata()),
               f"tenant {tenant} (the tenant table holds {lib.DP_ADM_MAX_ALL_TENANTS} at most)")

    def set_default_tenant(self, policy: TenantPolicy):
        """The settings of every tenant that has none of its own."""
        lib.dp_router_set_default_tenant(self._rt, policy.cdata())

    def tenant_stats(self, tenant: int) -> dict:
        """Its decisions and spending (all zero for a tenant never seen)."""
        st = ffi.new("struct dp_adm_tenant_stats *")
        lib.dp_router_tenant_stats(self._rt, _u32("tenant", tenant), st)
        out = _struct_dict(st)
        del out["pad"]
        return out

    def set_batching(self, batching: str, token_budget: int = 512, max_chunks: int = 64,
                     max_batch_size: int = 32, batch_timeout_s: float = 0.05):
        if batching not in BATCHING:
            raise ValueError(f"batching must be dynamic or static, not {batching!r}")
        _check(lib.dp_router_set_batching(self._rt, BATCHING[batching], token_budget, max_chunks, max_batch_size,
                                          int(batch_timeout_s * 1e9)), "batching")
        self.batching = batching

    @property
    def handle(self):
        """The C router, for a native poll loop (datapath.loop) in this process."""
        return self._rt

    def poll(self) -> int:
        """One pass (send held responses, take completions, drain inputs, send batches, expire
        stalled requests); for tests and single-threaded use."""
        return lib.dp_router_poll(self._rt)

    def start(self, cpu: int | None = None):
        """Run the router in its own native poll loop thread (pinned to `cpu` if given).
        To share one thread with other stages, add `handle` to a datapath.loop.PollLoop instead."""
        from . import _dataplane
        from .loop import PollLoop
        if self._loop is not None:
            raise RuntimeError("the router is already running")
        loop = PollLoop(cpu=cpu)
        loop.add(_dataplane, "dp_router_poll", self._rt, owner=self)
        loop.start()
        self._loop = loop

    def stop(self):
        if self._loop is not None:
            self._loop.stop()
            self._loop = None

    def stats(self) -> dict:
        st = ffi.new("struct dp_router_stats *")
        lib.dp_router_get_stats(self._rt, st)
        return _struct_dict(st)

    def worker_stats(self, worker: int) -> dict:
        st = ffi.new("struct dp_worker_stats *")
        _check(lib.dp_router_worker_stats(self._rt, _u32("worker", worker), st), f"worker {worker}")
        return _struct_dict(st)

    def close(self):
        self.stop()
        if self._rt is not None:
            lib.dp_router_destroy(self._rt)
            self._rt = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()
