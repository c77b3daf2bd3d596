"""Crash consistency with real processes: a writer SIGKILLed at a random point, then a check.

Each iteration forks a writer process that opens the store (one image reused
by every iteration, so the log wraps, compacts and relocates under crashes),
deletes the sessions of two iterations back and puts deltas into this
iteration's sessions from three threads (group commit). It reports on a pipe
"S sid i" before put i of session sid and "A sid i" once it returned, "DS" and
"DA" around deletes. The parent kills it with SIGKILL after a random delay,
reopens the store and checks, for every session it ever wrote:

    acknowledged puts restore bit-exact, in order, with their token ranges;
    a session holds at most the puts that were started (the one in flight
    when the kill came may or may not have landed: it was durable, or not,
    before the acknowledgement that never came);
    a session from an earlier iteration is exactly what the last check saw,
    and the store lists no session the check does not hold: an acknowledged
    delete stays deleted, in every later check too, and no key appears that
    was never written.

Used by tests/test_snapshot_crash.py (200 iterations) and the benchmark's
soak mode (`python -m bench snapshot --soak`, 1,000 iterations).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import signal
import threading
import time

from .api import Delta, session_key
from .device import create_image
from .log import LogStore, format_device

SECRET = b"crashtest-tenant-secret"
THREADS, SESSIONS_PER_THREAD, PUTS_PER_SESSION = 3, 2, 10
SIZES = (200, 3000, 3800, 5000, 12000)     # one-block and multi-block records
STORE_OPTIONS = dict(compact_after=4, eviction="refuse")


def sessions() -> list[int]:
    return [t * 100 + j for t in range(THREADS) for j in range(SESSIONS_PER_THREAD)]


def key_of(iteration: int, sid: int) -> bytes:
    return session_key(SECRET, f"{iteration}:{sid}")


def delta_of(iteration: int, sid: int, i: int, token_start: int) -> Delta:
    h = hashlib.shake_128(f"{iteration}:{sid}:{i}".encode())
    size = SIZES[h.digest(1)[0] % len(SIZES)]
    return Delta(h.digest(size), tokens=(token_start, token_start + size), layers=(0, 4), codec="f16")


def expected_chain(iteration: int, sid: int, n: int) -> bytes:
    parts, start = [], 0
    for i in range(n):
        d = delta_of(iteration, sid, i, start)
        parts.append(d.payload)
        start = d.tokens[1]
    return b"".join(parts)


def _writer(path: str, iteration: int, to_delete: list[tuple[int, int]], wfd: int):
    """The child: never returns (os._exit)."""
    def say(line: str):
        os.write(wfd, line.encode() + b"\n")     # < PIPE_BUF: atomic between threads

    def put_sessions(t: int):
        for j in range(SESSIONS_PER_THREAD):
            sid, start = t * 100 + j, 0
            for i in range(PUTS_PER_SESSION):
                d = delta_of(iteration, sid, i, start)
                say(f"S {sid} {i}")
                store.put(key_of(iteration, sid), d)
                say(f"A {sid} {i}")
                start = d.tokens[1]

    def guarded(fn, *a):
        try:
            fn(*a)
        except BaseException as e:               # reported, then the parent fails the iteration
            say(f"E {type(e).__name__}: {e}")

    try:
        try:
            store = LogStore(path, **STORE_OPTIONS)
            say("R")
            threads = [threading.Thread(target=guarded, args=(put_sessions, t)) for t in range(THREADS)]
            for th in threads:
                th.start()
            for it, sid in to_delete:
                say(f"DS {it} {sid}")
                guarded(store.delete, key_of(it, sid))
                say(f"DA {it} {sid}")
            say("DD")
            for th in threads:
                th.join()
            store.close()
            say("F")
        except BaseException as e:
            say(f"E {type(e).__name__}: {e}")
    finally:
        os._exit(0)         # whatever happens, even a say() that fails: never back into the caller's code


@dataclasses.dataclass
class CrashResult:
    iterations: int = 0
    acked_puts: int = 0
    records_verified: int = 0
    writer_finished: int = 0          # iterations where the kill came after the writer was done
    writer_ready: int = 0             # iterations whose writer opened the store (said R) before the kill
    torn_records_skipped: int = 0
    failures: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def run(path: str, iterations: int, seed: int = 0, image_size: int = 4 << 20, max_delay_s: float = 0.012,
        fresh: bool = True) -> CrashResult:
    """Run the iterations on the image (or device) at path; fresh: create and format it first."""
    if fresh:
        if not os.path.exists(path):
            create_image(path, image_size)
        format_device(path, force=True)
    rng = random.Random(seed)
    res = CrashResult()
    held: dict[tuple[int, int], int] = {}      # (iteration, sid) -> deltas the last check found
    started = time.perf_counter()
    delay_cap = max_delay_s
    for it in range(iterations):
        to_delete = sorted(s for s in held if s[0] <= it - 2)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _writer(path, it, to_delete, w)
        os.close(w)
        # Kills that keep coming before the deletes would let old sessions pile up until the
        # device is full: past a bound, this writer gets to finish its deletes first.
        wait_for = b"DD\n" if len(to_delete) > 2 * len(sessions()) else b"R\n"
        lines = _kill_at_random(pid, r, rng, delay_cap, wait_for)
        os.close(r)
        res.iterations += 1
        finished = res.writer_finished
        problems = _check(path, it, lines, held, res)
        # Keep the kills landing mid-work on a device of any speed: a writer that got done
        # first shortens the window, one that was cut lengthens it back.
        delay_cap = delay_cap * 0.7 if res.writer_finished > finished else min(max_delay_s, delay_cap * 1.05)
        res.failures += [f"iteration {it}: {p}" for p in problems]
        if len(res.failures) > 20:
            break
    res.seconds = time.perf_counter() - started
    return res


def _kill_at_random(pid: int, r: int, rng: random.Random, max_delay_s: float, wait_for: bytes) -> list[str]:
    """Wait for the writer to say wait_for (most of the time), sleep a random while, SIGKILL it."""
    buf = b""
    if wait_for != b"R\n" or rng.random() < 0.9:   # else: kill during open and recovery
        deadline = time.monotonic() + 10
        while wait_for not in buf and b"E " not in buf and time.monotonic() < deadline:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            buf += chunk
    time.sleep(rng.uniform(0, max_delay_s))
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    while chunk := os.read(r, 65536):
        buf += chunk
    return buf.decode().splitlines()


def _check(path, it, lines, held, res: CrashResult) -> list[str]:
    put_started, put_acked, del_started, del_acked = {}, {}, set(), set()
    problems = []
    for line in lines:
        f = line.split()
        if f[0] == "S":
            put_started[(it, int(f[1]))] = int(f[2]) + 1
        elif f[0] == "A":
            put_acked[(it, int(f[1]))] = int(f[2]) + 1
        elif f[0] == "DS":
            del_started.add((int(f[1]), int(f[2])))
        elif f[0] == "DA":
            del_acked.add((int(f[1]), int(f[2])))
        elif f[0] == "E":
            problems.append(f"the writer failed: {line[2:]}")
        elif f[0] == "R":
            res.writer_ready += 1
        elif f[0] == "DD":
            pass
        elif f[0] == "F":
            res.writer_finished += 1
    res.acked_puts += sum(put_acked.values())
    with LogStore(path, **STORE_OPTIONS) as store:
        res.torn_records_skipped += store.counters["torn_records_skipped"]
        bounds = {s: (n, n) for s, n in held.items()}
        reported = set()
        for s in sessions():
            bounds[(it, s)] = (put_acked.get((it, s), 0), put_started.get((it, s), 0))
        for s, (lo, hi) in bounds.items():
            snap = store.restore(key_of(*s))
            if s in del_started:
                if snap is None:
                    held.pop(s, None)
                    continue
                if s in del_acked:
                    problems.append(f"session {s} was deleted (acknowledged) but restores")
                    reported.add(key_of(*s))
                    continue
            n = _deltas_in(s, snap)
            if n is None:
                problems.append(f"session {s}: the restored bytes are no prefix of its deltas")
                reported.add(key_of(*s))
            elif not lo <= n <= hi:
                problems.append(f"session {s}: restores {n} deltas, expected {lo}..{hi}")
                reported.add(key_of(*s))
            else:
                res.records_verified += n
                if n:
                    held[s] = n
                else:
                    held.pop(s, None)
        # every iteration, not only the one that deleted it: a session whose delete was
        # acknowledged earlier (or that never held anything) must not come back
        live = {key_of(*s) for s in held}
        problems += [f"a session that holds nothing (deleted, or never written) is listed: {key.hex()[:16]}"
                     for key in store.list() if key not in live and key not in reported]
    return problems


def _deltas_in(s: tuple[int, int], snap) -> int | None:
    """How many of the session's deltas snap holds, or None if it is not exactly a prefix of them."""
    if snap is None:
        return 0
    n, start = 0, 0
    while start < len(snap.payload) and n < PUTS_PER_SESSION:
        start = delta_of(*s, n, start).tokens[1]
        n += 1
    ok = (start == len(snap.payload) and snap.tokens == (0, start)
          and snap.payload == expected_chain(*s, n))
    return n if ok else None
