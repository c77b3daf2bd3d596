"""Remote snapshot targets over NVMe/TCP (the NVMe-oF TCP transport, TP 8000), both ends in Python.

    pdu.py        the PDU, SQE/CQE, Connect and Identify layouts and constants, defined once
    transport.py  one connection's PDU stream: send, receive with header/data digests checked
    target.py     Target: one namespace on a file or block device (O_DIRECT), one host at a time
    initiator.py  NvmeTcpDevice: BlockDevice's interface on a remote namespace (LogStore runs on it)
    process.py    the target as a child process (tests, benchmarks)

A store on a remote namespace is LogStore("nvme-tcp://HOST:PORT/SUBNQN").
"""
from .initiator import NvmeError, NvmeTcpDevice, is_url, parse_url
from .target import DEFAULT_NQN, DEFAULT_PORT, Target

__all__ = ["NvmeError", "NvmeTcpDevice", "Target", "DEFAULT_NQN", "DEFAULT_PORT", "is_url", "parse_url"]
