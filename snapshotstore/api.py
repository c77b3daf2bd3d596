"""The store interface the worker calls, and that a remote (NVMe/TCP) store implements too.

    key = session_key(tenant_secret, session_id)       # 32 bytes, HMAC-SHA256
    seq = store.put(key, Delta(kv_bytes, tokens=(0, 128), layers=(0, 4), codec="f32"))
    snap = store.restore(key)    # Snapshot: the chain's payloads concatenated, or None
    n, seq = store.held(key)     # the chain holds tokens [0, n) (128), its last record is seq
    store.delete(key); store.list(); store.stats(); store.close()

put returns only once the record is durable. A session's deltas form a chain
(each delta's parent is the previous one); restore returns their payloads
concatenated in put order, with the token range from the first delta's start
to the last one's end. Keys are HMAC(tenant secret, session id): a tenant
that does not hold another's secret cannot name its snapshots.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from .errors import BadKey
from .format import CODEC_LEN, KEY_LEN


@dataclass(frozen=True)
class Delta:
    """One request's KV delta: opaque bytes and what they cover."""
    payload: bytes
    tokens: tuple[int, int] = (0, 0)     # [start, end) token positions
    layers: tuple[int, int] = (0, 0)     # [start, end) layers
    codec: str = "raw"                   # how the worker encoded payload (<= 16 ASCII chars)


class Snapshot(NamedTuple):
    """A restored session: every delta's payload, concatenated. (A NamedTuple: as immutable as a
    frozen dataclass, and built in 0.2 us rather than 0.6, warm; a restore's Python is counted
    against its reads.)"""
    payload: bytes
    tokens: tuple[int, int]
    layers: tuple[int, int]
    codec: str
    records: int                         # records read (1 after compaction)
    parts: tuple[bytes, ...] = ()        # the deltas one by one, oldest first (payload = their join)
    seq: int = 0                         # the chain's last record's sequence number (as held() says)


MIN_SECRET_BYTES = 16           # a master or tenant secret, and the store connection's (server.read_secret)
TENANT_SECRETS_KEPT = 4096      # WorkerStore's cache of derived tenant secrets (a tenant id is any u32)


def session_key(tenant_secret: bytes, session_id: int | bytes | str) -> bytes:
    if not isinstance(tenant_secret, (bytes, bytearray)) or len(tenant_secret) < MIN_SECRET_BYTES:
        raise BadKey(f"the tenant secret must be at least {MIN_SECRET_BYTES} bytes")
    if isinstance(session_id, int):
        sid = session_id.to_bytes(8, "little", signed=False)
    elif isinstance(session_id, str):
        sid = session_id.encode()
    else:
        sid = bytes(session_id)
    return hmac.new(bytes(tenant_secret), b"zerolayer-session\0" + sid, hashlib.sha256).digest()


def check_key(key) -> bytes:
    if not isinstance(key, (bytes, bytearray)):
        raise BadKey(f"a snapshot key is {KEY_LEN} bytes from session_key(), not a {type(key).__name__}")
    if len(key) != KEY_LEN:
        raise BadKey(f"a snapshot key is {KEY_LEN} bytes from session_key(), not {len(key)} bytes")
    return bytes(key)


def check_delta(delta) -> Delta:
    if not isinstance(delta, Delta):
        raise TypeError(f"put takes a snapshotstore.Delta, not a {type(delta).__name__}")
    if not isinstance(delta.payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"a delta's payload is bytes, not a {type(delta.payload).__name__}")
    codec = delta.codec.encode("ascii", "replace") if isinstance(delta.codec, str) else b""
    # no NUL: the device pads the name with them, so one at its end would not come back
    if not codec or len(codec) > CODEC_LEN or not delta.codec.isascii() or "\0" in delta.codec:
        raise ValueError(f"a codec name is 1 to {CODEC_LEN} ASCII characters (no NUL), not {delta.codec!r}")
    _check_range("tokens", delta.tokens, 1 << 32)
    _check_range("layers", delta.layers, 1 << 16)
    return delta


def _check_range(name: str, rng, top: int) -> None:
    # whole numbers only: a float passed every check here and failed the record's packing in
    # the middle of a group commit, which failed the store for every other writer
    if (not isinstance(rng, tuple) or len(rng) != 2 or not isinstance(rng[0], int) or not isinstance(rng[1], int)
            or isinstance(rng[0], bool) or isinstance(rng[1], bool)):
        raise TypeError(f"a delta's {name} range is a tuple of two ints, not {rng!r}")
    lo, hi = rng
    if not (0 <= lo <= hi < top):
        raise ValueError(f"a delta's {name} range must be 0 <= start <= end < {top}, not ({lo}, {hi})")


class Deltas(list):
    """A session's deltas as WorkerStore.restore gives them, oldest first, and the sequence number
    of the chain's last record (0: no chain), as held() names it."""

    def __init__(self, parts=(), seq: int = 0):
        super().__init__(parts)
        self.seq = seq


@runtime_checkable
class SnapshotStore(Protocol):
    def put(self, key: bytes, delta: Delta, replace: bool = False) -> int:
        """Append delta to key's chain; return its sequence number once it is durable. replace:
        the delta (from token 0) becomes the whole chain, in one durable step."""

    def restore(self, key: bytes) -> Snapshot | None:
        """The key's chain concatenated, or None if the store has nothing for key."""

    def held(self, key: bytes) -> tuple[int, int]:
        """(n, seq): the store holds tokens [0, n) of key's session, its chain ending with the record
        numbered seq ((0, 0): nothing); no data is read. Sequence numbers are not handed out twice
        (a read-write open skips past those a crash may have cut off; a format starts them at a
        random point), so a chain someone else put to since (or deleted and put anew, to the same
        length) has another seq."""

    def delete(self, key: bytes) -> bool:
        """Drop key's chain durably; False if there was none."""

    def list(self) -> list[bytes]:
        """The keys with a snapshot."""

    def stats(self) -> dict:
        """Counters and space figures (names are the store's own)."""

    def close(self) -> None:
        """Checkpoint and release the device."""


class WorkerStore:
    """The worker's store interface (datapath/serving/worker.py: put(key, delta, meta),
    restore(key) -> list of deltas, delete(key), key = (tenant, session_id)) on a
    SnapshotStore: each delta blob is one part of the chain, and keys are tenant-private
    (HMAC). The data path holds one master secret; tenant t's secret is
    HMAC(master, t), so the same session id of two tenants names two snapshots and no
    tenant can compute another's key.

        worker = Worker(model, store=WorkerStore(LogStore(path), master_secret))
    """

    def __init__(self, store: SnapshotStore, master_secret: bytes):
        self.store, self.secret = store, bytes(master_secret)
        session_key(self.secret, 0)                      # a bad secret fails here, not at the first put
        self._tenants: dict[int, bytes] = {}             # at most TENANT_SECRETS_KEPT

    def key(self, key: tuple[int, int]) -> bytes:
        tenant, session = key
        secret = self._tenants.get(tenant)
        if secret is None:
            if len(self._tenants) >= TENANT_SECRETS_KEPT:
                self._tenants.clear()
            secret = self._tenants[tenant] = hmac.new(self.secret, b"zerolayer-tenant\0" +
                                                      int(tenant).to_bytes(4, "little"), hashlib.sha256).digest()
        return session_key(secret, session)

    def put(self, key: tuple[int, int], delta: bytes, meta: dict) -> int:
        return self.store.put(self.key(key),
                       Delta(delta, tokens=(meta["token_start"], meta["token_end"]), codec=meta.get("codec", "raw")),
                       replace=bool(meta.get("replace", False)))

    def restore(self, key: tuple[int, int]) -> Deltas:
        snap = self.store.restore(self.key(key))
        return Deltas(snap.parts, snap.seq) if snap is not None else Deltas()

    def held(self, key: tuple[int, int]) -> tuple[int, int]:
        return self.store.held(self.key(key))

    def delete(self, key: tuple[int, int]) -> None:
        self.store.delete(self.key(key))

    def close(self) -> None:
        """Close the store under it (a RemoteStore's socket, a LogStore's device)."""
        close = getattr(self.store, "close", None)
        if close is not None:
            close()
