"""The shared-memory SPSC ring (native/ring.h) for the control plane and tests.

Python creates rings, attaches to them, reads their counters and, in tests,
moves records in bulk; the data path itself moves records in C. Names map to
/dev/shm/dp-<name>.

One process produces and one consumes. A handle that enqueues acts as the
producer, one that dequeues or waits as the consumer: it takes the role if
it is free or its holder died, and raises RingBusy if another live process
holds it (two producers would write the same slots).
"""
from __future__ import annotations

import errno
import os

from ._dataplane import ffi, lib

WAIT_MODES = {"spin": lib.DP_WAIT_SPIN, "yield": lib.DP_WAIT_YIELD, "sleep": lib.DP_WAIT_SLEEP}
ROLES = {"observer": lib.DP_ROLE_OBSERVER, "producer": lib.DP_ROLE_PRODUCER, "consumer": lib.DP_ROLE_CONSUMER}
MAX_BURST = 1 << 20


class RingError(RuntimeError):
    pass


class RingBusy(RingError):
    """The role is held by a live process."""


class RingNotReady(RingError):
    """The segment is not a ring yet: being created, or its creator died before it was one."""


def _raise(code: int, name: str, what: str):
    code = -code
    if code == errno.ENOENT:
        raise FileNotFoundError(f"no ring named {name!r} (/dev/shm/dp-{name}): create it first")
    if code == errno.EEXIST:
        raise FileExistsError(f"a ring named {name!r} already exists: attach to it, or unlink it first")
    if code == errno.EBUSY:
        raise RingBusy(f"ring {name!r}: the {what} role is held by a live process")
    if code == errno.EINVAL:
        raise ValueError(f"ring {name!r}: invalid argument for {what} (name without '/', slot size a "
                         "multiple of 8, capacity a power of two >= 2)")
    if code == errno.EPROTO:
        raise RingError(f"/dev/shm/dp-{name} is not a ring of this version")
    if code == errno.EAGAIN:
        raise RingNotReady(f"/dev/shm/dp-{name} is not a ring yet: being created (retry), or its creator "
                           "died first (unlink it)")
    raise OSError(code, f"ring {name!r}: {what}: {os.strerror(code)}")


class Ring:
    def __init__(self, ptr, name: str):
        self._ptr, self.name = ptr, name
        st = self.stats()
        self.slot_size, self.capacity = st["slot_size"], st["capacity"]

    @classmethod
    def create(cls, name: str, slot_size: int, capacity: int, wait: str = "spin", role: str = "observer") -> "Ring":
        if wait not in WAIT_MODES:
            raise ValueError(f"wait must be one of {sorted(WAIT_MODES)}, not {wait!r}")
        if role not in ROLES:        # before anything exists: a bad role left a segment behind
            raise ValueError(f"role must be one of {sorted(ROLES)}, not {role!r}")
        if not (0 < slot_size < 1 << 31 and 0 < capacity < 1 << 31):
            raise ValueError(f"slot_size and capacity must be positive 31-bit integers")
        err = ffi.new("int *")
        ptr = lib.dp_ring_create(name.encode(), slot_size, capacity, WAIT_MODES[wait], err)
        if ptr == ffi.NULL:
            _raise(err[0], name, "create")
        ring = cls(ptr, name)
        if role != "observer":
            rc = lib.dp_ring_claim(ptr, ROLES[role])
            if rc:
                ring.close()
                _raise(rc, name, role)
        return ring

    @classmethod
    def attach(cls, name: str, role: str = "observer") -> "Ring":
        if role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, not {role!r}")
        err = ffi.new("int *")
        ptr = lib.dp_ring_attach(name.encode(), ROLES[role], err)
        if ptr == ffi.NULL:
            _raise(err[0], name, role)
        return cls(ptr, name)

    @property
    def ptr(self):
        """The C handle, for native loops (router, benchmarks) in this process."""
        if self._ptr is None:
            raise RingError(f"ring {self.name!r} is closed")
        return self._ptr

    def enqueue(self, records, rec_len: int | None = None) -> int:
        """Enqueue consecutive records of rec_len bytes (default: slot size) from a
        bytes-like object; all that fit are published at once. Returns how many."""
        rec_len = self.slot_size if rec_len is None else rec_len
        if not 0 < rec_len <= self.slot_size:
            raise ValueError(f"record length {rec_len} does not fit a {self.slot_size}-byte slot")
        buf = ffi.from_buffer(records)
        if len(buf) % rec_len:
            raise ValueError(f"{len(buf)} bytes is not a whole number of {rec_len}-byte records")
        n = len(buf) // rec_len
        if n > MAX_BURST:
            raise ValueError(f"{n} records in one call exceeds {MAX_BURST}")
        k = lib.dp_ring_enqueue_copy(self.ptr, buf, n, rec_len, rec_len)
        if k < 0:
            _raise(k, self.name, "producer")
        return k

    def dequeue(self, max_records: int) -> bytes:
        """Up to max_records records, as slot_size-byte records back to back."""
        if not 0 <= max_records <= MAX_BURST:
            raise ValueError(f"max_records must be 0..{MAX_BURST}, not {max_records}")
        out = ffi.new("uint8_t[]", max_records * self.slot_size or 1)
        k = lib.dp_ring_dequeue_copy(self.ptr, out, max_records)
        if k < 0:
            _raise(k, self.name, "consumer")
        return bytes(ffi.buffer(out, k * self.slot_size))

    def act(self, role: str) -> "Ring":
        """This handle may act as role ("producer" or "consumer"): the role is this process's
        already, or free or its holder dead (taken, released at close); RingBusy if a live process
        holds it. For a native loop handed the ring, whose inline calls do not check."""
        if role not in ("producer", "consumer"):
            raise ValueError(f"role must be producer or consumer, not {role!r}")
        rc = lib.dp_ring_act(self.ptr, ROLES[role])
        if rc:
            _raise(rc, self.name, role)
        return self

    def wait(self, timeout_s: float) -> int:
        """Block (per the ring's wait mode) until a record is readable; readable count or 0."""
        self.act("consumer")
        return lib.dp_ring_wait(self.ptr, int(timeout_s * 1e9) if timeout_s >= 0 else -1)

    def stats(self) -> dict:
        st = ffi.new("struct dp_ring_stats *")
        lib.dp_ring_get_stats(self.ptr, st)
        return {k: getattr(st, k) for k in ("capacity", "slot_size", "enqueued", "dequeued", "depth",
                                            "full_events", "refused", "sleeps", "sleep_timeouts", "producer_pid",
                                            "consumer_pid")}

    def close(self):
        if self._ptr is not None:
            lib.dp_ring_close(self._ptr)
            self._ptr = None

    def unlink(self):
        unlink(self.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


def unlink(name: str) -> None:
    rc = lib.dp_ring_unlink(name.encode())
    if rc and rc != -errno.ENOENT:
        _raise(rc, name, "unlink")
