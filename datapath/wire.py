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
VERSION = 2                      # 2: the request header ends with a tag
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
STATUS_CONFLICT = 409
STATUS_TOO_LARGE = 413
STATUS_UNPROCESSABLE = 422
STATUS_RATE_LIMITED = 429
STATUS_UNAVAILABLE = 503
# in the order of the C counters' slots (wire.h dp_status_slot)
STATUSES = (STATUS_OK, STATUS_BAD_REQUEST, STATUS_CONFLICT, STATUS_TOO_LARGE, STATUS_UNPROCESSABLE,
            STATUS_RATE_LIMITED, STATUS_UNAVAILABLE)
N_STATUSES = len(STATUSES)

# (field, struct code) in wire order: the one Python statement of the layout.
REQ_FIELDS = (
    ("magic", "I"), ("version", "B"), ("kind", "B"), ("flags", "H"),
    ("tenant", "I"), ("max_output_tokens", "I"),
    ("session_id", "Q"), ("request_id", "Q"),
    ("chunk_index", "H"), ("chunk_count", "H"), ("n_tokens", "H"), ("reserved", "H"),
    ("send_ns", "Q"), ("tag", "Q"),
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
REQ_HDR_LEN = REQ_HDR.size      # 56
REQ_TAGGED_LEN = 48             # the bytes the tag covers: the header before it (bpf/wire.h, as each
TAG_KEY_LEN = 16                # DP_ constant: tests/test_wire_layout.py proves them equal)
RESP_HDR_LEN = RESP_HDR.size    # 40
RESP_TRACE = struct.Struct("<" + "".join(code for _, code in TRACE_FIELDS))
RESP_TRACE_LEN = RESP_TRACE.size  # 40


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
    tag: int = 0           # as decoded; encode_request sets it from a key when given one

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


def encode_request(req: Request, key: bytes | None = None) -> bytes:
    """Validate and encode; raises WireError for a request the server would reject as malformed.
    key: the tenant's tag key (tenant_key), which sets the tag; without one the tag is req.tag
    as given (0 by default: an ingress that requires tags drops it)."""
    n = req.n_tokens
    _check_common(MAGIC, VERSION, req.flags)
    _check_request(req.kind, req.chunk_index, req.chunk_count, n, 0)
    try:
        head = REQ_HDR.pack(MAGIC, VERSION, req.kind, req.flags, req.tenant, req.max_output_tokens,
                            req.session_id, req.request_id, req.chunk_index, req.chunk_count, n, 0,
                            req.send_ns, req.tag)
        body = struct.pack(f"<{n}I", *req.tokens)
    except struct.error as e:
        raise WireError("request", f"a field is out of range: {e}") from None
    return (sign(head, key) if key is not None else head) + body


# --- tags: SipHash-2-4 of the header's first 48 bytes under the tenant's key (bpf/siphash.h) -----------
# The ingress, when it requires tags, drops a request whose tag is not that of its tenant's key,
# before it charges or answers anything: a tenant id is then something a sender must hold the
# key of, not a number it writes. The tokens are not covered (the check's cost stays fixed, ~65 ns
# a chunk in XDP); nor is anything against a sender that sees the traffic (it can replay a chunk as
# it is: the router drops it as a duplicate only while it holds or remembers its request): the tag
# stops senders off the path from naming a tenant.

_M64 = (1 << 64) - 1


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _M64


def siphash24(key: bytes, data: bytes) -> int:
    """SipHash-2-4 of data (any length) under a 16-byte key, as the paper defines it."""
    if len(key) != TAG_KEY_LEN:
        raise ValueError(f"a SipHash key is {TAG_KEY_LEN} bytes, not {len(key)}")
    k0, k1 = struct.unpack("<2Q", key)
    v = [k0 ^ 0x736f6d6570736575, k1 ^ 0x646f72616e646f6d, k0 ^ 0x6c7967656e657261, k1 ^ 0x7465646279746573]

    def rounds(n):
        v0, v1, v2, v3 = v
        for _ in range(n):
            v0 = (v0 + v1) & _M64; v1 = _rotl(v1, 13) ^ v0; v0 = _rotl(v0, 32)
            v2 = (v2 + v3) & _M64; v3 = _rotl(v3, 16) ^ v2
            v0 = (v0 + v3) & _M64; v3 = _rotl(v3, 21) ^ v0
            v2 = (v2 + v1) & _M64; v1 = _rotl(v1, 17) ^ v2; v2 = _rotl(v2, 32)
        v[:] = v0, v1, v2, v3

    whole = len(data) // 8 * 8
    last = (len(data) & 0xff) << 56 | int.from_bytes(data[whole:], "little")
    for m in [*struct.unpack_from(f"<{whole // 8}Q", data), last]:
        v[3] ^= m
        rounds(2)
        v[0] ^= m
    v[2] ^= 0xff
    rounds(4)
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def request_tag(key: bytes, header) -> int:
    """The tag of a request header (its first REQ_TAGGED_LEN bytes) under a tenant's key."""
    return siphash24(key, bytes(header[:REQ_TAGGED_LEN]))


def sign(packet: bytes, key: bytes) -> bytes:
    """packet with its tag set for key (the header's other fields as they are)."""
    return packet[:REQ_TAGGED_LEN] + struct.pack("<Q", request_tag(key, packet)) + packet[REQ_HDR_LEN:]


def tenant_key(master: bytes, tenant: int) -> bytes:
    """Tenant's tag key derived from the operator's master secret: HMAC-SHA256(master,
    "zerolayer-wire-tag" || tenant), its first 16 bytes. The operator hands each tenant its own
    key and installs it in the ingress (Ingress.set_tenant_key); no tenant can derive another's."""
    import hashlib
    import hmac
    if len(master) < 16:
        raise ValueError("the master secret must be at least 16 bytes")
    return hmac.new(bytes(master), b"zerolayer-wire-tag\0" + int(tenant).to_bytes(4, "little"),
                    hashlib.sha256).digest()[:TAG_KEY_LEN]


def decode_request(buf) -> Request:
    buf = memoryview(buf).cast("B")
    if len(buf) < REQ_HDR_LEN:
        raise _truncated(REQ_OFFSETS, len(buf), REQ_HDR_LEN)
    (magic, version, kind, flags, tenant, max_out, session_id, request_id,
     chunk_index, chunk_count, n_tokens, reserved, send_ns, tag) = REQ_HDR.unpack_from(buf)
    _check_common(magic, version, flags)
    _check_request(kind, chunk_index, chunk_count, n_tokens, reserved)
    want = REQ_HDR_LEN + 4 * n_tokens
    if len(buf) != want:
        raise WireError("tokens", f"n_tokens={n_tokens} needs a {want}-byte packet, buffer is {len(buf)} bytes")
    tokens = struct.unpack_from(f"<{n_tokens}I", buf, REQ_HDR_LEN)
    return Request(kind=kind, tenant=tenant, session_id=session_id, request_id=request_id,
                   chunk_index=chunk_index, chunk_count=chunk_count, tokens=tokens,
                   max_output_tokens=max_out, flags=flags, send_ns=send_ns, tag=tag)


def encode_response(resp: Response) -> bytes:
    _check_common(MAGIC, VERSION, resp.flags)
    if resp.status not in STATUSES:
        raise WireError("status", f"{resp.status} is not one of {STATUSES}")
    body, flags = bytes(resp.body), resp.flags & ~FLAG_TRACE   # the flag says whether a trace follows
    if resp.trace is not None:
        if resp.trace.get("reserved", 0):
            raise WireError("trace", "its reserved field must be 0")
        try:
            body += RESP_TRACE.pack(*(resp.trace.get(name, 0) for name, _ in TRACE_FIELDS))
        except struct.error as e:        # (a worker past 16 bits raised a bare struct.error)
            raise WireError("trace", f"a field is out of range: {e}") from None
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
        if trace["reserved"]:
            raise WireError("trace", f"its reserved field is 0x{trace['reserved']:x}, not 0 (bpf/wire.h)")
    return Response(tenant=tenant, session_id=session_id, request_id=request_id, status=status,
                    body=body, flags=flags, send_ns=send_ns, trace=trace)


def pack_request_raw(tokens=(), **fields) -> bytes:
    """Encode a request header from raw field values with no validation: for
    tests and load generators that must craft malformed packets on purpose."""
    values = {"magic": MAGIC, "version": VERSION, "kind": KIND_CHUNK, "flags": 0, "tenant": 0,
              "max_output_tokens": 0, "session_id": 0, "request_id": 0, "chunk_index": 0,
              "chunk_count": 1, "n_tokens": len(tokens), "reserved": 0, "send_ns": 0, "tag": 0}
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
