"""The VM harness's host-side pieces that need no qemu: the cpio writer and the module load order."""
import os

import pytest

from datapath import vmtest


def _read_newc(data: bytes) -> dict:
    """name -> (mode, data), the way the kernel unpacks an initramfs."""
    out, off = {}, 0
    while True:
        assert data[off:off + 6] == b"070701"
        f = [int(data[off + 6 + 8 * i: off + 14 + 8 * i], 16) for i in range(13)]
        mode, size, namesize = f[1], f[6], f[11]
        name = data[off + 110: off + 110 + namesize - 1].decode()
        off = (off + 110 + namesize + 3) & ~3
        if name == "TRAILER!!!":
            return out
        out[name] = (mode, data[off:off + size])
        off = (off + size + 3) & ~3


def test_cpio_round_trip():
    entries = [("bin", 0o40755, b""), ("init", 0o100755, b"#!/bin/sh\n"), ("m/x.ko", 0o100644, b"\x7fELF" * 7)]
    got = _read_newc(vmtest._cpio_newc(entries))
    assert got == {name: (mode, data) for name, mode, data in entries}


def _ko(path, depends: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"\x7fELF...\0license=GPL\0depends=" + depends.encode() + b"\0vermagic=6.1\0")


def test_module_order_puts_dependencies_first(tmp_path, monkeypatch):
    k = tmp_path / "kernel"
    _ko(str(k / "a/nvme-core.ko"), "t10-pi")
    _ko(str(k / "b/t10-pi.ko"), "")
    _ko(str(k / "a/nvme-tcp.ko"), "nvme-core,nvme-fabrics")
    _ko(str(k / "a/nvme-fabrics.ko"), "nvme-core")
    monkeypatch.setattr(vmtest, "MODULES", [("nvme_tcp", ""), ("nvme-core", "multipath=N")])
    order = [(os.path.basename(p), params) for p, params in vmtest.module_load_order(str(tmp_path))]
    # nvme-core's params stay with it though it is first reached as a dependency of nvme-tcp
    assert [name for name, _ in order] == ["t10-pi.ko", "nvme-core.ko", "nvme-fabrics.ko", "nvme-tcp.ko"]


def test_module_missing_is_one_clear_error(tmp_path, monkeypatch):
    _ko(str(tmp_path / "kernel/x/nvmet.ko"), "configfs")
    monkeypatch.setattr(vmtest, "MODULES", [("nvmet", "")])
    with pytest.raises(vmtest.VmTestError, match="no module configfs"):
        vmtest.module_load_order(str(tmp_path))


def test_a_checkout_the_guest_cannot_see_is_refused_by_name():
    """The guest mounts fresh tmpfs over /tmp, /run, ...: a clone there failed inside the guest
    with a bare "can't cd"; it is refused on the host, saying why."""
    for mount in vmtest.GUEST_FRESH_MOUNTS:
        inside = f"{mount}/ci/x"
        with pytest.raises(vmtest.VmTestError, match=f"{inside} is under {mount}, which the guest mounts afresh"):
            vmtest.hidden_in_guest("/srv/zerolayer", inside)
    with pytest.raises(vmtest.VmTestError, match="under /run"):
        vmtest.hidden_in_guest("/run/x/.venv/bin/python")
    vmtest.hidden_in_guest("/srv/zerolayer", "/srv/zerolayer/.venv/bin/python", "/tmpfoo/zerolayer")   # fine


def test_modules_compressed_as_newer_kernels_ship_them_are_found_and_written_uncompressed(tmp_path, monkeypatch):
    """Debian 12's kernel ships .ko files; newer ones .ko.xz (or .ko.zst): those were not found at
    all. The initramfs gets them uncompressed (the guest's insmod takes them so)."""
    import lzma
    k = tmp_path / "kernel"
    _ko(str(k / "a/nvme-core.ko"), "")
    plain = b"\x7fELF...\0license=GPL\0depends=nvme-core\0vermagic=6.12\0"
    os.makedirs(k / "b")
    (k / "b/nvme-tcp.ko.xz").write_bytes(lzma.compress(plain, format=lzma.FORMAT_XZ))
    monkeypatch.setattr(vmtest, "MODULES", [("nvme-tcp", "")])
    order = vmtest.module_load_order(str(tmp_path))
    assert [os.path.basename(p) for p, _ in order] == ["nvme-core.ko", "nvme-tcp.ko.xz"]
    monkeypatch.setattr(vmtest, "BUSYBOX", __file__)       # any file: the cpio holds it as it is
    vmtest.build_initramfs(str(tmp_path / "i.cpio"), order, "tcg", "")
    got = _read_newc((tmp_path / "i.cpio").read_bytes())
    assert got["modules/nvme-tcp.ko"][1] == plain
    assert got["modules/order"][1].decode().split("\n")[:2] == ["nvme-core.ko", "nvme-tcp.ko"]


def test_a_softdep_the_kernel_has_not_as_a_module_is_left_out_not_an_error(tmp_path, monkeypatch):
    _ko(str(tmp_path / "kernel/x/nvme-tcp.ko"), "")
    monkeypatch.setattr(vmtest, "MODULES", [("crc64_rocksoft_generic", ""), ("nvme-tcp", "")])
    assert [os.path.basename(p) for p, _ in vmtest.module_load_order(str(tmp_path))] == ["nvme-tcp.ko"]


def test_a_package_that_is_no_kernel_is_one_clear_error(tmp_path):
    """A damaged .deb raised tar's CalledProcessError (the message meant for it could not be
    reached) and left dpkg-deb unwaited for."""
    bad = tmp_path / "linux-image-x.deb"
    bad.write_bytes(os.urandom(5000))
    with pytest.raises(vmtest.VmTestError, match="could not unpack the kernel and its modules from"):
        vmtest.unpack_kernel(str(bad), str(tmp_path))


def test_kvm_runs_a_cpu_numpy_can_import_on():
    """-cpu qemu64 under KVM: no SSSE3-SSE4.2 or POPCNT, and numpy (built for x86-64-v2) refused to
    import in the guest, so every KVM run failed. The host's CPU first, else x86-64-v2's flags."""
    assert vmtest.KVM_CPUS[0] == "host"
    assert {"+ssse3", "+sse4.1", "+sse4.2", "+popcnt", "+cx16", "+lahf_lm"} <= set(vmtest.KVM_CPUS[1].split(","))
    assert vmtest.pick_accel("tcg", "", "", "") == ("tcg", "max", "as asked")
    cmd = vmtest.qemu_command("kvm", "host", "vmlinuz", "initrd", "/s", "/c", probe=True)
    assert cmd[cmd.index("-accel") + 1] == "kvm" and cmd[cmd.index("-cpu") + 1] == "host"


def test_the_kernel_s_complaints_about_nvme_are_found():
    """The check by "failed" alone let by what Linux recovers from: a data digest error, a timeout,
    an expired keep-alive, an I/O error."""
    from datapath import vmguest
    fine = ["[ 4.2] nvmet: adding nsid 1 to subsystem nqn.x", "[ 4.2] nvmet_tcp: enabling port 1 (127.0.0.1:4420)",
            "[ 4.2] nvmet: creating nvm controller 1 for subsystem nqn.x for NQN nqn.y.",
            "[ 4.2] nvme nvme0: creating 2 I/O queues.", "[ 4.2] nvme nvme0: mapped 2/0/0 default/read/poll queues.",
            '[ 4.2] nvme nvme0: new ctrl: NQN "nqn.x", addr 127.0.0.1:4420', '[ 9] nvme nvme0: Removing ctrl: NQN "x"',
            "[ 37] nvme nvme0: queue_size 128 > ctrl sqsize 32, clamping down", "[ 1] sd 0:0:0:0: Attached SCSI disk"]
    bad = ["[ 5] nvme nvme0: data digest error: recv 0x1 expected 0x2",
           "[ 5] nvmet: ctrl 1 keep-alive timer (5 seconds) expired!",
           "[ 5] nvme nvme0: I/O tag 3 (1003) type 4 opcode 0x1 (Write) QID 1 timeout",
           "[ 5] I/O error, dev nvme0n1, sector 0 op 0x1:(WRITE)", "[ 5] nvme nvme0: Reconnecting in 10 seconds...",
           "[ 5] nvme nvme0: keep-alive support is mandatory for fabrics"]
    assert vmguest.kernel_complaints(fine + bad) == bad
