"""The NVMe/TCP initiator: BlockDevice's interface on a remote namespace, so LogStore runs on it unchanged.

    dev = NvmeTcpDevice("nvme-tcp://127.0.0.1:4420/nqn.2026-12.io.zerolayer:snapshots")
    dev.block_size, dev.blocks          # from Identify Namespace, as nvme-cli learns them
    dev.read_into(buf, block, n); dev.write_from(buf, off, block, n); dev.sync(); dev.close()

It connects as the Linux host does: an admin queue (ICReq, Connect with
CNTLID 0xFFFF, Property Get CAP, Set CC.EN, wait for CSTS.RDY, Identify
controller and namespace), then one I/O queue (Connect with the CNTLID the
admin Connect returned). Transfers larger than MDTS are split; a Write up to
the controller's in-capsule size (IOCCSZ) travels in its capsule, a larger
one answers the target's R2Ts with H2CData. One command at a time per queue
(the store serializes its device calls anyway). A non-zero status raises
NvmeError; a lost connection or a TermReq raises DeviceError.
"""
from __future__ import annotations

import errno
import socket
import threading
import time
import uuid

from ..errors import DeviceError
from . import pdu as P
from .transport import Channel, ConnectionClosed, ProtocolError

SCHEME = "nvme-tcp://"
DEFAULT_PORT = 4420
QUEUE_SIZE = 32              # entries; the Connect sends it 0's based
READY_TIMEOUT_S = 5.0
TRANSIENT_RETRIES = 3
NO_MDTS_BYTES = 4 << 20      # the most one command moves when the controller sets no limit (MDTS 0)
CC_ENABLED = P.CC_EN | 6 << 16 | 4 << 20     # IOSQES 64 B, IOCQES 16 B


HOST_FILES = ("/etc/nvme/hostnqn", "/etc/nvme/hostid")


def host_identity(files: tuple[str, str] = HOST_FILES) -> tuple[str, uuid.UUID]:
    """This host's NQN and host ID as nvme-cli keeps them, so a target that admits listed hosts only
    admits it, and every open is the same host; a fresh random pair where they are missing. An
    ID file missing or unreadable beside an NQN of the uuid form takes the NQN's UUID."""
    def read(path):
        try:
            with open(path) as f:
                return f.read().strip() or None
        except OSError:
            return None
    nqn, hostid = read(files[0]), read(files[1])
    for text in (hostid, nqn.rsplit(":uuid:", 1)[1] if nqn and ":uuid:" in nqn else None):
        try:
            if text:
                return nqn or f"nqn.2014-08.org.nvmexpress:uuid:{uuid.UUID(text)}", uuid.UUID(text)
        except ValueError:
            pass
    hid = uuid.uuid4()
    return nqn or f"nqn.2014-08.org.nvmexpress:uuid:{hid}", hid


class NvmeError(DeviceError):
    """The target completed a command with a non-zero status (sc: (SCT << 8) | SC; dnr: Do Not
    Retry was set)."""

    def __init__(self, text: str, sc: int, dnr: bool = True):
        super().__init__(text)
        self.sc, self.dnr = sc, dnr


class MediaError(NvmeError, OSError):
    """A media and data integrity error (SCT 2: an unrecovered read, a write fault): EIO, as a
    local device says it, so the store's recovery reads around a bad block of a remote namespace
    as it does on a local one (a remote one's failed to open, and fsck with it)."""

    def __init__(self, text: str, sc: int, dnr: bool = True):
        NvmeError.__init__(self, text, sc, dnr)
        self.errno, self.strerror = errno.EIO, text


def is_url(path) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


def parse_url(url: str) -> tuple[str, int, str]:
    """nvme-tcp://HOST[:PORT]/SUBNQN[?digests] -> (host, port, subnqn)."""
    rest, _, option = (url[len(SCHEME):] if is_url(url) else "").partition("?")
    hostport, _, nqn = rest.partition("/")
    host, _, port = hostport.rpartition(":") if ":" in hostport else (hostport, "", str(DEFAULT_PORT))
    if host.startswith("[") or ":" in host:      # (it failed as "Name or service not known")
        raise DeviceError(f"{url!r}: an IPv6 address; the NVMe/TCP initiator connects over IPv4 only "
                          f"(an address or a host name)")
    if not host or not nqn or not port.isdigit() or int(port) > 65535 or option not in ("", "digests"):
        raise DeviceError(f"{url!r} is not an NVMe/TCP namespace URL: write "
                          f"nvme-tcp://HOST[:PORT]/SUBSYSTEM-NQN[?digests] "
                          f"(for example nvme-tcp://127.0.0.1:4420/nqn.2026-12.io.zerolayer:snapshots)")
    return host, int(port), nqn


def _opname(qid: int, opc: int) -> str:
    if opc == P.OPC_FABRICS:
        return "Fabrics command"
    if qid == 0:
        return {P.ADMIN_IDENTIFY: "Identify"}.get(opc, f"admin opcode {opc:#x}")
    return {P.NVM_READ: "Read", P.NVM_WRITE: "Write", P.NVM_FLUSH: "Flush"}.get(opc, f"opcode {opc:#x}")


class _Queue:
    """One queue pair on its own TCP connection."""

    def __init__(self, url: str, host: str, port: int, qid: int, digests: bool, timeout_s: float):
        self.url, self.qid, self.timeout_s = url, qid, timeout_s
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as e:
            raise DeviceError(f"cannot connect to the NVMe/TCP target at {host}:{port}: {e.strerror or e} "
                              f"(is `snapshotstore target` running there?)") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.channel = Channel(sock)
        self.cid = 0
        self.maxh2cdata = 0
        self.in_capsule = P.ADMIN_ICD                # the I/O queue's comes from Identify (IOCCSZ)
        self._expect = 0                             # data bytes the current command may still receive
        self.transient_retries = 0
        self.lost: str | None = None                 # why the connection was lost (a DeviceError said it)
        self._call(self._icreq, digests)

    def _call(self, fn, *args):
        """Run one exchange, turning transport failures into DeviceError (the queue is dead then).
        The exchange is bounded as a whole by timeout_s, not each read by it."""
        self.channel.deadline = time.monotonic() + self.timeout_s
        try:
            return fn(*args)
        except NvmeError:
            raise
        except ProtocolError as e:
            try:
                self.channel.send_term(P.H2C_TERM_REQ, e.fes, e.fei, e.header)
            except OSError:
                pass
            raise self._lose(f"the NVMe/TCP target at {self.url} broke the protocol ({e}): reconnect") from None
        except socket.timeout:
            raise self._lose(f"the NVMe/TCP target at {self.url} did not complete the exchange within "
                             f"{self.timeout_s:g} s") from None
        except (ConnectionClosed, OSError) as e:
            raise self._lose(f"the NVMe/TCP target at {self.url} closed the connection ({e}): is it "
                             f"still running? reopen the store once it is back") from None
        finally:
            self.channel.deadline = None

    def _lose(self, why: str) -> DeviceError:
        """The queue is dead: closed, and every later command told why (it went on to the closed
        socket and failed "Bad file descriptor", found by review)."""
        self.close()
        self.lost = why
        return DeviceError(why)

    def _icreq(self, digests: bool):
        dgst = (P.DGST_HEADER | P.DGST_DATA) if digests else 0
        self.channel.send(P.ICREQ, P.psh(P.ICREQ_PDU, pfv=0, hpda=0, dgst=dgst, maxr2t=0))
        t, _, header, _ = self.channel.recv_header(   # an ICResp carries no data (PLEN 128), a TermReq its error's
            (P.ICRESP, P.C2H_TERM_REQ), lambda t: P.TERM_MAX_ERROR_DATA if t == P.C2H_TERM_REQ else 0)
        if t == P.C2H_TERM_REQ:      # the target refused the ICReq (SPDK does so); its header is 24 bytes
            raise ConnectionClosed(f"the target refused the connection (C2HTermReq {P.unpack(P.HEADERS[t], header)})")
        resp = P.unpack(P.ICRESP_PDU, header)
        want = (P.DGST_HEADER | P.DGST_DATA) if digests else 0
        if resp["dgst"] != want:     # digests asked and not granted, or granted unasked: not silently
            raise ProtocolError(f"the target negotiated digests {resp['dgst']:#x}, not {want:#x}",
                                P.FES_UNSUPPORTED_PARAMETER)
        if resp["pdu_type"] != P.ICRESP or resp["pfv"] != 0 or resp["cpda"] != 0 or resp["maxh2cdata"] < 4096:
            raise ProtocolError(f"an ICResp this host cannot use ({resp})", P.FES_UNSUPPORTED_PARAMETER)
        self.maxh2cdata = resp["maxh2cdata"]
        self.channel.hdgst, self.channel.ddgst = bool(resp["dgst"] & P.DGST_HEADER), bool(resp["dgst"] & P.DGST_DATA)

    def command(self, sqe_fields: dict, data_out=None, data_in=None, layout=P.SQE) -> dict:
        """Submit one command and wait for its completion: data_out is sent (in the capsule if it
        fits, else by R2T), data_in (a writable view) receives the C2HData. Returns the CQE.
        A Transient Transport Error without DNR (a data digest the target found wrong) is sent
        again, up to TRANSIENT_RETRIES times: one corrupted PDU failed the whole store before."""
        for attempt in range(TRANSIENT_RETRIES + 1):
            try:
                return self._call(self._command, sqe_fields, data_out, data_in, layout)
            except NvmeError as e:
                if e.sc != P.SC_TRANSIENT_TRANSPORT or e.dnr or attempt == TRANSIENT_RETRIES:
                    raise
                self.transient_retries += 1

    def _digest_checked(self, bad: bool):
        """A command whose C2HData failed its data digest: a Transient Transport Error without Do Not
        Retry, which command() sends again, as the target answers a bad H2CData digest."""
        if bad:
            raise NvmeError(f"the NVMe/TCP target at {self.url}: a C2HData's data digest did not match",
                            P.SC_TRANSIENT_TRANSPORT, dnr=False)

    def _command(self, sqe_fields, data_out, data_in, layout) -> dict:
        self.cid = (self.cid + 1) & 0xFFFF
        n = len(data_out) if data_out is not None else len(data_in) if data_in is not None else 0
        icd = data_out is not None and n <= self.in_capsule
        # a command without data carries a transport data block of length 0, as Linux's host sends it
        # (the TCP binding allows no other SGL type; it sent type 0, which nvmet and SPDK do not parse)
        sgl = dict(sgl_addr=0, sgl_len=n, sgl_id=P.SGL_ICD if icd else P.SGL_TRANSPORT)
        # PSDT 01b on every command, Fabrics ones too (their byte 1 is reserved in NVMe-oF 1.1): Linux's
        # nvmet refuses any command without it, the Connect first, with Invalid Field in Command
        sqe = P.pack(layout, cid=self.cid, flags=P.PSDT_SGL, **sgl, **sqe_fields)
        self.channel.send(P.CAPSULE_CMD, sqe, data_out if icd else None)
        self._expect = n if data_in is not None else 0
        received = pulled = 0
        digest_bad = False
        while True:
            t, flags, header, dlen = self.channel.recv_header(
                (P.CAPSULE_RESP, P.C2H_DATA, P.R2T, P.C2H_TERM_REQ), self._max_data)
            if t == P.C2H_TERM_REQ:
                h = P.unpack(P.TERM_REQ_PDU, header)
                self.channel.discard(dlen)
                raise ConnectionClosed(f"C2HTermReq, fatal error status {h['fes']:#x} at byte {h['fei']}")
            if t == P.CAPSULE_RESP:
                cqe = P.unpack(P.CQE, header, P.CH.size)
                if cqe["cid"] != self.cid:
                    raise ProtocolError(f"a completion for command {cqe['cid']}, not {self.cid}",
                                        P.FES_INVALID_HEADER_FIELD, P.CH.size + 12, header)
                sc = P.status_code(cqe["status"])
                if sc != P.SC_SUCCESS:
                    name = P.STATUS_NAMES.get(sc, "status")
                    op = _opname(self.qid, sqe_fields.get("opc", P.OPC_FABRICS))
                    raise (MediaError if sc >> 8 == 2 else NvmeError)(
                        f"the NVMe/TCP target at {self.url} failed {op}: {name} "
                        f"(SCT {sc >> 8:#x} SC {sc & 0xFF:#04x})", sc, bool(cqe["status"] & P.STATUS_DNR))
                if data_in is not None and received != n:
                    raise ProtocolError(f"{received} of {n} bytes before the completion",
                                        P.FES_PDU_SEQUENCE_ERROR, 0, header)
                if data_out is not None and not icd and pulled != n:
                    # a success before the target asked for all the data: not believed
                    raise ProtocolError(f"a completion after {pulled} of {n} bytes were asked for",
                                        P.FES_PDU_SEQUENCE_ERROR, 0, header)
                self._digest_checked(digest_bad)
                return cqe
            if t == P.C2H_DATA:
                h = P.unpack(P.C2H_DATA_PDU, header)
                if (data_in is None or h["cccid"] != self.cid or h["datao"] != received or h["datal"] != dlen
                        or dlen == 0):
                    raise ProtocolError("C2HData outside the command's buffer", P.FES_DATA_OUT_OF_RANGE, 12, header)
                if bool(flags & P.FLAG_LAST_PDU) != (received + dlen == n):   # on the last data and no other
                    raise ProtocolError("C2HData's LAST_PDU flag " + ("before the end of the command's data"
                                        if flags & P.FLAG_LAST_PDU else "missing on the command's last data"),
                                        P.FES_PDU_SEQUENCE_ERROR, 0, header)
                # a digest mismatch: the rest of the command is read as it comes, then the command is
                # sent again (command(): reads are idempotent, as Linux's host retries). It closed the
                # queue, and the device refused every later call until reopened (found by review)
                digest_bad |= not self.channel.recv_data(data_in[received:received + dlen])
                received += dlen
                self._expect = n - received
                if flags & P.FLAG_SUCCESS:
                    # the command succeeded and no CapsuleResp follows: SPDK's target does this by
                    # default, and a read waited for the response until its timeout (found by review)
                    if not flags & P.FLAG_LAST_PDU:      # (LAST_PDU said the data is all here, above)
                        raise ProtocolError("C2HData with SUCCESS before the last of the command's data",
                                            P.FES_INVALID_HEADER_FIELD, 1, header)
                    self._digest_checked(digest_bad)
                    return dict(dw0=0, dw1=0, sqhd=0, sqid=self.qid, cid=self.cid, status=0)
                continue
            h = P.unpack(P.R2T_PDU, header)                 # R2T: send the requested range
            if data_out is None or icd or h["cccid"] != self.cid or h["r2to"] + h["r2tl"] > n or h["r2tl"] == 0:
                raise ProtocolError("an R2T outside the command's data", P.FES_DATA_OUT_OF_RANGE, 12, header)
            if h["r2to"] != pulled:          # in order, each range once: what was asked for is all of it
                raise ProtocolError(f"an R2T for offset {h['r2to']}, not {pulled}", P.FES_DATA_OUT_OF_RANGE, 12, header)
            view = memoryview(data_out)
            pulled += h["r2tl"]
            for off in range(h["r2to"], h["r2to"] + h["r2tl"], self.maxh2cdata):
                k = min(self.maxh2cdata, h["r2to"] + h["r2tl"] - off)
                last = P.FLAG_LAST_PDU if off + k == h["r2to"] + h["r2tl"] else 0
                self.channel.send(P.H2C_DATA, P.psh(P.H2C_DATA_PDU, cccid=self.cid, ttag=h["ttag"], datao=off,
                                                    datal=k), view[off:off + k], last)

    def _max_data(self, pdu_type) -> int:
        """A C2HData what is still expected, a TermReq its error header; a CapsuleResp or an R2T
        carries none (its data was let through unread, and parsed as the next PDU's header)."""
        if pdu_type == P.C2H_DATA:
            return self._expect
        return P.TERM_MAX_ERROR_DATA if pdu_type == P.C2H_TERM_REQ else 0

    def connect(self, subnqn: str, hostnqn: str, hostid: bytes, cntlid: int, entries: int = QUEUE_SIZE) -> int:
        data = P.pack(P.CONNECT_DATA, hostid=hostid, cntlid=cntlid, subnqn=P.nqn_field(subnqn),
                      hostnqn=P.nqn_field(hostnqn))
        spec = P.pack(P.CONNECT_SPECIFIC, recfmt=0, qid=self.qid, sqsize=entries - 1, kato=0)
        cqe = self.command(dict(opc=P.OPC_FABRICS, fctype=P.FCTYPE_CONNECT, specific=spec), data_out=data,
                           layout=P.FABRICS_SQE)
        return cqe["dw0"] & 0xFFFF

    def get_property(self, ofst: int, size8: bool = False) -> int:
        spec = P.pack(P.PROPERTY_SPECIFIC, attrib=1 if size8 else 0, ofst=ofst)
        cqe = self.command(dict(opc=P.OPC_FABRICS, fctype=P.FCTYPE_PROPERTY_GET, specific=spec),
                           layout=P.FABRICS_SQE)
        return cqe["dw0"] | cqe["dw1"] << 32

    def set_property(self, ofst: int, value: int) -> None:
        spec = P.pack(P.PROPERTY_SPECIFIC, attrib=0, ofst=ofst, value=value)
        self.command(dict(opc=P.OPC_FABRICS, fctype=P.FCTYPE_PROPERTY_SET, specific=spec), layout=P.FABRICS_SQE)

    def close(self):
        self.channel.close()


class NvmeTcpDevice:
    """One namespace (NSID 1) of an NVMe/TCP target, with BlockDevice's interface."""

    def __init__(self, url: str, readonly: bool = False, *, digests: bool = False, hostnqn: str | None = None,
                 timeout_s: float = 30.0):
        host, port, self.subnqn = parse_url(url)
        digests = digests or url.endswith("?digests")          # header and data digests, from the URL too
        self.path, self.readonly = url, readonly
        nqn, hostid = host_identity()
        self.hostnqn = hostnqn or nqn
        self._lock = threading.Lock()
        self._queue_args, self._hostid = (url, host, port, digests, timeout_s), hostid.bytes
        self.admin = _Queue(url, host, port, 0, digests, timeout_s)
        self.io = None
        try:
            self._cntlid = self.admin.connect(self.subnqn, self.hostnqn, hostid.bytes, 0xFFFF)
            self._enable()
            ctrl = self._identify(P.CNS_CONTROLLER, 0, P.ID_CTRL)
            ns = self._identify(P.CNS_NAMESPACE, 1, P.ID_NS)
            if P.nqn_of(ctrl["subnqn"]) != self.subnqn:
                raise DeviceError(f"{url}: the controller reports subsystem {P.nqn_of(ctrl['subnqn'])!r}")
            # the namespace's LBA size, which every command counts in; block_size is the I/O's
            # (set_block_size: a store formatted in larger blocks)
            self.logical_block_size, metadata = P.lba_format(ns)
            if self.logical_block_size < 512:
                raise DeviceError(f"{url}: namespace 1 reports {self.logical_block_size}-byte blocks (LBADS "
                                  f"below 9)")
            if metadata:
                raise DeviceError(f"{url}: namespace 1 is formatted with {metadata} bytes of metadata per "
                                  f"block; the store writes plain blocks (format it without metadata)")
            self._lbas = ns["nsze"]
            self.size = self._lbas * self.logical_block_size
            # MDTS in units of CAP.MPSMIN (4 KiB); 0 means no limit (Linux's nvmet), where a command is
            # still kept to NO_MDTS_BYTES: the target allocates a command's whole transfer at once
            self._max_bytes = (4096 << ctrl["mdts"]) if ctrl["mdts"] else NO_MDTS_BYTES
            self.set_block_size(self.logical_block_size)
            # in-capsule data starts ICDOFF 16-byte units past the SQE; Linux's host refuses a nonzero
            # ICDOFF: here such a controller gets every write's data by R2T instead (none in capsule;
            # the I/O queue's Connect still carries its data in capsule, as on the admin queue)
            self._in_capsule = ctrl["ioccsz"] * 16 - 64 if not ctrl["icdoff"] else 0
            self.io = self._io_queue()
        except BaseException:
            self.close()
            raise

    def set_block_size(self, n: int) -> None:
        """I/O in n-byte blocks, a multiple of the namespace's LBA size: a store formatted in other
        blocks than the namespace's own (LogStore._open), as BlockDevice's. A store formatted in
        4 KiB blocks opened through a loop device of 512-byte sectors locally, and was refused
        through a target on the same device (found by review)."""
        lba = self.logical_block_size
        if n < lba or n % lba:
            raise DeviceError(f"{n}-byte blocks on {self.path}, whose namespace has {lba}-byte blocks")
        most = min(self._max_bytes // n, (1 << 16) // (n // lba))    # NLB, in LBAs, is 16 bits
        if most < 1:
            raise DeviceError(f"{self.path}: a command may move {self._max_bytes} bytes (MDTS), less than one "
                              f"{n}-byte block")
        self.block_size, self.blocks, self.max_blocks = n, self._lbas // (n // lba), most

    def _io_queue(self) -> "_Queue":
        url, host, port, digests, timeout_s = self._queue_args
        io = _Queue(url, host, port, 1, digests, timeout_s)    # (its Connect's data goes in capsule)
        try:
            io.connect(self.subnqn, self.hostnqn, self._hostid, self._cntlid, min(QUEUE_SIZE, self.mqes))
        except BaseException:
            io.close()
            raise
        io.in_capsule = self._in_capsule
        return io

    def reset(self) -> None:
        """A controller reset: CC.EN 1 -> 0 (the target deletes the I/O queue; a write of it still
        running lands before the reset is done, or not at all), enabled again, and a new I/O queue
        connected; the admin queue stays."""
        with self._lock:
            io, self.io = self.io, None
            try:
                self.admin.set_property(P.PROP_CC, 0)
            finally:
                if io is not None:
                    io.close()
            deadline = time.monotonic() + READY_TIMEOUT_S
            while self.admin.get_property(P.PROP_CSTS) & P.CSTS_RDY:
                if time.monotonic() > deadline:
                    raise DeviceError(f"the controller at {self.path} did not stop (CSTS.RDY) after CC.EN = 0")
                time.sleep(0.01)
            self._enable()
            self.io = self._io_queue()

    def _enable(self):
        cap = self.admin.get_property(P.PROP_CAP, size8=True)
        self.mqes = (cap & 0xFFFF) + 1                  # its I/O queues' most entries
        if cap >> 48 & 0xF:
            # CC.MPS 0 (4 KiB) is below its smallest page size, and MDTS counts in that size
            raise DeviceError(f"the controller at {self.path} needs memory pages of at least "
                              f"{4096 << (cap >> 48 & 0xF)} bytes (CAP.MPSMIN); this host uses 4 KiB")
        self.admin.set_property(P.PROP_CC, CC_ENABLED)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.admin.get_property(P.PROP_CSTS) & P.CSTS_RDY:
            if time.monotonic() > deadline:
                raise DeviceError(f"the controller at {self.path} did not become ready (CSTS.RDY)")
            time.sleep(0.01)

    def _identify(self, cns: int, nsid: int, layout) -> dict:
        buf = bytearray(P.IDENTIFY_LEN)
        self.admin.command(dict(opc=P.ADMIN_IDENTIFY, nsid=nsid, cdw10=cns), data_in=memoryview(buf))
        return P.unpack(layout, buf)

    def lock(self, shared: bool) -> None:
        """Nothing to do: the target admits one host at a time (Controller Busy to a second)."""

    def _rw(self, opc: int, view, block: int, nblocks: int, fua: bool = False):
        if block < 0 or nblocks < 1 or len(view) != nblocks * self.block_size:
            raise ValueError(f"{nblocks} blocks at {block} with a buffer of {len(view)} bytes")
        with self._lock:
            self._check_io()
            done, per = 0, self.block_size // self.logical_block_size
            while done < nblocks:
                k = min(self.max_blocks, nblocks - done)
                lba = (block + done) * per
                part = view[done * self.block_size:(done + k) * self.block_size]
                fields = dict(opc=opc, nsid=1, cdw10=lba & 0xFFFFFFFF, cdw11=lba >> 32,
                              cdw12=(k * per - 1) | (P.RW_FUA if fua else 0))
                if opc == P.NVM_READ:
                    self.io.command(fields, data_in=part)
                else:
                    self.io.command(fields, data_out=part)
                done += k

    def read_into(self, buf, block: int, nblocks: int) -> memoryview:
        view = memoryview(buf)[:nblocks * self.block_size]
        self._rw(P.NVM_READ, view, block, nblocks)
        return view

    def write_from(self, buf, offset: int, block: int, nblocks: int) -> None:
        if self.readonly:
            raise DeviceError(f"{self.path} is open read-only")
        self._rw(P.NVM_WRITE, memoryview(buf)[offset:offset + nblocks * self.block_size], block, nblocks)

    def sync(self) -> None:
        with self._lock:
            self._check_io()
            self.io.command(dict(opc=P.NVM_FLUSH, nsid=1))

    def _check_io(self):
        if self.io is None:
            raise DeviceError(f"{self.path} is closed")
        if self.lost:
            raise DeviceError(f"{self.lost} (the connection is gone: reopen the store)")

    @property
    def lost(self) -> str | None:
        """Why a connection to the target was lost, if one was: every command fails until the
        device is opened again (a target restarted is not reconnected to by itself)."""
        return next((q.lost for q in (self.io, self.admin) if q is not None and q.lost), None)

    def close(self) -> None:
        """A normal shutdown (CC.SHN: the target syncs), then both connections closed."""
        with self._lock:
            io, self.io = self.io, None
            admin, self.admin = getattr(self, "admin", None), None
        if io is not None:
            io.close()
        if admin is not None:
            try:
                if admin.channel.sock.fileno() != -1:
                    # SHN with CC as it was (it cleared EN and the entry sizes before), then CSTS.SHST
                    # complete. Durability is the store's Flush before, not this: Linux's nvmet
                    # flushes nothing at a shutdown (this project's target syncs)
                    admin.set_property(P.PROP_CC, CC_ENABLED | P.CC_SHN_NORMAL)
                    deadline = time.monotonic() + READY_TIMEOUT_S
                    while (admin.get_property(P.PROP_CSTS) & 3 << 2 != P.CSTS_SHST_COMPLETE
                           and time.monotonic() < deadline):
                        time.sleep(0.01)
            except DeviceError:
                pass
            admin.close()
