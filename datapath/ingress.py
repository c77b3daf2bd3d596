"""The XDP ingress: load bpf/steer.bpf.c with bcc, attach it, steer, count, consume.

    with Ingress(queues=4) as ig, output_ring("in0") as out:   # compile (tunables as -D cflags)
        ig.attach(topo.host_if[0], topo.host_ns)               # native, else generic: ig.mode says which
        with ig.consumer(out, cpu=1):                          # the C thread busy-polling the ring buffers
            router.add_input(Ring.attach("in0", "consumer"))   # downstream: the router drains "in0"
            ig.set_policy("tenant"); ig.route_tenant(7, 2); ig.set_rate(7, tokens_per_minute=6000)
            ...
        ig.counters()                                          # {"queued": ..., "drop_bad_magic": ...}
    router.add_feed(ig.consumer(None))                         # or: no thread, no input ring (the pipeline)

The ring-buffer record is struct dp_chunk (native/chunk.h) cut after its tokens
(rounded up to 16, 32, 64 or 128: steer.h): XDP writes it, the C consumer stamps t_consumer and copies header + tokens into a slot of
the router's input ring (native/ring.h), publishing once per burst; or, as a
router's feed, the router's own pass runs the consumer, which hands each record
from where XDP wrote it into the router's chunk pool. UdpIngress feeds the same
kind of ring from a plain UDP socket. Detaching is certain: the
context manager detaches on exit, on error, on Ctrl-C and on SIGTERM (turned
into SystemExit while an Ingress is open), and an attachment never outlives
the namespace it lives in.
"""
from __future__ import annotations

import contextlib
import errno
import ctypes
import functools
import ipaddress
import operator
import os
import signal
import socket
import sys
import struct
import threading
import time

import numpy as np

from . import wire, xdp
from ._dataplane import ffi as _dp_ffi
from ._ingress import ffi, lib
from .records import CHUNK
from .ring import Ring

DEFAULT_QUEUES = 4
DEFAULT_RING_PAGES = 256        # 1 MiB per queue: ~1,700 records of 65-128 tokens (616 bytes with the
                                # ring's header), ~6,200 of up to 16
POLICIES = {"hash": lib.DP_POLICY_SESSION_HASH, "session": lib.DP_POLICY_SESSION_PIN,
            "tenant": lib.DP_POLICY_TENANT}
# names from the enums in bpf/steer.h: drop reasons "truncated", "bad_magic", ...; events "pass", "reply_429"
DROP_REASONS = [name[len("DP_DROP_"):].lower() for value, name in
                sorted(ffi.typeof("enum dp_drop").elements.items()) if name != "DP_DROP_MAX"]
EVENTS = [name[len("DP_EV_"):].lower() for value, name in
          sorted(ffi.typeof("enum dp_event").elements.items()) if name != "DP_EV_MAX"]
NS_PER_MINUTE = 60_000_000_000
LOCAL_ADDRS = lib.DP_MAX_LOCAL_ADDRS   # accept_only's addresses at most (bpf/steer.h, dp_policy)
HOST_ADDRS = lib.DP_MAX_HOST_ADDRS     # refuse_sources' addresses at most (the same)


def namespace_sources(netns: str | None = None) -> set[str]:
    """The IPv4 addresses of netns (None: this process's) a request must not come from: each
    interface address and its broadcast (0/8, loopback and 224/3 aside: the program refuses them anyway)."""
    found = set()
    with xdp._iproute(netns) as ipr:
        for msg in ipr.get_addr(family=socket.AF_INET):
            # IFA_LOCAL, not IFA_ADDRESS: on a point-to-point link that is the peer's
            for attr in ("IFA_LOCAL", "IFA_BROADCAST"):
                if (a := msg.get_attr(attr)) and 0 < int(a.split(".")[0]) < 224 and not a.startswith("127."):
                    found.add(a)
    return found


def _as_read(address: str) -> int:
    """An IPv4 address in network order, as the program reads it into a u32."""
    return struct.unpack("=I", ipaddress.IPv4Address(address).packed)[0]


def source_bit(address: str) -> int:
    """An IPv4 address's bit in the policy's host_source_bits (the program's hash of it)."""
    return 1 << ((_as_read(address) * lib.DP_SOURCE_HASH_MUL) % (1 << 32) >> 26)


def session_queue(session_id: int, queues: int) -> int:
    """The queue the default policy gives a session (the XDP program's hash)."""
    return ((int(session_id) * lib.DP_SESSION_HASH_MUL) % (1 << 64) >> 32) % queues


class Ingress:
    """The steering program, compiled with bcc; maps by name; attach/detach."""

    # the program: a source in bpf/ with steer_maps.h's maps, and its function (bench ingress loads
    # ring_floor.bpf.c through a subclass)
    SOURCE, FUNCTION = "steer.bpf.c", "xdp_steer"

    def __init__(self, queues: int = DEFAULT_QUEUES, port: int | None = None,
                 ring_pages: int = DEFAULT_RING_PAGES):
        from . import wire
        if not 1 <= queues <= lib.DP_MAX_QUEUES:
            raise ValueError(f"queues must be 1..{lib.DP_MAX_QUEUES}, not {queues}")
        if ring_pages < 1 or ring_pages & (ring_pages - 1):
            raise ValueError(f"ring_pages must be a power of two, not {ring_pages}")
        self.queues, self.port, self.ring_pages = queues, port or wire.DEFAULT_PORT, ring_pages
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be 1..65535, not {self.port}")
        self.cflags = [f"-I{xdp.BPF_DIR.parent / 'native'}", f"-DDP_QUEUES={queues}",
                       f"-DDP_PORT={self.port}", f"-DDP_RING_PAGES={ring_pages}"]
        self.bpf = None
        self.fn = None
        self.attachments: list[xdp.XdpAttachment] = []
        self._peer_prog = None
        self._sigterm: SigtermExit | None = None
        self._host_sources: set[str] = set()

    # --- life cycle -----------------------------------------------------------------
    def load(self):
        self.bpf, self.fn = None, None
        b = xdp.load(self.SOURCE, self.cflags)
        try:
            self.fn = b.load_func(self.FUNCTION.encode(), xdp.import_bcc().BPF.XDP)
        except Exception as e:  # bcc raises bare Exception with the verifier log on stderr
            b.cleanup()
            raise xdp.BpfUnavailable(f"the kernel refused bpf/{self.SOURCE}: {e}") from e
        self.bpf = b
        # lat_hist is written by the C consumer only; binding it to the program lists it among the
        # program's maps, where `datapath ingress stats` looks (BPF_PROG_BIND_MAP, Linux 5.10)
        lib_bpf = xdp.libbpf()
        lib_bpf.bpf_prog_bind_map.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        if lib_bpf.bpf_prog_bind_map(self.fn.fd, self.table("lat_hist").map_fd, None):
            self.close()
            raise xdp.BpfUnavailable("cannot bind lat_hist to the steering program (BPF_PROG_BIND_MAP needs Linux 5.10)")
        return self

    def attach(self, ifname: str, netns: str | None = None, mode: str = "auto",
               veth_peer: tuple[str, str | None] | None = None) -> str:
        """Attach to ifname in netns (a veth this process made); returns the mode in use.

        The namespace's own IPv4 addresses are refused as a source from then on (refuse_sources).
        veth_peer (ifname, netns): the other end of that veth. In native mode a
        veth delivers XDP_TX frames (the 429s) only to a peer running NAPI, which
        it does once an XDP program is attached there, so the pass-everything
        count program goes on the peer. A physical NIC needs nothing of the kind.
        """
        # the namespace's own addresses are refused as a source from the first packet on: read
        # first, so a namespace with more than the program holds attaches nothing
        self.refuse_sources(list(self._host_sources | namespace_sources(netns)))
        # listed before they attach, so close() detaches one that an error (or a signal) interrupts
        # after the attach, in attached_mode() (detach of one whose mode is unset does nothing)
        att = xdp.XdpAttachment(self.fn.fd, ifname, netns, mode)
        self.attachments.append(att)
        try:
            att.__enter__()
        except xdp.BpfUnavailable:
            self.attachments.remove(att)          # nothing attached: the next try starts clean
            raise
        if mode == "auto" and att.mode == "generic":
            # said, not silent: generic XDP sees a sender's UDP GSO send (UDP_SEGMENT) as one packet,
            # whose length is no request's, so its datagrams are all dropped under one `length`
            # count (found by review: a veth of MTU 4000 or more falls back here)
            print(f"ingress: native XDP refused on {ifname}, attached in generic mode: a UDP GSO send to it "
                  f"(UDP_SEGMENT) is seen as one packet and dropped whole (drop_length)", file=sys.stderr)
        if veth_peer and att.mode == "native":
            self._peer_prog = self._peer_prog or xdp.load_xdp("count.bpf.c", "xdp_count")
            peer = xdp.XdpAttachment(self._peer_prog[1].fd, *veth_peer, mode="native")
            self.attachments.append(peer)
            peer.__enter__()
        return att.mode

    @property
    def mode(self) -> str | None:
        """The steering program's XDP mode (of its first attachment)."""
        return self.attachments[0].mode if self.attachments else None

    def close(self):
        while self.attachments:          # listed until detached: an interrupt leaves it to the next close
            self.attachments[-1].detach()
            self.attachments.pop()
        for b in (self.bpf, self._peer_prog and self._peer_prog[0]):
            if b is not None:
                b.cleanup()
        self.bpf = self._peer_prog = None

    def __enter__(self):
        self._sigterm = SigtermExit.install()
        try:
            return self.load()
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc):
        with signals_held(self._sigterm):
            self.close()
        self._sigterm = None

    # --- maps -------------------------------------------------------------------------
    def table(self, name: str):
        return self.bpf[name.encode()]

    def ring_fds(self) -> list[int]:
        return [self.table(f"ring{q}").map_fd for q in range(self.queues)]

    def _percpu_sums(self, name: str, n: int) -> list[int]:
        t = self.table(name)
        return [t.sum(t.Key(i)).value for i in range(n)]

    def counters(self) -> dict[str, int]:
        """Every counter by name: "pass", "reply_429", drop_<reason>, queue<n>, and "queued" (their sum)."""
        out = dict(zip(EVENTS, self._percpu_sums("events", len(EVENTS))))
        out.update(zip((f"drop_{r}" for r in DROP_REASONS), self._percpu_sums("drops", len(DROP_REASONS))))
        per_queue = self._percpu_sums("queue_pkts", self.queues)
        out.update(zip((f"queue{q}" for q in range(self.queues)), per_queue))
        out["queued"] = sum(per_queue)
        return out

    def set_policy(self, mode: str):
        """hash (default), session (pins, else hash) or tenant (tenant routes, else hash)."""
        if mode not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, not {mode!r}")
        self._set_policy_field("mode", POLICIES[mode])

    def stamp_validated(self, on: bool = True):
        """Stamp each chunk's t_xdp_in when its request is validated (the XDP program's own live
        cost is then t_xdp - t_xdp_in). Off by default: the clock read costs ~30 ns a chunk."""
        self._set_policy_field("stamp_validated", int(bool(on)))

    def require_tags(self, on: bool = True):
        """Drop every request whose tag is not the SipHash of its header under its tenant's key
        (set_tenant_key; a tenant without one is dropped too), unanswered and uncharged, before
        anything else is done with it (datapath.wire, "tags"). Off by default: the check costs
        ~65 ns a chunk (bench ingress: steer_tagged_ns against steer_ns)."""
        self._set_policy_field("require_tags", int(bool(on)))

    def accept_only(self, addresses: list[str] | None):
        """Take only IPv4 datagrams to these addresses (the service's, LOCAL_ADDRS at most); the
        rest, IPv6 too, pass to the kernel untouched. None: every datagram to the port, whatever its
        destination (the default: right on an interface whose traffic to the port is the service's,
        wrong on a router or a bridge port, whose transit traffic it would take and answer)."""
        if isinstance(addresses, str):
            raise TypeError("accept_only takes a list of addresses, not one string")
        addresses = list(addresses or ())
        if len(addresses) > LOCAL_ADDRS:
            raise ValueError(f"at most {LOCAL_ADDRS} addresses, not {len(addresses)}")
        packed = [_as_read(a) for a in addresses]
        # two updates: the program reads the entry meanwhile, and one update is a plain copy, so it
        # could see the count with the old addresses; with the count 0 first it takes every datagram
        t = self.table("policy")
        leaf = t[t.Key(0)]
        leaf.local_only = 0
        for i in range(LOCAL_ADDRS):
            leaf.local_addrs[i] = packed[i] if i < len(packed) else 0
        t[t.Key(0)] = leaf
        self._set_policy_field("local_only", len(packed))   # the count of them, 0: off

    def refuse_sources(self, addresses: list[str]):
        """Refuse requests from these IPv4 addresses (bad_source), HOST_ADDRS at most: this host's
        own addresses and subnet broadcasts, which the kernel's input drops as a source. A request
        from one would be run and its answer sent there by the egress, to a local port. attach()
        sets those of its interface's namespace; call again with the namespace's addresses
        (namespace_sources) after they change. The destination's own address is refused anyway."""
        if isinstance(addresses, str):
            raise TypeError("refuse_sources takes a list of addresses, not one string")
        addresses = sorted({str(ipaddress.IPv4Address(a)) for a in addresses})
        if len(addresses) > HOST_ADDRS:
            raise ValueError(f"at most {HOST_ADDRS} addresses refused as a source, not {len(addresses)} "
                             f"({', '.join(addresses)})")
        for a in self._host_sources - set(addresses):   # those in both stay in throughout
            self._forget("host_sources", _as_read(a))
        t = self.table("host_sources")
        for a in addresses:
            t[t.Key(_as_read(a))] = t.Leaf(1)
        self._set_policy_field("host_source_bits", functools.reduce(operator.or_, map(source_bit, addresses), 0))
        self._host_sources = set(addresses)

    def set_tenant_key(self, tenant: int, key: bytes):
        """Tenant's 16-byte tag key (datapath.wire.tenant_key), live."""
        if len(key) != wire.TAG_KEY_LEN:
            raise ValueError(f"a tag key is {wire.TAG_KEY_LEN} bytes, not {len(key)}")
        k0, k1 = struct.unpack("<2Q", key)
        t = self.table("tenant_keys")
        t[t.Key(tenant)] = t.Leaf(k0, k1)

    def clear_tenant_key(self, tenant: int):
        """Tenant's key gone: with tags required, its requests are dropped from now on."""
        self._forget("tenant_keys", tenant)

    def _forget(self, table: str, key: int):
        """key's entry of a hash map gone, if it had one."""
        t = self.table(table)
        try:
            del t[t.Key(key)]
        except KeyError:
            pass

    def _count_rate_limits(self):
        others = self.table("others_bucket")[0].ns_per_token != 0
        self._set_policy_field("rate_limits", len(self.table("buckets")) + others)

    def _set_policy_field(self, name: str, value: int):
        t = self.table("policy")
        leaf = t[t.Key(0)]
        if name not in dict(leaf._fields_):   # setattr would add a Python attribute, unseen by the map
            raise AttributeError(f"struct dp_policy has no field {name!r}")
        setattr(leaf, name, value)
        t[t.Key(0)] = leaf

    def _queue(self, queue: int) -> int:
        if not 0 <= queue < self.queues:
            raise ValueError(f"queue must be 0..{self.queues - 1}, not {queue}")
        return queue

    def pin_session(self, session_id: int, queue: int):
        t = self.table("pins")
        t[t.Key(session_id)] = t.Leaf(self._queue(queue))

    def route_tenant(self, tenant: int, queue: int):
        t = self.table("tenant_queue")
        t[t.Key(tenant)] = t.Leaf(self._queue(queue))

    def set_rate(self, tenant: int, tokens_per_minute: int, burst_tokens: int | None = None):
        """A token bucket for tenant: tokens_per_minute, holding at most burst_tokens (default: 1 s worth,
        at least one full chunk). A new bucket starts full; a tenant's rate set again keeps what its
        bucket had spent, in tokens (at most the new burst): before, it refilled, so lowering a
        tenant's rate handed it a fresh burst exactly when it was being throttled."""
        self._set_bucket("buckets", tenant, tokens_per_minute, burst_tokens)

    def clear_rate(self, tenant: int):
        self._forget("buckets", tenant)
        self._count_rate_limits()

    def set_others_rate(self, tokens_per_minute: int, burst_tokens: int | None = None):
        """One token bucket that every tenant without a bucket of its own (set_rate) shares, as
        set_rate's: a cap on all the traffic of tenants the operator has not named, made-up
        tenant ids among them (without it, a sender rotating made-up ids met no limit in XDP)."""
        self._set_bucket("others_bucket", 0, tokens_per_minute, burst_tokens)

    def clear_others_rate(self):
        t = self.table("others_bucket")
        t[t.Key(0)] = t.Leaf(0, 0, 0)
        self._count_rate_limits()

    def _set_bucket(self, table: str, key: int, tokens_per_minute: int, burst_tokens: int | None):
        if tokens_per_minute < 1 or tokens_per_minute > NS_PER_MINUTE:
            raise ValueError(f"tokens_per_minute must be 1..{NS_PER_MINUTE}, not {tokens_per_minute}")
        burst = burst_tokens if burst_tokens is not None else max(tokens_per_minute // 60, lib.DP_MAX_CHUNK_TOKENS)
        if burst < lib.DP_MAX_CHUNK_TOKENS:
            raise ValueError(f"burst_tokens must be at least one full chunk ({lib.DP_MAX_CHUNK_TOKENS}), not {burst}")
        ns_per_token = -(-NS_PER_MINUTE // tokens_per_minute)   # up: never more than the rate
        if burst * ns_per_token >= 1 << 62:    # the program adds it to the clock: it must not wrap
            raise ValueError(f"burst_tokens {burst} at {tokens_per_minute}/minute is more than the bucket can hold "
                             f"({((1 << 62) - 1) // ns_per_token} tokens): clear the rate to lift the limit")
        t = self.table(table)
        tat = 0                                          # (full)
        try:
            old = t[t.Key(key)]
        except KeyError:
            old = None
        if old is not None and old.ns_per_token:         # (the others' bucket is an array: 0 is none)
            # the program's clock is CLOCK_MONOTONIC (bpf_ktime_get_ns): the tokens spent ahead of
            # now, at the old rate, are charged again at the new one
            # (a charge the program makes between this read and the write below is lost: the
            # maps have no compare-and-swap from user space; a few records' worth at most)
            now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            spent = -(-max(0, old.tat - now) // old.ns_per_token)     # up: never in the tenant's favour
            if spent:
                tat = now + min(spent, burst) * ns_per_token
        t[t.Key(key)] = t.Leaf(ns_per_token, burst * ns_per_token, tat)
        self._count_rate_limits()

    def consumer(self, out: Ring | None, samples: int = 1 << 20, cpu: int = -1, rt_priority: int = 0) -> "Consumer":
        """The C consumer of this program's ring buffers, writing into `out` (see output_ring), or,
        with out None, only feeding a router (Router.add_feed)."""
        return Consumer(self.ring_fds(), out, samples, cpu, rt_priority, hist_fd=self.table("lat_hist").map_fd,
                        cuts_fd=self.table("cuts").map_fd, buckets_fd=self.table("buckets").map_fd,
                        others_fd=self.table("others_bucket").map_fd)


class Terminated(SystemExit):
    """The SystemExit a SIGTERM becomes (SigtermExit): told apart from an exit the code asked for."""


class SigtermExit:
    """SIGTERM as SystemExit (Terminated), so with-blocks unwind and the program is detached.

    Only in the process that installed it: a forked child (pyroute2's netns
    helpers are) must die as usual, not unwind the parent's with-blocks and
    tear down its namespaces."""

    def __init__(self):
        self.pid = os.getpid()
        self.old = None          # the handler it replaced (install)

    @classmethod
    def install(cls) -> "SigtermExit | None":
        """One installed for SIGTERM, the handler it replaces kept; None off the main thread (where
        Python runs no handler), or where this process's own is in place already (an Ingress inside
        a Pipeline): the outer one restores the caller's. (Nested, the outer teardown restored the
        inner one, stale, instead of the caller's handler: found by review.) signals_held(it) puts
        the old one back."""
        if threading.current_thread() is not threading.main_thread():
            return None
        current = signal.getsignal(signal.SIGTERM)
        if isinstance(current, SigtermExit) and current.pid == os.getpid():
            return None
        handler = cls()
        handler.old = signal.signal(signal.SIGTERM, handler)
        return handler

    def __call__(self, signum, frame):
        if os.getpid() != self.pid:
            os._exit(128 + signum)
        raise Terminated(128 + signum)


@contextlib.contextmanager
def signals_held(sigterm: SigtermExit | None = None):
    """SIGINT and SIGTERM held while a teardown runs (or a resource is made and its cleanup
    registered, which must not be parted) and delivered once it is done. A second Ctrl-C
    or SIGTERM landing in a teardown left the step it hit half done (an XDP attachment taken off
    the list and never detached, a namespace forgotten before it was removed) or, between steps,
    skipped every later one (found by review). sigterm: the teardown's own SigtermExit.install(),
    whose old handler goes back after, if it is still the one in place (inside another teardown,
    that one's hold is, and it restores its own). In the main thread only, where Python runs
    handlers; elsewhere it holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held, both = [], (signal.SIGINT, signal.SIGTERM)
    # both handlers swapped with both signals blocked, in and out: one landing between the two
    # swaps left a hold in place for good, and every later signal of its kind was swallowed (found
    # by review); blocked, it waits for the handler the swaps leave
    with _blocked(both):
        restore = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in both}
    if sigterm is not None and restore[signal.SIGTERM] is sigterm:
        restore[signal.SIGTERM] = sigterm.old
    try:
        yield
    finally:
        with _blocked(both):
            for s, handler in restore.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if held:
            signal.raise_signal(held[0])


@contextlib.contextmanager
def _blocked(signals):
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(signals))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def output_ring(name: str, capacity: int = 1 << 14) -> Ring:
    """A router input ring for a consumer to fill: one struct dp_chunk per slot, this process its producer."""
    return Ring.create(name, ffi.sizeof("struct dp_chunk"), capacity, role="producer")


def _ring_ptr(ring: Ring):
    """ring's C handle as this extension's type (the ring's own binding is datapath._dataplane)."""
    return ffi.cast("struct dp_ring *", int(_dp_ffi.cast("uintptr_t", ring.ptr)))


def take(ring: Ring, limit: int = 1 << 16) -> np.ndarray:
    """Records waiting in ring (a consumer handle), as a records.CHUNK array: tests and tools."""
    return np.frombuffer(ring.dequeue(limit), dtype=CHUNK)


def lat_samples(lat) -> list[int]:
    return list(ffi.unpack(lat.samples, lat.n)) if lat.n else []


class _Thread:
    """A C consumer thread's Python handle: start/stop, stats.

    cpu pins the thread; rt_priority > 0 runs it SCHED_FIFO (for benchmarks on
    shared cores: a busy-poller under the normal scheduler waits for whole time
    slices while another process has its core)."""

    _start = _stop = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        rc = self._start(self.ptr, self.cpu, self.rt_priority)
        if rc:
            raise OSError(-rc, "cannot start the consumer thread")

    def stop(self):
        self._stop(self.ptr)


class Consumer(_Thread):
    """The C consumer of the steering program's ring buffers (mapped and read by native/ingress.c
    the way libbpf's ring_buffer__consume reads them): a thread that busy-polls them into its
    output ring, or a router's feed (out None), run by the router's own pass."""

    _start, _stop = lib.dp_consumer_start, lib.dp_consumer_stop

    def __init__(self, ring_fds, out: Ring | None, samples: int = 1 << 20, cpu: int = -1, rt_priority: int = 0,
                 hist_fd: int = -1, cuts_fd: int = -1, buckets_fd: int = -1, others_fd: int = -1):
        self.cuts_fd = cuts_fd   # the program's cut requests (bpf/steer.h, dp_cut_key): Router.watch_cuts
        self.buckets_fd = buckets_fd   # and its tenants' buckets: the router cuts only theirs,
        self.others_fd = others_fd     # and every tenant's while the others' bucket is set
        fds = ffi.new("int[]", list(ring_fds))
        ptr = lib.dp_consumer_new(fds, len(ring_fds), hist_fd, _ring_ptr(out) if out else ffi.NULL, samples)
        if ptr == ffi.NULL and ffi.errno == errno.EBUSY:
            raise OSError(errno.EBUSY, "these ring buffers already have a consumer in this process (a ring buffer "
                          "has one reader: two would each take the same records): close() it first")
        if ptr == ffi.NULL:
            raise OSError("cannot set up the ring-buffer consumer: a ring buffer could not be mapped, or the "
                          "output ring's slots are smaller than a chunk or this process is not its producer")
        self.ptr = ffi.gc(ptr, lib.dp_consumer_free)
        # after ptr: an object's attributes go in the order they were set, and dp_consumer_free
        # stops the thread, which must not outlive the ring it writes (found by review)
        self.out = out
        # poll() and close() from two threads: a close freed the consumer under a poll running in
        # it (cffi lets go of the GIL for the call), and a poll after close ran on NULL
        self._lock = threading.Lock()
        self.cpu, self.rt_priority = cpu, rt_priority
        self.fed = False         # a router's feed (Router.add_feed): the router may call it until it goes

    @property
    def records(self) -> int:
        return self.ptr.records

    def feed(self) -> tuple[int, int]:
        """(dp_consumer_feed, this consumer) as addresses: what Router.add_feed takes."""
        return (int(ffi.cast("uintptr_t", ffi.addressof(lib, "dp_consumer_feed"))),
                int(ffi.cast("uintptr_t", self.ptr)))

    @property
    def out_full(self) -> int:
        """Records that found the output ring full, each counted once: each stayed in its ring
        buffer for a later pass (and what XDP could then not write there, it counts in
        drop_ring_full)."""
        return self.ptr.out.full

    @property
    def malformed(self) -> int:
        """Records skipped: not a chunk record (steer.bpf.c writes none such)."""
        return self.ptr.malformed

    def poll(self) -> int:
        """One pass over the ring buffers from the calling thread (a consumer not started): the
        records it took from them, up to a burst from each."""
        with self._lock:
            if self.ptr is None:
                raise RuntimeError("this consumer is closed")
            return lib.dp_consumer_poll(self.ptr)

    def start(self):
        if self.ptr is None:
            raise RuntimeError("this consumer is closed")
        super().start()

    def stop(self):
        if self.ptr is not None:         # (closed: its thread was stopped then)
            super().stop()

    def close(self):
        """Stop the thread and let the ring buffers go, for another consumer (freed here, not at
        garbage collection; after a poll running in another thread). Its counters are gone with it."""
        if self.fed:
            raise RuntimeError("this consumer is a router's feed: it lives as long as the router")
        with self._lock:
            if self.ptr is not None:
                ffi.release(self.ptr)
                self.ptr = None

    def reset(self):
        """Clear the latency records (call while stopped)."""
        lib.dp_lat_reset(ffi.addressof(self.ptr.xdp_lat))
        lib.dp_lat_reset(ffi.addressof(self.ptr.send_lat))

    def xdp_latency(self) -> list[int]:
        return lat_samples(self.ptr.xdp_lat)

    def send_latency(self) -> list[int]:
        return lat_samples(self.ptr.send_lat)


class UdpIngress(_Thread):
    """The same downstream interface from a plain UDP socket (a C recvmmsg thread): no root, no bcc."""

    _start, _stop = lib.dp_udp_rx_start, lib.dp_udp_rx_stop

    def __init__(self, sock, out: Ring, queues: int = DEFAULT_QUEUES, samples: int = 1 << 20, cpu: int = -1,
                 reply_status: int = 0, rt_priority: int = 0):
        if sock.family != socket.AF_INET:   # a chunk carries an IPv4 address: where its answer goes
            raise ValueError("the UDP ingress answers IPv4 senders only: give it an AF_INET socket")
        ptr = lib.dp_udp_rx_new(sock.fileno(), queues, _ring_ptr(out), samples)
        if ptr == ffi.NULL:
            raise ValueError(f"cannot set up the UDP ingress (queues must be 1..{lib.DP_MAX_QUEUES}; the output "
                             "ring needs chunk-sized slots and this process as its producer)")
        self.ptr = ffi.gc(ptr, lib.dp_udp_rx_free)
        self.sock, self.out = sock, out   # after ptr, as Consumer's: freed after the thread stops
        self.ptr.reply_status = reply_status   # answer instead of forwarding (the user-space 429 path)
        self.cpu, self.rt_priority = cpu, rt_priority

    @property
    def records(self) -> int:
        return self.ptr.records

    def drops(self) -> dict[str, int]:
        return {r: self.ptr.drops[i] for i, r in enumerate(DROP_REASONS)}

    def reset(self):
        lib.dp_lat_reset(ffi.addressof(self.ptr.send_lat))

    def send_latency(self) -> list[int]:
        return lat_samples(self.ptr.send_lat)
