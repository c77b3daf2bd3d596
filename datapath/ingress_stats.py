"""ingress_stats - per-queue packets, drops by reason and XDP-to-consumer latency of a running ingress.

USAGE: datapath ingress stats [-p PROG_ID] [--ebpf] [interval [count]]

Finds every loaded bpf/steer.bpf.c program (by name, xdp_steer) the way
bpftool does -- program ids, then the program's own maps by name -- so it
observes a data path running in another process and changes nothing. Each
interval prints what happened in it: packets per queue, drops per reason,
passes and 429 replies, and the log2 histogram of XDP-to-consumer latency
that the C consumer counts into the program's mmapable lat_hist array.
"""
from __future__ import annotations

import ctypes
import os
import time

from .ingress import DROP_REASONS, EVENTS
from .metrics import log2_hist
from .xdp import BPF_DIR, libbpf

PROG_NAME = b"xdp_steer"
ENOENT = 2


class _ProgInfo(ctypes.Structure):  # struct bpf_prog_info (UAPI), the leading fields
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("tag", ctypes.c_uint8 * 8),
                ("jited_prog_len", ctypes.c_uint32), ("xlated_prog_len", ctypes.c_uint32),
                ("jited_prog_insns", ctypes.c_uint64), ("xlated_prog_insns", ctypes.c_uint64),
                ("load_time", ctypes.c_uint64), ("created_by_uid", ctypes.c_uint32),
                ("nr_map_ids", ctypes.c_uint32), ("map_ids", ctypes.c_uint64), ("name", ctypes.c_char * 16)]


class _MapInfo(ctypes.Structure):  # struct bpf_map_info (UAPI), the leading fields
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("key_size", ctypes.c_uint32),
                ("value_size", ctypes.c_uint32), ("max_entries", ctypes.c_uint32),
                ("map_flags", ctypes.c_uint32), ("name", ctypes.c_char * 16)]


def _info(fd: int, info) -> None:
    size = ctypes.c_uint32(ctypes.sizeof(info))
    if libbpf().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)):
        raise OSError(ctypes.get_errno(), "bpf_obj_get_info_by_fd")


def _ids(get_next) -> list[int]:
    out, cur, nxt = [], 0, ctypes.c_uint32()
    while get_next(cur, ctypes.byref(nxt)) == 0:
        out.append(nxt.value)
        cur = nxt.value
    return out


class SteerMaps:
    """One loaded steering program's counter maps, opened by id (read-only use)."""

    def __init__(self, prog_id: int):
        lib = libbpf()
        self.prog_id, self.maps, self.fds = prog_id, {}, []
        fd = lib.bpf_prog_get_fd_by_id(prog_id)
        if fd < 0:
            raise OSError(ctypes.get_errno(), f"program {prog_id} is gone")
        try:
            info = _ProgInfo()
            _info(fd, info)
            ids = (ctypes.c_uint32 * max(info.nr_map_ids, 1))()
            info2 = _ProgInfo(nr_map_ids=info.nr_map_ids, map_ids=ctypes.addressof(ids))
            _info(fd, info2)
        finally:
            os.close(fd)
        try:
            for map_id in ids[:info.nr_map_ids]:
                mfd = lib.bpf_map_get_fd_by_id(map_id)
                if mfd < 0:
                    continue
                self.fds.append(mfd)
                m = _MapInfo()
                _info(mfd, m)
                self.maps[m.name.decode()] = (mfd, m)
        except BaseException:
            self.close()                 # the map fds opened so far (the caller gets no object to close)
            raise
        missing = {"drops", "events", "queue_pkts", "lat_hist"} - set(self.maps)
        if missing:
            self.close()
            raise OSError(ENOENT, f"program {prog_id} lacks maps {sorted(missing)}: not bpf/steer.bpf.c")
        self.queues = self.maps["queue_pkts"][1].max_entries
        self.ncpus = lib.libbpf_num_possible_cpus()

    def _read(self, name: str, percpu: bool) -> list[int]:
        fd, m = self.maps[name]
        width = self.ncpus if percpu else 1
        value, key = (ctypes.c_uint64 * width)(), ctypes.c_uint32()
        out = []
        for i in range(m.max_entries):
            key.value = i
            if libbpf().bpf_map_lookup_elem(fd, ctypes.byref(key), value):
                raise OSError(ctypes.get_errno(), f"{name}[{i}]: lookup failed")   # not the last key's again
            out.append(sum(value))
        return out

    def snapshot(self) -> dict:
        return {"queues": self._read("queue_pkts", True), "drops": self._read("drops", True),
                "events": self._read("events", True), "hist": self._read("lat_hist", False)}

    def close(self):
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def steer_programs() -> list[int]:
    """Ids of every loaded program named xdp_steer."""
    lib = libbpf()
    out = []
    for pid in _ids(lib.bpf_prog_get_next_id):
        fd = lib.bpf_prog_get_fd_by_id(pid)
        if fd < 0:
            continue
        try:
            info = _ProgInfo()
            _info(fd, info)
        finally:
            os.close(fd)
        if info.name == PROG_NAME:
            out.append(pid)
    return out


def _setup_libbpf():
    lib = libbpf()
    u32p = ctypes.POINTER(ctypes.c_uint32)
    lib.bpf_prog_get_next_id.argtypes = [ctypes.c_uint32, u32p]
    lib.bpf_map_get_next_id.argtypes = [ctypes.c_uint32, u32p]
    lib.bpf_prog_get_fd_by_id.argtypes = [ctypes.c_uint32]
    lib.bpf_map_get_fd_by_id.argtypes = [ctypes.c_uint32]
    lib.bpf_obj_get_info_by_fd.argtypes = [ctypes.c_int, ctypes.c_void_p, u32p]
    lib.bpf_map_lookup_elem.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]


def report(maps: SteerMaps, before: dict, now: dict) -> str:
    d = {k: [a - b for a, b in zip(now[k], before[k])] for k in now}
    lines = [f"{time.strftime('%H:%M:%S')}  xdp_steer prog {maps.prog_id}, {maps.queues} queues"]
    lines.append("  queue " + " ".join(f"{q:>9}" for q in range(maps.queues)))
    lines.append("  pkts  " + " ".join(f"{n:>9}" for n in d["queues"]))
    lines.append("  " + "  ".join(f"{name} {n}" for name, n in zip(EVENTS, d["events"])))
    drops = [f"{r} {n}" for r, n in zip(DROP_REASONS, d["drops"]) if n]
    lines.append("  drops: " + (", ".join(drops) if drops else "none"))
    lines.append(log2_hist(d["hist"], unit="xdp->consumer ns"))
    return "\n".join(lines)


def run(interval: float = 1.0, count: int | None = None, prog_id: int | None = None, ebpf: bool = False,
        out=None) -> int:
    import sys
    out = out or sys.stdout
    if ebpf:
        try:
            for name in ("steer.h", "steer_maps.h", "steer.bpf.c"):
                print(f"/* ---- bpf/{name} ---- */\n{(BPF_DIR / name).read_text()}", file=out, flush=True)
        except BrokenPipeError:   # `| head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if os.geteuid() != 0:
        print("datapath ingress stats: needs root to read BPF maps: run it with sudo", file=sys.stderr)
        return 1
    _setup_libbpf()
    ids = [prog_id] if prog_id is not None else steer_programs()
    if not ids:
        print("datapath ingress stats: no steering program (xdp_steer) is loaded: start the data path first",
              file=sys.stderr)
        return 1
    try:
        maps = SteerMaps(ids[0])
    except OSError as e:
        print(f"datapath ingress stats: {e.strerror or e}", file=sys.stderr)
        return 1
    if len(ids) > 1:
        print(f"{len(ids)} steering programs loaded ({', '.join(map(str, ids))}): showing {ids[0]}; "
              "choose one with -p", file=out)
    try:
        before, n = maps.snapshot(), 0
        while count is None or n < count:
            try:
                time.sleep(interval)
            except KeyboardInterrupt:
                print(report(maps, before, maps.snapshot()), file=out)   # a last report, as bcc tools do
                break
            now = maps.snapshot()
            print(report(maps, before, now) + "\n", file=out, flush=True)
            before, n = now, n + 1
    except OSError as e:
        print(f"datapath ingress stats: program {maps.prog_id} went away ({e})", file=sys.stderr)
        return 1
    finally:
        maps.close()
    return 0
