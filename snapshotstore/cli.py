"""snapshotstore: format, inspect, check and count a snapshot store on a block device or image file.

    snapshotstore format [DEVICE] [--size SIZE] [--force]
    snapshotstore inspect [DEVICE] [--limit N]
    snapshotstore fsck [DEVICE]
    snapshotstore stats [DEVICE] [--json]
    snapshotstore target [--listen HOST:PORT] [--nqn NQN] DEVICE
    snapshotstore serve [DEVICE] --listen ENDPOINT

DEVICE is a regular file, a loop device, an NVMe / NVMe-oF namespace
(/dev/nvmeXnY, attached with nvme-cli), or a namespace of an NVMe/TCP target
(nvme-tcp://HOST:PORT/SUBNQN, such as `snapshotstore target` serves); without
one, the default image in the state directory. inspect, fsck and stats open
the store read-only.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from .device import DEFAULT_IMAGE_SIZE, create_image, default_image_path
from .errors import SnapshotError
from .format import KIND_NAMES, KIND_PAD
from .nvmetcp.initiator import is_url
from .nvmetcp.target import DEFAULT_NQN, DEFAULT_PORT

EPILOG = """examples:
    snapshotstore format store.img --size 256M        # create a sparse image and format it
    sudo snapshotstore format /dev/nvme1n1 --force    # erase a namespace and make an empty store
    snapshotstore inspect store.img --limit 20        # the log, oldest record first
    snapshotstore fsck store.img                      # every CRC and every chain; exit 1 if damaged
    snapshotstore stats --json                        # the default store's counters
    snapshotstore target store.img --listen 127.0.0.1:4420    # serve store.img over NVMe/TCP
    snapshotstore serve store.img --listen tcp://198.18.0.9:5600 --secret-file key   # to workers: datapath worker --store
    snapshotstore fsck nvme-tcp://127.0.0.1:4420/nqn.2026-12.io.zerolayer:snapshots
"""


def parse_size(text: str) -> int:
    """Bytes, a K/M/G/T suffix (powers of 1024) allowed; more than 0."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        scale = units[t[-1]] if t and t[-1] in units else 1
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 4096, 256M, 1G)")
    return int(value)


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (0 or more)")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="snapshotstore", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    device = dict(nargs="?", help=f"block device, image file or nvme-tcp://HOST:PORT/SUBNQN (default: "
                                  f"{default_image_path()})")
    f = sub.add_parser("format", help="make an empty store (creates an image file with --size)")
    f.add_argument("device", **device)
    f.add_argument("--size", type=parse_size, help="create the image file with this size, in bytes or with a "
                   f"K/M/G/T suffix (default {DEFAULT_IMAGE_SIZE >> 30}G for the default image)")
    f.add_argument("--force", action="store_true",
                   help="erase what DEVICE holds: a store, or any data (without it only zeroed blocks are formatted)")
    f.add_argument("--block-size", type=parse_size, metavar="N",
                   help="blocks of N bytes, a multiple of the device's logical block (default: the device's "
                        "own, 4K at least, so the image opens as a file, through a loop device or over "
                        "NVMe/TCP alike)")
    i = sub.add_parser("inspect", help="list the records of the log, oldest first")
    i.add_argument("device", **device)
    i.add_argument("--limit", type=_count, default=0, metavar="N", help="show at most N records (default 0: all)")
    c = sub.add_parser("fsck", help="verify every record's CRC and every chain; exit 1 on damage")
    c.add_argument("device", **device)
    s = sub.add_parser("stats", help="sessions, records, space and recovery counters")
    s.add_argument("device", **device)
    s.add_argument("--json", action="store_true", help="print JSON")
    t = sub.add_parser("target", help="serve DEVICE as an NVMe/TCP namespace until SIGTERM or Ctrl-C")
    t.add_argument("device", help="block device or image file (opened with O_DIRECT, held exclusively)")
    t.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT", type=_host_port,
                   help=f"address to listen on (default 127.0.0.1:{DEFAULT_PORT}; port 0 picks a free one)")
    t.add_argument("--insecure", action="store_true",
                   help="listen off loopback: any peer that reaches the address reads and writes every block "
                        "(this target has no NVMe in-band authentication, and takes any host NQN)")
    t.add_argument("--nqn", default=DEFAULT_NQN, help=f"subsystem NQN (default {DEFAULT_NQN})")
    t.add_argument("--maxh2cdata", type=_maxh2cdata, default=128 << 10, metavar="SIZE",
                   help="largest H2CData PDU, and R2T chunk, the target accepts: a multiple of the block "
                        "size, in bytes or with a K/M suffix (default 128K)")
    v = sub.add_parser("serve", help="serve the store to worker processes over ZeroMQ until SIGTERM or Ctrl-C")
    v.add_argument("device", **device)
    v.add_argument("--listen", required=True, metavar="ENDPOINT", type=_endpoint,
                   help="ZeroMQ endpoint to bind: tcp://HOST:PORT or ipc://PATH (datapath worker --store ENDPOINT)")
    v.add_argument("--eviction", choices=["lru", "refuse"], default="lru",
                   help="when the log is full: evict the least recently used sessions (default), or refuse puts")
    v.add_argument("--secret-file", metavar="PATH",
                   help="the secret the workers hold (their --store-secret-file): only they connect, encrypted "
                        "(ZeroMQ CURVE, keys derived from it); needed for command-line workers (datapath "
                        "worker --store always keys its connection) and for any tcp:// endpoint off loopback")
    return p


def _host_port(s: str) -> str:
    """--listen of target: a usage error (exit 2) as argparse's own, not a device's (1)."""
    host, _, port = s.rpartition(":")
    if host.startswith("[") or ":" in host:
        raise argparse.ArgumentTypeError(f"takes an IPv4 address or a host name: {s!r} is IPv6")
    if not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"takes HOST:PORT, not {s!r} (for example 127.0.0.1:4420)")
    return s


def _maxh2cdata(s: str) -> int:
    """--maxh2cdata of target: under the spec's floor is a usage error (exit 2); not a multiple of
    the device's block size is the device's (1), known once it is open."""
    from .nvmetcp.target import MAX_MAXH2CDATA, MIN_MAXH2CDATA
    n = parse_size(s)
    if not MIN_MAXH2CDATA <= n <= MAX_MAXH2CDATA:
        raise argparse.ArgumentTypeError(f"is {MIN_MAXH2CDATA} bytes to 4 GiB - 1 (NVMe/TCP's 32-bit field), "
                                         f"not {s!r}")
    return n


def _endpoint(s: str) -> str:
    """--listen of serve: tcp://HOST:PORT or ipc://PATH (server.check_endpoint)."""
    from .server import check_endpoint
    try:
        check_endpoint(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _serve(args) -> int:
    """One process holds the device; workers restore each other's sessions through it
    (snapshotstore/server.py): what the pipeline starts for its workers, by hand."""
    import signal
    import threading

    import zmq
    from .server import serve
    path = args.device or default_image_path()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    from .server import read_secret
    secret = read_secret(args.secret_file) if args.secret_file else None

    class Said:                          # serve's `ready`: set once the store is open and bound
        def set(self):
            print(f"serving {path} at {args.listen}" + (", to clients holding its secret" if secret else ""),
                  flush=True)
    try:
        serve(path, args.listen, stop, eviction=args.eviction, ready=Said(), secret=secret)
    except zmq.ZMQError as e:
        raise SnapshotError(f"cannot serve at {args.listen}: {e}") from None
    return 0


def _format(args) -> int:
    from .log import format_device
    path = args.device or default_image_path()
    made = False
    if args.block_size is not None and not (512 <= args.block_size <= 65536
                                            and args.block_size & (args.block_size - 1) == 0):
        raise SnapshotError(f"--block-size must be a power of two from 512 to 64K, not {args.block_size}")
    if is_url(path):
        if args.size is not None:
            raise SnapshotError("--size creates an image file: a remote namespace has its size already")
    elif not os.path.exists(path):
        if args.device is None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        elif args.size is None:
            raise SnapshotError(f"{path} does not exist: pass --size to create an image file there")
        size = DEFAULT_IMAGE_SIZE if args.size is None else args.size
        create_image(path, size)
        made = True
        print(f"created {path} ({size:,} bytes, {size / 2**20:g} MiB sparse image)")
    elif args.size is not None:
        raise SnapshotError(f"{path} exists already: --size only applies to a new image file")
    try:
        sb = format_device(path, force=args.force, block_size=args.block_size)
    except BaseException:
        if made:
            os.unlink(path)        # the image made here goes with the format that failed on it
        raise
    print(f"formatted {path}: {sb.log_blocks} log blocks of {sb.block_size} bytes, store id {sb.store_id:016x}")
    return 0


def _open(args):
    from .log import LogStore
    path = args.device or default_image_path()
    return LogStore(path, readonly=True)


def _inspect(args) -> int:
    with _open(args) as store:
        print(f"{'lpos':>10} {'kind':<9} {'key':<16} {'seq':>8} {'parent':>8} {'tokens':>15} {'layers':>7} "
              f"{'codec':<8} {'raw':>8} {'stored':>8} {'blocks':>6} state")
        for e in store.entries(args.limit or None):
            key = "-" if e.kind == KIND_PAD else e.key.hex()[:16]
            print(f"{e.lpos:>10} {KIND_NAMES[e.kind]:<9} {key:<16} {e.seq:>8} {e.parent:>8} "
                  f"{f'{e.tokens[0]}-{e.tokens[1]}':>15} {f'{e.layers[0]}-{e.layers[1]}':>7} {e.codec:<8} "
                  f"{e.raw_len:>8} {e.stored_len:>8} {e.nblocks:>6} {'live' if e.live else 'dead'}")
        st = store.stats()
        print(f"{st['records']} live records in {st['sessions']} sessions; skipped: "
              f"{st['torn_records_skipped']} torn, {st['corrupt_blocks_skipped']} corrupt blocks, "
              f"{st['unlinked_records_skipped']} unlinked")
    return 0


def _fsck(args) -> int:
    with _open(args) as store:
        st = store.stats()
        problems = store.verify()
        if st["superblock_cut"]:
            # after a power cut the checkpoint being written may be torn: not damage (exit 0)
            print(f"  1 of 2 superblock copies unreadable: the last checkpoint's, which a crash cut (or "
                  f"damage there, which reads the same); the other, generation {st['generation']}, holds the "
                  f"store, and the next read-write open rewrites both")
        elif st["superblocks_valid"] < 2:
            problems.append(f"{2 - st['superblocks_valid']} of 2 superblock copies damaged "
                            f"(the next read-write open rewrites both)")
        if st["corrupt_blocks_skipped"]:
            problems.append(f"{st['corrupt_blocks_skipped']} corrupt blocks in the durable part of the log")
        if st["unreadable_blocks"]:
            problems.append(f"{st['unreadable_blocks']} blocks could not be read (EIO: bad sectors)"
                            + (", the log's end among them: records after it, acknowledged ones among them, "
                               "are lost" if st["end_unreadable"] else ""))
        print(f"{store.path}: {st['sessions']} sessions, {st['records']} live records, every CRC read: "
              f"{st['log_records']} records from head {st['head']} to tail {st['tail']}")
        if st["torn_records_skipped"]:
            # past the checkpoint (the last <= 10 ms of flushes) a torn write and a damaged one read alike
            print("  a torn record ends the log: a write a crash cut, unacknowledged (ignored); or, if the "
                  "device damaged an acknowledged one of the last flushes before the checkpoint, it and "
                  "any after it are lost (snapshot-store.md, The checkpoint)")
        for p in problems:
            print(f"  damage: {p}")
        print("  clean" if not problems else f"  {len(problems)} problems")
        return 1 if problems else 0


def _stats(args) -> int:
    with _open(args) as store:
        st = store.stats()
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        for k, v in st.items():
            print(f"{k:<26} {v}")
    return 0


def _target(args) -> int:
    import signal
    import threading
    from .nvmetcp.target import Target
    from .server import off_loopback
    host, _, port = args.listen.rpartition(":")
    if not args.insecure and off_loopback(f"tcp://{args.listen}"):
        # as serve refuses a tcp:// endpoint off loopback without a secret: every tenant's sessions,
        # raw blocks here, to any peer (it served 0.0.0.0 without a word: found by review)
        raise SnapshotError(f"--listen {args.listen} is off loopback: any peer reaching it could read and write "
                            f"every block of {args.device} (no authentication here). Listen on 127.0.0.1, or "
                            f"give --insecure on a network only trusted hosts reach")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        target = Target(args.device, args.nqn, host, int(port), maxh2cdata=args.maxh2cdata,
                        log=lambda line: print(line, flush=True)).start()
    except ValueError as e:
        raise SnapshotError(str(e)) from None
    try:
        dev = target.dev
        print(f"serving {args.device} ({dev.blocks} blocks of {dev.block_size} bytes) at {target.url}", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        target.stop()
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = {"format": _format, "inspect": _inspect, "fsck": _fsck, "stats": _stats,
              "target": _target, "serve": _serve}[args.command](args)
        sys.stdout.flush()        # here, not at exit: buffered, a pipe's end fails its flush
        return rc
    except SnapshotError as e:
        print(f"snapshotstore: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:       # `snapshotstore inspect | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # (nor one at exit's flush)
        return 141                # as a shell reports a command SIGPIPE ended
    except OSError as e:          # the device itself (a traceback said no more)
        print(f"snapshotstore: {getattr(args, 'device', '')}: {e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
