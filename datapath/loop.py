"""One native thread polling several data-path stages in turn (native/loop.h).

    loop = PollLoop(cpu=1)
    loop.add(_dataplane, "dp_router_poll", router.handle, owner=router)
    loop.add(_ingress, "dp_consumer_poll", consumer.ptr, owner=consumer)
    loop.start() ... loop.stop()
"""
from __future__ import annotations

import os

from ._dataplane import ffi, lib


class PollLoop:
    def __init__(self, cpu: int | None = None, yield_after: int = 256):
        self._l = ffi.new("struct dp_loop *")
        self._l.cpu = -1 if cpu is None else cpu
        self._l.yield_after = yield_after
        self._keep = []   # the stages' owners stay alive while the loop runs

    def add(self, module, fn_name: str, arg, owner=None):
        """Stage: `fn_name` of the cffi extension `module` (uint32_t fn(T *)), called with `arg` (a T *).
        `owner` (the Python object arg belongs to) is kept alive as long as the loop is."""
        if self._l.running:
            raise RuntimeError("add stages before start()")
        if self._l.n >= lib.DP_LOOP_MAX_STAGES:
            raise ValueError(f"at most {lib.DP_LOOP_MAX_STAGES} stages")
        fn = module.ffi.addressof(module.lib, fn_name)
        self._l.fn[self._l.n] = int(module.ffi.cast("uintptr_t", fn))
        self._l.arg[self._l.n] = int(module.ffi.cast("uintptr_t", arg))
        self._l.n += 1
        self._keep.append((arg, owner))

    def start(self):
        if self._l.n == 0:
            raise RuntimeError("cannot start the poll loop: it has no stages (add them first)")
        rc = lib.dp_loop_start(self._l)
        if rc:
            raise RuntimeError(f"cannot start the poll loop"
                               f"{f' pinned to CPU {self._l.cpu}' if self._l.cpu >= 0 else ''}: {os.strerror(-rc)}")

    def stop(self):
        lib.dp_loop_stop(self._l)

    def stats(self) -> dict:
        return {"passes": self._l.passes, "busy_passes": self._l.busy_passes, "yields": self._l.yields}

    def __del__(self):
        self.stop()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
