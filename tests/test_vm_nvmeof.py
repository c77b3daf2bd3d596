"""The snapshot store on a real NVMe-oF namespace: Linux nvmet and the kernel's NVMe/TCP initiator in a VM.

datapath/vmtest.py boots the guest, datapath/vmguest.py runs in it. Not part of
`sudo make test` (its "not vm"); `sudo make vm-test` runs it (about a minute
under TCG here). The result is also written to vm-result.json in the test's
tmp_path. ZEROLAYER_VM_ACCEL=tcg (or kvm) skips the KVM probe.
"""
import json
import os

import pytest

from datapath import vmtest


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
