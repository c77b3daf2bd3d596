"""`snapshotstore target` as a child process, for tests and benchmarks: start, read its URL, stop or kill.

    with TargetProcess("store.img") as t:        # a free port on 127.0.0.1
        LogStore(t.url) ...
        t.kill()                                # SIGKILL: a crashed target; TargetProcess(...) again restarts it
"""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import threading

from ..errors import DeviceError
from .target import DEFAULT_NQN

START_TIMEOUT_S = 30.0


class TargetProcess:
    def __init__(self, path: str, nqn: str = DEFAULT_NQN, listen: str = "127.0.0.1:0", *args: str):
        cmd = [sys.executable, "-m", "snapshotstore", "target", "--listen", listen, "--nqn", nqn, *args, path]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self.output: list[str] = []              # what it printed after its banner: a line per queue connected
        self.stderr = ""
        self._reader: threading.Thread | None = None
        # stderr drained from the start too: read only at exit, a target whose threads wrote more
        # than a pipe holds (64 KiB of tracebacks) would have blocked at its next write
        self._err_reader = threading.Thread(target=self._read_errors, name="target-stderr", daemon=True)
        self._err_reader.start()
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            ready = sel.select(START_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("serving "):
            self.kill()
            raise DeviceError(f"the target did not start: {(line + self.stderr).strip()[-500:]}")
        self.url = line.split()[-1]              # "serving PATH (...) at nvme-tcp://HOST:PORT/NQN"
        self.banner = line.strip()
        # drained as it comes: a full pipe would stall the target at its next line
        self._reader = threading.Thread(target=self._read_output, name="target-output", daemon=True)
        self._reader.start()

    def _read_output(self):
        for line in self.proc.stdout:
            self.output.append(line.rstrip("\n"))

    def _read_errors(self):
        for line in self.proc.stderr:
            self.stderr = (self.stderr + line)[-(64 << 10):]      # the end is what explains an exit

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM: a clean shutdown (connections closed, device synced and released)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait()
        self._reap()

    def _reap(self):
        if self._reader is not None:                 # it has exited: its stdout ends
            self._reader.join(10)
        elif self.proc.stdout and not self.proc.stdout.closed:
            self.output += self.proc.stdout.read().splitlines()
        self._err_reader.join(10)                   # its stderr ends too
        for f in (self.proc.stdout, self.proc.stderr):
            if f and not f.closed:
                f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
