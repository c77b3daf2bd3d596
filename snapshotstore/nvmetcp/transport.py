"""One NVMe/TCP connection's PDU stream, as both ends use it: send a PDU, receive one checked.

A received PDU is taken in two steps, so its data lands where it belongs
(an aligned I/O buffer) without a copy: recv_header() reads and checks the
header, its digest and the lengths; recv_data() then reads the data and its
digest into the caller's buffer. A malformed header raises ProtocolError
(the connection cannot continue: the receiver sends a TermReq and closes).
"""
from __future__ import annotations

import socket
import time

from . import pdu as P

# TermReq PDUs never carry digests; ICReq/ICResp neither (they are exchanged before digests are on)
_NO_DIGESTS = (P.ICREQ, P.ICRESP, P.H2C_TERM_REQ, P.C2H_TERM_REQ)


class ProtocolError(Exception):
    """A fatal transport error: fes/fei as a TermReq reports them, header = the offending PDU's."""

    def __init__(self, text: str, fes: int = P.FES_INVALID_HEADER_FIELD, fei: int = 0, header: bytes = b""):
        super().__init__(text)
        self.fes, self.fei, self.header = fes, fei, header


class ConnectionClosed(Exception):
    """The peer closed the connection (or it was reset)."""


class Channel:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.hdgst = self.ddgst = False          # negotiated by ICReq/ICResp
        self.data_align = 1                      # a controller's C2HData: (the host's HPDA + 1) x 4 bytes
        self._ch = bytearray(P.CH.size)
        self._scratch = bytearray(256)
        self.deadline = None                     # monotonic seconds: no read past it (an exchange's bound)

    # --- sending -----------------------------------------------------------------------

    def send(self, pdu_type: int, psh: bytes, data=None, flags: int = 0) -> None:
        """One PDU: the PDU-specific header psh (after the common header), then data (a buffer)."""
        hlen = P.CH.size + len(psh)
        digests = pdu_type not in _NO_DIGESTS
        hd = P.DIGEST_LEN if digests and self.hdgst else 0
        dlen = len(data) if data is not None else 0
        dd = P.DIGEST_LEN if digests and self.ddgst and dlen else 0
        # a C2HData's data starts at a multiple of the alignment the host asked for (HPDA), padded
        align = self.data_align if pdu_type == P.C2H_DATA else 1
        pdo = -(-(hlen + hd) // align) * align if dlen else 0
        pad = pdo - hlen - hd if dlen else 0
        plen = hlen + hd + pad + dlen + dd
        flags |= (P.FLAG_HDGST if hd else 0) | (P.FLAG_DDGST if dd else 0)
        header = P.CH.struct.pack(pdu_type, flags, hlen, pdo, plen) + psh
        parts = [header]
        if hd:
            parts.append(P.digest(header))
        if dlen:
            if pad:
                parts.append(bytes(pad))
            parts.append(data)
            if dd:
                parts.append(P.digest(data))
        self._sendall(parts, plen)

    def _sendall(self, parts, total: int) -> None:
        sent = self.sock.sendmsg(parts)
        while sent < total:                       # a short send: finish the rest in order
            rest, skip = [], sent
            for p in parts:
                n = len(p)
                if skip >= n:
                    skip -= n
                    continue
                rest.append(memoryview(p)[skip:])
                skip = 0
            parts, total = rest, total - sent
            sent = self.sock.sendmsg(parts)

    # --- receiving ---------------------------------------------------------------------

    def recv_exact(self, view) -> None:
        view = memoryview(view).cast("B")
        if self.deadline is None:
            while view:
                view = view[self._recv_into(view):]
            return
        # the socket's timeout bounds one read, the deadline the whole exchange: a peer that kept
        # sending PDUs without data (zero-length R2Ts), or a byte at a time, held it for ever
        base = self.sock.gettimeout()
        try:
            while view:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout("the exchange's deadline passed")
                self.sock.settimeout(left if base is None else min(base, left))
                view = view[self._recv_into(view):]
        finally:
            self.sock.settimeout(base)

    def _recv_into(self, view) -> int:
        n = self.sock.recv_into(view)
        if n == 0:
            raise ConnectionClosed("the peer closed the connection")
        return n

    def recv_header(self, allowed, max_data) -> tuple[int, int, bytes, int]:
        """The next PDU's (type, flags, header, data length): its type one of allowed, its header
        length the spec's, its digest right, its data no more than max_data(type) bytes."""
        self.recv_exact(self._ch)
        pdu_type, flags, hlen, pdo, plen = P.CH.struct.unpack(self._ch)
        ch = bytes(self._ch)
        if pdu_type not in allowed:
            raise ProtocolError(f"unexpected PDU type {pdu_type:#04x}", P.FES_INVALID_HEADER_FIELD, 0, ch)
        layout = P.HEADERS[pdu_type]
        if hlen != layout.size:
            raise ProtocolError(f"{P.PDU_NAMES[pdu_type]} with hlen {hlen}, not {layout.size}",
                                P.FES_INVALID_HEADER_FIELD, 2, ch)
        digests = pdu_type not in _NO_DIGESTS
        if pdu_type in (P.H2C_TERM_REQ, P.C2H_TERM_REQ):
            pdo = hlen               # its error data follows the header (SPDK and FreeBSD send pdo 0)
        hd = P.DIGEST_LEN if digests and self.hdgst else 0
        if digests and bool(flags & P.FLAG_HDGST) != self.hdgst:
            raise ProtocolError("the header digest flag differs from what was negotiated",
                                P.FES_INVALID_HEADER_FIELD, 1, ch)
        if plen < hlen + hd:
            raise ProtocolError(f"plen {plen} is shorter than the header", P.FES_INVALID_HEADER_FIELD, 4, ch)
        has_data = plen > hlen + hd
        dd = P.DIGEST_LEN if digests and self.ddgst and has_data else 0
        if has_data and not hlen + hd <= pdo <= plen - dd:
            raise ProtocolError(f"pdo {pdo} is outside the PDU", P.FES_INVALID_HEADER_FIELD, 3, ch)
        if digests and has_data and bool(flags & P.FLAG_DDGST) != self.ddgst:
            raise ProtocolError("the data digest flag differs from what was negotiated",
                                P.FES_INVALID_HEADER_FIELD, 1, ch)
        dlen = plen - pdo - dd if has_data else 0
        if has_data and dlen == 0:   # only padding or a digest after the header: its data digest went unread
            raise ProtocolError(f"{P.PDU_NAMES[pdu_type]} with a data section of 0 bytes",
                                P.FES_INVALID_HEADER_FIELD, 3, ch)
        if dlen > max_data(pdu_type):
            raise ProtocolError(f"{P.PDU_NAMES[pdu_type]} of {plen} bytes exceeds the limit",
                                P.FES_DATA_LIMIT_EXCEEDED, 4, ch)
        rest = bytearray(hlen - P.CH.size + hd)
        self.recv_exact(rest)
        header = ch + bytes(rest[:len(rest) - hd])
        if hd and rest[-hd:] != P.digest(header):
            raise ProtocolError("header digest mismatch", P.FES_HEADER_DIGEST_ERROR, 0, header)
        if has_data and pdo > hlen + hd:
            self.recv_exact(memoryview(self._scratch)[:pdo - hlen - hd])     # alignment padding
        self._dd = dd
        return pdu_type, flags, header, dlen

    def recv_data(self, view) -> bool:
        """Read the data of the PDU whose header was just received into view (exactly its
        length); False if its data digest does not match."""
        self.recv_exact(view)
        if not self._dd:
            return True
        got = memoryview(self._scratch)[:P.DIGEST_LEN]
        self.recv_exact(got)
        return bytes(got) == P.digest(view)

    def discard(self, n: int) -> None:
        while n:
            k = min(n, len(self._scratch))
            self.recv_exact(memoryview(self._scratch)[:k])
            n -= k
        if self._dd:
            self.recv_exact(memoryview(self._scratch)[:P.DIGEST_LEN])

    def send_term(self, pdu_type: int, fes: int, fei: int, header: bytes) -> None:
        """A TermReq naming the PDU (header) that broke the protocol; none for a TermReq, which ends
        the stream whatever it holds (one with too much error data was answered: a review)."""
        if header[:1] in (bytes([P.H2C_TERM_REQ]), bytes([P.C2H_TERM_REQ])):
            return
        self.send(pdu_type, P.psh(P.TERM_REQ_PDU, fes=fes, fei=fei), header[:P.TERM_MAX_ERROR_DATA] or None)

    def shutdown(self) -> None:
        """End the stream, from any thread: the owning thread's next read or write fails and it
        closes the socket. A close from another thread freed the fd number while the owner could
        still be about to use it, and the next accept could reuse it for another host's stream."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """End the stream and release the socket: by the thread that reads and writes it."""
        self.shutdown()
        self.sock.close()
