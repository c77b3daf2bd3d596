"""Loading, attaching and test-running XDP programs (bcc compiles, libbpf links, pyroute2 reads).

Programs are loaded from the files in bpf/ with bpf/ on the include path.
An attachment is a BPF link (bpf_link_create, BPF_XDP) made in the
interface's own namespace, so it works for veths inside namespaces the caller
created. The link is held by a file descriptor of this process alone (a forked
child closes its copy), so the kernel detaches the program when the process
ends, however it ends: a SIGKILL, a SIGHUP, an OOM kill left a netlink
attachment on the device, dropping its port's traffic with nobody reading it
(found by review). XdpAttachment also detaches on exit, on error and on
Ctrl-C, and never outlives its namespace.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import platform
import threading

BPF_DIR = pathlib.Path(__file__).resolve().parent.parent / "bpf"

XDP_FLAGS_SKB_MODE = 1 << 1   # generic: works on any device, after the skb is built
XDP_FLAGS_DRV_MODE = 1 << 2   # native: in the driver (veth supports it)
BPF_XDP = 37                           # enum bpf_attach_type: an XDP link
CLONE_NEWNET = 0x40000000
XDP_MODES = {"native": XDP_FLAGS_DRV_MODE, "generic": XDP_FLAGS_SKB_MODE}
XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = range(5)
VERDICTS = {XDP_ABORTED: "XDP_ABORTED", XDP_DROP: "XDP_DROP", XDP_PASS: "XDP_PASS",
            XDP_TX: "XDP_TX", XDP_REDIRECT: "XDP_REDIRECT"}


class BpfUnavailable(RuntimeError):
    """bcc, kernel headers or a kernel feature is missing; the message says what to do."""


def import_bcc():
    try:
        import bcc
    except ImportError:
        raise BpfUnavailable(
            "bcc's Python module is not importable: install Debian's python3-bpfcc "
            "(apt-get install python3-bpfcc) and re-run `make setup` so the virtualenv sees it") from None
    return bcc


def kernel_headers() -> tuple[pathlib.Path | None, str]:
    """(headers directory bcc will use, one line on where it comes from)."""
    build = pathlib.Path("/lib/modules") / platform.release() / "build"
    if not build.exists():
        return None, (f"no kernel headers at {build}: run `make setup` (it installs the running kernel's "
                      "headers, or Debian's and links them there)")
    target = build.resolve()
    running = platform.release()
    if running in target.name:
        return target, f"running kernel's headers ({target})"
    return target, f"fallback headers {target.name} for kernel {running} (UAPI-only programs compile)"


def load(src: str, cflags=(), **bpf_kwargs):
    """Compile bpf/<src> with bcc. Returns the bcc.BPF object; errors say what to fix."""
    bcc = import_bcc()
    path = BPF_DIR / src
    if not path.is_file():
        raise FileNotFoundError(f"BPF source {path} does not exist")
    headers, note = kernel_headers()
    if headers is None:
        raise BpfUnavailable(note)
    try:
        return bcc.BPF(src_file=str(path).encode(), cflags=[f"-I{BPF_DIR}", *cflags], **bpf_kwargs)
    except Exception as e:  # bcc raises bare Exception on compile/load failure
        raise BpfUnavailable(f"bcc could not compile/load {src}: {e} (headers: {note})") from e


def load_xdp(src: str, fn_name: str, cflags=()):
    """Compile bpf/<src> and load function fn_name as an XDP program: (bpf, fn)."""
    b = load(src, cflags)
    return b, b.load_func(fn_name.encode(), import_bcc().BPF.XDP)


def _iproute(netns: str | None):
    from pyroute2 import IPRoute, NetNS
    return NetNS(netns) if netns else IPRoute()


_ATTACHED = {"xdp": "native", "xdpgeneric": "generic", "xdpoffload": "offload", "xdpmulti": "multi"}


class _LinkCreateOpts(ctypes.Structure):
    # struct bpf_link_create_opts's head (libbpf >= 0.2): sz, then flags (an XDP link: its mode)
    _fields_ = [("sz", ctypes.c_size_t), ("flags", ctypes.c_uint32)]


_LINKS: set[int] = set()          # this process's XDP link fds, closed in any child it forks
_links_lock = threading.Lock()        # held from a link's creation to its registration, and over a
                                      # fork: a thread forking in between gave its child a copy the
                                      # child did not know to close (34 of 150 tries: found by review)


def _close_links_in_child():
    # a forked child's copy of a link fd would keep the program attached after this process is
    # gone (and after its detach): the link dies with its last fd
    _links_lock.release()
    for fd in _LINKS:
        try:
            os.close(fd)
        except OSError:
            pass
    _LINKS.clear()


os.register_at_fork(before=_links_lock.acquire, after_in_parent=_links_lock.release,
                    after_in_child=_close_links_in_child)


@contextlib.contextmanager
def _in_netns(netns: str | None):
    """This thread in netns (/run/netns/NAME) for the block, back in its own after, whatever
    happens (setns moves the calling thread only)."""
    if not netns:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into netns {netns}: {os.strerror(err)}")
        finally:
            os.close(target)
        try:
            yield
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:     # (never seen): not an attach to try again
                err = ctypes.get_errno()              # in another mode, from the wrong namespace
                raise RuntimeError(f"setns back from netns {netns}: {os.strerror(err)}: this thread is "
                                   f"left in it")
    finally:
        os.close(home)


def _link_xdp(prog_fd: int, ifindex: int, netns: str | None, flags: int) -> int:
    """An XDP link of prog_fd on ifindex (in netns), in mode flags: its fd, registered so a
    forked child closes it. The kernel never lets a link replace a program already attached,
    nor anything replace a link (EBUSY)."""
    lib = libbpf()
    lib.bpf_link_create.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_LinkCreateOpts)]
    opts = _LinkCreateOpts(sz=ctypes.sizeof(_LinkCreateOpts), flags=flags)
    with _links_lock, _in_netns(netns):
        fd = lib.bpf_link_create(prog_fd, ifindex, BPF_XDP, ctypes.byref(opts))
        if fd < 0:
            err = -fd                   # (libbpf 1.x returns -errno)
            raise OSError(err, f"bpf_link_create: {os.strerror(err)}")
        os.set_inheritable(fd, False)
        _LINKS.add(fd)
    return fd


def _unlink_xdp(fd: int):
    with _links_lock:
        _LINKS.discard(fd)
        os.close(fd)


def attached_prog_id(ifname: str, netns: str | None = None) -> int | None:
    """The id of the XDP program attached to ifname (in netns) now, whoever attached it."""
    with _iproute(netns) as ipr:
        found = ipr.link_lookup(ifname=ifname)
        xdp = ipr.get_links(found[0])[0].get_attr("IFLA_XDP") if found else None
        return (xdp.get_attr("IFLA_XDP_PROG_ID") or None) if xdp else None


def attached_prog(ifname: str, netns: str | None = None) -> str:
    """What is attached to ifname, for an error: "program ID (NAME)", or "" if nothing is."""
    prog = attached_prog_id(ifname, netns)
    if not prog:
        return ""
    try:
        import subprocess
        out = subprocess.run(["bpftool", "prog", "show", "id", str(prog)], capture_output=True, text=True,
                             timeout=5).stdout.split()
        name = out[out.index("name") + 1] if "name" in out else "?"
    except (OSError, ValueError, subprocess.SubprocessError):
        name = "?"
    return f"program {prog} ({name})"


class XdpAttachment:
    """Attach prog_fd to ifname (inside netns) for the life of a with-block, as a BPF link: the
    kernel detaches it when this process ends, however it ends.

    mode: "native", "generic", or "auto" (native, falling back to generic);
    self.mode says which one is in use.
    """

    def __init__(self, prog_fd: int, ifname: str, netns: str | None = None, mode: str = "auto"):
        if mode not in ("auto", *XDP_MODES):
            raise ValueError(f"XDP mode must be auto, native or generic, not {mode!r}")
        self.prog_fd, self.ifname, self.netns, self.want = prog_fd, ifname, netns, mode
        self.mode = None
        self.ifindex = None
        self.link_fd = None
        self.pid = os.getpid()          # the process holding link_fd (a forked child closed its copy)

    def __enter__(self):
        with _iproute(self.netns) as ipr:
            found = ipr.link_lookup(ifname=self.ifname)
        if not found:
            raise BpfUnavailable(f"no interface {self.ifname!r} in netns {self.netns or '(current)'}")
        self.ifindex = found[0]
        tries = ["native", "generic"] if self.want == "auto" else [self.want]
        errors = []
        for mode in tries:
            try:
                # never over another's program: the kernel refuses a link where one is attached
                # (an operator's filter was replaced once, and the detach then removed it). (A
                # signal landing as the call returns leaves the link to the process's end.)
                self.pid = os.getpid()
                self.link_fd = _link_xdp(self.prog_fd, self.ifindex, self.netns, XDP_MODES[mode])
            except OSError as e:        # mode unsupported on this device, or a program there
                errors.append(f"{mode}: {e}")
                continue
            self.mode = mode
            try:
                got = self.attached_mode()
            except BaseException:       # (SIGTERM's SystemExit among them) never left attached
                self.detach()
                raise
            if got != mode:
                self.detach()
                raise BpfUnavailable(f"asked the kernel for {mode} XDP on {self.ifname}, it attached {got}")
            return self
        there = attached_prog(self.ifname, self.netns)
        raise BpfUnavailable(f"cannot attach XDP to {self.ifname}: " + "; ".join(errors)
                             + (f". {there} is attached there: if it is a dead run's, remove it with `ip "
                                f"{'-n ' + self.netns + ' ' if self.netns else ''}link set dev {self.ifname} "
                                f"xdp off`" if there else ""))

    def detach(self):
        """Our link closed: the kernel takes our program, and only ours, off the device. In a
        forked child, whose copy of the fd was closed as it started, nothing is closed (its number
        may be another file of the child's by then: found by review)."""
        if self.link_fd is not None and os.getpid() == self.pid:
            _unlink_xdp(self.link_fd)
        self.link_fd = None
        self.mode = None

    def __exit__(self, *exc):
        self.detach()

    def attached_mode(self) -> str | None:
        """The mode the kernel reports for the attached program: native, generic, or None."""
        with _iproute(self.netns) as ipr:
            xdp = ipr.get_links(self.ifindex)[0].get_attr("IFLA_XDP")
        return _ATTACHED.get(xdp.get_attr("IFLA_XDP_ATTACHED")) if xdp else None

    def prog_id(self) -> int | None:
        """The id of the program attached now, whoever's (None if nothing is)."""
        return attached_prog_id(self.ifname, self.netns)


class _TestRunOpts(ctypes.Structure):
    # struct bpf_test_run_opts, libbpf >= 1.0 (bpf/bpf.h)
    _fields_ = [("sz", ctypes.c_size_t), ("data_in", ctypes.c_void_p), ("data_out", ctypes.c_void_p),
                ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32),
                ("ctx_in", ctypes.c_void_p), ("ctx_out", ctypes.c_void_p),
                ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),
                ("retval", ctypes.c_uint32), ("repeat", ctypes.c_int), ("duration", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32), ("batch_size", ctypes.c_uint32)]


_libbpf = None


def libbpf():
    """libbpf.so.1, for bpf_prog_test_run_opts (bcc 0.26 does not expose BPF_PROG_TEST_RUN)."""
    global _libbpf
    if _libbpf is None:
        try:
            lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
            lib.bpf_prog_test_run_opts.argtypes = [ctypes.c_int, ctypes.POINTER(_TestRunOpts)]
        except (OSError, AttributeError) as e:
            raise BpfUnavailable(f"libbpf.so.1 with bpf_prog_test_run_opts is not available ({e}): "
                                 "apt-get install libbpf1") from None
        _libbpf = lib
    return _libbpf


def prog_test_run(prog_fd: int, packet: bytes, repeat: int = 1) -> tuple[int, int, bytes]:
    """Run an XDP program on one packet in the kernel: (verdict, ns per run, packet out)."""
    if repeat < 1:
        raise ValueError("repeat must be at least 1")
    data_in = ctypes.create_string_buffer(bytes(packet), len(packet))
    out = ctypes.create_string_buffer(len(packet) + 512)
    opts = _TestRunOpts(sz=ctypes.sizeof(_TestRunOpts), data_in=ctypes.addressof(data_in),
                        data_out=ctypes.addressof(out), data_size_in=len(packet),
                        data_size_out=len(out), repeat=repeat)
    if libbpf().bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf_prog_test_run_opts: {os.strerror(err)}")
    return opts.retval, opts.duration, out.raw[:opts.data_size_out]
