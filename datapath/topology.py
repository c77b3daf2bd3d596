"""Network namespaces and veths for the data path, built with pyroute2.

    host netns  dp<pid>t<seq>h         client netns dp<pid>t<seq>c<n>
      h<n>  198.18.<n>.1/24  <--veth-->  c<n>  198.18.<n>.2/24

Both ends live in namespaces this process created, so nothing on the
machine's own interfaces changes and an XDP program on h<n> sees only test
traffic. Addresses come from 198.18.0.0/15 (RFC 2544 benchmarking). Every
name carries the creating process's pid: two runs never collide, and
sweep_stale() can remove what a killed run left behind without touching
anything that belongs to a live process.
"""
from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import socket
import tempfile
import threading

from pyroute2 import NetNS, netns

PREFIX = "dp"
NAME_RE = re.compile(rf"^{PREFIX}(\d+)t\d+[hc]\d*$")
SUBNET = ipaddress.ip_network("198.18.0.0/15")
MAX_CLIENTS = 256
_seq = itertools.count()


def host_addr(n: int) -> str:
    return f"198.18.{n}.1"


def client_addr(n: int) -> str:
    return f"198.18.{n}.2"


class Topology:
    """A host namespace joined to `clients` client namespaces by veth pairs.

    Use as a context manager; everything is removed on exit, also when the
    body raises or the setup itself fails half-way.
    """

    def __init__(self, clients: int = 1, mtu: int = 1500, queues: int = 1):
        if not 1 <= clients <= MAX_CLIENTS:
            raise ValueError(f"clients must be 1..{MAX_CLIENTS}, not {clients}")
        if not 68 <= mtu <= 65535:
            raise ValueError(f"mtu must be 68..65535, not {mtu}")
        if not 1 <= queues <= 64:
            raise ValueError(f"queues must be 1..64, not {queues}")
        self.clients, self.mtu, self.queues = clients, mtu, queues
        tag = f"{PREFIX}{os.getpid()}t{next(_seq)}"
        self.host_ns = f"{tag}h"
        self.client_ns = [f"{tag}c{n}" for n in range(clients)]
        self.host_if = [f"h{n}" for n in range(clients)]
        self.client_if = [f"c{n}" for n in range(clients)]
        self.host_ip = [host_addr(n) for n in range(clients)]
        self.client_ip = [client_addr(n) for n in range(clients)]
        self._made: list[str] = []

    def __enter__(self):
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _build(self):
        for name in (self.host_ns, *self.client_ns):
            self._made.append(name)       # first: an interrupt during the create leaves no namespace
            netns.create(name)
            with NetNS(name) as ns:
                ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
        with NetNS(self.host_ns) as host:
            for n in range(self.clients):
                host.link("add", ifname=self.host_if[n], kind="veth", mtu=self.mtu,
                          num_tx_queues=self.queues, num_rx_queues=self.queues,
                          peer={"ifname": self.client_if[n], "mtu": self.mtu,
                                "num_tx_queues": self.queues, "num_rx_queues": self.queues,
                                "net_ns_fd": self.client_ns[n]})
                idx = host.link_lookup(ifname=self.host_if[n])[0]
                host.addr("add", index=idx, address=self.host_ip[n], prefixlen=24)
                host.link("set", index=idx, state="up")
        for n in range(self.clients):
            with NetNS(self.client_ns[n]) as client:
                idx = client.link_lookup(ifname=self.client_if[n])[0]
                client.addr("add", index=idx, address=self.client_ip[n], prefixlen=24)
                client.link("set", index=idx, state="up")

    def close(self):
        while self._made:                # listed until removed: an interrupt leaves it to the next close
            try:
                netns.remove(self._made[-1])
            except OSError:
                pass  # already gone
            self._made.pop()

    def namespaces(self) -> list[str]:
        return [self.host_ns, *self.client_ns]


def enter(name: str):
    """Move the calling thread into netns `name` (use in a child process or a preexec_fn)."""
    netns.setns(name, flags=0)   # never create: pyroute2's default would make a stray namespace


def socket_in(name: str, family=socket.AF_INET, type=socket.SOCK_DGRAM) -> socket.socket:
    """A socket that lives in netns `name` (sockets keep the namespace they were made in), made by
    a short-lived thread that moves there, so the caller never moves: moving it there and back
    (pyroute2's pushns) took a thread back to the main thread's namespace, and a Ctrl-C between
    the two moves left the main thread in `name`. A missing namespace is FileNotFoundError, never
    created."""
    out = {}

    def make():
        try:
            netns.setns(name, flags=0)
            out["sock"] = socket.socket(family, type)
        except BaseException as e:      # raised again in the caller
            out["error"] = e
    maker = threading.Thread(target=make, name=f"socket-in-{name}")
    maker.start()
    maker.join()
    if "error" in out:
        raise out["error"]
    return out["sock"]


def ours() -> list[str]:
    """Every namespace on the machine that this module's naming scheme made."""
    return [n for n in netns.listnetns() if NAME_RE.match(n)]


def _leftovers() -> list:
    """What a run leaves if SIGKILLed, as (name pattern with its pid, directory): a pipeline's rings
    and lanes (datapath.pipeline, tag pl<pid>-<seq>), its store server's socket directory and its
    zmq lanes' (lane="zmq"; both zl-<tag>-), `datapath worker --demo`'s rings, and bench e2e's
    store images (bench.e2e.fresh_store). Each pattern names this project's files alone: a bare
    pl<n>-<n>. took a user's pl2024-01.csv in the temp directory for a dead run's (found by review)."""
    from snapshotstore.device import state_dir
    return [(re.compile(r"^dp-pl(\d+)-\d+\."), "/dev/shm"),
            (re.compile(r"^dp-zl-demo-(\d+)\."), "/dev/shm"),
            (re.compile(r"^zl-pl(\d+)-\d+-"), tempfile.gettempdir()),
            (re.compile(r"^e2e-store-(\d+)-"), state_dir())]


def sweep_stale() -> list[str]:
    """Remove namespaces, and a run's rings, socket directories and store images (_leftovers),
    whose creating process is dead (a run killed with SIGKILL): nothing else cleans them up.

    What belongs to live processes is left alone, whoever they are.
    """
    def dead(pid: int) -> bool:
        return pid != os.getpid() and not os.path.exists(f"/proc/{pid}")
    removed = []
    for name in ours():
        if dead(int(NAME_RE.match(name).group(1))):
            try:
                netns.remove(name)
                removed.append(name)
            except OSError:
                pass
    for pattern, where in _leftovers():
        for name in os.listdir(where) if os.path.isdir(where) else []:
            m = pattern.match(name)
            if m and dead(int(m.group(1))):
                path = os.path.join(where, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                removed.append(path)
    return removed
