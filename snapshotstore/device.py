"""Block-device backends: a regular file, a loop device, an NVMe or NVMe-oF namespace, or a
namespace of a remote NVMe/TCP target ("nvme-tcp://HOST:PORT/SUBNQN", snapshotstore/nvmetcp).

All I/O is O_DIRECT from page-aligned (mmap-allocated) buffers, in whole
blocks: a block device's are the larger of its logical and physical block
sizes (BLKSSZGET, BLKPBSZGET), a regular file's 4 KiB. Durability is
fdatasync after the writes.

With no device named, the store uses a sparse image file in a state
directory ($ZEROLAYER_STATE_DIR, else /var/lib/zerolayer as root, else
~/.local/state/zerolayer), created and formatted on first use.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import stat
import struct

from .errors import DeviceError
from .format import FILE_BLOCK_SIZE, LOG_START, MIN_LOG_BLOCKS

BLKSSZGET = 0x1268          # logical block size, int
BLKPBSZGET = 0x127B         # physical block size, unsigned int
BLKGETSIZE64 = 0x80081272   # device size in bytes, u64

DEFAULT_IMAGE_NAME = "snapshots.img"
DEFAULT_IMAGE_SIZE = 1 << 30


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory, as O_DIRECT needs."""
    return mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))


def state_dir() -> str:
    if os.environ.get("ZEROLAYER_STATE_DIR"):
        return os.environ["ZEROLAYER_STATE_DIR"]
    if os.geteuid() == 0:
        return "/var/lib/zerolayer"
    return os.path.join(os.path.expanduser("~"), ".local", "state", "zerolayer")


def default_image_path() -> str:
    return os.path.join(state_dir(), DEFAULT_IMAGE_NAME)


def create_image(path: str, size: int) -> None:
    """A sparse image file of size bytes (a multiple of 4 KiB, as large as a store's smallest at
    least: one of 256 KiB was made, then refused by the format); refuses to replace one."""
    least = (LOG_START + MIN_LOG_BLOCKS) * FILE_BLOCK_SIZE
    if size < least or size % FILE_BLOCK_SIZE:
        raise DeviceError(f"an image must be a multiple of 4 KiB and at least {least >> 10} KiB, not {size} bytes")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise DeviceError(f"{path} already exists: format it as it is, or remove it first") from None
    except OSError as e:
        raise DeviceError(f"cannot create {path}: {e.strerror}") from None
    try:
        os.ftruncate(fd, size)
    except (OSError, OverflowError) as e:   # too large (for the file system): leave no empty file behind
        os.close(fd)
        os.unlink(path)
        raise DeviceError(f"cannot make {path} {size} bytes: {getattr(e, 'strerror', None) or e}") from None
    os.close(fd)


LOOP_MAJOR = 7


def loop_backing_file(rdev: int) -> str | None:
    """The file a loop device (by its device number) reads and writes, if it is one and has one."""
    if os.major(rdev) != LOOP_MAJOR:
        return None
    try:
        with open(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}/loop/backing_file") as f:
            path = f.read().rstrip("\n")
    except OSError:
        return None                       # no file attached
    return None if path.endswith(" (deleted)") else path


class BlockDevice:
    """One open device: read and write whole blocks at block offsets, O_DIRECT."""

    def __init__(self, path: str, readonly: bool = False):
        self.path = path
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise DeviceError(f"{path} does not exist: name a block device or an image file "
                              f"(create one with `snapshotstore format {path} --size 1G`)") from None
        except OSError as e:
            raise DeviceError(f"cannot stat {path}: {e.strerror}") from None
        if not (stat.S_ISBLK(st.st_mode) or stat.S_ISREG(st.st_mode)):
            raise DeviceError(f"{path} is neither a block device nor a regular file")
        self.is_block = stat.S_ISBLK(st.st_mode)
        self.rdev = st.st_rdev if self.is_block else None
        self.backing_fd = -1             # a loop device's backing file, locked with it (lock)
        flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_DIRECT
        try:
            self.fd = os.open(path, flags)
        except OSError as e:
            raise DeviceError(f"cannot open {path} with O_DIRECT: {e.strerror}"
                              + (" (run as root)" if e.errno == 13 else "")) from None
        try:
            if self.is_block:
                logical = struct.unpack("i", fcntl.ioctl(self.fd, BLKSSZGET, b"\0" * 4))[0]
                physical = struct.unpack("I", fcntl.ioctl(self.fd, BLKPBSZGET, b"\0" * 4))[0]
                # A 512e disk (512-byte LBAs on 4 KiB sectors) rewrites a whole sector for a
                # 512-byte write: a torn one could take the acknowledged record sharing it, and
                # both superblock copies sat in one sector (found by review). Its own blocks then.
                self.block_size = max(logical, physical)
                self.logical_block_size = logical
                self.size = struct.unpack("Q", fcntl.ioctl(self.fd, BLKGETSIZE64, b"\0" * 8))[0]
            else:
                self.block_size, self.size = FILE_BLOCK_SIZE, st.st_size
                self.logical_block_size = FILE_BLOCK_SIZE
        except OSError as e:
            os.close(self.fd)
            raise DeviceError(f"cannot read the geometry of {path}: {e.strerror}") from None
        self.blocks = self.size // self.block_size

    def set_block_size(self, n: int) -> None:
        """I/O in n-byte blocks (a multiple of the logical block size): a store formatted in other
        blocks than this device's own (LogStore._open)."""
        if n % self.logical_block_size:
            raise DeviceError(f"{n}-byte blocks on {self.path}, whose logical blocks are {self.logical_block_size}")
        self.block_size, self.blocks = n, self.size // n

    def read_into(self, buf, block: int, nblocks: int) -> memoryview:
        """Read nblocks at block into the aligned buf; returns the filled view."""
        n = nblocks * self.block_size
        view = memoryview(buf)[:n]
        got = os.preadv(self.fd, [view], block * self.block_size)
        if got != n:
            raise DeviceError(f"short read at block {block} of {self.path}: {got} of {n} bytes")
        return view

    def write_from(self, buf, offset: int, block: int, nblocks: int) -> None:
        """Write nblocks from the aligned buf at byte offset (a multiple of the block size)."""
        n = nblocks * self.block_size
        view = memoryview(buf)[offset:offset + n]
        done = os.pwritev(self.fd, [view], block * self.block_size)
        if done != n:
            raise DeviceError(f"short write at block {block} of {self.path}: {done} of {n} bytes")

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def lock(self, shared: bool) -> None:
        """One store process per device: an exclusive flock (shared for read-only opens). A loop
        device's backing file is locked too: a flock is an inode's, and the loop device and its
        file are two, so a store opened through each (or through two loop devices of one file)
        wrote one log unaware of the other, and acknowledged puts were lost (found by review)."""
        how = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
        try:
            fcntl.flock(self.fd, how)
        except BlockingIOError:
            raise DeviceError(f"{self.path} is in use by another snapshot store process") from None
        backing = loop_backing_file(self.rdev) if self.rdev is not None else None
        if backing is None:
            return
        try:
            self.backing_fd = os.open(backing, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise DeviceError(f"cannot open {self.path}'s backing file {backing} to lock it: {e.strerror}") from None
        try:
            fcntl.flock(self.backing_fd, how)
        except BlockingIOError:
            raise DeviceError(f"{self.path}'s backing file {backing} is in use by another snapshot store "
                              f"process") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.backing_fd >= 0:
            os.close(self.backing_fd)
            self.backing_fd = -1


def open_device(path: str, readonly: bool = False):
    """A BlockDevice, or an NvmeTcpDevice for an nvme-tcp:// URL: the same interface."""
    from .nvmetcp.initiator import NvmeTcpDevice, is_url
    if is_url(path):
        return NvmeTcpDevice(path, readonly)
    return BlockDevice(path, readonly)
