"""A loop device over an image file, for tests and benchmarks (root), always detached.

    with loop_device("store.img", sector_size=512) as dev:   # "/dev/loopN"
        LogStore(dev) ...

losetup(8) attaches with direct I/O on the backing file, so a write that the
loop device completes has reached the backing file's device, as on a disk.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

from .errors import DeviceError


def cache_flushes(dev: str) -> int:
    """Cache flushes the block device completed (/sys/block/<dev>/stat, its 16th field): an
    fdatasync of it issues one, an O_DIRECT write none. What tests of durability count."""
    with open(f"/sys/block/{os.path.basename(dev)}/stat") as f:
        return int(f.read().split()[15])


@contextlib.contextmanager
def loop_device(image: str, sector_size: int = 512):
    if os.geteuid() != 0:
        raise DeviceError("a loop device needs root: run with sudo")
    if not shutil.which("losetup"):
        raise DeviceError("losetup is missing: install util-linux")
    r = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", "--sector-size", str(sector_size), image],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise DeviceError(f"losetup could not attach {image}: {r.stderr.strip()}")
    dev = r.stdout.strip()
    try:
        yield dev
    finally:
        # A busy device is detached when its last user closes it (losetup sets autoclear).
        subprocess.run(["losetup", "--detach", dev], capture_output=True)
