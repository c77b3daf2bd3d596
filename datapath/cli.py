"""datapath: the data path's command line.

    datapath doctor            check this machine can run the data path
    datapath worker            run one worker (serving side)
    datapath model info        the tiny model's sizes
"""
from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
    sudo .venv/bin/datapath doctor     # one line per check, exit 0 if the data path can run
    python -m datapath doctor          # the same
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
                               "Exit 0 only when the data path can run. Cleans up all it creates.")
    from .serving import commands as serving_commands
    serving_commands.add_parsers(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from . import doctor
        return doctor.run()
    if args.command in ("worker", "model"):
        from .serving import commands as serving_commands
        return serving_commands.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
