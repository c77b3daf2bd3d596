"""datapath: the data path's command line.

    datapath doctor            check this machine can run the data path
"""
from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
    sudo .venv/bin/datapath doctor     # one line per check, exit 0 if the data path can run
    python -m datapath doctor          # the same
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="datapath", description="zerolayer's LLM request data path.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    sub.add_parser("doctor", help="check root, kernel, BPF features, bcc, headers, extensions, loop, kvm, qemu",
                   description="One line per check: OK, WARN (optional) or FAIL with a fix. "
                               "Exit 0 only when the data path can run. Cleans up all it creates.")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from . import doctor
        return doctor.run()
    return 2


if __name__ == "__main__":
    sys.exit(main())
