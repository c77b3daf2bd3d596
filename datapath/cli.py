"""datapath: the data path's command line.

    datapath doctor            check this machine can run the data path
    datapath ingress stats     per-queue packets, drops by reason, XDP-to-consumer latency
    datapath worker            run one worker (serving side)
    datapath model info        the tiny model's sizes
"""
from __future__ import annotations

import argparse
import math
import os
import sys

EPILOG = """examples:
    sudo .venv/bin/datapath doctor     # one line per check, exit 0 if the data path can run
    python -m datapath doctor          # the same
    sudo .venv/bin/datapath ingress stats        # a report every second of the running ingress
    sudo .venv/bin/datapath ingress stats 5 3    # three 5-second reports
    datapath model info                # parameters, KV bytes per token, delta sizes per codec
    datapath worker --demo 4           # a worker running 4 requests in-process
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="datapath", description="zerolayer's LLM request data path.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    sub.add_parser("doctor", help="check root, kernel, BPF features, bcc, headers, extensions, loop, kvm, qemu",
                   description="One line per check: OK, WARN (optional) or FAIL with a fix. "
                               "Exit 0 only when the data path can run. Run it as root: it compiles and loads "
                               "a BPF program, and attaches XDP on a throwaway veth pair in a namespace of its "
                               "own, all removed before it exits.")
    ing = sub.add_parser("ingress", help="the XDP ingress").add_subparsers(dest="ingress_command", metavar="WHAT")
    ing.required = True
    st = ing.add_parser("stats", help="per-queue packets, drops by reason, log2 histogram of XDP-to-consumer latency",
                        description="Reports on the running steering program (found by name, read-only) every "
                                    "interval seconds, count times (default: until Ctrl-C). Needs root (it reads "
                                    "the program's BPF maps).",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="examples:\n    datapath ingress stats\n    datapath ingress stats 5 3\n"
                               "    datapath ingress stats -p 42 1\n")
    st.add_argument("interval", nargs="?", type=positive(float), default=1.0,
                    help="seconds between reports (default 1)")
    st.add_argument("count", nargs="?", type=positive(int), default=None, help="number of reports (default: until Ctrl-C)")
    st.add_argument("-p", "--prog-id", type=positive(int, most=2**32 - 1),
                    help="the program's id, when several are loaded")
    st.add_argument("--ebpf", action="store_true", help=argparse.SUPPRESS)   # print the BPF C, as bcc tools do
    from .serving import commands as serving_commands
    serving_commands.add_parsers(sub)
    return p


def positive(kind, zero_ok: bool = False, most=None):
    """An argparse type: a finite number > 0 (>= 0 with zero_ok, <= most); argparse names the flag."""
    def parse(text):
        try:
            v = kind(text)
            math.isfinite(v)             # a 400-digit int overflows a float here: not a number to us
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a{' whole' if kind is int else ''} number") from None
        if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"{text} must be {'0 or more' if zero_ok else 'positive'}")
        if most is not None and v > most:
            raise argparse.ArgumentTypeError(f"{text} must be at most {most}")
        return v
    return parse


def main(argv=None) -> int:
    try:
        rc = _run(build_parser().parse_args(argv))
        sys.stdout.flush()      # here, not at exit: buffered, a pipe's end fails its flush
        return rc
    except BrokenPipeError:     # `datapath model info | head`
        return reader_left()


def reader_left() -> int:
    """stdout's reader left (`... | head`): no traceback, nor one at exit's flush (stdout goes to
    /dev/null); the status a shell reports for a command SIGPIPE ended. bench's too."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


def _run(args) -> int:
    if args.command == "doctor":
        from . import doctor
        return doctor.run()
    if args.command == "ingress":
        from . import ingress_stats
        return ingress_stats.run(args.interval, args.count, args.prog_id, args.ebpf)
    if args.command in ("worker", "model"):
        from .serving import commands as serving_commands
        return serving_commands.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
