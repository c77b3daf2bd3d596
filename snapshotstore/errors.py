"""The errors a user of the snapshot store can cause; each message is one sentence saying what to do."""


class SnapshotError(Exception):
    """Base of every error the store raises on purpose."""


class DeviceError(SnapshotError):
    """The device path is missing, of the wrong type, or cannot be read or written."""


class FormatError(SnapshotError):
    """The device holds no valid store (both superblocks unreadable, or never formatted)."""


class DeviceFull(SnapshotError):
    """The log cannot take the record without dropping live snapshots (eviction="refuse")."""


class TooLarge(SnapshotError):
    """A delta, or the chain it would make, is larger than one record on this device can hold."""


class BadKey(SnapshotError, TypeError):
    """A key that is not the 32 bytes session_key() makes."""


class DamagedRecord(SnapshotError):
    """A record the index holds is damaged on the device or cannot be read (fsck says more)."""


class SessionChanged(SnapshotError):
    """The session was evicted or deleted while a put to it was in flight."""
