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
