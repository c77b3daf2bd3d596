"""struct dp_chunk (native/chunk.h) as a numpy structured dtype.

A lane carries a micro-batch as consecutive dp_chunk records; the worker views
those bytes as an array of CHUNK_DTYPE without copying. The field list mirrors
native/chunk.h in order; tests/test_chunk_layout.py compiles the header with
cffi and proves every offset and size equal. Little-endian, like the wire.
"""
from __future__ import annotations

import numpy as np

from .wire import MAX_CHUNK_TOKENS

CHUNK_HDR_LEN = 96
CHUNK_LEN = 608

CHUNK_DTYPE = np.dtype([
    ("session_id", "<u8"), ("request_id", "<u8"),
    ("tenant", "<u4"), ("max_output_tokens", "<u4"),
    ("chunk_index", "<u2"), ("chunk_count", "<u2"), ("n_tokens", "<u2"),
    ("kind", "u1"), ("queue", "u1"),
    ("batch_seq", "<u4"), ("batch_len", "<u2"), ("batch_pos", "<u2"),
    ("t_send", "<u8"), ("t_xdp", "<u8"), ("t_consumer", "<u8"),
    ("t_router", "<u8"), ("t_lane", "<u8"), ("t_worker", "<u8"),
    ("flags", "<u4"), ("reserved", "<u4"),
    ("tokens", "<u4", (MAX_CHUNK_TOKENS,)),
])

STAMPS = ("t_send", "t_xdp", "t_consumer", "t_router", "t_lane", "t_worker")


def batch_from_bytes(buf) -> np.ndarray:
    """View a lane message (consecutive dp_chunk records) as records, without a copy."""
    if len(buf) % CHUNK_DTYPE.itemsize:
        raise ValueError(f"a micro-batch is a whole number of {CHUNK_DTYPE.itemsize}-byte dp_chunk records, "
                         f"got {len(buf)} bytes")
    return np.frombuffer(buf, dtype=CHUNK_DTYPE)


def make_batch(chunks: list[dict], batch_seq: int = 0) -> np.ndarray:
    """Records for a micro-batch; each dict gives fields by name, `tokens` as a sequence (n_tokens follows)."""
    batch = np.zeros(len(chunks), dtype=CHUNK_DTYPE)
    for pos, fields in enumerate(chunks):
        rec = batch[pos]
        for name, value in fields.items():
            if name == "tokens":
                if len(value) > MAX_CHUNK_TOKENS:
                    raise ValueError(f"a chunk carries at most {MAX_CHUNK_TOKENS} tokens, got {len(value)}")
                rec["tokens"][:len(value)] = value
                rec["n_tokens"] = len(value)
            else:
                rec[name] = value
        rec["batch_seq"], rec["batch_len"], rec["batch_pos"] = batch_seq, len(chunks), pos
    return batch
