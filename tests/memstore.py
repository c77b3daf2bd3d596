"""The in-memory stand-in for the snapshot store (issue 6), for tests only.

MemoryStore implements the worker's SnapshotStore interface; StoreServer hosts
one in a manager process so that several real worker processes share it.
"""
from multiprocessing.managers import BaseManager


class MemoryStore:
    def __init__(self):
        self.chains: dict[int, list[bytes]] = {}
        self.metas: dict[int, list[dict]] = {}
        self.fail_puts = False

    def put(self, key: int, delta: bytes, meta: dict) -> None:
        if self.fail_puts:
            raise OSError("stand-in store told to fail")
        self.chains.setdefault(key, []).append(bytes(delta))
        self.metas.setdefault(key, []).append(dict(meta))

    def restore(self, key: int) -> list[bytes]:
        return list(self.chains.get(key, []))

    def delete(self, key: int) -> None:
        self.chains.pop(key, None)
        self.metas.pop(key, None)

    def meta(self, key: int) -> list[dict]:
        return list(self.metas.get(key, []))


class StoreServer(BaseManager):
    pass


StoreServer.register("MemoryStore", MemoryStore)
