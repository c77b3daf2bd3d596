"""Codec for the request and response packets defined in bpf/wire.h.

The struct formats below mirror bpf/wire.h field by field; the test
tests/test_wire_layout.py compiles the header with cffi and proves every size
and offset equal, and every DP_* constant. Little-endian throughout.

Decoding never trusts the buffer: any malformed input raises WireError, which
names the offending field and the reason.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

MAGIC = 0x31575044
VERSION = 1
MAX_CHUNK_TOKENS = 128
MAX_RESP_BODY = 1024
DEFAULT_PORT = 7878

KIND_OPEN = 1
KIND_CHUNK = 2
KIND_CLOSE = 3
KIND_COUNT_TOKENS = 4
KIND_RESPONSE = 5
REQUEST_KINDS = {KIND_OPEN: "open", KIND_CHUNK: "chunk", KIND_CLOSE: "close", KIND_COUNT_TOKENS: "count_tokens"}
KINDS_WITH_TOKENS = (KIND_CHUNK, KIND_COUNT_TOKENS)

FLAG_TRACE = 0x0001
FLAGS_KNOWN = 0x0001

STATUS_OK = 200
STATUS_BAD_REQUEST = 400
STATUS_TOO_LARGE = 413
STATUS_UNPROCESSABLE = 422
STATUS_RATE_LIMITED = 429
STATUS_UNAVAILABLE = 503
STATUSES = (STATUS_OK, STATUS_BAD_REQUEST, STATUS_TOO_LARGE, STATUS_UNPROCESSABLE,
            STATUS_RATE_LIMITED, STATUS_UNAVAILABLE)

# (field, struct code) in wire order: the one Python statement of the layout.
REQ_FIELDS = (
    ("magic", "I"), ("version", "B"), ("kind", "B"), ("flags", "H"),
    ("tenant", "I"), ("max_output_tokens", "I"),
    ("session_id", "Q"), ("request_id", "Q"),
    ("chunk_index", "H"), ("chunk_count", "H"), ("n_tokens", "H"), ("reserved", "H"),
    ("send_ns", "Q"),
)
RESP_FIELDS = (
    ("magic", "I"), ("version", "B"), ("kind", "B"), ("flags", "H"),
    ("tenant", "I"), ("status", "H"), ("body_len", "H"),
    ("session_id", "Q"), ("request_id", "Q"), ("send_ns", "Q"),
)
TRACE_FIELDS = (   # struct dp_resp_trace: the end of a response body whose flags have FLAG_TRACE
    ("t_xdp", "Q"), ("t_first_lane", "Q"), ("t_done", "Q"), ("t_egress", "Q"),
    ("worker", "H"), ("pool", "H"), ("reserved", "I"),
)
REQ_HDR = struct.Struct("<" + "".join(code for _, code in REQ_FIELDS))
RESP_HDR = struct.Struct("<" + "".join(code for _, code in RESP_FIELDS))
REQ_HDR_LEN = REQ_HDR.size      # 48
RESP_HDR_LEN = RESP_HDR.size    # 40
RESP_TRACE = struct.Struct("<" + "".join(code for _, code in TRACE_FIELDS))
RESP_TRACE_LEN = RESP_TRACE.size  # 40
TOKEN = struct.Struct("<I")


def field_offsets(fields) -> dict[str, tuple[int, int]]:
    """{field: (offset, size)} as the struct module lays the fields out."""
    out, off = {}, 0
    for name, code in fields:
        size = struct.calcsize("<" + code)
        out[name] = (off, size)
        off += size
    return out


REQ_OFFSETS = field_offsets(REQ_FIELDS)
RESP_OFFSETS = field_offsets(RESP_FIELDS)
TRACE_OFFSETS = field_offsets(TRACE_FIELDS)


class WireError(ValueError):
    """A malformed packet: `field` names the offending field, `reason` says why."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class Request:
    kind: int
    tenant: int
    session_id: int
    request_id: int
    chunk_index: int = 0
    chunk_count: int = 1
    tokens: tuple[int, ...] = ()
    max_output_tokens: int = 0
    flags: int = 0
    send_ns: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Response:
    tenant: int
    session_id: int
    request_id: int
    status: int
    body: bytes = b""
    flags: int = 0
    send_ns: int = 0
    trace: dict | None = None   # FLAG_TRACE: {field: value} of the trace that ended the body (not in body)


def _truncated(fields_offsets: dict, have: int, total: int):
    """The first field a buffer of `have` bytes cuts short."""
    for name, (off, size) in fields_offsets.items():
        if off + size > have:
            return WireError(name, f"truncated: buffer is {have} bytes, {name} needs bytes {off}..{off + size - 1} "
                                   f"(header is {total} bytes)")
    raise AssertionError("not truncated")


def _check_common(magic: int, version: int, flags: int):
    if magic != MAGIC:
        raise WireError("magic", f"0x{magic:08x} is not 0x{MAGIC:08x}")
    if version != VERSION:
        raise WireError("version", f"{version} is not supported (this codec speaks {VERSION})")
    if flags & ~FLAGS_KNOWN:
        raise WireError("flags", f"unknown bits 0x{flags & ~FLAGS_KNOWN:04x}")


def _check_request(kind, chunk_index, chunk_count, n_tokens, reserved):
    if kind not in REQUEST_KINDS:
        raise WireError("kind", f"{kind} is not a request kind {sorted(REQUEST_KINDS)}")
    if reserved:
        raise WireError("reserved", f"must be 0, is {reserved}")
    if chunk_count < 1:
        raise WireError("chunk_count", "must be at least 1")
    if chunk_index >= chunk_count:
        raise WireError("chunk_index", f"{chunk_index} is not below chunk_count {chunk_count}")
    if kind in KINDS_WITH_TOKENS:
        if not 1 <= n_tokens <= MAX_CHUNK_TOKENS:
            raise WireError("n_tokens", f"{n_tokens} is outside 1..{MAX_CHUNK_TOKENS} for a {REQUEST_KINDS[kind]}")
    elif n_tokens:
        raise WireError("n_tokens", f"a {REQUEST_KINDS[kind]} carries no tokens, got {n_tokens}")


def encode_request(req: Request) -> bytes:
    """Validate and encode; raises WireError for a request the server would reject as malformed."""
    n = req.n_tokens
    _check_common(MAGIC, VERSION, req.flags)
    _check_request(req.kind, req.chunk_index, req.chunk_count, n, 0)
    try:
        head = REQ_HDR.pack(MAGIC, VERSION, req.kind, req.flags, req.tenant, req.max_output_tokens,
                            req.session_id, req.request_id, req.chunk_index, req.chunk_count, n, 0,
                            req.send_ns)
        return head + struct.pack(f"<{n}I", *req.tokens)
    except struct.error as e:
        raise WireError("request", f"a field is out of range: {e}") from None


def decode_request(buf) -> Request:
    buf = memoryview(buf).cast("B")
    if len(buf) < REQ_HDR_LEN:
        raise _truncated(REQ_OFFSETS, len(buf), REQ_HDR_LEN)
    (magic, version, kind, flags, tenant, max_out, session_id, request_id,
     chunk_index, chunk_count, n_tokens, reserved, send_ns) = REQ_HDR.unpack_from(buf)
    _check_common(magic, version, flags)
    _check_request(kind, chunk_index, chunk_count, n_tokens, reserved)
    want = REQ_HDR_LEN + 4 * n_tokens
    if len(buf) != want:
        raise WireError("tokens", f"n_tokens={n_tokens} needs a {want}-byte packet, buffer is {len(buf)} bytes")
    tokens = struct.unpack_from(f"<{n_tokens}I", buf, REQ_HDR_LEN)
    return Request(kind=kind, tenant=tenant, session_id=session_id, request_id=request_id,
                   chunk_index=chunk_index, chunk_count=chunk_count, tokens=tokens,
                   max_output_tokens=max_out, flags=flags, send_ns=send_ns)


def encode_response(resp: Response) -> bytes:
    _check_common(MAGIC, VERSION, resp.flags)
    if resp.status not in STATUSES:
        raise WireError("status", f"{resp.status} is not one of {STATUSES}")
    body, flags = bytes(resp.body), resp.flags & ~FLAG_TRACE   # the flag says whether a trace follows
    if resp.trace is not None:
        body += RESP_TRACE.pack(*(resp.trace.get(name, 0) for name, _ in TRACE_FIELDS))
        flags |= FLAG_TRACE
    if len(body) > MAX_RESP_BODY:
        raise WireError("body_len", f"{len(body)} exceeds {MAX_RESP_BODY}")
    try:
        return RESP_HDR.pack(MAGIC, VERSION, KIND_RESPONSE, flags, resp.tenant, resp.status,
                             len(body), resp.session_id, resp.request_id, resp.send_ns) + body
    except struct.error as e:
        raise WireError("response", f"a field is out of range: {e}") from None


def decode_response(buf) -> Response:
    buf = memoryview(buf).cast("B")
    if len(buf) < RESP_HDR_LEN:
        raise _truncated(RESP_OFFSETS, len(buf), RESP_HDR_LEN)
    (magic, version, kind, flags, tenant, status, body_len,
     session_id, request_id, send_ns) = RESP_HDR.unpack_from(buf)
    _check_common(magic, version, flags)
    if kind != KIND_RESPONSE:
        raise WireError("kind", f"{kind} is not a response ({KIND_RESPONSE})")
    if status not in STATUSES:
        raise WireError("status", f"{status} is not one of {STATUSES}")
    if body_len > MAX_RESP_BODY:
        raise WireError("body_len", f"{body_len} exceeds {MAX_RESP_BODY}")
    if len(buf) != RESP_HDR_LEN + body_len:
        raise WireError("body", f"body_len={body_len} needs a {RESP_HDR_LEN + body_len}-byte packet, "
                                f"buffer is {len(buf)} bytes")
    body, trace = bytes(buf[RESP_HDR_LEN:]), None
    if flags & FLAG_TRACE:
        if body_len < RESP_TRACE_LEN:
            raise WireError("body", f"flags say a {RESP_TRACE_LEN}-byte trace ends the body, it has {body_len} bytes")
        body, tail = body[:-RESP_TRACE_LEN], body[-RESP_TRACE_LEN:]
        trace = dict(zip((name for name, _ in TRACE_FIELDS), RESP_TRACE.unpack(tail)))
    return Response(tenant=tenant, session_id=session_id, request_id=request_id, status=status,
                    body=body, flags=flags, send_ns=send_ns, trace=trace)


def pack_request_raw(tokens=(), **fields) -> bytes:
    """Encode a request header from raw field values with no validation: for
    tests and load generators that must craft malformed packets on purpose."""
    values = {"magic": MAGIC, "version": VERSION, "kind": KIND_CHUNK, "flags": 0, "tenant": 0,
              "max_output_tokens": 0, "session_id": 0, "request_id": 0, "chunk_index": 0,
              "chunk_count": 1, "n_tokens": len(tokens), "reserved": 0, "send_ns": 0}
    unknown = set(fields) - set(values)
    if unknown:
        raise TypeError(f"unknown request fields: {sorted(unknown)}")
    values.update(fields)
    return REQ_HDR.pack(*(values[name] for name, _ in REQ_FIELDS)) + struct.pack(f"<{len(tokens)}I", *tokens)


@dataclass(frozen=True)
class AdmissionBody:
    """The JSON body of an admission answer (native/admission.c): a 400/422/429 refusal, or the
    200 answer to a COUNT_TOKENS record. `fields` holds the other top-level keys (request_tokens,
    limit_tokens, tokens_per_minute, retry_after_ms, would_be ...)."""
    status: int
    cost_breakdown: dict
    suggestions: list
    error: str = ""
    fields: dict = field(default_factory=dict)


def decode_admission_body(body) -> AdmissionBody:
    """Parse an admission body; WireError(field="body") if it is not one."""
    import json
    try:
        doc = json.loads(bytes(body).decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError("body", f"not a JSON document: {e}") from None
    if not isinstance(doc, dict) or doc.get("status") not in STATUSES:
        raise WireError("body", "no status among the body's keys")
    if not isinstance(doc.get("cost_breakdown"), dict) or not isinstance(doc.get("suggestions"), list):
        raise WireError("body", "an admission body carries cost_breakdown {...} and suggestions [...]")
    rest = {k: v for k, v in doc.items() if k not in ("status", "cost_breakdown", "suggestions", "error")}
    return AdmissionBody(status=doc["status"], cost_breakdown=doc["cost_breakdown"], suggestions=doc["suggestions"],
                         error=doc.get("error", ""), fields=rest)
