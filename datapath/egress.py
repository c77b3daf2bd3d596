"""The response path: a native thread turns the router's egress records into UDP
responses (bpf/wire.h) to the client, and keeps each response's stamps."""
from __future__ import annotations

import ipaddress
import socket
import struct

import numpy as np

from ._dataplane import ffi, lib
from .records import RESPONSE, dtype_of
from .wire import STATUSES
from .ring import Ring

TRACE = dtype_of("struct dp_trace")


class Responder:
    """Drains `egress` (its consumer) and sends each response from `sock` to its request's source
    (the record's client address), or to (dst_ip, dst_port) for a record without one.

    sock: a UDP socket, opened in the namespace the responses leave from
    (topology.socket_in); the responder keeps it open while it runs.
    """

    def __init__(self, egress: Ring, sock: socket.socket, dst_ip: str, dst_port: int, trace_cap: int = 1 << 20):
        if not 1 <= dst_port <= 65535:
            raise ValueError(f"dst_port must be 1..65535, not {dst_port}")
        if egress.slot_size < RESPONSE.itemsize:        # each slot is read as a whole record
            raise ValueError(f"egress ring {egress.name!r} has {egress.slot_size}-byte slots: a response "
                             f"record needs {RESPONSE.itemsize}")
        self.egress, self.sock = egress.act("consumer"), sock
        self._trace = np.zeros(trace_cap, dtype=TRACE)
        self._r = ffi.new("struct dp_responder *")
        self._r.egress = egress.ptr
        self._r.fd = sock.fileno()
        self._r.dst_ip = struct.unpack("=I", ipaddress.IPv4Address(dst_ip).packed)[0]   # network order in memory
        self._r.dst_port = socket.htons(dst_port)
        self._r.trace = ffi.cast("struct dp_trace *", ffi.from_buffer(self._trace))
        self._r.trace_cap = trace_cap


    @property
    def handle(self):
        """The C responder, for a native poll loop (datapath.loop) in this process."""
        return self._r

    def poll(self) -> int:
        """One pass (tests); a pipeline runs dp_responder_poll as a stage of its poll loop."""
        return lib.dp_responder_poll(self._r)

    def stats(self) -> dict:
        r = self._r
        return {"sent": r.sent, "send_errors": r.send_errors, "send_blocked": r.send_blocked,
                "send_held": r.send_held, "held": r.n_held, "held_tries": r.held_tries, "traced": r.traced,
                "by_status": {s: r.by_status[i] for i, s in enumerate(STATUSES) if r.by_status[i]}}

    def trace(self) -> np.ndarray:
        """The stamps of every response traced so far (a copy)."""
        return self._trace[:self._r.traced].copy()
