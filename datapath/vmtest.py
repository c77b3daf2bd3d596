"""vmtest: boot a Debian kernel under qemu and run the snapshot store on a real NVMe-oF namespace.

USAGE: sudo .venv/bin/python -m datapath.vmtest [--json PATH] [--accel auto|kvm|tcg] [--timeout S]
       (or `sudo make vm-test`, which runs tests/test_vm_nvmeof.py through it)

The host kernel here loads no modules, so nvmet cannot run on it. The guest
can: this boots Debian's stock kernel (from its linux-image package, unpacked
into a temporary directory, never installed on the host) with a tiny busybox
initramfs that loads the NVMe target and initiator modules, mounts the host's
root filesystem read-only over 9p (so the guest runs this checkout and its
.venv as they are) and a writable scratch directory for the result, and runs
datapath/vmguest.py, which does the NVMe-oF work and writes result.json.

Idempotent and only when asked: qemu-system-x86 and busybox-static are
apt-installed if missing, the kernel package is downloaded into apt's own
cache once. Everything a run makes (kernel tree, initramfs, scratch, console
log) lives in one directory under the state directory, removed at the end;
qemu is our child, killed by its pid on a timeout (and by the kernel if this
process dies: PR_SET_PDEATHSIG). The guest has no network device at all: its
NVMe/TCP traffic stays on the guest's own loopback.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

from snapshotstore.device import state_dir
from .cli import positive

PACKAGES = ("qemu-system-x86", "busybox-static")
KERNEL_META = "linux-image-amd64"
APT_ARCHIVES = "/var/cache/apt/archives"
BUSYBOX = "/bin/busybox"

# What the guest loads, in this order (each with its dependencies first). The
# crypto modules are softdeps (aliases like "crct10dif") a plain insmod would
# not pull in; nvme-tcp and nvmet-tcp need crc32c for their digests. Tested
# with Debian 12's kernel (6.1); the softdeps are loaded where the kernel has
# them as modules (newer ones build some in, or dropped them: SOFTDEPS).
MODULES = [
    ("virtio_pci", ""), ("9pnet_virtio", ""), ("9p", ""),
    ("crc32c_generic", ""), ("crct10dif_generic", ""), ("crc64_rocksoft_generic", ""),
    # multipath=N: the namespace is /dev/nvmeXnY of its controller, not a hidden path behind a head node
    ("nvme-core", "multipath=N"),
    # memory-backed, 4 KiB logical blocks: the namespace reports 4096 and keeps what is written
    ("null_blk", "nr_devices=2 gb=1 bs=4096 memory_backed=1"),     # nullb1: the project's target
    ("nvmet", ""), ("nvmet-tcp", ""), ("nvme-fabrics", ""), ("nvme-tcp", ""),
    # a 512e disk: 512-byte LBAs on 4 KiB physical sectors, which the store must write whole
    ("sd_mod", ""), ("scsi_debug", "dev_size_mb=32 sector_size=512 physblk_exp=3"),
]

SOFTDEPS = {"crc32c_generic", "crct10dif_generic", "crc64_rocksoft_generic"}
# what a module file may be: as built, or compressed as newer Debian kernels ship them (insmod
# in the guest takes them uncompressed: build_initramfs writes them so)
MODULE_SUFFIXES = (".ko", ".ko.xz", ".ko.zst")
# under KVM, the host's CPU; else x86-64-v2 (numpy's baseline: qemu64 alone lacks SSSE3-SSE4.2
# and POPCNT, and numpy refused to import); under TCG, everything qemu emulates
KVM_CPUS = ("host", "qemu64,+ssse3,+sse4.1,+sse4.2,+popcnt,+cx16,+lahf_lm")

GUEST_MEMORY_MB = 3072     # two 1 GiB null_blk devices at most, plus python and numpy
PROBE_TIMEOUT_S = 20       # a KVM guest reaches init in ~1 s; one that hangs is not KVM that works


class VmTestError(Exception):
    """Something the user can fix (missing root, packages, a guest that failed): one sentence."""


def say(msg: str) -> None:
    print(f"vmtest: {msg}", flush=True)


# --- packages -----------------------------------------------------------------

def _installed(pkg: str) -> bool:
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
    return r.returncode == 0 and "install ok installed" in r.stdout


class _Apt:
    updated = False

    def update(self) -> None:
        if not self.updated:
            r = subprocess.run(["apt-get", "update", "-qq"], capture_output=True, text=True)
            if r.returncode:
                raise VmTestError(f"apt-get update failed: {r.stderr.strip()[-500:]}")
            self.updated = True

    def run(self, *args: str, cwd: str | None = None) -> None:
        self.update()
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        r = subprocess.run(["apt-get", *args], cwd=cwd, env=env, capture_output=True, text=True)
        if r.returncode:
            raise VmTestError(f"apt-get {' '.join(args)} failed: {r.stderr.strip()[-500:]}")


def ensure_packages(apt: _Apt) -> None:
    missing = [p for p in PACKAGES if not _installed(p)]
    if missing:
        say(f"installing {' '.join(missing)}")
        apt.run("install", "-y", "-qq", "--no-install-recommends", *missing)


def _cached_kernel() -> str | None:
    # the stock flavour only: -cloud- lacks drivers, -rt- and -dbg are not what a user boots
    cached = [c for c in glob.glob(f"{APT_ARCHIVES}/linux-image-[0-9]*-amd64_*_amd64.deb")
              if not re.search(r"-(cloud|rt)-amd64_|-dbg_", c)]
    cached.sort(key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p)])  # 6.1.0-57 > 6.1.0-9
    return cached[-1] if cached else None


def kernel_package(apt: _Apt) -> str:
    """A linux-image-<version>-amd64 .deb in apt's cache (downloaded once, not installed)."""
    if os.environ.get("ZEROLAYER_VM_KERNEL_DEB"):
        return os.environ["ZEROLAYER_VM_KERNEL_DEB"]
    if _cached_kernel():
        return _cached_kernel()
    apt.update()
    deps = subprocess.run(["apt-cache", "depends", KERNEL_META], capture_output=True, text=True).stdout
    m = re.search(r"Depends: (linux-image-[0-9][^\s]*-amd64)\b", deps)
    if not m:
        raise VmTestError(f"apt knows no {KERNEL_META}: is this Debian with its main archive configured?")
    say(f"downloading {m.group(1)} into {APT_ARCHIVES} (unpacked per run, not installed)")
    apt.run("download", m.group(1), cwd=APT_ARCHIVES)
    deb = _cached_kernel()
    if not deb:
        raise VmTestError(f"apt-get download {m.group(1)} left no package in {APT_ARCHIVES}")
    return deb


# --- kernel and initramfs -----------------------------------------------------

def unpack_kernel(deb: str, dest: str) -> tuple[str, str]:
    """Unpack the package's kernel image and modules under dest: (vmlinuz, modules dir)."""
    deb_p = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", deb], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tar = subprocess.run(["tar", "-x", "-C", dest, "--wildcards", "./boot/vmlinuz-*", "./lib/modules/*"],
                         stdin=deb_p.stdout, capture_output=True, text=True)
    deb_p.stdout.close()
    deb_rc, deb_err = deb_p.wait(), deb_p.stderr.read().decode(errors="replace").strip()
    deb_p.stderr.close()
    if deb_rc or tar.returncode:
        why = deb_err if deb_rc else tar.stderr.strip()
        raise VmTestError(f"could not unpack the kernel and its modules from {deb} ({why[-300:]}): remove it "
                          "and run again")
    vmlinuz, moddir = glob.glob(f"{dest}/boot/vmlinuz-*"), glob.glob(f"{dest}/lib/modules/*")
    if len(vmlinuz) != 1 or len(moddir) != 1:
        raise VmTestError(f"{deb} holds {len(vmlinuz)} kernel images and {len(moddir)} module trees, not one of "
                          "each: is it a linux-image package?")
    return vmlinuz[0], moddir[0]


def module_bytes(path: str) -> bytes:
    """A module file's contents, uncompressed."""
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".xz"):
        import lzma
        return lzma.decompress(data)
    if path.endswith(".zst"):
        import zstandard
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return data


def _module_file(path: str) -> str:
    """.../nvme-tcp.ko.xz -> nvme-tcp.ko (the file insmod takes, uncompressed)."""
    base = os.path.basename(path)
    return base[:base.index(".ko") + 3]


def _module_name(path: str) -> str:
    """nvme-tcp.ko.xz -> nvme_tcp (the kernel's name: dashes and underscores are one)."""
    return _module_file(path)[:-3].replace("-", "_")


def _modinfo_depends(path: str) -> list[str]:
    """The depends= field of a .ko's .modinfo strings (no kmod on these hosts)."""
    data = module_bytes(path)
    m = re.search(rb"\0depends=([^\0]*)\0", data)
    return [d for d in m.group(1).decode().split(",") if d] if m else []


def module_load_order(moddir: str) -> list[tuple[str, str]]:
    """(path, params) for MODULES and everything they depend on, dependencies first."""
    by_name = {}
    for suffix in MODULE_SUFFIXES:
        for p in glob.glob(f"{moddir}/kernel/**/*{suffix}", recursive=True):
            by_name[_module_name(p)] = p
    params_of = {name.replace("-", "_"): params for name, params in MODULES}
    order, seen = [], set()

    def visit(name: str):
        key = name.replace("-", "_")
        if key in seen:
            return
        if key not in by_name:
            raise VmTestError(f"the kernel package has no module {name} (is it built in? see its config)")
        seen.add(key)
        for dep in _modinfo_depends(by_name[key]):
            visit(dep)
        order.append((by_name[key], params_of.get(key, "")))

    for name, _ in MODULES:
        if name in SOFTDEPS and name not in by_name:
            say(f"no module {name} in this kernel (built in, or not needed there): not loaded")
            continue
        visit(name)
    return order


def _cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """An uncompressed newc cpio archive of (name, mode, data) (no cpio tool needed)."""
    out = bytearray()
    for ino, (name, mode, data) in enumerate(entries + [("TRAILER!!!", 0, b"")], 1):
        nm = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (
            ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nm), 0))
        out += hdr.encode() + nm
        out += b"\0" * (-len(out) % 4) + data
        out += b"\0" * (-len(out) % 4)
    return bytes(out)


INIT = r"""#!/bin/busybox sh
# The guest's pid 1: modules, the host's root read-only over 9p, then vmguest.py in a chroot.
/bin/busybox mkdir -p /proc /sys /dev /host /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
if grep -q zl.probe /proc/cmdline; then echo ZL-PROBE-OK; poweroff -f; fi
while read -r mod params; do
    insmod "/modules/$mod" $params || echo "vmtest-init: insmod $mod failed"
done < /modules/order
H=/host
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot $H
mount -t proc proc $H/proc
mount -t sysfs sys $H/sys
mount -t configfs configfs $H/sys/kernel/config
mount -t devtmpfs dev $H/dev
mkdir -p $H/dev/shm
mount -t tmpfs tmpfs $H/dev/shm
mount -t tmpfs tmpfs $H/tmp
mount -t tmpfs tmpfs $H/run
mount -t tmpfs tmpfs $H/var/tmp
mkdir -p $H/run/vmtest
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 scratch $H/run/vmtest
chroot $H /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root PYTHONDONTWRITEBYTECODE=1 \
    ZEROLAYER_STATE_DIR=/run/zerolayer ZL_VM_ACCEL=@ACCEL@ \
    /bin/sh -c 'cd @REPO@ && exec @PYTHON@ -m datapath.vmguest --out /run/vmtest/result.json @ARGS@'
echo "vmtest-init: guest script exited $?"
sync
umount $H/run/vmtest
poweroff -f
"""


# What INIT mounts afresh over the host's root in the guest: files there are not the host's.
GUEST_FRESH_MOUNTS = ("/proc", "/sys", "/dev", "/tmp", "/run", "/var/tmp")


def hidden_in_guest(*paths: str) -> None:
    """Refuse a checkout or interpreter the guest cannot see (it would fail there as "can't cd")."""
    for path in paths:
        for m in GUEST_FRESH_MOUNTS:        # the path as the guest reads it, and where its links lead
            if any(p == m or p.startswith(m + "/") for p in (os.path.abspath(path), os.path.realpath(path))):
                raise VmTestError(f"{path} is under {m}, which the guest mounts afresh over the host's root: "
                                  f"run the VM test from a checkout (and venv) outside {', '.join(GUEST_FRESH_MOUNTS)}")


def build_initramfs(path: str, modules: list[tuple[str, str]], accel: str, guest_args: str) -> None:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    init = (INIT.replace("@ACCEL@", accel).replace("@REPO@", repo)
            .replace("@PYTHON@", sys.executable).replace("@ARGS@", guest_args))
    with open(BUSYBOX, "rb") as f:
        busybox = f.read()
    d, x, r = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o755, stat.S_IFREG | 0o644
    entries = [("bin", d, b""), ("bin/busybox", x, busybox), ("init", x, init.encode()), ("modules", d, b"")]
    order = []
    for p, params in modules:
        name = _module_file(p)
        entries.append((f"modules/{name}", r, module_bytes(p)))
        order.append(f"{name} {params}".strip())
    entries.append(("modules/order", r, ("\n".join(order) + "\n").encode()))
    with open(path, "wb") as f:
        f.write(_cpio_newc(entries))


# --- qemu ---------------------------------------------------------------------

def _die_with_parent():
    # qemu must not outlive this process, even if it is SIGKILLed (then no finally runs)
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def qemu_command(accel: str, cpu: str, vmlinuz: str, initrd: str, scratch: str, console: str,
                 probe: bool) -> list[str]:
    cmd = ["qemu-system-x86_64", "-machine", "pc", "-m", str(GUEST_MEMORY_MB), "-smp", "2",
           "-kernel", vmlinuz, "-initrd", initrd,
           "-append", "console=ttyS0 panic=-1 loglevel=4" + (" zl.probe" if probe else ""),
           "-display", "none", "-monitor", "none", "-serial", f"file:{console}",
           "-no-reboot", "-nic", "none"]
    cmd += ["-accel", accel, "-cpu", cpu]
    if not probe:
        cmd += ["-virtfs", "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap",
                "-virtfs", f"local,path={scratch},mount_tag=scratch,security_model=passthrough"]
    return cmd


def run_qemu(cmd: list[str], timeout: float) -> tuple[int | None, float]:
    """Run qemu to its exit or the timeout (then kill it, by pid): (exit code or None, seconds)."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=_die_with_parent)
    try:
        out, _ = proc.communicate(timeout=timeout)
        if proc.returncode and out:
            say(f"qemu: {out.decode(errors='replace').strip()[-400:]}")
        return proc.returncode, time.monotonic() - started
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()      # our own child, by pid
            proc.wait()


def pick_accel(want: str, vmlinuz: str, initrd: str, workdir: str) -> tuple[str, str, str]:
    """(accel, cpu, why): KVM with the first of KVM_CPUS a probe guest reaches its init with (-cpu
    host failed on a host whose KVM refused one of its MSRs), else TCG."""
    if want == "tcg":
        return "tcg", "max", "as asked"
    if want == "kvm":
        return "kvm", KVM_CPUS[0], "as asked"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg", "max", "no usable /dev/kvm"
    if os.path.exists("/sys/module/kvm_pvm"):   # no probe: it timed out with either CPU, 40 s lost
        return "tcg", "max", ("the host's KVM is kvm_pvm, which virtualizes without VMX/SVM and boots only "
                              "kernels built as PVM guests")
    whys = []
    for cpu in KVM_CPUS:
        console = os.path.join(workdir, "probe.log")
        rc, secs = run_qemu(qemu_command("kvm", cpu, vmlinuz, initrd, workdir, console, probe=True),
                            PROBE_TIMEOUT_S)
        text = open(console, errors="replace").read() if os.path.exists(console) else ""
        if "ZL-PROBE-OK" in text:
            return "kvm", cpu, f"a probe guest booted in {secs:.1f} s"
        last = text.strip().splitlines()[-1:]
        whys.append(f"-cpu {cpu.split(',')[0]}: " + (f"qemu exited {rc}" if rc is not None else
                                                      f"no init in {PROBE_TIMEOUT_S} s")
                    + (f", last console line {last[0]!r}" if last else ", no console output"))
    return "tcg", "max", f"/dev/kvm is there but cannot run this guest ({'; '.join(whys)})"


# --- the run ------------------------------------------------------------------

def _remove_stale_runs(base: str) -> None:
    """Run directories of harnesses that were killed (SIGKILL skips their cleanup): their pid is gone."""
    for d in glob.glob(os.path.join(base, "run-*-*")):
        pid = d.rsplit("/", 1)[1].split("-")[1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            say(f"removing {d}, left by a harness that was killed")
            shutil.rmtree(d, ignore_errors=True)


def run(accel: str = "auto", timeout: float = 1800, crash_iterations: int = 50, keep: bool = False) -> dict:
    """Boot the guest, run vmguest.py in it, return its result (plus the host's view of the run)."""
    if os.geteuid() != 0:
        raise VmTestError("needs root (apt-get, 9p passthrough of /): run it with sudo")
    if not os.path.exists("/usr/bin/dpkg-query"):
        raise VmTestError("needs a Debian or Ubuntu host (apt-get, dpkg-deb)")
    hidden_in_guest(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), sys.executable)
    started = time.monotonic()
    apt = _Apt()
    ensure_packages(apt)
    deb = kernel_package(apt)
    base = os.path.join(state_dir(), "vm")
    os.makedirs(base, exist_ok=True)
    _remove_stale_runs(base)
    workdir = tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=base)
    try:
        vmlinuz, moddir = unpack_kernel(deb, workdir)
        kernel = os.path.basename(moddir)
        scratch = os.path.join(workdir, "scratch")
        os.mkdir(scratch)
        modules = module_load_order(moddir)
        args = f"--crash-iterations {int(crash_iterations)}"
        initrd = os.path.join(workdir, "initramfs.cpio")
        build_initramfs(initrd, modules, "probe", args)
        accel, cpu, why = pick_accel(accel, vmlinuz, initrd, workdir)
        say(f"accelerator: {accel}, -cpu {cpu} ({why}); kernel {kernel} from {os.path.basename(deb)}")
        build_initramfs(initrd, modules, accel, args)
        shutil.rmtree(os.path.join(workdir, "lib"))          # 400 MB of modules the guest does not need
        console = os.path.join(workdir, "console.log")
        left = max(60.0, timeout - (time.monotonic() - started))
        rc, secs = run_qemu(qemu_command(accel, cpu, vmlinuz, initrd, scratch, console, probe=False), left)
        log = open(console, errors="replace").read() if os.path.exists(console) else ""
        result_path = os.path.join(scratch, "result.json")
        if rc is None:
            raise VmTestError(f"the guest did not finish in {left:.0f} s (killed); console tail:\n{log[-3000:]}")
        if not os.path.exists(result_path):
            raise VmTestError(f"the guest wrote no result (qemu exited {rc}); console tail:\n{log[-3000:]}")
        with open(result_path) as f:
            result = json.load(f)
        result["host"] = dict(accel=accel, cpu=cpu, accel_reason=why, kernel=kernel, kernel_package=os.path.basename(deb),
                              guest_seconds=round(secs, 1), total_seconds=round(time.monotonic() - started, 1),
                              qemu_exit=rc)
        return result
    finally:
        if keep:
            say(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
            try:
                os.rmdir(base)
            except OSError:
                pass


EPILOG = """examples:
    sudo .venv/bin/python -m datapath.vmtest                 # KVM if it works, else TCG
    sudo .venv/bin/python -m datapath.vmtest --accel tcg --json vm.json
    sudo .venv/bin/python -m datapath.vmtest --install-only  # just the packages (make vm-test does this)
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m datapath.vmtest", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    p.add_argument("--accel", choices=("auto", "kvm", "tcg"), default="auto",
                   help="kvm, tcg (emulation: slower, no /dev/kvm needed) or auto: kvm when usable (default)")
    p.add_argument("--timeout", type=positive(float), default=1800, help="seconds for the whole run (default 1800)")
    p.add_argument("--crash-iterations", type=positive(int), default=50,
                   help="SIGKILLed writers on the namespace (default 50)")
    p.add_argument("--json", help="write the result here too")
    p.add_argument("--keep", action="store_true", help="keep the run directory (kernel, initramfs, console log)")
    p.add_argument("--install-only", action="store_true", help="install the packages and fetch the kernel, no boot")
    args = p.parse_args(argv)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        p.error(f"--json {args.json}: no such directory (checked now, not after the run)")
    try:
        if args.install_only:
            if os.geteuid() != 0:
                raise VmTestError("needs root to install packages: run it with sudo")
            apt = _Apt()
            ensure_packages(apt)
            say(f"ready: {os.path.basename(kernel_package(apt))}")
            return 0
        result = run(args.accel, args.timeout, args.crash_iterations, args.keep)
    except VmTestError as e:
        print(f"vmtest: {e}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    h = result["host"]
    say(f"{'passed' if result.get('ok') else 'FAILED'}: {result.get('device')} over {result.get('transport')}, "
        f"{result.get('logical_block_size')}-byte blocks, {h['accel']}, guest {h['guest_seconds']} s, "
        f"total {h['total_seconds']} s")
    for problem in result.get("problems", []):
        say(f"  {problem}")
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
