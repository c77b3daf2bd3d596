"""NVMe/TCP PDU and NVMe command layouts, defined once (NVMe/TCP transport 1.0, TP 8000; NVMe-oF 1.1).

Every integer on the wire is little-endian, as the spec says. A PDU is a
common header (8 bytes), its PDU-specific header (together hlen bytes), an
optional header digest, padding up to pdo, data, and an optional data digest;
plen counts all of it. Digests are CRC32C, sent little-endian.

tests/test_nvmetcp.py pins every size, offset and constant here against the spec.
"""
from __future__ import annotations

import struct

from ..format import Layout, crc32c

# --- PDU types, flags (common header byte 0, byte 1) ---------------------------------
ICREQ, ICRESP, H2C_TERM_REQ, C2H_TERM_REQ = 0x00, 0x01, 0x02, 0x03
CAPSULE_CMD, CAPSULE_RESP, H2C_DATA, C2H_DATA, R2T = 0x04, 0x05, 0x06, 0x07, 0x09
PDU_NAMES = {ICREQ: "ICReq", ICRESP: "ICResp", H2C_TERM_REQ: "H2CTermReq", C2H_TERM_REQ: "C2HTermReq",
             CAPSULE_CMD: "CapsuleCmd", CAPSULE_RESP: "CapsuleResp", H2C_DATA: "H2CData", C2H_DATA: "C2HData",
             R2T: "R2T"}

FLAG_HDGST = 0x01        # a header digest follows the header
FLAG_DDGST = 0x02        # a data digest follows the data
FLAG_LAST_PDU = 0x04     # H2CData / C2HData: the last data PDU of the transfer
FLAG_SUCCESS = 0x08      # C2HData: the command succeeded, no CapsuleResp follows (ours always sends one; SPDK's does not)

DGST_HEADER, DGST_DATA = 0x01, 0x02      # ICReq / ICResp DGST byte
DIGEST_LEN = 4

# Fatal error status (TermReq FES)
FES_INVALID_HEADER_FIELD = 0x01
FES_PDU_SEQUENCE_ERROR = 0x02
FES_HEADER_DIGEST_ERROR = 0x03
FES_DATA_OUT_OF_RANGE = 0x04
FES_DATA_LIMIT_EXCEEDED = 0x05
FES_UNSUPPORTED_PARAMETER = 0x06
TERM_MAX_ERROR_DATA = 128    # a TermReq carries at most this much of the offending PDU's header

# --- PDU headers -----------------------------------------------------------------------
_CH = (("pdu_type", "B"), ("flags", "B"), ("hlen", "B"), ("pdo", "B"), ("plen", "I"))
CH = Layout(_CH)
ICREQ_PDU = Layout(_CH + (("pfv", "H"), ("hpda", "B"), ("dgst", "B"), ("maxr2t", "I"), ("rsvd", "112s")))
ICRESP_PDU = Layout(_CH + (("pfv", "H"), ("cpda", "B"), ("dgst", "B"), ("maxh2cdata", "I"), ("rsvd", "112s")))
TERM_REQ_PDU = Layout(_CH + (("fes", "H"), ("fei", "I"), ("rsvd", "10s")))
CAPSULE_CMD_PDU = Layout(_CH + (("sqe", "64s"),))
CAPSULE_RESP_PDU = Layout(_CH + (("cqe", "16s"),))
H2C_DATA_PDU = Layout(_CH + (("cccid", "H"), ("ttag", "H"), ("datao", "I"), ("datal", "I"), ("rsvd", "4s")))
C2H_DATA_PDU = Layout(_CH + (("cccid", "H"), ("rsvd0", "H"), ("datao", "I"), ("datal", "I"), ("rsvd", "4s")))
R2T_PDU = Layout(_CH + (("cccid", "H"), ("ttag", "H"), ("r2to", "I"), ("r2tl", "I"), ("rsvd", "4s")))
HEADERS = {ICREQ: ICREQ_PDU, ICRESP: ICRESP_PDU, H2C_TERM_REQ: TERM_REQ_PDU, C2H_TERM_REQ: TERM_REQ_PDU,
           CAPSULE_CMD: CAPSULE_CMD_PDU, CAPSULE_RESP: CAPSULE_RESP_PDU, H2C_DATA: H2C_DATA_PDU,
           C2H_DATA: C2H_DATA_PDU, R2T: R2T_PDU}

# --- the submission and completion queue entries ---------------------------------------
_SGL = (("sgl_addr", "Q"), ("sgl_len", "I"), ("sgl_rsvd", "3s"), ("sgl_id", "B"))
SQE = Layout((("opc", "B"), ("flags", "B"), ("cid", "H"), ("nsid", "I"), ("cdw2", "I"), ("cdw3", "I"),
              ("mptr", "Q")) + _SGL + tuple((f"cdw{n}", "I") for n in range(10, 16)))
FABRICS_SQE = Layout((("opc", "B"), ("flags", "B"), ("cid", "H"), ("fctype", "B"), ("rsvd5", "19s"))
                     + _SGL + (("specific", "24s"),))
CONNECT_SPECIFIC = Layout((("recfmt", "H"), ("qid", "H"), ("sqsize", "H"), ("cattr", "B"), ("rsvd", "B"),
                           ("kato", "I"), ("rsvd2", "12s")))
PROPERTY_SPECIFIC = Layout((("attrib", "B"), ("rsvd", "3s"), ("ofst", "I"), ("value", "Q"), ("rsvd2", "8s")))
CONNECT_DATA = Layout((("hostid", "16s"), ("cntlid", "H"), ("rsvd", "238s"), ("subnqn", "256s"),
                       ("hostnqn", "256s"), ("rsvd2", "256s")))
CQE = Layout((("dw0", "I"), ("dw1", "I"), ("sqhd", "H"), ("sqid", "H"), ("cid", "H"), ("status", "H")))

PSDT_SGL = 0x40              # SQE flags: data pointer is an SGL (required on fabrics, Fabrics commands too)
SGL_ICD = 0x01               # Data Block descriptor, Offset subtype: data in the capsule
SGL_TRANSPORT = 0x5A         # Transport SGL Data Block, transport-specific: data by R2T/H2CData or C2HData

# opcodes
OPC_FABRICS = 0x7F
FCTYPE_PROPERTY_SET, FCTYPE_CONNECT, FCTYPE_PROPERTY_GET = 0x00, 0x01, 0x04
ADMIN_GET_LOG_PAGE, ADMIN_IDENTIFY, ADMIN_KEEP_ALIVE = 0x02, 0x06, 0x18
ADMIN_SET_FEATURES, ADMIN_GET_FEATURES = 0x09, 0x0A
NVM_FLUSH, NVM_WRITE, NVM_READ = 0x00, 0x01, 0x02
CNS_NAMESPACE, CNS_CONTROLLER, CNS_ACTIVE_NS_LIST, CNS_NS_DESCRIPTORS = 0x00, 0x01, 0x02, 0x03
FID_NUM_QUEUES = 0x07        # Set/Get Features: Number of Queues
LID_SMART, SMART_LOG_LEN = 0x02, 512     # Get Log Page: SMART / Health Information
NIDT_UUID, NIDT_CSI = 0x03, 0x04     # namespace identification descriptor types (CNS 03h)
NS_DESC = Layout((("nidt", "B"), ("nidl", "B"), ("rsvd", "H")))     # then nidl bytes of identifier
CNTRLTYPE_IO = 1
KAS_UNITS = 10               # Keep Alive Support, in 100 ms units (nvmet's: a 1 s granularity)
RW_FUA = 1 << 30             # cdw12 of Read/Write: force unit access

# controller properties (offset, bytes)
PROP_CAP, PROP_VS, PROP_CC, PROP_CSTS = 0x00, 0x08, 0x14, 0x1C
CC_EN, CC_SHN_MASK, CC_SHN_NORMAL = 1 << 0, 3 << 14, 1 << 14
CSTS_RDY, CSTS_SHST_COMPLETE = 1 << 0, 2 << 2

# status codes: (status code type << 8) | status code
SC_SUCCESS = 0x000
SC_INVALID_OPCODE = 0x001
SC_INVALID_FIELD = 0x002
SC_DATA_TRANSFER_ERROR = 0x004
SC_INTERNAL = 0x006
SC_INVALID_NAMESPACE = 0x00B
SC_COMMAND_SEQUENCE = 0x00C
SC_SGL_INVALID_DATA_LENGTH = 0x00F
SC_SGL_INVALID_OFFSET = 0x016
SC_TRANSIENT_TRANSPORT = 0x022
SC_LBA_OUT_OF_RANGE = 0x080
SC_CONNECT_INCOMPATIBLE_FORMAT = 0x180
SC_CONNECT_CONTROLLER_BUSY = 0x181
SC_CONNECT_INVALID_PARAMETERS = 0x182
SC_CONNECT_INVALID_HOST = 0x184
SC_WRITE_FAULT = 0x280
SC_UNRECOVERED_READ = 0x281
STATUS_NAMES = {SC_SUCCESS: "Successful Completion", SC_INVALID_OPCODE: "Invalid Command Opcode",
                SC_INVALID_FIELD: "Invalid Field in Command", SC_DATA_TRANSFER_ERROR: "Data Transfer Error",
                SC_INTERNAL: "Internal Error", SC_INVALID_NAMESPACE: "Invalid Namespace or Format",
                SC_COMMAND_SEQUENCE: "Command Sequence Error",
                SC_SGL_INVALID_DATA_LENGTH: "Data SGL Length Invalid", SC_SGL_INVALID_OFFSET: "SGL Offset Invalid",
                SC_TRANSIENT_TRANSPORT: "Transient Transport Error", SC_LBA_OUT_OF_RANGE: "LBA Out of Range",
                SC_CONNECT_INCOMPATIBLE_FORMAT: "Connect Incompatible Format",
                SC_CONNECT_CONTROLLER_BUSY: "Connect Controller Busy",
                SC_CONNECT_INVALID_PARAMETERS: "Connect Invalid Parameters",
                SC_CONNECT_INVALID_HOST: "Connect Invalid Host", SC_WRITE_FAULT: "Write Fault",
                SC_UNRECOVERED_READ: "Unrecovered Read Error"}
STATUS_DNR = 1 << 15         # do not retry


def status_field(sc: int) -> int:
    """The CQE status word: SC in bits 8:1, SCT in 11:9, DNR in 15 (phase tag 0: no queue memory).
    Every error is final but a transient transport error (a data digest mismatch), which the host
    may retry: with DNR, Linux failed the I/O up to the file system instead; and Controller Busy,
    which ends when the association holding the controller does: with DNR, newer Linux hosts
    reconnecting after a partition gave the controller up instead of retrying."""
    dnr = sc not in (SC_SUCCESS, SC_TRANSIENT_TRANSPORT, SC_CONNECT_CONTROLLER_BUSY)
    return ((sc & 0xFF) << 1) | ((sc >> 8 & 7) << 9) | (STATUS_DNR if dnr else 0)


def status_code(status: int) -> int:
    return (status >> 9 & 7) << 8 | (status >> 1 & 0xFF)


# --- Identify data (4096 bytes each; unused fields reserved, zero) ---------------------
IDENTIFY_LEN = 4096
ID_CTRL = Layout((
    ("vid", "H"), ("ssvid", "H"), ("sn", "20s"), ("mn", "40s"), ("fr", "8s"), ("rab", "B"), ("ieee", "3s"),
    ("cmic", "B"), ("mdts", "B"), ("cntlid", "H"), ("ver", "I"), ("rsvd84", "27s"), ("cntrltype", "B"),
    ("rsvd112", "208s"), ("kas", "H"), ("rsvd322", "190s"),
    ("sqes", "B"), ("cqes", "B"), ("maxcmd", "H"), ("nn", "I"), ("oncs", "H"), ("fuses", "H"), ("fna", "B"),
    ("vwc", "B"), ("awun", "H"), ("awupf", "H"), ("rsvd530", "6s"), ("sgls", "I"), ("rsvd540", "228s"),
    ("subnqn", "256s"), ("rsvd1024", "768s"),
    ("ioccsz", "I"), ("iorcsz", "I"), ("icdoff", "H"), ("fcatt", "B"), ("msdbd", "B"), ("ofcs", "H"),
    ("rsvd1806", "242s"), ("psd_vs", "2048s"),
))
ID_NS = Layout((
    ("nsze", "Q"), ("ncap", "Q"), ("nuse", "Q"), ("nsfeat", "B"), ("nlbaf", "B"), ("flbas", "B"), ("mc", "B"),
    ("dpc", "B"), ("dps", "B"), ("nmic", "B"), ("rescap", "B"), ("fpi", "B"), ("dlfeat", "B"), ("nawun", "H"),
    ("nawupf", "H"), ("rsvd38", "90s"), ("lbaf", "256s"), ("rsvd384", "3712s"),   # LBAF0-63, 4 bytes each
))


def lba_format(ns: dict) -> tuple[int, int]:
    """(LBA data size, metadata bytes per LBA) of the namespace's active format: FLBAS bits 3:0,
    and 6:5 as the index's high bits, pick one of its LBA formats (format 0 is not the active one
    on every drive: 512 bytes there and 4 KiB in use is common)."""
    index = (ns["flbas"] & 0xF) | (ns["flbas"] >> 1 & 0x30)
    lbaf = struct.unpack_from("<I", ns["lbaf"], 4 * index)[0]
    return 1 << (lbaf >> 16 & 0xFF), lbaf & 0xFFFF


NVME_VERSION = 0x00010400    # 1.4
NQN_LEN = 256      # the fields' bytes
NQN_MAX = 223      # an NQN's (NVMe base spec; Linux's NVMF_NQN_SIZE): Linux's host takes a longer
                   # SUBNQN for missing and makes up its own (255 was taken here: found by review)
ADMIN_ICD = 8192             # in-capsule data on the admin queue (Linux's NVME_TCP_ADMIN_CCSZ): the Connect data


def pack(layout: Layout, **fields) -> bytes:
    """The layout with the named fields set, every other one zero."""
    values = []
    for name, f in layout.fields:
        values.append(fields.pop(name, b"" if f.endswith("s") else 0))
    if fields:
        raise TypeError(f"no fields {sorted(fields)} in this layout")
    return layout.struct.pack(*values)


def unpack(layout: Layout, buf, off: int = 0) -> dict:
    return dict(zip((name for name, _ in layout.fields), layout.struct.unpack_from(buf, off)))


def psh(layout: Layout, **fields) -> bytes:
    """A PDU-specific header: the layout packed, less the common header (Channel.send adds it)."""
    return pack(layout, **fields)[CH.size:]


def digest(buf) -> bytes:
    """HDGST / DDGST: CRC32C of the header or the data, little-endian."""
    return struct.pack("<I", crc32c(buf))


def nqn_field(nqn: str) -> bytes:
    raw = nqn.encode("utf-8")
    if not raw or len(raw) > NQN_MAX:
        raise ValueError(f"an NQN is 1 to {NQN_MAX} bytes, not {len(raw)}")
    return raw


def nqn_of(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "replace")
