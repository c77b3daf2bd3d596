"""The client side: requests as chunk packets, and an open-loop Poisson load generator.

    pkts = request_packets(tenant=7, session_id=1, request_id=1, tokens=range(300))   # 3 chunks
    res = send_from(topo.client_ns[0], topo.host_ip[0], pkts, rate=100_000, count=200_000, duration=5)

The sender is C (native/loadgen.c, sendmmsg): Poisson arrivals at `rate`,
bounded by `count` and `duration`, each packet stamped with send_ns just
before it leaves, optionally its sequence number in request_id (every chunk
of a request gets its first chunk's); it reads the responses between sends,
counting them by status and keeping the first refusal's body (an admission
answer, datapath.wire.decode_admission_body, or the router's {"status",
"error"} saying why: docs/wire.md). send_from runs it
in a forked child that enters the client namespace, so the parent (the
ingress, the consumer) stays where it is.
"""
from __future__ import annotations

import ipaddress
import json
import math
import os
import select
import socket
import threading
import time

from . import topology, wire
from ._ingress import ffi, lib

MAX_PACKET = wire.REQ_HDR_LEN + 4 * wire.MAX_CHUNK_TOKENS


def _chunks(tokens) -> list[tuple]:
    """A request's tokens cut into chunks of at most 128."""
    tokens = tuple(tokens)
    if not tokens:
        raise ValueError("a request needs at least one token")
    return [tokens[i:i + wire.MAX_CHUNK_TOKENS] for i in range(0, len(tokens), wire.MAX_CHUNK_TOKENS)]


def _stamp(send_ns: int | None) -> int:
    """A packet's send stamp: given, or now (CLOCK_MONOTONIC, as the sender stamps its own). A retry
    under the same ids is one only if stamped later than its try: a stamp of 0 can never retry, and
    the router dropped such a retry as a repeat, unanswered (docs/dataplane.md, "Retries")."""
    return time.monotonic_ns() if send_ns is None else send_ns


def request_packets(tenant: int, session_id: int, request_id: int, tokens, max_output_tokens: int = 0,
                    kind: int = wire.KIND_CHUNK, trace: bool = False, key: bytes | None = None,
                    send_ns: int | None = None) -> list[bytes]:
    """One request's tokens cut into chunks of at most 128, each an encoded packet (trace: the
    response ends with the request's stamps, wire.Response.trace; key: the tenant's tag key, for
    packets sent as they are; send() tags its own, from its keys; send_ns: the packets' send
    stamp, now by default: to retry, build the packets again, later; send() stamps its own)."""
    parts, stamp = _chunks(tokens), _stamp(send_ns)
    return [wire.encode_request(wire.Request(kind=kind, tenant=tenant, session_id=session_id,
                                             request_id=request_id, chunk_index=i, chunk_count=len(parts),
                                             tokens=part, max_output_tokens=max_output_tokens,
                                             flags=wire.FLAG_TRACE if trace else 0, send_ns=stamp), key)
            for i, part in enumerate(parts)]


def interleave(sessions: list[list[bytes]]) -> list[bytes]:
    """Round-robin over sessions, keeping each session's packets in order."""
    out, longest = [], max(map(len, sessions), default=0)
    for i in range(longest):
        out += [s[i] for s in sessions if i < len(s)]
    return out


def _check_whole_requests(packets: list[bytes]) -> list[bool]:
    """With sequence ids, a request's chunks must be consecutive packets, chunk 0 first (loadgen.c
    numbers a request by its first chunk); a COUNT_TOKENS record is a request of its own, whatever
    chunk count it prices. Read raw: packets may be malformed on purpose. Returns, per packet,
    whether a request starts there."""
    idx_at, count_at = wire.REQ_OFFSETS["chunk_index"][0], wire.REQ_OFFSETS["chunk_count"][0]
    kind_at = wire.REQ_OFFSETS["kind"][0]
    want, starts = 0, []
    for p in packets:
        starts.append(want == 0)      # (a short packet, malformed on purpose, stands alone)
        if len(p) < wire.REQ_HDR_LEN:
            want = 0
            continue
        if p[kind_at] in (wire.KIND_OPEN, wire.KIND_CLOSE):
            raise ValueError("stamp_seq numbers each request by its own packets: an OPEN or CLOSE would get "
                             "an id of its own, not its request's or session's; send them with stamp_seq=False")
        index = int.from_bytes(p[idx_at:idx_at + 2], "little")
        count = int.from_bytes(p[count_at:count_at + 2], "little")
        if p[kind_at] == wire.KIND_COUNT_TOKENS and want == 0 and index == 0:
            continue                  # (one record, numbered as chunk 0 is)
        if index != want:
            raise ValueError("stamp_seq numbers requests by their first chunk: a request's chunks must be "
                             "consecutive packets, chunk 0 first, and the list must end with a whole request")
        want = index + 1 if index + 1 < count else 0
    if want:
        raise ValueError("stamp_seq: the packet list ends in the middle of a request")
    return starts


def count_tokens_packet(tenant: int, session_id: int, request_id: int, tokens, max_output_tokens: int = 0,
                        key: bytes | None = None, send_ns: int | None = None) -> bytes:
    """A COUNT_TOKENS record for a request of `tokens`: its first chunk and its chunk count are all
    the price needs (the estimate is chunk_count x 128); the answer is a 200 with the breakdown."""
    first = request_packets(tenant, session_id, request_id, tokens, max_output_tokens, kind=wire.KIND_COUNT_TOKENS,
                            key=key, send_ns=send_ns)
    return first[0]


def open_packet(tenant: int, session_id: int, request_id: int, tokens, max_output_tokens: int = 0,
                key: bytes | None = None, trace: bool = False, send_ns: int | None = None) -> bytes:
    """The OPEN record announcing a request of `tokens` (its chunk count; no tokens of its own): the
    router admits it, and reserves room for its chunks, before they come. Send it first, then the
    request's chunks (request_packets) with the same ids. trace: the record that opens a request
    decides whether its answer carries the stamps (the chunks' flag comes too late for it). For a
    request of several chunks: the router takes a one-chunk request's OPEN without effect, its
    chunk saying all the OPEN would (docs/admission.md, "Cut requests")."""
    return wire.encode_request(wire.Request(kind=wire.KIND_OPEN, tenant=tenant, session_id=session_id,
                                            request_id=request_id, chunk_index=0, chunk_count=len(_chunks(tokens)),
                                            tokens=(), max_output_tokens=max_output_tokens,
                                            flags=wire.FLAG_TRACE if trace else 0, send_ns=_stamp(send_ns)), key)


def close_packet(tenant: int, session_id: int, request_id: int, key: bytes | None = None,
                 send_ns: int | None = None) -> bytes:
    """The CLOSE record: the client is done with the session (its KV and snapshots are freed)."""
    return wire.encode_request(wire.Request(kind=wire.KIND_CLOSE, tenant=tenant, session_id=session_id,
                                            request_id=request_id, chunk_index=0, chunk_count=1, tokens=(),
                                            send_ns=_stamp(send_ns)), key)


MAX_COUNT = 1 << 24          # loadgen.c keeps a schedule slot per packet (stamp_seq)


def send(sock: socket.socket, packets: list[bytes], rate: float, count: int, duration: float,
         batch: int = 32, stamp_seq: bool = True, drain_ms: int = 50, seed: int = 1, spin_us: int = 50,
         seq_base: int = 0, merge: int = 1, keys: dict[int, bytes] | None = None) -> dict:
    """Send `count` packets (cycling through `packets`) on a connected UDP socket. Returns the C stats.

    `rate` is packets/s, each packet its own Poisson arrival: a request of several chunks is
    several packets, spread by the gaps between them, and its latency (from its first chunk)
    includes that spread. `seq_base` numbers the requests (stamp_seq): a router remembers
    finished requests' keys, so a second run against the same router with the same packets and
    base has those answered 200 dropped as late duplicates (unanswered), and those refused run
    again as retries (their new stamps): give each run its own base.

    merge > 1 is client-side batching: requests arrive at `rate`, every `merge` of them leave
    as one packet (each packet must carry that many requests' prompts) once the last has
    arrived, and each answer counts `merge` latencies, from each request's own arrival.

    rtt_ns / rtt_ok_ns: per answer (all / 200s), from the packet's own send: the path's round
    trip (merge > 1: per request the answer carried, each with its own wait for its companions).
    A packet that could not be sent (send_errors) starts no request. lat_ok_ns (stamp_seq): per request answered 200, from its scheduled send, and per
    request still unanswered when the drain ended (`unanswered`) the time it had waited then:
    the open-loop latency, with a late sender's lag (`late_mean_ns`, `max_late_ns`) and the
    unanswered tail kept in it.

    keys: {tenant: tag key} (datapath.wire.tenant_key): each packet is tagged as it leaves,
    after its request id and stamp are written, with its tenant's key (one missing is an error)."""
    if not packets or not 0 < rate < math.inf or count < 1 or not 0 < duration < math.inf:
        raise ValueError("send needs packets, a finite rate > 0, count >= 1 and a finite duration > 0")
    # what loadgen.c refuses with EINVAL, said here (it surfaced as "[Errno 22] Invalid argument")
    if not 1 <= merge <= lib.DP_MAX_BATCH_CHUNKS:
        raise ValueError(f"merge must be 1..{lib.DP_MAX_BATCH_CHUNKS} (requests a packet carries), not {merge}")
    if merge > 1 and not stamp_seq:
        raise ValueError("merge > 1 needs stamp_seq: an answer is matched to its requests by their ids")
    if max(map(len, packets)) < wire.REQ_HDR_LEN:
        raise ValueError(f"every packet is shorter than a request header ({wire.REQ_HDR_LEN} bytes)")
    if keys is None and any(len(p) >= wire.REQ_HDR_LEN and wire.REQ_HDR.unpack_from(p)[-1] for p in packets):
        # the sender rewrites send_ns (and the request id) under the tag: every one would be dropped
        # by an ingress that requires tags, unanswered, with nothing said (found by review)
        raise ValueError("packets tagged by request_packets(key=) are re-stamped as they leave, which "
                         "spoils their tags: pass send(keys={tenant: key}) and untagged packets instead")
    if stamp_seq:
        starts = _check_whole_requests(packets)
        if merge > 1 and not all(starts):
            raise ValueError("merge > 1 needs one-chunk requests: each packet is the merge of `merge` "
                             "requests' arrivals, so a request of several chunks would draw that many per chunk")
        # whole requests only: a count that ended inside one left its first chunks sent and the
        # rest not, a 400 at the router's expiry counted against the server (found by review)
        while not starts[count % len(packets)]:
            count += 1
    if count > MAX_COUNT:
        raise ValueError(f"count is at most {MAX_COUNT} packets a run (each one's schedule is kept), not {count}")
    stride = max(map(len, packets))
    if stride > MAX_PACKET:
        raise ValueError(f"a packet is {stride} bytes, more than a request can be ({MAX_PACKET})")
    key_buf = ffi.NULL
    if keys is not None:
        tenant_at = wire.REQ_OFFSETS["tenant"][0]
        # (a packet too short for a header, malformed on purpose, goes as it is: no tenant, no tag)
        tenants = [int.from_bytes(p[tenant_at:tenant_at + 4], "little") if len(p) >= wire.REQ_HDR_LEN else None
                   for p in packets]
        missing = sorted(set(tenants) - set(keys) - {None})
        if missing:
            raise ValueError(f"keys has no tag key for tenant(s) {missing[:8]}")
        if any(len(keys[t]) != wire.TAG_KEY_LEN for t in set(tenants) - {None}):
            raise ValueError(f"a tag key is {wire.TAG_KEY_LEN} bytes")
        key_buf = ffi.new("uint8_t[]", b"".join(keys[t] if t is not None else bytes(wire.TAG_KEY_LEN) for t in tenants))
    buf = ffi.new("uint8_t[]", b"".join(p.ljust(stride, b"\0") for p in packets))
    lens = ffi.new("uint16_t[]", [len(p) for p in packets])
    cfg = ffi.new("struct dp_send_cfg *", dict(rate_pps=rate, count=count, max_ns=int(duration * 1e9),
                                                seed=seed, batch=batch, drain_ms=drain_ms, stamp_seq=stamp_seq,
                                                spin_ns=spin_us * 1000, seq_base=seq_base, merge=merge,
                                                keys=key_buf))
    st = ffi.new("struct dp_send_stats *")
    lats = (st.rtt, st.rtt_ok, st.lat_ok)
    # room for every sample: the unanswered come last, so a cap would drop exactly the tail. No
    # more can be sent than the count, or than the duration holds (Poisson: 10 sd over the mean,
    # and a request finished past the deadline): a large count with a short run took gigabytes
    expected = rate * duration
    sendable = min(count, int(expected + 10 * math.sqrt(expected)) + 1024 + len(packets))
    cap = max(1 << 16, sendable * merge)
    if any(lib.dp_lat_init(ffi.addressof(lat), cap) for lat in lats):
        for lat in lats:
            lib.dp_lat_free(ffi.addressof(lat))
        raise MemoryError("cannot allocate the response latency samples")
    try:
        rc = lib.dp_send_poisson(sock.fileno(), buf, stride, lens, len(packets), cfg, st)
        if rc:
            raise OSError(-rc, os.strerror(-rc))
        rtt, rtt_ok, lat_ok = (sorted(ffi.unpack(lat.samples, lat.n)) for lat in lats)
        return dict(sent=st.sent, send_errors=st.send_errors, elapsed_s=st.elapsed_ns / 1e9,
                    offered_pps=st.sent / (st.elapsed_ns / 1e9) if st.elapsed_ns else 0.0,
                    max_late_ns=st.max_late_ns, responses=st.responses, resp_429=st.resp_429,
                    resp_ok=st.resp_ok, resp_other=st.resp_other, last_resp_s=st.last_resp_ns / 1e9,
                    first_ok_s=st.first_ok_ns / 1e9, last_ok_s=st.last_ok_ns / 1e9,
                    requests=st.requests, rtt_ns=rtt, rtt_ok_ns=rtt_ok, lat_ok_ns=lat_ok,
                    unanswered=st.unanswered, duplicates=st.duplicates, strays=st.strays, malformed=st.malformed,
                    # the lag is kept per request only with stamp_seq (it read 0 without, however late)
                    late_mean_ns=(st.late_ns_sum / st.sent if st.sent else 0.0) if merge == 1 and stamp_seq else None,
                    merge_wait_ns_mean=st.merge_wait_ns / (st.sent * merge) if merge > 1 and st.sent else 0.0,
                    by_status={s: st.by_status[i] for i, s in enumerate(wire.STATUSES) if st.by_status[i]},
                    sample_status=st.sample_status,
                    sample_body=bytes(ffi.buffer(st.sample_body, st.sample_len)).decode(errors="replace"))
    finally:
        for lat in lats:
            lib.dp_lat_free(ffi.addressof(lat))


def schedule_span_s(rate: float, count: int, seed: int = 1) -> float:
    """When send(rate=rate, count=count, seed=seed) has its last packet due, in seconds from its
    start (merge 1): its seeded Poisson draws, read without sending."""
    if not 0 < rate < math.inf or count < 1:
        raise ValueError(f"schedule_span_s needs a finite rate > 0 and a count >= 1, not {rate} and {count}")
    return lib.dp_poisson_unit_span(seed, count) / rate


def rate_to_offer(offered: float, count: int, seed: int = 1) -> float:
    """The nominal rate at which send(count=count, seed=seed) offers `offered` packets/s, from
    its start to its last send (merge 1, and `count` whole requests: send() rounds it up to
    one otherwise). A short run's Poisson draws stray from their rate (a nominal 45/s over 8 s
    offered 42.55): a run meant at a given rate, say 80% of a saturation just measured, is
    aimed with this (its lag, if any, only lowers what it offers)."""
    if not offered > 0 or not math.isfinite(offered) or count < 1:
        raise ValueError(f"rate_to_offer needs a finite rate > 0 and a count >= 1, not {offered} and {count}")
    return offered * schedule_span_s(1.0, count, seed) / count


def run_in_netns(netns: str, fn, *args, cpu: int | None = None, rt_priority: int = 0,
                 timeout: float = 120.0, **kwargs):
    """fn(*args, **kwargs) in a forked child inside netns (pinned to cpu, SCHED_FIFO at rt_priority
    if > 0); returns its (JSON-able) result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            topology.enter(netns)
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})
            if rt_priority:
                os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(rt_priority))
            out = {"ok": fn(*args, **kwargs)}
            code = 0
        except BaseException as e:  # report it to the parent, never unwind into its code
            out = {"error": f"{type(e).__name__}: {e}"}
        try:
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(code)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                raise TimeoutError(f"the client in {netns} did not finish in {timeout} s")
            data = os.read(r, 1 << 20)
            if not data:
                break
            chunks.append(data)
    except BaseException:
        os.kill(pid, 9)       # a timeout, or Ctrl-C: the waitpid below waited out the whole send
        raise
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks) or b'{"error": "the client died without a word"}')
    if "error" in out:
        raise RuntimeError(f"client in {netns}: {out['error']}")
    return out["ok"]


def spawn_in_netns(netns: str, dst: str, packets: list[bytes], timeout: float, port: int = wire.DEFAULT_PORT,
                   cpu: int | None = None, rt_priority: int = 0, **kw) -> dict:
    """send_from's twin for a parent whose memory must stay its own: the sender is a fresh
    interpreter (exec'd in the client namespace), not a fork. A forked child shares the
    parent's pages copy-on-write, so while it lives every first write of the parent's
    native threads (router, consumer) to a page costs them a page fault. rt_priority > 0
    runs it SCHED_FIFO (pinned to cpu), so a busy task there cannot hold its sends back."""
    import pickle
    import subprocess
    import sys
    if ipaddress.ip_address(dst) not in topology.SUBNET:
        raise ValueError(f"{dst} is outside {topology.SUBNET}: the load generator only sends to test namespaces")
    if netns not in topology.netns.listnetns():
        raise FileNotFoundError(f"no network namespace {netns!r}")
    # `ip netns exec` enters the namespace in the child, so the parent forks nothing of its own
    # (no preexec_fn: that would run Python between fork and exec in a process with native threads)
    # PR_SET_PDEATHSIG: a SIGKILLed parent takes the sender with it (`ip netns exec` execs, so the
    # parent is this process); one that unwinds kills it by stop_spawned
    code = ("import ctypes, json, os, pickle, sys; ctypes.CDLL(None).prctl(1, 9); "
            "from datapath.client import _send_to; "
            "a, k, cpu, rt = pickle.load(sys.stdin.buffer); cpu is None or os.sched_setaffinity(0, {cpu}); "
            "rt and os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(rt)); "
            "print(json.dumps(_send_to(*a, **k)))")
    with _spawned_lock:                  # registered as it starts: stop_spawned misses none
        proc = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c", code], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _spawned[proc] = netns
    try:
        out, err = proc.communicate(pickle.dumps(((dst, port, packets), kw, cpu, rt_priority)), timeout=timeout)
    except BaseException:
        proc.kill()
        proc.communicate()               # reaped, its pipes closed
        raise
    finally:
        with _spawned_lock:
            _spawned.pop(proc, None)
    if proc.returncode:
        raise RuntimeError(f"client in {netns}: exit {proc.returncode}: {err.decode(errors='replace').strip()[-500:]}")
    return _from_json(json.loads(out))


def _from_json(res: dict) -> dict:
    """send()'s result as send() returns it, after a trip through JSON (which made by_status's
    keys strings: .get(200) read None)."""
    return {**res, "by_status": {int(k): v for k, v in res["by_status"].items()}}


_spawned: dict = {}                 # spawn_in_netns's senders still running, from any thread: their netns
_spawned_lock = threading.Lock()


def stop_spawned(netns: str) -> int:
    """Kill the senders spawn_in_netns still runs in netns (a teardown's: an offer from another
    thread kept its sender, and the process, alive for the offer's duration and drain after a
    SIGTERM unwound the pipeline; found by review). How many it killed."""
    with _spawned_lock:
        procs = [p for p, ns in _spawned.items() if ns == netns]
    for proc in procs:
        proc.kill()
    return len(procs)


def _send_to(dst: str, port: int, packets, **kw) -> dict:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
        try:                                  # past rmem_max (root): SO_RCVBUF alone is cut to it
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUFFORCE, 1 << 22)
        except (OSError, AttributeError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        s.connect((dst, port))
        return send(s, packets, **kw)


def send_from(netns: str, dst: str, packets: list[bytes], rate: float, count: int, duration: float,
              port: int = wire.DEFAULT_PORT, cpu: int | None = None, rt_priority: int = 0, **kw) -> dict:
    """The load generator in the client namespace, sending to dst:port (an address in 198.18.0.0/15)."""
    if ipaddress.ip_address(dst) not in topology.SUBNET:
        raise ValueError(f"{dst} is outside {topology.SUBNET}: the load generator only sends to test namespaces")
    # the sender runs its schedule, then waits drain_ms for the last answers: both within the timeout
    timeout = duration + kw.get("drain_ms", 50) / 1000 + 30
    return _from_json(run_in_netns(netns, _send_to, dst, port, packets, rate=rate, count=count, duration=duration,
                                   cpu=cpu, rt_priority=rt_priority, timeout=timeout, **kw))

