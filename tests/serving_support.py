"""Test support for the serving side: the in-memory store stand-in and a driver playing the router.

MemoryStore is the stand-in for the snapshot store (issue 6), for tests only:
it implements the worker's SnapshotStore interface; StoreServer hosts one in a
manager process so that several real worker processes share it.

drive() speaks the router's protocol to one worker, deterministically (the
native router's batches depend on timing): per step, one KIND_DECODE record
for each generating request first, then prompt pieces (the last flagged
CHUNK_F_FINAL) up to a chunk cap; tokens come back in the completion entries.
"""
from multiprocessing.managers import BaseManager

import numpy as np

from datapath import records, wire
from snapshotstore.api import Deltas
from snapshotstore.errors import SessionChanged


class MemoryStore:
    def __init__(self):
        self.chains: dict[tuple[int, int], list[bytes]] = {}   # (tenant, session) -> deltas
        self.metas: dict[tuple[int, int], list[dict]] = {}
        self.seqs: dict[tuple[int, int], int] = {}             # the chain's last record's number
        self.last_seq = 0                                      # as the real store: never repeated
        self.fail_puts = False

    def put(self, key: tuple[int, int], delta: bytes, meta: dict) -> int:
        if self.fail_puts:
            raise OSError("stand-in store told to fail")
        if meta.get("replace"):            # as the real store: the delta, from token 0, is the chain now
            assert meta["token_start"] == 0
            self.delete(key)
        end = self.metas[key][-1]["token_end"] if key in self.metas else 0
        if meta["token_start"] != end:     # as the real store: a chain continues where it ends
            raise SessionChanged(f"the store holds tokens [0, {end}), not up to {meta['token_start']}")
        self.chains.setdefault(key, []).append(bytes(delta))
        self.metas.setdefault(key, []).append(dict(meta))
        self.last_seq += 1
        self.seqs[key] = self.last_seq
        return self.last_seq

    def restore(self, key: tuple[int, int]) -> Deltas:
        return Deltas(self.chains.get(key, []), self.seqs.get(key, 0))

    def held(self, key: tuple[int, int]) -> tuple[int, int]:
        metas = self.metas.get(key)
        return (metas[-1]["token_end"], self.seqs[key]) if metas else (0, 0)

    def delete(self, key: tuple[int, int]) -> None:
        self.chains.pop(key, None)
        self.metas.pop(key, None)
        self.seqs.pop(key, None)

    evict = delete       # the real store's LRU drops a chain the same way (no record of it)

    def meta(self, key: tuple[int, int]) -> list[dict]:
        return list(self.metas.get(key, []))


class StoreServer(BaseManager):
    pass


StoreServer.register("MemoryStore", MemoryStore)


def prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 512, n)]


def prefill_records(sid, rid, tokens, max_out, piece=128, t_send=0):
    """A request's prompt as the router sends it: pieces of at most `piece` tokens, the last FINAL."""
    parts = [tokens[i:i + piece] for i in range(0, len(tokens), piece)]
    arr = np.zeros(len(parts), dtype=records.CHUNK)
    for i, p in enumerate(parts):
        arr[i]["session_id"], arr[i]["request_id"], arr[i]["kind"] = sid, rid, wire.KIND_CHUNK
        arr[i]["chunk_index"], arr[i]["chunk_count"] = i, len(parts)
        arr[i]["max_output_tokens"], arr[i]["n_tokens"], arr[i]["t_send"] = max_out, len(p), t_send
        arr[i]["tokens"][:len(p)] = p
    arr[-1]["flags"] |= records.CHUNK_F_FINAL
    return arr


def decode_record(sid, rid, max_out):
    rec = np.zeros(1, dtype=records.CHUNK)
    rec["session_id"], rec["request_id"], rec["kind"], rec["max_output_tokens"] = sid, rid, records.KIND_DECODE, max_out
    return rec


def as_batch(recs, seq=0):
    batch = np.concatenate(recs) if recs else np.zeros(0, dtype=records.CHUNK)
    batch["batch_seq"], batch["batch_len"], batch["batch_pos"] = seq, len(batch), np.arange(len(batch))
    return batch


def drive(exchange, requests, max_chunks=4, piece=128):
    """Run requests [(session, request, prompt, max_out)] to the end; {request: output tokens}.

    exchange(batch) -> completion record: Worker.step, or a lane round trip.
    """
    pending = {rid: list(prefill_records(sid, rid, toks, max_out, piece)) for sid, rid, toks, max_out in requests}
    meta = {rid: (sid, max_out) for sid, rid, _, max_out in requests}
    out = {rid: [] for rid in pending}
    decoding = []
    seq = 0
    while pending or decoding:
        recs = [decode_record(meta[rid][0], rid, meta[rid][1]) for rid in decoding]
        for rid in list(pending):
            while pending[rid] and len(recs) < max_chunks:
                recs.append(pending[rid].pop(0).reshape(1))
            if not pending[rid]:
                del pending[rid]
        batch = as_batch(recs, seq)
        comp = exchange(batch)
        assert comp["batch_seq"][0] == seq and comp["n"][0] == len(batch)
        e = comp["e"][0]
        assert (e["status"][:len(batch)] == wire.STATUS_OK).all(), e["status"][:len(batch)]
        for i, rec in enumerate(batch):
            rid = int(rec["request_id"])
            if rec["kind"] == records.KIND_DECODE or rec["flags"] & records.CHUNK_F_FINAL:
                if meta[rid][1]:
                    out[rid].append(int(e["token"][i]))
        decoding = [rid for rid in meta if rid not in pending and len(out[rid]) < meta[rid][1]]
        seq += 1
    return out


class ZmqRouterEnd:
    """The router's end of a ZeroMQ lane, for tests: a DEALER connecting to the worker's."""

    def __init__(self, endpoint: str):
        import zmq
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.connect(endpoint)

    def send(self, batch):
        self.sock.send(batch.tobytes())

    def exchange(self, batch, timeout_s=60):
        self.send(batch)
        assert self.sock.poll(int(timeout_s * 1000)), "no completion in time"
        return np.frombuffer(self.sock.recv(), dtype=records.COMPLETION)

    def close(self):
        self.sock.close(linger=0)
