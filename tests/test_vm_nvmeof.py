"""The snapshot store on a real NVMe-oF namespace: Linux nvmet and the kernel's NVMe/TCP initiator in a VM,
and the project's own NVMe/TCP target and initiator against them (both directions, with and without digests).

datapath/vmtest.py boots the guest, datapath/vmguest.py runs in it. Not part of
`sudo make test` (its "not vm"); `sudo make vm-test` runs it (about two minutes
under TCG here). The result is also written to vm-result.json in the test's
tmp_path. ZEROLAYER_VM_ACCEL=tcg (or kvm) skips the KVM probe.
"""
import json
import os

import pytest

from datapath import vmguest, vmtest


@pytest.mark.vm
@pytest.mark.slow
@pytest.mark.root
def test_snapshot_store_on_nvme_tcp_namespace(tmp_path):
    try:
        r = vmtest.run(os.environ.get("ZEROLAYER_VM_ACCEL", "auto"), timeout=1500, crash_iterations=50)
    except vmtest.VmTestError as e:
        pytest.fail(str(e), pytrace=False)
    (tmp_path / "vm-result.json").write_text(json.dumps(r, indent=2))
    print(f"vm: {r['host']['accel']} ({r['host']['accel_reason']}), guest {r['host']['guest_seconds']} s, "
          f"total {r['host']['total_seconds']} s")

    assert r["problems"] == [] and r["ok"]
    # a real NVMe-oF namespace behind the kernel's TCP transport, on the guest's loopback
    assert r["transport"] == "tcp"
    assert "traddr=127.0.0.1" in r["address"] and "trsvcid=4420" in r["address"]
    assert r["device"].startswith("/dev/nvme") and r["is_block_device"]
    # the block size came from BLKSSZGET on the namespace (the target exports 4 KiB blocks)
    assert r["logical_block_size"] == r["sysfs_logical_block_size"] == 4096
    assert r["kv"]["store_block_size"] == 4096
    assert r["format_rc"] == 0
    # every delta written restores, bit-exact, after a reopen that rebuilt the index from the device
    kv = r["kv"]
    assert kv["records_written"] == kv["records_restored"] == 15
    assert kv["kv_bit_exact"]
    assert kv["recovery"]["records"] == 15 and kv["recovery"]["corrupt_blocks_skipped"] == 0
    assert r["fsck_rc"] == 0 and r["fsck_output"].endswith("clean")
    # SIGKILLed writers: every acknowledged record present, nothing else; fsck clean afterwards
    crash = r["crash"]
    assert crash["ok"] and crash["failures"] == [] and crash["iterations"] == 50
    assert crash["acked_puts"] > 50 and crash["writer_finished"] < 25
    assert r["crash_fsck_rc"] == 0

    # nothing refused or recovered from on either side: every kernel line about nvme is one a working
    # peer draws (no "keep-alive support is mandatory", "failed cmd", digest error, timeout, reconnect)
    assert not vmguest.kernel_complaints(r["dmesg"]), vmguest.kernel_complaints(r["dmesg"])

    # the store the kernel's initiator left on nvmet, checked through the project's initiator
    assert r["user_fsck_rc"] == 0 and r["user_fsck_output"].endswith("clean")

    # Linux's nvme-tcp host -> `snapshotstore target` (127.0.0.1:4421, /dev/nullb1), without and with digests
    assert [k["digests"] for k in r["kernel_initiator_user_target"]] == [False, True]
    for k in r["kernel_initiator_user_target"]:
        assert k["ok"] and k["problems"] == [], k
        assert k["transport"] == "tcp" and k["subsysnqn"] == "nqn.2026-01.io.zerolayer:vmtest-user"
        assert "traddr=127.0.0.1" in k["address"] and "trsvcid=4421" in k["address"]
        assert k["model"] == "zerolayer snapshot target"
        assert k["logical_block_size"] == k["sysfs_logical_block_size"] == 4096
        assert k["sysfs_bytes"] == k["device_bytes"] == k["target_bytes"] == 1 << 30     # what Identify says
        on = "on" if k["digests"] else "off"
        assert [line for line in k["target_log"] if f"header digest {on}, data digest {on}" in line], k
        assert k["format_rc"] == 0 and k["fsck_rc"] == 0 and k["fsck_output"].endswith("clean")
        assert k["kv"]["records_written"] == k["kv"]["records_restored"] == 15 and k["kv"]["kv_bit_exact"]
        assert k["disconnected"] and k["target_exit"] == 0

    # the project's initiator (LogStore on nvme-tcp://) -> Linux nvmet, without and with digests
    assert [u["digests"] for u in r["user_initiator_kernel_target"]] == [False, True]
    for u in r["user_initiator_kernel_target"]:
        assert u["ok"] and u["problems"] == [], u
        assert (u["header_digest"], u["data_digest"]) == (u["digests"], u["digests"])
        assert u["block_size"] == 4096 and u["blocks"] == (1 << 30) // 4096
        assert u["format_rc"] == 0 and u["fsck_rc"] == 0 and u["fsck_output"].endswith("clean")
        assert u["kv"]["records_written"] == u["kv"]["records_restored"] == 15 and u["kv"]["kv_bit_exact"]
        assert u["kv"]["recovery"]["records"] == 15

    # a 512e disk (scsi_debug: 512-byte LBAs on 4 KiB physical sectors): the store writes whole
    # physical sectors, so a torn write cannot take an acknowledged neighbour or both superblocks
    e = r["store_512e"]
    assert e["ok"] and e["problems"] == [], e
    assert (e["logical_block_size"], e["physical_block_size"], e["store_block_size"]) == (512, 4096, 4096)
    assert e["format_rc"] == 0 and e["fsck_rc"] == 0 and e["fsck_output"].endswith("clean")
    assert e["kv"]["store_block_size"] == 4096
    assert e["kv"]["records_written"] == e["kv"]["records_restored"] == 15 and e["kv"]["kv_bit_exact"]
    assert e["old_store_block_size"] == 512 and e["old_store_restored"]     # formatted before: still opens
