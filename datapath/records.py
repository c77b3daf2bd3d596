"""numpy views of the records in native/chunk.h, built from the C compiler's layout.

The dtypes are read off the cffi extension (whose cdef is chunk.h's LAYOUT
section), so there is no second statement of any offset here: Python reads a
micro-batch in place as a structured array, one call per batch.
"""
from __future__ import annotations

import numpy as np

from ._dataplane import ffi, lib
from .wire import KIND_CHUNK, KIND_OPEN

MAX_CHUNK_TOKENS = lib.DP_MAX_CHUNK_TOKENS
MAX_BATCH_CHUNKS = lib.DP_MAX_BATCH_CHUNKS
MAX_OUTPUT_TOKENS = lib.DP_MAX_OUTPUT_TOKENS
KIND_DECODE = lib.DP_KIND_DECODE
CHUNK_F_FINAL = lib.DP_CHUNK_F_FINAL
CHUNK_F_MOVED = lib.DP_CHUNK_F_MOVED
CHUNK_F_REPLAY = lib.DP_CHUNK_F_REPLAY
CHUNK_F_RETAKE = lib.DP_CHUNK_F_RETAKE
CE_EOS = lib.DP_CE_EOS
CE_KV_FULL = lib.DP_CE_KV_FULL
CE_NO_STORE = lib.DP_CE_NO_STORE
CE_STORE = lib.DP_CE_STORE
CE_KV_LOST = lib.DP_CE_KV_LOST

_SCALARS = {"uint8_t": np.uint8, "uint16_t": np.uint16, "uint32_t": np.uint32, "uint64_t": np.uint64}


def _np_type(ctype):
    if ctype.kind == "primitive":
        return np.dtype(_SCALARS[ctype.cname]).newbyteorder("<")
    if ctype.kind == "array":
        return (_np_type(ctype.item), ctype.length)
    if ctype.kind == "struct":
        return dtype_of(ctype.cname)
    raise TypeError(f"no numpy type for {ctype.cname}")


def dtype_of(cname: str) -> np.dtype:
    """The numpy dtype with the same fields, offsets and size as C's `cname`."""
    ctype = ffi.typeof(cname)
    names, formats, offsets = [], [], []
    for name, field in ctype.fields:
        names.append(name)
        formats.append(_np_type(field.type))
        offsets.append(field.offset)
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": ffi.sizeof(ctype)})


CHUNK = dtype_of("struct dp_chunk")
COMPLETION = dtype_of("struct dp_completion")
RESPONSE = dtype_of("struct dp_response_rec")


def request_open(request_id: int, chunk_count: int, *, session: int | None = None, max_out: int = 0,
                 tenant: int = 0, t_send: int = 0) -> np.ndarray:
    """The OPEN record of a request of chunk_count chunks, as the ingress delivers it."""
    arr = np.zeros(1, dtype=CHUNK)
    arr["session_id"] = request_id if session is None else session
    arr["request_id"] = request_id
    arr["tenant"] = tenant
    arr["max_output_tokens"] = max_out
    arr["chunk_count"] = chunk_count
    arr["kind"] = KIND_OPEN
    arr["t_send"] = t_send
    return arr


def request_chunks(request_id: int, tokens, session: int | None = None, max_out: int = 0, tenant: int = 0,
                   t_send: int = 0) -> np.ndarray:
    """A request cut into <= 128-token chunk records, as the ingress delivers them."""
    tokens = list(tokens)
    pieces = [tokens[i:i + MAX_CHUNK_TOKENS] for i in range(0, len(tokens), MAX_CHUNK_TOKENS)] or [[]]
    arr = np.zeros(len(pieces), dtype=CHUNK)
    arr["session_id"] = request_id if session is None else session
    arr["request_id"] = request_id
    arr["tenant"] = tenant
    arr["max_output_tokens"] = max_out
    arr["chunk_index"] = np.arange(len(pieces))
    arr["chunk_count"] = len(pieces)
    arr["kind"] = KIND_CHUNK
    arr["t_send"] = t_send
    for i, p in enumerate(pieces):
        arr[i]["n_tokens"] = len(p)
        arr[i]["tokens"][:len(p)] = p
    return arr
