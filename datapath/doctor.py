"""datapath doctor: can this machine run the data path? One line per check.

Each check prints OK, WARN (optional, e.g. only the VM tests need it), FAIL
with a one-line fix, or SKIP (one that needs root, run without it). Exit status 0 only when every required check passes.
Everything the checks create (a namespace pair, a veth, an XDP attachment,
BPF maps) is removed before the check returns.
"""
from __future__ import annotations

import ctypes
import importlib
import os
import pathlib
import platform
import shutil
import sys

# cffi extensions the package builds (setup.py's cffi_modules); later stages add theirs here.
EXTENSIONS = ["datapath._wire_layout", "datapath._dataplane", "datapath._ingress", "snapshotstore._snapindex"]
MIN_KERNEL = (5, 12)  # BPF ring buffers (5.8), BPF_PROG_BIND_MAP (5.10), BPF atomics (cmpxchg, 5.12); tested on 6.x
BPF_MAP_TYPE_ARRAY, BPF_MAP_TYPE_RINGBUF = 2, 27


class Check:
    def __init__(self, name: str, required: bool = True, needs_root: bool = False):
        self.name, self.required, self.needs_root = name, required, needs_root
        self.status, self.detail, self.hint = "OK", "", ""

    def fail(self, detail: str, hint: str = ""):
        self.status = "FAIL" if self.required else "WARN"
        self.detail, self.hint = detail, hint
        return self

    def skip(self, detail: str):
        self.status, self.detail = "SKIP", detail
        return self

    def ok(self, detail: str = ""):
        self.status, self.detail = "OK", detail
        return self

    def line(self) -> str:
        text = f"{self.status:<4} {self.name:<22} {self.detail}"
        return text + (f"\n     {'':<22} fix: {self.hint}" if self.hint else "")


def check_root(c):
    if os.geteuid() == 0:
        return c.ok("uid 0")
    return c.fail(f"uid {os.geteuid()}", "run as root: sudo .venv/bin/datapath doctor")


def check_kernel(c):
    rel = platform.release()
    try:
        ver = tuple(int(x) for x in rel.split("-")[0].split(".")[:2])
    except ValueError:
        return c.fail(f"cannot parse kernel release {rel!r}")
    if ver < MIN_KERNEL:
        return c.fail(f"{rel} is older than {MIN_KERNEL[0]}.{MIN_KERNEL[1]}",
                      "boot a kernel >= 5.12 (BPF ring buffers, BPF_PROG_BIND_MAP, BPF atomics)")
    return c.ok(rel)


def _map_create(map_type: int, key: int, value: int, entries: int) -> int:
    from .xdp import libbpf
    lib = libbpf()
    lib.bpf_map_create.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_uint32,
                                   ctypes.c_uint32, ctypes.c_void_p]
    fd = lib.bpf_map_create(map_type, b"dp_doctor", key, value, entries, None)
    if fd < 0:
        raise OSError(-fd, os.strerror(-fd))
    os.close(fd)
    return fd


def check_bpf_syscall(c):
    try:
        _map_create(BPF_MAP_TYPE_ARRAY, 4, 8, 1)
        return c.ok("array map created and closed")
    except Exception as e:
        return c.fail(f"bpf(BPF_MAP_CREATE) failed: {e}", "run as root on a kernel with CONFIG_BPF_SYSCALL")


def check_ringbuf(c):
    try:
        _map_create(BPF_MAP_TYPE_RINGBUF, 0, 0, 1 << 16)
        return c.ok("BPF_MAP_TYPE_RINGBUF created and closed")
    except Exception as e:
        return c.fail(f"cannot create a BPF ring buffer: {e}", "needs kernel >= 5.8 and root")


def check_jit(c):
    p = pathlib.Path("/proc/sys/net/core/bpf_jit_enable")
    try:
        v = p.read_text().strip()
    except OSError as e:
        return c.fail(f"cannot read {p}: {e}")
    if v in ("1", "2"):
        return c.ok(f"bpf_jit_enable={v}")
    return c.fail(f"bpf_jit_enable={v} (interpreted BPF is ~10x slower)", f"echo 1 > {p}")


def check_headers(c):
    from .xdp import kernel_headers
    path, note = kernel_headers()
    return c.ok(note) if path else c.fail(note, "sudo make setup")


def check_bcc(c):
    try:
        bcc = importlib.import_module("bcc")
    except ImportError as e:
        return c.fail(f"cannot import bcc ({e})",
                      "apt-get install python3-bpfcc, then `make setup` (bcc is not on PyPI)")
    return c.ok(f"bcc {getattr(bcc, '__version__', '?')} from {pathlib.Path(bcc.__file__).parent}")


class _State:
    prog = None  # (bpf, fn) of the trial compile, reused by the attach and test-run checks


def check_compile(c, state):
    from .xdp import BpfUnavailable, load_xdp
    try:
        state.prog = load_xdp("count.bpf.c", "xdp_count")
    except BpfUnavailable as e:
        return c.fail(str(e), "sudo make setup (installs python3-bpfcc and kernel headers)")
    # the steering program too: the verifier of an older kernel may refuse what count.bpf.c does not use
    try:
        from .ingress import Ingress
    except ImportError as e:
        return c.fail(f"the ingress extension does not import: {e}", "make setup (builds the cffi extensions)")
    ig = Ingress(queues=1)
    try:
        ig.load()
    except BpfUnavailable as e:
        return c.fail(str(e), f"boot a kernel >= {MIN_KERNEL[0]}.{MIN_KERNEL[1]} whose verifier takes bpf/steer.bpf.c")
    finally:
        ig.close()
    return c.ok(f"bpf/count.bpf.c and bpf/steer.bpf.c compiled and loaded (fd {state.prog[1].fd})")


def check_xdp_attach(c, state):
    if state.prog is None:
        return c.fail("skipped: no program (trial compile failed)")
    from .topology import Topology
    from .xdp import XdpAttachment
    try:
        with Topology(clients=1) as topo:
            with XdpAttachment(state.prog[1].fd, topo.host_if[0], topo.host_ns) as att:
                mode, pid = att.mode, att.prog_id()
        return c.ok(f"{mode} mode on a throwaway veth (prog id {pid}); detached, netns removed")
    except Exception as e:
        return c.fail(f"XDP attach on a throwaway veth failed: {e}", "needs root and veth (CONFIG_VETH)")


def check_test_run(c, state):
    from . import packet, wire
    from .xdp import VERDICTS, XDP_PASS, prog_test_run
    try:
        if state.prog is None:
            from .xdp import libbpf
            libbpf()
            return c.ok("libbpf.so.1 exports bpf_prog_test_run_opts (not run: no program)")
        frame = packet.udp_frame(b"\0" * 48, wire.DEFAULT_PORT)
        verdict, ns, _ = prog_test_run(state.prog[1].fd, frame, repeat=1000)
    except Exception as e:
        return c.fail(f"{e}", "apt-get install libbpf1")
    if verdict != XDP_PASS:
        return c.fail(f"count program returned {VERDICTS.get(verdict, verdict)}, expected XDP_PASS")
    return c.ok(f"libbpf bpf_prog_test_run_opts ran the count program: {ns} ns/packet")


def check_extensions(c):
    missing = []
    for name in EXTENSIONS:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
    if missing:
        return c.fail("not built: " + ", ".join(missing), "make setup (rebuilds the cffi extensions)")
    return c.ok(", ".join(EXTENSIONS))


def check_pyroute2(c):
    try:
        import pyroute2
    except ImportError:
        return c.fail("pyroute2 not importable", "make setup")
    return c.ok(f"pyroute2 {pyroute2.__version__}")


def check_loop(c):
    if os.path.exists("/dev/loop-control") and shutil.which("losetup"):
        return c.ok("/dev/loop-control and losetup present")
    return c.fail("no /dev/loop-control or losetup", "modprobe loop; apt-get install util-linux "
                  "(only the loop-device snapshot tests need it)")


def check_kvm(c):
    if os.access("/dev/kvm", os.R_OK | os.W_OK):
        return c.ok("/dev/kvm present (on these VMs it cannot run a guest: the VM tests use TCG)")
    return c.fail("no usable /dev/kvm", "the VM tests fall back to TCG software emulation")


def check_qemu(c):
    q = shutil.which("qemu-system-x86_64")
    if q:
        return c.ok(q)
    return c.fail("qemu-system-x86_64 not found", "`sudo make vm-test` installs it (only the VM tests need it)")


def run(out=sys.stdout) -> int:
    state = _State()
    plan = [
        (Check("root"), check_root),
        (Check("kernel"), check_kernel),
        (Check("bpf syscall", needs_root=True), check_bpf_syscall),
        (Check("bpf ring buffer map", needs_root=True), check_ringbuf),
        (Check("bpf jit", required=False), check_jit),
        (Check("bcc import"), check_bcc),
        (Check("kernel headers"), check_headers),
        (Check("bcc trial compile", needs_root=True), lambda c: check_compile(c, state)),
        (Check("xdp attach (veth)", needs_root=True), lambda c: check_xdp_attach(c, state)),
        (Check("libbpf test_run", needs_root=True), lambda c: check_test_run(c, state)),
        (Check("cffi extensions"), check_extensions),
        (Check("pyroute2"), check_pyroute2),
        (Check("loop devices", required=False, needs_root=True), check_loop),
        (Check("/dev/kvm", required=False), check_kvm),
        (Check("qemu", required=False), check_qemu),
    ]
    failed = 0
    root = os.geteuid() == 0
    for check, fn in plan:
        try:
            if check.needs_root and not root:
                # (run, each failed on EPERM with a fix of its own, a wrong one: "sudo make setup")
                check.skip("needs root (see the root check)")
            else:
                fn(check)
        except Exception as e:  # a check must never take the others down with it
            check.fail(f"unexpected error: {type(e).__name__}: {e}")
        print(check.line(), file=out, flush=True)
        failed += check.status == "FAIL"
    if state.prog is not None:
        state.prog[0].cleanup()
    verdict = "the data path can run here" if not failed else f"{failed} required check(s) failed"
    print(f"\n{verdict}", file=out)
    return 0 if not failed else 1
