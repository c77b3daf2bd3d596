"""Test support for the serving side: the in-memory store stand-in and request helpers.

MemoryStore is the stand-in for the snapshot store (issue 6), for tests only:
it implements the worker's SnapshotStore interface; StoreServer hosts one in a
manager process so that several real worker processes share it.
"""
from multiprocessing.managers import BaseManager

import numpy as np

from datapath import wire
from datapath.chunk import make_batch


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


def prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 512, n)]


def chunks(sid, rid, tokens, max_out, t_send=0):
    """A request cut into chunks of at most 128 tokens, as the router would send them."""
    parts = [tokens[i:i + 128] for i in range(0, len(tokens), 128)]
    return [dict(session_id=sid, request_id=rid, kind=wire.KIND_CHUNK, chunk_index=i, chunk_count=len(parts),
                 max_output_tokens=max_out, tokens=p, t_send=t_send) for i, p in enumerate(parts)]


def run(worker, batches, max_steps=500):
    """Feed micro-batches (lists of chunk dicts), then step until idle; all completions."""
    done = []
    for seq, b in enumerate(batches):
        done += worker.step(make_batch(b, batch_seq=seq))
    for _ in range(max_steps):
        if not worker.busy:
            return done
        done += worker.step()
    raise AssertionError("worker still busy")
