"""Loading, attaching and test-running XDP programs (bcc compiles, pyroute2 attaches).

Programs are loaded from the files in bpf/ with bpf/ on the include path.
Attachment goes through netlink in the interface's own namespace, so it works
for veths inside namespaces the caller created; an attachment never outlives
its namespace, and XdpAttachment detaches on exit, on error and on Ctrl-C.
"""
from __future__ import annotations

import ctypes
import os
import pathlib
import platform

BPF_DIR = pathlib.Path(__file__).resolve().parent.parent / "bpf"

XDP_FLAGS_SKB_MODE = 1 << 1   # generic: works on any device, after the skb is built
XDP_FLAGS_DRV_MODE = 1 << 2   # native: in the driver (veth supports it)
XDP_FLAGS_UPDATE_IF_NOEXIST = 1 << 0   # fail, not replace, if a program is attached already
XDP_FLAGS_REPLACE = 1 << 4             # with IFLA_XDP_EXPECTED_FD: only if that program is the one there
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


def _set_xdp(ipr, ifindex: int, fd: int, flags: int, expected_fd: int | None = None):
    # The nested IFLA_XDP attribute spelled out: pyroute2 0.9's xdp_fd=/xdp_flags= keywords drop
    # the flags, so a "generic" attach silently became a driver-mode one. expected_fd: only if that
    # program is the one attached (XDP_FLAGS_REPLACE; the kernel refuses with EEXIST otherwise).
    attrs = [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", flags | (XDP_FLAGS_REPLACE if expected_fd is not None else 0))]
    if expected_fd is not None:
        attrs.append(("IFLA_XDP_EXPECTED_FD", expected_fd))
    ipr.link("set", index=ifindex, xdp={"attrs": attrs})


class XdpAttachment:
    """Attach prog_fd to ifname (inside netns) for the life of a with-block.

    mode: "native", "generic", or "auto" (native, falling back to generic);
    self.mode says which one is in use.
    """

    def __init__(self, prog_fd: int, ifname: str, netns: str | None = None, mode: str = "auto"):
        if mode not in ("auto", *XDP_MODES):
            raise ValueError(f"XDP mode must be auto, native or generic, not {mode!r}")
        self.prog_fd, self.ifname, self.netns, self.want = prog_fd, ifname, netns, mode
        self.mode = None
        self.ifindex = None

    def __enter__(self):
        with _iproute(self.netns) as ipr:
            found = ipr.link_lookup(ifname=self.ifname)
            if not found:
                raise BpfUnavailable(f"no interface {self.ifname!r} in netns {self.netns or '(current)'}")
            self.ifindex = found[0]
            tries = ["native", "generic"] if self.want == "auto" else [self.want]
            errors = []
            for mode in tries:
                # before the call: a signal in it, after the kernel attached, left the program
                # attached with no mode for close() to detach in (found by review). A detach
                # removes only our own program (XDP_FLAGS_REPLACE), so one that never attached
                # costs nothing; before that guard, this had to come after the attach.
                self.mode = mode
                try:
                    # never over another's program (an operator's filter was replaced, and
                    # the detach then removed whatever was there)
                    _set_xdp(ipr, self.ifindex, self.prog_fd, XDP_MODES[mode] | XDP_FLAGS_UPDATE_IF_NOEXIST)
                except Exception as e:  # netlink error: mode unsupported on this device
                    self.mode = None
                    errors.append(f"{mode}: {e}")
                    continue
                try:
                    got = self.attached_mode()
                except BaseException:       # (SIGTERM's SystemExit among them) never left attached
                    self.detach()
                    raise
                if got != mode:
                    self.mode = got if got in XDP_MODES else mode   # removed in the mode it has: the
                    self.detach()                                    # asked one's slot is empty
                    raise BpfUnavailable(f"asked the kernel for {mode} XDP on {self.ifname}, it attached {got}")
                return self
        raise BpfUnavailable(f"cannot attach XDP to {self.ifname}: " + "; ".join(errors))

    def detach(self):
        """Our program off the device, in one netlink call that the kernel carries out only if it is
        still the one attached (XDP_FLAGS_REPLACE, IFLA_XDP_EXPECTED_FD): another's put there since
        stays (EEXIST). Before, whatever was there was removed."""
        if self.mode is None:
            return
        try:
            with _iproute(self.netns) as ipr:
                _set_xdp(ipr, self.ifindex, -1, XDP_MODES[self.mode], expected_fd=self.prog_fd)
        except Exception:
            pass  # gone with its namespace, or another's program there now: not ours to remove
        self.mode = None

    def __exit__(self, *exc):
        self.detach()

    def attached_mode(self) -> str | None:
        """The mode the kernel reports for the attached program: native, generic, or None."""
        with _iproute(self.netns) as ipr:
            xdp = ipr.get_links(self.ifindex)[0].get_attr("IFLA_XDP")
        return _ATTACHED.get(xdp.get_attr("IFLA_XDP_ATTACHED")) if xdp else None

    def prog_id(self) -> int | None:
        """The id of the program attached now (None if nothing is)."""
        with _iproute(self.netns) as ipr:
            xdp = ipr.get_links(self.ifindex)[0].get_attr("IFLA_XDP")
            return xdp.get_attr("IFLA_XDP_PROG_ID") if xdp else None


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
