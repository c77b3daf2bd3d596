"""snapshotstore: crash-consistent KV-delta snapshots on a block device.

    from snapshotstore import LogStore, Delta, session_key
    with LogStore("/dev/nvme1n1") as store:         # or an image file, or "nvme-tcp://HOST:PORT/SUBNQN"; None: the default image
        key = session_key(tenant_secret, session_id)
        store.put(key, Delta(kv, tokens=(0, 128), layers=(0, 4), codec="f32"))
        snap = store.restore(key)

The interface (SnapshotStore) is in api.py, the on-device format in format.py,
the log, recovery and space management in log.py, the devices in device.py,
remote NVMe/TCP targets and their initiator in nvmetcp/.
"""
from .api import Delta, Snapshot, SnapshotStore, WorkerStore, session_key
from .errors import (BadKey, DamagedRecord, DeviceError, DeviceFull, FormatError, SessionChanged,
                     SnapshotError, TooLarge)
from .log import LogStore, format_device

__all__ = ["Delta", "Snapshot", "SnapshotStore", "WorkerStore", "session_key", "LogStore", "format_device",
           "SnapshotError", "DeviceError", "FormatError", "DeviceFull", "TooLarge", "BadKey",
           "SessionChanged", "DamagedRecord"]
