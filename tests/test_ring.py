"""The shared-memory SPSC ring between real processes: nothing lost, duplicated or reordered."""
import contextlib
import itertools
import multiprocessing
import os
import signal
import struct
import time

import pytest

from datapath import records
from datapath import ring as ringmod
from datapath._dataplane import ffi, lib
from datapath.ring import Ring, RingBusy
from datapath.router import Router

SEC = 1_000_000_000
_names = itertools.count()
ctx = multiprocessing.get_context("fork")


@pytest.fixture
def ring_name():
    name = f"test{os.getpid()}-{next(_names)}"
    yield name
    ringmod.unlink(name)


def produce(name, first, n, burst, rec_len, q=None):
    with Ring.attach(name, "producer") as r:
        done = lib.dp_seq_produce(r.ptr, first, n, burst, rec_len, 60 * SEC)
    if q:
        q.put(done)


def consume(name, first, n, burst, rec_len, q):
    errors = ffi.new("uint64_t *")
    with Ring.attach(name, "consumer") as r:
        done = lib.dp_seq_consume(r.ptr, first, n, burst, rec_len, 60 * SEC, errors)
    q.put((done, errors[0]))


@pytest.mark.slow
@pytest.mark.parametrize("wait", ["spin", "sleep"])
def test_ten_million_records_between_two_processes(ring_name, wait):
    n = 10_000_000
    Ring.create(ring_name, 32, 1024, wait=wait).close()
    q = ctx.Queue()
    cons = ctx.Process(target=consume, args=(ring_name, 0, n, 32, 32, q))
    prod = ctx.Process(target=produce, args=(ring_name, 0, n, 32, 32, q))
    cons.start()
    prod.start()
    results = [q.get(timeout=120), q.get(timeout=120)]
    prod.join(10)
    cons.join(10)
    assert n in results  # the producer's count
    assert (n, 0) in results, results  # the consumer's: all records, no sequence error
    with Ring.attach(ring_name) as r:
        st = r.stats()
    assert st["enqueued"] == st["dequeued"] == n and st["depth"] == 0


@pytest.mark.parametrize("capacity", [2, 4, 8, 64, 1024])
def test_wrap_around_at_every_boundary(ring_name, capacity):
    errors = ffi.new("uint64_t *")
    with Ring.create(ring_name, 16, capacity, role="producer") as r:
        seq = 0
        # every burst size from 1 to capacity, so the tail crosses the end at every offset
        for burst in range(1, capacity + 1):
            for _ in range(3):
                assert lib.dp_seq_produce(r.ptr, seq, burst, burst, 16, SEC) == burst
                assert lib.dp_seq_consume(r.ptr, seq, burst, capacity, 16, SEC, errors) == burst
                assert errors[0] == 0, (burst, seq)
                seq += burst
        assert r.stats()["enqueued"] == seq and r.stats()["full_events"] == 0


def test_full_and_empty_counted_exactly(ring_name):
    with Ring.create(ring_name, 8, 8, role="producer") as r:
        assert r.dequeue(4) == b""
        recs = b"".join(struct.pack("<Q", i) for i in range(13))
        assert r.enqueue(recs) == 8                         # 5 refused
        assert r.enqueue(struct.pack("<Q", 99)) == 0        # 1 refused
        st = r.stats()
        assert (st["full_events"], st["refused"], st["depth"]) == (2, 6, 8)
        out = r.dequeue(3)
        assert out == recs[:24]
        assert r.enqueue(recs[:40]) == 3                    # 2 refused, never overwrites
        st = r.stats()
        assert (st["full_events"], st["refused"]) == (3, 8)
        rest = r.dequeue(100)
        assert rest == recs[24:64] + recs[:24]
        assert r.dequeue(1) == b"" and r.stats()["depth"] == 0


def test_partial_record_length_copies_only_that(ring_name):
    with Ring.create(ring_name, 64, 4, role="producer") as r:
        assert r.enqueue(b"a" * 16 + b"b" * 16, rec_len=16) == 2
        out = r.dequeue(2)
        assert out[:16] == b"a" * 16 and out[64:80] == b"b" * 16


def slow_consumer(name, q):
    errors = ffi.new("uint64_t *")
    r = Ring.attach(name, "consumer")
    q.put("attached")
    lib.dp_seq_consume(r.ptr, 0, 1 << 40, 7, 16, 60 * SEC, errors)  # killed long before the end


@pytest.mark.slow
def test_consumer_killed_mid_stream(ring_name):
    total = 20_000_000
    Ring.create(ring_name, 16, 256).close()
    q = ctx.Queue()
    cons = ctx.Process(target=slow_consumer, args=(ring_name, q))
    cons.start()
    assert q.get(timeout=10) == "attached"
    with pytest.raises(RingBusy):
        Ring.attach(ring_name, "consumer")  # a live consumer holds the role
    prod_q = ctx.Queue()
    prod = ctx.Process(target=produce, args=(ring_name, 0, total, 16, 16, prod_q))
    prod.start()
    with Ring.attach(ring_name) as obs:
        deadline = time.monotonic() + 10
        while obs.stats()["dequeued"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
    os.kill(cons.pid, signal.SIGKILL)  # mid-stream: it has consumed some, the producer is still going
    cons.join(10)
    # the producer keeps working: it fills the ring, is told so, and its timeout bounds it
    with Ring.attach(ring_name) as obs:
        deadline = time.monotonic() + 10
        while obs.stats()["depth"] < 256 and time.monotonic() < deadline:
            time.sleep(0.01)
        st = obs.stats()
        assert st["depth"] == 256 and st["full_events"] > 0
        resume = st["dequeued"]
    assert 0 < resume < total
    # a new consumer takes the dead one's role and continues exactly where it released
    errors = ffi.new("uint64_t *")
    with Ring.attach(ring_name, "consumer") as r:
        got = lib.dp_seq_consume(r.ptr, resume, total - resume, 32, 16, 60 * SEC, errors)
    assert (got, errors[0]) == (total - resume, 0)
    assert prod_q.get(timeout=60) == total
    prod.join(10)


def whole_consume(name, commits, q):
    torn = ffi.new("uint64_t *")
    with Ring.attach(name, "consumer") as r:
        q.put("attached")
        ended = lib.dp_whole_consume(r.ptr, commits, 60 * SEC, torn)
    q.put((ended, torn[0]))


def test_a_commit_is_seen_whole(ring_name):
    """A commit of n records publishes them last to first, so a consumer on another core that
    sees the first sees all n: the worker takes a micro-batch as one (dp_lane_recv), never in
    two parts. The consumer peeks everything readable, as fast as it can, and counts the peeks
    that end inside a commit."""
    commits = 5_000_000   # published first to last instead, 1-45 torn peeks a million here
    Ring.create(ring_name, 16, 64).close()
    q = ctx.Queue()
    cons = ctx.Process(target=whole_consume, args=(ring_name, commits, q))
    cons.start()
    assert q.get(timeout=10) == "attached"
    with Ring.attach(ring_name, "producer") as r:
        made = lib.dp_whole_produce(r.ptr, commits, 60 * SEC)
    ended, torn = q.get(timeout=90)
    cons.join(10)
    assert made == ended == commits
    assert torn == 0


def die_inside_a_commit(name, published):
    r = Ring.attach(name, "producer")
    assert lib.dp_ring_torn_commit(r.ptr, 4, published) == 4
    os._exit(0)   # no close: the role and the torn commit are left as a killed producer leaves them


def test_a_producer_killed_inside_a_commit_is_undone_by_its_successor(ring_name):
    """A producer killed between the sequence words of a commit (its later slots published, the
    first not) leaves those slots looking published past the producer's index. Its successor
    clears them when it takes the role: otherwise its next record would bring the dead one's
    three along with it, read as published."""
    with Ring.create(ring_name, 16, 8, role="consumer") as cons:
        with Ring.attach(ring_name, "producer") as prod:
            assert prod.enqueue(b"a" * 16) == 1
        assert cons.dequeue(8) == b"a" * 16
        p = ctx.Process(target=die_inside_a_commit, args=(ring_name, 3))
        p.start()
        p.join(10)
        assert p.exitcode == 0
        assert cons.dequeue(8) == b""                   # its first slot unpublished: nothing readable
        with Ring.attach(ring_name, "producer") as prod:   # taken over from the dead process
            assert prod.enqueue(b"b" * 16) == 1
            assert cons.dequeue(8) == b"b" * 16
            assert prod.enqueue(b"c" * 16 + b"d" * 16) == 2
            assert cons.dequeue(8) == b"c" * 16 + b"d" * 16
        st = cons.stats()
        assert st["enqueued"] == st["dequeued"] == 4 and st["depth"] == 0


@pytest.mark.parametrize("read_first", [True, False], ids=["read-before-the-successor", "read-after"])
def test_a_producer_killed_after_publishing_a_commit_whole_leaves_it_standing(ring_name, read_first):
    """Killed after the last sequence word of a commit, before its index moved: the commit is
    published (the consumer may read and release it at once), so it stands, and the successor
    starts past it. Taking the stale index instead, the successor rewrote slots already read (its
    first records never delivered) and, its index below the consumer's, counted free room past
    the capacity: 12 records placed in an 8-slot ring, then the ring wedged for good (found by
    review)."""
    with Ring.create(ring_name, 16, 8, role="consumer") as cons:
        p = ctx.Process(target=die_inside_a_commit, args=(ring_name, 4))
        p.start()
        p.join(10)
        assert p.exitcode == 0
        dead = b"\xdd" * 16 * 4
        if read_first:
            assert cons.dequeue(8) == dead
        with Ring.attach(ring_name, "producer") as prod:   # taken over from the dead process
            if not read_first:
                assert cons.dequeue(8) == dead
            for lap in range(6):                          # laps past the dead commit's slots
                recs = bytes([lap]) * 16 * 3
                assert prod.enqueue(recs) == 3
                assert cons.dequeue(8) == recs
            assert prod.enqueue(b"z" * 16 * 9) == 8        # full at the capacity, not past it
            assert cons.dequeue(16) == b"z" * 16 * 8
        st = cons.stats()
        assert st["enqueued"] == st["dequeued"] == 4 + 18 + 8 and st["depth"] == 0


def hold(name, role, q, release):
    r = Ring.attach(name, role)        # noqa: F841 (held, never closed)
    q.put("holding")
    release.wait(30)
    os._exit(0)                        # dies holding the role: its successor takes it over


def try_attach(name, role, q):
    try:
        Ring.attach(name, role).close()
        q.put("took it")
    except RingBusy:
        q.put("busy")


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_a_handle_cannot_act_in_a_role_another_live_process_holds(ring_name, role):
    """An observer handle that enqueues (dequeues, waits) acts as the producer (consumer): with a
    live process holding that role it is refused, RingBusy, and moves nothing; once the holder
    has died (the role still naming it) it takes the role over, and holds it until it closes.
    Unchecked, a second producer wrote the slots the first was writing."""
    q, release = ctx.Queue(), ctx.Event()
    with Ring.create(ring_name, 16, 8) as obs:
        act = (lambda: obs.enqueue(b"x" * 16)) if role == "producer" else (lambda: obs.dequeue(8))
        p = ctx.Process(target=hold, args=(ring_name, role, q, release))
        p.start()
        try:
            assert q.get(timeout=10) == "holding"
            with pytest.raises(RingBusy, match=role):
                act()
            if role == "consumer":
                with pytest.raises(RingBusy, match=role):
                    obs.wait(0)
            st = obs.stats()
            assert (st["enqueued"], st["dequeued"], st[f"{role}_pid"]) == (0, 0, p.pid)
        finally:
            release.set()
            p.join(10)
        assert p.exitcode == 0
        act()                                     # its holder gone: taken over
        assert obs.stats()[f"{role}_pid"] == os.getpid()
        other = ctx.Process(target=try_attach, args=(ring_name, role, q))
        other.start()
        assert q.get(timeout=10) == "busy"
        other.join(10)
    with Ring.attach(ring_name) as obs:
        assert obs.stats()[f"{role}_pid"] == 0, "released at close"


def test_acting_under_a_role_this_process_holds_neither_takes_nor_releases_it(ring_name):
    """An observer handle that enqueues while another handle of this process is the producer acts
    under that handle's role: it moves records, and its close leaves the role held (taken as its
    own, its close released the role under the live producer handle, and another process could
    attach as a second producer)."""
    q, release = ctx.Queue(), ctx.Event()
    with Ring.create(ring_name, 16, 8, role="producer") as prod:
        with Ring.attach(ring_name) as obs:
            assert obs.enqueue(b"a" * 16) == 1
            assert obs.dequeue(8) == b"a" * 16
        st = prod.stats()
        assert (st["producer_pid"], st["consumer_pid"]) == (os.getpid(), 0), "the producer's role stays; the consumer's, taken, was released"
        other = ctx.Process(target=try_attach, args=(ring_name, "producer", q))
        other.start()
        assert q.get(timeout=10) == "busy"
        other.join(10)
        assert prod.enqueue(b"b" * 16) == 1


def test_attaching_a_role_this_process_holds_neither_takes_it_over_nor_releases_it(ring_name):
    """A second handle attached (or claimed) as the producer this process is already: taken as a
    free role, its take-over steps cleared the slots of the live handle's commit in progress and
    its close gave the role away, so another process attached as a second producer (a review's
    probe)."""
    q = ctx.Queue()
    with Ring.create(ring_name, 16, 8, role="producer") as prod:
        Ring.attach(ring_name, "producer").close()
        assert prod.stats()["producer_pid"] == os.getpid()
        other = ctx.Process(target=try_attach, args=(ring_name, "producer", q))
        other.start()
        assert q.get(timeout=10) == "busy"
        other.join(10)


def test_a_router_is_refused_an_input_another_live_process_consumes(ring_name):
    """Router.add_input takes the consumer's role: handed a ring attached as an observer (as
    dataplane.md's example had it), the router drained it holding no role, and a second consumer
    could attach beside it (a review's probe)."""
    q, release = ctx.Queue(), ctx.Event()
    with Ring.create(ring_name, records.CHUNK.itemsize, 8, role="producer") as r, Router() as router:
        p = ctx.Process(target=hold, args=(ring_name, "consumer", q, release))
        p.start()
        try:
            assert q.get(timeout=10) == "holding"
            with pytest.raises(RingBusy, match="consumer"):
                router.add_input(Ring.attach(ring_name))
        finally:
            release.set()
            p.join(10)
        router.add_input(Ring.attach(ring_name))       # its holder gone: the router's process takes it
        assert r.stats()["consumer_pid"] == os.getpid()


# dp_ring_hdr's line 3 (native/ring.h): the futex word and the sleeping flag, u32 each
_FUTEX, _SLEEPING = 192, 196


def _header_word(name, off):
    with open(f"/dev/shm/dp-{name}", "rb") as f:
        f.seek(off)
        return struct.unpack("<I", f.read(4))[0]


def sleeper(name, q):
    with Ring.attach(name, "consumer") as r:
        q.put("waiting")
        n = r.wait(10.0)
        q.put((n, r.stats()["sleeps"]))


@contextlib.contextmanager
def _a_sleeper(ring_name):
    """A sleep-mode ring (this process its producer) and a consumer process asleep on it: (ring,
    the consumer's queue, the process)."""
    with Ring.create(ring_name, 8, 16, wait="sleep", role="producer") as r:
        q = ctx.Queue()
        p = ctx.Process(target=sleeper, args=(ring_name, q))
        p.start()
        assert q.get(timeout=10) == "waiting"
        deadline = time.monotonic() + 10   # wait until it is in the futex, past spinning and yielding
        while r.stats()["sleeps"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.stats()["sleeps"] >= 1
        yield r, q, p


def test_sleeping_consumer_is_woken(ring_name):
    """The commit wakes it: its futex wait ends by the producer's wake, not by its timeout. The
    wait re-checks every 100 ms, so without the wake the record was still taken, and this test
    passed with the futex word's move checked too (a review's mutation, the FUTEX_WAKE removed)."""
    with _a_sleeper(ring_name) as (r, q, p):
        before = r.stats()["sleep_timeouts"]
        assert r.enqueue(b"\1" * 8) == 1
        n, sleeps = q.get(timeout=10)
        p.join(10)
        assert n == 1 and sleeps >= 1 and r.stats()["sleep_timeouts"] == before, "woken by its timeout"


def test_a_consumer_killed_asleep_leaves_its_successor_awake(ring_name):
    """Its sleeping flag stayed set under a successor that only polls, and every commit after made
    a futex wake syscall for no one (a review's probe: 1,000 commits, 1,000 wakes)."""
    with _a_sleeper(ring_name) as (r, q, p):
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert _header_word(ring_name, _SLEEPING) == 1
        with Ring.attach(ring_name, "consumer"):
            assert _header_word(ring_name, _SLEEPING) == 0
            before = _header_word(ring_name, _FUTEX)
            assert r.enqueue(b"\1" * 8) == 1
            assert _header_word(ring_name, _FUTEX) == before, "no wake for a consumer that is not asleep"


def test_bad_input_is_a_clear_error(ring_name):
    with pytest.raises(FileNotFoundError, match="create it first"):
        Ring.attach(f"missing-{ring_name}")
    for kw in (dict(slot_size=12, capacity=8), dict(slot_size=8, capacity=6), dict(slot_size=8, capacity=1)):
        with pytest.raises(ValueError):
            Ring.create(ring_name, **kw)
    with pytest.raises(ValueError):
        Ring.create("a/b", 8, 8)
    with pytest.raises(ValueError, match="wait"):
        Ring.create(ring_name, 8, 8, wait="nap")
    with Ring.create(ring_name, 16, 8) as r:
        with pytest.raises(FileExistsError):
            Ring.create(ring_name, 16, 8)
        with pytest.raises(ValueError, match="does not fit"):
            r.enqueue(b"x" * 32, rec_len=32)
        with pytest.raises(ValueError, match="whole number"):
            r.enqueue(b"x" * 20)
        with pytest.raises(ValueError):
            r.dequeue(-1)
        with pytest.raises(ValueError):
            r.dequeue(1 << 40)
        with pytest.raises(ValueError, match="role"):
            Ring.attach(ring_name, "boss")
    with pytest.raises(ringmod.RingError, match="closed"):
        r.enqueue(b"x" * 16)


def _rss_kib(path: str) -> list[int]:
    """Rss of each mapping of `path` in this process (from /proc/self/smaps)."""
    out, inside = [], False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0] and ":" not in line.split(" ", 1)[0]:
            inside = line.rstrip().endswith(path)
        elif inside and line.startswith("Rss:"):
            out.append(int(line.split()[1]))
    return out


# dp_ring_hdr's first line (native/ring.h): magic, version, slot_size, capacity, mask, wait_mode,
# stride (u32 each), then data_offset and map_size (u64, from byte 32)
_HDR_FIELD = {"slot_size": (8, "<I"), "capacity": (12, "<I"), "mask": (16, "<I"), "stride": (24, "<I"),
              "data_offset": (32, "<Q")}


@pytest.mark.parametrize("field,value", [("mask", 0xFFFF), ("capacity", 24), ("stride", 28), ("stride", 0),
                                         ("slot_size", 12), ("data_offset", 2**64 - 4096), ("data_offset", 8),
                                         ("data_offset", 1000)])
def test_a_header_whose_geometry_is_not_create_s_is_refused_at_attach(ring_name, field, value):
    """Attach checks the geometry before it touches a slot: a mask past the capacity indexed past the
    mapping, a stride off the line misaligned the sequence words, a data offset near 2^64 wrapped
    the bounds check."""
    Ring.create(ring_name, 16, 8).close()
    off, fmt = _HDR_FIELD[field]
    with open(f"/dev/shm/dp-{ring_name}", "r+b") as f:
        f.seek(off)
        f.write(struct.pack(fmt, value))
    with pytest.raises(ringmod.RingError, match="not a ring of this version"):
        Ring.attach(ring_name, "consumer")


def test_a_segment_that_is_no_ring_yet_is_refused_as_not_ready_and_never_faulted_in(ring_name):
    """Empty (shm_open'd, not yet sized) or without its magic (create writes it last): not ready,
    which a caller may retry, not "not a ring of this version". Checked from the header alone:
    attach mapped the whole segment with MAP_POPULATE first, and a sparse 256 MiB one was left
    allocated in /dev/shm (a review's probe)."""
    path = f"/dev/shm/dp-{ring_name}"
    with open(path, "wb"):
        pass
    with pytest.raises(ringmod.RingNotReady, match="not a ring yet"):
        Ring.attach(ring_name, "consumer")
    os.truncate(path, 256 << 20)
    with pytest.raises(ringmod.RingNotReady):
        Ring.attach(ring_name)
    assert os.stat(path).st_blocks * 512 <= 4096, "the header's page at most"


def test_a_ring_is_resident_from_the_start(ring_name):
    """Every page of a ring is faulted in when it is created or attached, not on the data
    path's first lap (where each fault cost 35-58 us in these VMs)."""
    slot, cap = 640, 1024
    with Ring.create(ring_name, slot, cap, role="producer") as r:
        path = f"/dev/shm/dp-{ring_name}"
        with Ring.attach(ring_name, role="consumer"):
            rss = _rss_kib(path)
        assert len(rss) == 2
        assert all(kib * 1024 >= slot * cap for kib in rss), rss


def test_a_private_ring_has_both_ends_here_and_no_name():
    """A shadow stage's ring (dp_ring_create_private): unlinked at once, both roles this process's;
    records go round through the one handle."""
    err = ffi.new("int *")
    before = set(os.listdir("/dev/shm"))
    r = lib.dp_ring_create_private(64, 8, lib.DP_WAIT_SPIN, lib.DP_ROLE_PRODUCER, err)
    assert r != ffi.NULL and err[0] == 0
    try:
        assert set(os.listdir("/dev/shm")) == before, "no name left behind"
        st = ffi.new("struct dp_ring_stats *")
        lib.dp_ring_get_stats(r, st)
        assert st.producer_pid == st.consumer_pid == os.getpid() and st.capacity == 8
        assert lib.dp_ring_enqueue_copy(r, b"x" * 64 * 3, 3, 64, 64) == 3
        out = ffi.new("uint8_t[]", 64 * 8)
        assert lib.dp_ring_dequeue_copy(r, out, 8) == 3 and bytes(out[0:64]) == b"x" * 64
    finally:
        lib.dp_ring_close(r)


@pytest.mark.root
def test_a_ring_too_large_for_dev_shm_is_refused_at_create_not_a_sigbus_later():
    """/dev/shm (a 1 MiB tmpfs here, in a mount namespace of its own) cannot hold the ring:
    create says ENOSPC. Before, ftruncate reserved nothing, create succeeded, and the first
    touch of an unbacked page killed the process with SIGBUS."""
    import subprocess
    import sys
    script = ("import errno, sys\n"
              "from datapath.ring import Ring\n"
              "try:\n"
              "    r = Ring.create('test-too-big', 4096, 1024, role='producer')\n"
              "except OSError as e:\n"
              "    sys.exit(0 if e.errno == errno.ENOSPC else 3)\n"
              "r.enqueue(bytes(4096 * 1024))\n"
              "sys.exit(4)\n")
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} -c \"$0\"", script]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, (done.returncode, done.stderr[-500:])


def test_a_bad_role_leaves_no_segment_behind():
    name = f"test-role-{os.getpid()}"
    with pytest.raises(ValueError, match="role must be one of"):
        Ring.create(name, 16, 8, role="boss")
    Ring.create(name, 16, 8).close()               # the name is free: nothing was created
    ringmod.unlink(name)
