"""An NVMe/TCP target serving one namespace from a file or block device (O_DIRECT).

    with Target("store.img", nqn="nqn.2026-12.io.zerolayer:store") as t:   # listens on 127.0.0.1:4420
        LogStore(t.url) ...

One controller (static CNTLID 1, one host at a time: a second host's Connect
is answered Controller Busy, so two stores never share the namespace), an
admin queue and one I/O queue, each its own TCP connection and thread.
Commands on a queue run in order. A Write beyond the in-capsule size is
pulled with one R2T per MAXH2CDATA chunk, and each chunk is written before
the next R2T goes out: memory per command stays one chunk, and a write cut
by a crash leaves whole chunks, as a power cut leaves whole LBAs on a drive
(atomic write unit: one LBA). A Write with FUA, or a Flush, is fdatasync'd
before its CapsuleResp is sent. Bounded: connections, queue depth, PDU sizes
(a PDU over the limit gets a C2HTermReq and the connection is closed).

A host that goes away without closing its connections (a power cut, a
partition) does not hold the controller for good: a connection must Connect
within HANDSHAKE_TIMEOUT_S of its accept, TCP keep-alive probes every idle
connection (keepalive_s, then 3 probes keepalive_s / 3 apart) and a send left
unacknowledged that long gives up (TCP_USER_TIMEOUT), and an admin queue that
asked for a keep-alive timeout (KATO) and hears nothing for twice it ends its
association. Before, every later Connect was answered Controller Busy until
the target restarted.
"""
from __future__ import annotations

import collections
import errno
import os
import select
import socket
import stat
import struct
import threading
import time
import uuid

from ..device import BlockDevice, aligned_buffer
from ..errors import DeviceError
from . import pdu as P
from .transport import Channel, ConnectionClosed, ProtocolError

DEFAULT_NQN = "nqn.2026-12.io.zerolayer:snapshots"
DEFAULT_PORT = 4420
CNTLID = 1
NSID = 1
ADMIN_QUEUE_DEPTH = 32       # Linux's NVME_AQ_DEPTH: the admin queue's size from every kernel host
MAX_CONNECTIONS = 8            # an association (2), and room for refused or reconnecting hosts
HANDSHAKE_TIMEOUT_S = 10.0     # a connection that has not connected its queue by then is dropped
MIN_MAXH2CDATA = 4096          # the spec's floor (Linux refuses a target that offers less)
MAX_MAXH2CDATA = 0xFFFFFFFF    # the ICResp field is 32 bits


class Target:
    def __init__(self, path: str, nqn: str = DEFAULT_NQN, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                 queue_depth: int = 32, maxh2cdata: int = 128 << 10, in_capsule: int = 8192,
                 max_transfer: int = 1 << 20, keepalive_s: float = 10.0, log=None):
        P.nqn_field(nqn)
        if not MIN_MAXH2CDATA <= maxh2cdata <= MAX_MAXH2CDATA:
            # (over 32 bits, every connection's ICResp failed to pack: a traceback per queue thread)
            raise ValueError(f"maxh2cdata is {MIN_MAXH2CDATA} to {MAX_MAXH2CDATA} bytes (NVMe/TCP), not {maxh2cdata}")
        if not keepalive_s >= 1:
            raise ValueError(f"keepalive_s is at least 1 second, not {keepalive_s}")
        self.keepalive_s = keepalive_s
        self.log = log                   # log(line) for each queue connected (`snapshotstore target` prints them)
        self.path, self.nqn, self.host, self.port = path, nqn, host, port
        self.queue_depth, self.maxh2cdata, self.in_capsule = queue_depth, maxh2cdata, in_capsule
        self.mdts = max(0, (max_transfer >> 12).bit_length() - 1)    # 2^mdts * 4 KiB (CAP.MPSMIN)
        self.max_transfer = 4096 << self.mdts
        if max(in_capsule, P.ADMIN_ICD) > self.max_transfer:
            # in-capsule data is read into the queue's transfer buffer: a larger capsule was read
            # short, and its rest parsed as the next PDU header
            raise ValueError(f"in_capsule {in_capsule} (and the admin queue's {P.ADMIN_ICD}) must fit the "
                             f"transfer size {self.max_transfer}")
        self.dev: BlockDevice | None = None
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()                 # connections and the controller state
        self._conns: set[_Connection] = set()
        self._accepter: threading.Thread | None = None
        self._threads: list[threading.Thread] = []     # one per connection
        self._stopping = threading.Event()
        self.cc = self.csts = 0
        self.host_nqn: str | None = None              # the associated host, None when free
        # An association's number, bumped when it ends or its controller is reset (CC.EN 1 -> 0, which
        # ends its I/O queues); every write checks it under the write lock,
        # and a new association's Connect waits for that lock (outside the target's lock): a write
        # of an ended association lands before the next host is let in, or not at all (a dead
        # host's last in-flight write landed over the new host's before).
        self.association = 0
        self._write_lock = threading.Lock()
        self.admin_queue: _Connection | None = None
        self.io_queue: _Connection | None = None

    @property
    def url(self) -> str:
        return f"nvme-tcp://{self.host}:{self.port}/{self.nqn}"

    def start(self) -> "Target":
        self.dev = BlockDevice(self.path)
        if (self.max_transfer % self.dev.block_size or self.maxh2cdata % self.dev.block_size
                or not self.maxh2cdata or not self.dev.blocks):
            self.dev.close()
            raise DeviceError(f"{self.path} has {self.dev.blocks} blocks of {self.dev.block_size} bytes: a "
                              f"namespace needs one at least, and the transfer sizes (maxh2cdata "
                              f"{self.maxh2cdata}) must be positive multiples of the block size")
        try:
            self.dev.lock(shared=False)                # no local store on it meanwhile
            self._listener = socket.create_server((self.host, self.port))
        except DeviceError:
            self.dev.close()
            raise
        except OSError as e:
            self.dev.close()
            raise DeviceError(f"cannot listen on {self.host}:{self.port}: {e.strerror}") from None
        self.port = self._listener.getsockname()[1]
        self._accepter = threading.Thread(target=self._accept_loop, name="nvmet-accept", daemon=True)
        self._accepter.start()
        return self

    def stop(self) -> None:
        """Stop accepting, close every connection, wait for their threads, release the device."""
        self._stopping.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)     # wakes accept()
            except OSError:
                pass
            self._listener.close()
        if self._accepter is not None:
            self._accepter.join(10)                   # no connection is added after this
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.channel.shutdown()
        for t in self._threads:
            t.join(10)
        if self.dev is not None:
            try:
                self.dev.sync()          # what was written without FUA or a Flush, made durable too
            except (DeviceError, OSError):
                pass
            self.dev.close()
            self.dev = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def wait(self) -> None:
        """Serve until stop() is called (from a signal handler, say)."""
        self._stopping.wait()

    def _accept_loop(self):
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(0.01)                  # ECONNABORTED, EMFILE, ...: not the end of serving
                continue
            with self._lock:
                if len(self._conns) >= MAX_CONNECTIONS or self._stopping.is_set():
                    sock.close()
                    continue
                try:
                    conn = _Connection(self, sock)
                except OSError:
                    sock.close()
                    continue
                self._conns.add(conn)
            t = threading.Thread(target=conn.run, name="nvmet-queue", daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _closed(self, conn: "_Connection"):
        with self._lock:
            self._conns.discard(conn)
            if self.io_queue is conn:
                self.io_queue = None
            others = self._end_association() if conn is self.admin_queue else []
        for c in others:
            c.channel.shutdown()

    def _end_association(self) -> list["_Connection"]:
        """The admin queue is gone (lock held): the controller is free; its I/O queues, to close."""
        self.host_nqn, self.cc, self.csts, self.admin_queue, self.io_queue = None, 0, 0, None, None
        self.association += 1
        return [c for c in self._conns if c.connected and c.qid != 0]

    # --- identify data and properties -------------------------------------------------------

    def identify_controller(self) -> bytes:
        return P.pack(P.ID_CTRL, vid=0x1AF4, ssvid=0x1AF4, sn=(b"zerolayer-%08d" % (self.port % 10 ** 8)).ljust(20),
                      mn=b"zerolayer snapshot target".ljust(40), fr=b"1.0".ljust(8), mdts=self.mdts,
                      cntlid=CNTLID, ver=P.NVME_VERSION, cntrltype=P.CNTRLTYPE_IO,
                      kas=P.KAS_UNITS,              # Linux refuses a fabrics controller without keep-alive
                      sqes=0x66, cqes=0x44, maxcmd=self.queue_depth,
                      nn=1, vwc=1, awun=0, awupf=0, sgls=(1 << 0) | (1 << 20),   # SGLs; offsets in capsules
                      subnqn=P.nqn_field(self.nqn), ioccsz=(64 + self.in_capsule) // 16, iorcsz=1,
                      msdbd=1)                      # one SGL descriptor per command: all that is parsed

    def identify_namespace(self) -> bytes:
        lbads = self.dev.block_size.bit_length() - 1
        return P.pack(P.ID_NS, nsze=self.dev.blocks, ncap=self.dev.blocks, nuse=self.dev.blocks,
                      nlbaf=0, flbas=0, lbaf=struct.pack("<I", lbads << 16))

    def active_namespaces(self, after: int) -> bytes:
        """Identify CNS 02h: the active NSIDs above after (Linux scans namespaces by this list)."""
        return struct.pack("<I", NSID).ljust(P.IDENTIFY_LEN, b"\0") if after < NSID else bytes(P.IDENTIFY_LEN)

    def namespace_descriptors(self) -> bytes:
        """Identify CNS 03h: a UUID and the command set (NVM). Linux reads it before Identify Namespace
        and attaches no namespace when it fails. The UUID names the namespace's backing store, not
        the subsystem alone: a target restarted on another image under the same NQN was the same
        namespace to a host, which kept its cached blocks. A block device is named by its device
        number (its /dev node's inode changes at every boot), a file by its filesystem and inode."""
        st = os.fstat(self.dev.fd)
        backing = f"blk:{st.st_rdev}" if stat.S_ISBLK(st.st_mode) else f"file:{st.st_dev}:{st.st_ino}"
        nsuuid = uuid.uuid5(uuid.NAMESPACE_URL, f"nvme:{self.nqn}:{NSID}:{backing}").bytes
        return (P.pack(P.NS_DESC, nidt=P.NIDT_UUID, nidl=16) + nsuuid
                + P.pack(P.NS_DESC, nidt=P.NIDT_CSI, nidl=1) + b"\0").ljust(P.IDENTIFY_LEN, b"\0")

    def get_property(self, ofst: int, size8: bool) -> int | None:
        if ofst == P.PROP_CAP and size8:
            # MQES (0's based), CQR, TO = 500 ms, CSS = NVM, MPSMIN = MPSMAX = 4 KiB
            return (self.queue_depth - 1) | 1 << 16 | 1 << 24 | 1 << 37
        if not size8 and ofst in (P.PROP_VS, P.PROP_CC, P.PROP_CSTS):
            return {P.PROP_VS: P.NVME_VERSION, P.PROP_CC: self.cc, P.PROP_CSTS: self.csts}[ofst]
        return None

    def set_property(self, ofst: int, value: int, conn: "_Connection") -> bool:
        if ofst != P.PROP_CC:
            return False
        reset = []
        with self._lock:
            # _execute checked the association without this lock: a closed host's last Property Set
            # could pass it, then a new host's Connect take the controller, and CC.EN=0 reset that
            # host's controller (found by review); checked again here, where the Connect cannot run
            if conn is not self.admin_queue:
                raise ConnectionClosed("this queue's association has ended")
            if self.cc & P.CC_EN and not value & P.CC_EN:
                # a controller reset (CC.EN 1 -> 0): its I/O queues are deleted, the host connects
                # them again once it has enabled it (NVMe-oF 1.1, 3.5); the admin queue stays. One
                # left open kept the I/O slot taken: the reconnect was refused (Command Sequence)
                reset = [c for c in self._conns if c.connected and c.qid != 0]
                self.io_queue = None
                self.association += 1             # their writes still running are refused (_write)
            if value & P.CC_EN and not self.cc & P.CC_EN:
                self.csts &= ~(3 << 2)                # enabled again: no shutdown reported any more
            self.cc = value & 0xFFFFFFFF
            if value & P.CC_SHN_MASK:
                self.dev.sync()                       # a shutdown notification: make everything durable
                self.csts = (self.csts & ~(3 << 2)) | P.CSTS_SHST_COMPLETE
            self.csts = (self.csts | P.CSTS_RDY) if value & P.CC_EN else (self.csts & ~P.CSTS_RDY)
        for c in reset:
            c.channel.shutdown()
        if reset:
            with self._write_lock:                # one of theirs already writing lands before the
                pass                              # reset is done, never over the next queue's writes
        return True


class _Command:
    __slots__ = ("sqe", "header", "data")

    def __init__(self, sqe: dict, header: bytes, data):
        self.sqe, self.header, self.data = sqe, header, data


class _Connection:
    """One queue: the admin queue (qid 0) or the I/O queue (qid 1), as its Connect says."""

    def __init__(self, target: Target, sock: socket.socket):
        self.t, self.channel = target, Channel(sock)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        k = target.keepalive_s                     # a host gone without a close (the module's text)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(k)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, int(k / 3)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(k * 2 * 1000))
        self.qid, self.connected, self.sqsize, self.sqhd, self.ttag = None, False, 0, 0, 0
        self.association = -1                      # the target's, when this queue connected
        self.pending: collections.deque[_Command] = collections.deque()   # arrived during an R2T exchange
        self.buf = aligned_buffer(target.max_transfer)

    def peer_closed(self) -> bool:
        """The host has closed this connection (its FIN arrived, or the socket is closed here).
        Asked with poll(0), never a read: a peek on a queue with a KATO (a socket in timeout
        mode) waited out the timeout and read TimeoutError as closed, so a second host's Connect
        could end a live host's association (found by review)."""
        fd = self.channel.sock.fileno()
        if fd < 0:
            return True
        p = select.poll()
        p.register(fd, select.POLLIN | select.POLLRDHUP)
        return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in p.poll(0))

    def _handshake_expired(self):
        if not self.connected:                    # shut down, not closed: this thread's socket
            try:
                self.channel.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def run(self):
        # until its Connect (_connect), a deadline from the accept, not an idle timeout: eight
        # silent sockets locked every host out, and a command every few seconds kept one in. A
        # timer, since the socket's timeout counts per recv: a PDU sent a byte every few seconds
        # held the connection for hours (found by review)
        expiry = threading.Timer(HANDSHAKE_TIMEOUT_S, self._handshake_expired)
        expiry.daemon = True
        expiry.start()
        try:
            deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
            self.channel.sock.settimeout(HANDSHAKE_TIMEOUT_S)
            self._handshake()
            while True:
                if not self.connected:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ConnectionClosed("no Connect before the handshake deadline")
                    self.channel.sock.settimeout(left)
                cmd = self.pending.popleft() if self.pending else self._read_command()
                self._execute(cmd)
        except ProtocolError as e:
            try:
                self.channel.send_term(P.C2H_TERM_REQ, e.fes, e.fei, e.header)
            except OSError:
                pass
        except (ConnectionClosed, OSError):
            pass
        finally:
            expiry.cancel()
            self.channel.close()
            self.t._closed(self)

    # --- the stream ------------------------------------------------------------------------

    def _handshake(self):
        ch = self.channel
        _, _, header, _ = ch.recv_header((P.ICREQ,), lambda t: 0)
        req = P.unpack(P.ICREQ_PDU, header)
        if req["pfv"] != 0:
            raise ProtocolError(f"PDU format version {req['pfv']}", P.FES_UNSUPPORTED_PARAMETER, 8, header)
        if req["hpda"] > 31:
            raise ProtocolError(f"HPDA {req['hpda']}", P.FES_INVALID_HEADER_FIELD, 10, header)
        dgst = req["dgst"] & (P.DGST_HEADER | P.DGST_DATA)     # both digests are offered
        ch.send(P.ICRESP, P.psh(P.ICRESP_PDU, pfv=0, cpda=0, dgst=dgst, maxh2cdata=self.t.maxh2cdata))
        ch.hdgst, ch.ddgst = bool(dgst & P.DGST_HEADER), bool(dgst & P.DGST_DATA)
        ch.data_align = (req["hpda"] + 1) * 4      # every C2HData's PDO a multiple of it (HPDA)

    def _max_data(self, pdu_type):
        if pdu_type == P.CAPSULE_CMD:
            return P.ADMIN_ICD if self.qid in (None, 0) else self.t.in_capsule
        if pdu_type == P.H2C_DATA:
            return self.t.maxh2cdata
        return P.TERM_MAX_ERROR_DATA

    def _read_command(self) -> _Command:
        t, flags, header, dlen = self.channel.recv_header((P.CAPSULE_CMD, P.H2C_DATA, P.H2C_TERM_REQ),
                                                          self._max_data)
        if t == P.H2C_TERM_REQ:
            raise ConnectionClosed("the host terminated the connection")
        if t == P.H2C_DATA:
            raise ProtocolError("H2CData without an R2T outstanding", P.FES_PDU_SEQUENCE_ERROR, 0, header)
        sqe = P.unpack(P.SQE, header, P.CH.size)
        data = None
        if dlen:
            data = memoryview(self.buf)[:dlen]
            if not self.channel.recv_data(data):
                data = False                          # data digest error: fail the command, keep the queue
        return _Command(sqe, header, data)

    def _respond(self, cid: int, sc: int = P.SC_SUCCESS, dw0: int = 0, dw1: int = 0):
        # SQHD: the entries consumed, this command's included, as Linux's nvmet at completion: a
        # Connect answers 1 (it answered 0, every later command one short: found by review), and
        # it wraps at the size the Connect gave
        self.sqhd = (self.sqhd + 1) % (self.sqsize + 1) if self.connected else 0
        cqe = P.pack(P.CQE, dw0=dw0, dw1=dw1, sqhd=self.sqhd, sqid=self.qid or 0, cid=cid,
                     status=P.status_field(sc))
        self.channel.send(P.CAPSULE_RESP, cqe)

    def _send_data(self, cid: int, data):
        self.channel.send(P.C2H_DATA, P.psh(P.C2H_DATA_PDU, cccid=cid, datao=0, datal=len(data)), data,
                          P.FLAG_LAST_PDU)

    def _pull(self, cmd: _Command, view, block: int) -> int:
        """A Write's data by R2T: one chunk per R2T, each written at its blocks before the next
        R2T. The status: a data digest error or a device error still drains the rest."""
        sc, bs, cid = P.SC_SUCCESS, self.t.dev.block_size, cmd.sqe["cid"]
        for r2to in range(0, len(view), self.t.maxh2cdata):
            r2tl = min(self.t.maxh2cdata, len(view) - r2to)
            self.ttag = (self.ttag + 1) & 0xFFFF
            self.channel.send(P.R2T, P.psh(P.R2T_PDU, cccid=cid, ttag=self.ttag, r2to=r2to, r2tl=r2tl))
            got = 0
            while got < r2tl:
                t, flags, header, dlen = self.channel.recv_header((P.CAPSULE_CMD, P.H2C_DATA, P.H2C_TERM_REQ),
                                                                  self._max_data)
                if t == P.H2C_TERM_REQ:
                    raise ConnectionClosed("the host terminated the connection")
                if t == P.CAPSULE_CMD:            # another command meanwhile: keep it for later
                    if len(self.pending) + 1 >= self.sqsize + 1:
                        raise ProtocolError("more commands outstanding than the queue holds",
                                            P.FES_PDU_SEQUENCE_ERROR, 0, header)
                    data = bytearray(dlen)
                    good = self.channel.recv_data(data) if dlen else True
                    self.pending.append(_Command(P.unpack(P.SQE, header, P.CH.size), header,
                                                 memoryview(data) if good and dlen else (None if good else False)))
                    continue
                h = P.unpack(P.H2C_DATA_PDU, header)
                if h["cccid"] != cid or h["ttag"] != self.ttag:
                    raise ProtocolError("H2CData for a command or tag with no R2T outstanding",
                                        P.FES_INVALID_HEADER_FIELD, 8 if h["cccid"] != cid else 10, header)
                # an empty one too: it passed, and as many as a host sent kept the command waiting (review)
                if h["datao"] != r2to + got or h["datal"] != dlen or not dlen or got + dlen > r2tl:
                    raise ProtocolError("H2CData outside the R2T's range", P.FES_DATA_OUT_OF_RANGE, 12, header)
                # LAST_PDU on the PDU that ends the R2T's range and on no other, as FreeBSD's nvmf
                # checks (Linux's nvmet does not): a host that disagrees on where its data ends
                if bool(flags & P.FLAG_LAST_PDU) != (got + dlen == r2tl):
                    raise ProtocolError("H2CData's LAST_PDU flag " + ("before the end of the R2T's data"
                                        if flags & P.FLAG_LAST_PDU else "missing on the R2T's last data"),
                                        P.FES_PDU_SEQUENCE_ERROR, 0, header)
                if not self.channel.recv_data(view[r2to + got:r2to + got + dlen]):
                    sc = P.SC_TRANSIENT_TRANSPORT
                got += dlen
            if sc == P.SC_SUCCESS:
                sc = self._write(view, r2to, block + r2to // bs, r2tl // bs)
        return sc

    # --- commands -----------------------------------------------------------------------------

    def _execute(self, cmd: _Command):
        sqe, cid = cmd.sqe, cmd.sqe["cid"]
        if self.connected and self is not (self.t.admin_queue if self.qid == 0 else self.t.io_queue):
            # its association ended (its host closed the admin queue and another host connected, or
            # a reset ended this I/O queue) while commands of it still waited in the socket: run,
            # a Property Set CC.EN=0 queued by a host that had closed reset the next host's
            # controller (found by review)
            raise ConnectionClosed("this queue's association has ended")
        if cmd.data is False:
            return self._respond(cid, P.SC_TRANSIENT_TRANSPORT)
        if (sqe["sgl_len"] or cmd.data is not None) and not self._moves_data(cmd):
            # a Flush, Keep Alive, Features or Property command carrying data (or an SGL length):
            # each succeeded, the data dropped (found by review); nvmet refuses the same
            return self._respond(cid, P.SC_SGL_INVALID_DATA_LENGTH)
        if sqe["opc"] == P.OPC_FABRICS:
            return self._fabrics(cmd)
        if not self.connected:
            return self._respond(cid, P.SC_COMMAND_SEQUENCE)
        if self.qid == 0:
            return self._admin(cmd)
        return self._io(cmd)

    def _moves_data(self, cmd: _Command) -> bool:
        """The command has data of its own: to the controller (a Connect's, a Write's, which may come
        in the capsule) or from it (a Read's, Identify's, Get Log Page's, by C2HData only)."""
        opc = cmd.sqe["opc"]
        if opc == P.OPC_FABRICS:
            return P.unpack(P.FABRICS_SQE, cmd.header, P.CH.size)["fctype"] == P.FCTYPE_CONNECT
        if cmd.data is not None:
            return self.qid != 0 and opc == P.NVM_WRITE
        return opc in ((P.ADMIN_IDENTIFY, P.ADMIN_GET_LOG_PAGE) if self.qid == 0 else (P.NVM_WRITE, P.NVM_READ))

    def _fabrics(self, cmd: _Command):
        f = P.unpack(P.FABRICS_SQE, cmd.header, P.CH.size)
        cid = f["cid"]
        if f["fctype"] == P.FCTYPE_CONNECT:
            return self._connect(cmd, f)
        if not self.connected or self.qid != 0:
            return self._respond(cid, P.SC_COMMAND_SEQUENCE if not self.connected else P.SC_INVALID_OPCODE)
        prop = P.unpack(P.PROPERTY_SPECIFIC, f["specific"])
        if f["fctype"] == P.FCTYPE_PROPERTY_GET:
            value = self.t.get_property(prop["ofst"], bool(prop["attrib"] & 7))
            if value is None:
                return self._respond(cid, P.SC_INVALID_FIELD)
            return self._respond(cid, dw0=value & 0xFFFFFFFF, dw1=value >> 32)
        if f["fctype"] == P.FCTYPE_PROPERTY_SET:
            return self._respond(cid, P.SC_SUCCESS if self.t.set_property(prop["ofst"], prop["value"], self)
                                 else P.SC_INVALID_FIELD)
        return self._respond(cid, P.SC_INVALID_FIELD)

    def _connect(self, cmd: _Command, f: dict):
        cid, t = f["cid"], self.t
        c = P.unpack(P.CONNECT_SPECIFIC, f["specific"])
        if self.connected:
            return self._respond(cid, P.SC_COMMAND_SEQUENCE)
        if cmd.data is None or len(cmd.data) != P.CONNECT_DATA.size or f["sgl_id"] != P.SGL_ICD:
            return self._respond(cid, P.SC_SGL_INVALID_DATA_LENGTH)
        data = P.unpack(P.CONNECT_DATA, cmd.data)
        subnqn, hostnqn = P.nqn_of(data["subnqn"]), P.nqn_of(data["hostnqn"])

        def invalid(attr_data: bool, offset: int):     # DW0: IATTR (bit 16: in the data), IPO (bits 15:0)
            return self._respond(cid, P.SC_CONNECT_INVALID_PARAMETERS, dw0=int(attr_data) << 16 | offset)

        if c["recfmt"] != 0:
            return self._respond(cid, P.SC_CONNECT_INCOMPATIBLE_FORMAT)
        if subnqn != t.nqn:
            return invalid(True, P.CONNECT_DATA.offsets["subnqn"])
        # the I/O queue within CAP.MQES; the admin queue's Linux sizes at 32 whatever MQES says
        if not 1 <= c["sqsize"] < (max(t.queue_depth, ADMIN_QUEUE_DEPTH) if c["qid"] == 0 else t.queue_depth):
            return invalid(False, 40 + P.CONNECT_SPECIFIC.offsets["sqsize"])
        with t._lock:
            if c["qid"] == 0:
                if data["cntlid"] != 0xFFFF and data["cntlid"] != CNTLID:
                    return invalid(True, P.CONNECT_DATA.offsets["cntlid"])
                if t.admin_queue is not None and t.admin_queue.peer_closed():
                    # the host closed it, its thread has not seen that yet: a host reconnecting
                    # right after a close (or a reset) must find the controller free, not busy
                    for stale in t._end_association():
                        stale.channel.shutdown()
                if t.host_nqn is not None:
                    return self._respond(cid, P.SC_CONNECT_CONTROLLER_BUSY)
                t.host_nqn, t.admin_queue = hostnqn, self
            elif c["qid"] == 1:
                if t.host_nqn is None or data["cntlid"] != CNTLID:
                    return invalid(True, P.CONNECT_DATA.offsets["cntlid"])
                if hostnqn != t.host_nqn:
                    return self._respond(cid, P.SC_CONNECT_INVALID_HOST)
                if not t.csts & P.CSTS_RDY or t.io_queue is not None:
                    return self._respond(cid, P.SC_COMMAND_SEQUENCE)    # enable first; one I/O queue
                t.io_queue = self
            else:
                return invalid(False, 40 + P.CONNECT_SPECIFIC.offsets["qid"])
            self.qid, self.sqsize, self.connected = c["qid"], c["sqsize"], True
            self.association = t.association
        if self.qid == 0:
            with t._write_lock:                        # a write of the ended association, still running
                pass
        # Connected: no handshake deadline now. An admin queue whose host asked for a keep-alive
        # timeout must hear from it (Keep Alive or any command) within twice that, or its
        # association ends; an I/O queue may idle (TCP keep-alive still finds a vanished host).
        self.channel.sock.settimeout(2 * c["kato"] / 1000 if self.qid == 0 and c["kato"] else None)
        self._respond(cid, dw0=CNTLID)
        if t.log:
            on = lambda flag: "on" if flag else "off"
            try:                 # the host's NQN as a literal (a newline in it made a line of its own),
                # and a log that fails (stdout gone) is no reason to drop the queue just connected
                t.log(f"queue {self.qid} connected: host {hostnqn!r}, sqsize {c['sqsize'] + 1}, kato {c['kato']} "
                      f"ms, header digest {on(self.channel.hdgst)}, data digest {on(self.channel.ddgst)}")
            except Exception:
                pass

    def _admin(self, cmd: _Command):
        sqe, cid, t = cmd.sqe, cmd.sqe["cid"], self.t
        if sqe["opc"] == P.ADMIN_KEEP_ALIVE:          # its arrival restarted the KATO deadline (_connect)
            return self._respond(cid)
        if sqe["opc"] in (P.ADMIN_SET_FEATURES, P.ADMIN_GET_FEATURES):
            # Number of Queues only: Linux sets it before connecting I/O queues and, refused, connects
            # none. One I/O queue pair, 0's based in both halves of dw0, whatever the host asked for.
            if sqe["cdw10"] & 0xFF != P.FID_NUM_QUEUES:
                return self._respond(cid, P.SC_INVALID_FIELD)
            return self._respond(cid, dw0=0)
        if sqe["opc"] == P.ADMIN_GET_LOG_PAGE:
            return self._get_log_page(cmd)
        if sqe["opc"] != P.ADMIN_IDENTIFY:
            return self._respond(cid, P.SC_INVALID_OPCODE)
        if not t.csts & P.CSTS_RDY:
            return self._respond(cid, P.SC_COMMAND_SEQUENCE)
        cns = sqe["cdw10"] & 0xFF
        if cns == P.CNS_CONTROLLER:
            data = t.identify_controller()
        elif cns == P.CNS_ACTIVE_NS_LIST:
            if sqe["nsid"] >= 0xFFFFFFFE:                # the broadcast NSIDs start no list
                return self._respond(cid, P.SC_INVALID_NAMESPACE)
            data = t.active_namespaces(sqe["nsid"])
        elif cns in (P.CNS_NAMESPACE, P.CNS_NS_DESCRIPTORS):
            if sqe["nsid"] != NSID:
                return self._respond(cid, P.SC_INVALID_NAMESPACE)
            data = t.identify_namespace() if cns == P.CNS_NAMESPACE else t.namespace_descriptors()
        else:
            return self._respond(cid, P.SC_INVALID_FIELD)
        if sqe["sgl_id"] != P.SGL_TRANSPORT or sqe["sgl_len"] != P.IDENTIFY_LEN:
            return self._respond(cid, P.SC_SGL_INVALID_DATA_LENGTH)
        self._send_data(cid, data)
        self._respond(cid)

    def _get_log_page(self, cmd: _Command):
        """SMART / Health only, all zero (no health data is kept): Linux reads it at every connect
        (its hwmon sensor) and logs "Failed to read smart log" when it is refused."""
        sqe, cid = cmd.sqe, cmd.sqe["cid"]
        n = ((sqe["cdw10"] >> 16 | (sqe["cdw11"] & 0xFFFF) << 16) + 1) * 4       # NUMD, 0's based dwords
        offset = sqe["cdw12"] | sqe["cdw13"] << 32
        if sqe["cdw10"] & 0xFF != P.LID_SMART or offset % 4 or offset >= P.SMART_LOG_LEN:
            return self._respond(cid, P.SC_INVALID_FIELD)
        if sqe["sgl_id"] != P.SGL_TRANSPORT or sqe["sgl_len"] != n or n > self.t.max_transfer:
            return self._respond(cid, P.SC_SGL_INVALID_DATA_LENGTH)
        self._send_data(cid, bytes(n))      # the log from offset, zero past its end as well
        self._respond(cid)

    def _io(self, cmd: _Command):
        sqe, cid, t = cmd.sqe, cmd.sqe["cid"], self.t
        opc, dev = sqe["opc"], t.dev
        if opc not in (P.NVM_FLUSH, P.NVM_WRITE, P.NVM_READ):
            return self._respond(cid, P.SC_INVALID_OPCODE)
        if sqe["nsid"] != NSID:
            return self._respond(cid, P.SC_INVALID_NAMESPACE)
        if opc == P.NVM_FLUSH:
            return self._respond(cid, self._device(P.SC_WRITE_FAULT, dev.sync))
        slba, nlb = sqe["cdw10"] | sqe["cdw11"] << 32, (sqe["cdw12"] & 0xFFFF) + 1
        n = nlb * dev.block_size
        if slba + nlb > dev.blocks:
            return self._respond(cid, P.SC_LBA_OUT_OF_RANGE)
        if n > t.max_transfer:
            return self._respond(cid, P.SC_INVALID_FIELD)
        # in-capsule data only with a Write, and only under its in-capsule SGL (a Read carrying some
        # succeeded, the data dropped: found by review)
        if sqe["sgl_len"] != n or sqe["sgl_id"] not in (P.SGL_ICD, P.SGL_TRANSPORT) or \
                (sqe["sgl_id"] == P.SGL_ICD) != (opc == P.NVM_WRITE and cmd.data is not None) or \
                (cmd.data is not None and opc != P.NVM_WRITE):
            return self._respond(cid, P.SC_SGL_INVALID_DATA_LENGTH)
        if sqe["sgl_id"] == P.SGL_ICD and sqe["sgl_addr"]:
            return self._respond(cid, P.SC_SGL_INVALID_OFFSET)   # the data is read from the capsule's start
        if opc == P.NVM_READ:
            sc = self._device(P.SC_UNRECOVERED_READ, dev.read_into, self.buf, slba, nlb)
            if sc != P.SC_SUCCESS:
                return self._respond(cid, sc)
            self._send_data(cid, memoryview(self.buf)[:n])
            return self._respond(cid)
        if cmd.data is not None:                      # in-capsule
            if len(cmd.data) != n:
                return self._respond(cid, P.SC_SGL_INVALID_DATA_LENGTH)
            if cmd.data.obj is not self.buf:          # queued during an R2T exchange: to aligned memory
                self.buf[:n] = cmd.data
            sc = self._write(self.buf, 0, slba, nlb)
        else:
            sc = self._pull(cmd, memoryview(self.buf)[:n], slba)
        if sc == P.SC_SUCCESS and sqe["cdw12"] & P.RW_FUA:
            sc = self._device(P.SC_WRITE_FAULT, dev.sync)
        self._respond(cid, sc)

    def _write(self, buf, offset: int, block: int, nblocks: int) -> int:
        """A write to the device, only while this queue's association lasts (Target.association);
        its status."""
        with self.t._write_lock:
            if self.association != self.t.association:
                return P.SC_WRITE_FAULT
            return self._device(P.SC_WRITE_FAULT, self.t.dev.write_from, buf, offset, block, nblocks)

    @staticmethod
    def _device(media: int, fn, *args) -> int:
        """A device call's status (not fatal to the connection): `media` (an unrecovered read, a write
        fault) only for the medium's own EIO, which the initiator's store reads around as a bad
        block; any other failure (a short read of a shrunk image, a closed device) is an internal
        error, which stops its recovery there as a local device's would. Both were a media status,
        and a recovery over the wire took a backend fault for a bad block: the log's end, written
        over with the acknowledged records after it (found by review)."""
        try:
            fn(*args)
            return P.SC_SUCCESS
        except OSError as e:
            return media if e.errno == errno.EIO else P.SC_INTERNAL
        except DeviceError:
            return P.SC_INTERNAL
