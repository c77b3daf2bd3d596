"""python -m bench SUITE [--quick] [--json PATH]: run a benchmark suite.

Each suite measures its references in the same run (these machines are shared
and noisy, so only ratios travel), prints a table and writes JSON, with the
issues' goals of the suite judged from its figures (bench.goals);
`python -m bench goals [DIR ...]` judges them from a run's JSON files.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import os
import pathlib
import signal
import sys
import textwrap

# suite name -> module in bench/ with run(report, args)
SUITES = {
    "wire": "bench.wire",
    "ring": "bench.ring",
    "e2e": "bench.e2e",
    "ingress": "bench.ingress",
    "worker": "bench.worker",
    "snapshot": "bench.snapshot",
    "nvmetcp": "bench.nvmetcp",
    "compare": "bench.compare",
}
IN_ALL = [name for name in SUITES if name != "compare"]   # compare needs --policy
# a run of one of these alone is refused up front without root or bcc, leaving its last JSON as it
# was (`bench ingress` without sudo wrote a failed ingress.json over it: found by review); under
# `all`, each says so in its own JSON and the others run
NEED_ROOT = ("ingress", "e2e", "compare")

EPILOG = """examples:
    python -m bench wire --quick            # a short run, table + bench-results/wire.json
    python -m bench wire --json out/wire.json
    python -m bench all                     # every suite, in full, then every goal's verdict
    python -m bench goals figures/run-19c00b8   # the goals judged from a committed run's JSON files
    sudo python -m bench snapshot --soak    # the snapshot store, and 1,000 SIGKILLed writers
    sudo python -m bench nvmetcp            # the store on an NVMe/TCP target (loopback) against a local one
    sudo python -m bench e2e --quick        # the whole pipeline, every scenario briefly, report in bench-results/e2e/
    sudo python -m bench compare --policy round_robin,affinity,static   # same load per policy, table + plot
    sudo python -m bench compare --policy affinity,affinity:0.05 --repeat 4   # a policy parameter, 4 rounds
    sudo python -m bench compare --policy dynamic,static --device l4 --rate 30   # on a simulated L4's step time
    sudo python -m bench compare --policy round_robin,least_tokens,peak_ewma --straggler 1:4   # worker 1 4x slower
    sudo python -m bench compare --policy power_of_two,peak_ewma --device l4 --workers 4 --straggler 0:3 --rate 60
    sudo python -m bench compare --policy round_robin,peak_ewma --straggler 1:4@4   # slow from 4 s in
"""


def _number(arg: str) -> bool:
    """A negative number is a flag's value (argparse reads it so), not a flag."""
    try:
        float(arg)
        return True
    except ValueError:
        return False


def _suites_said() -> str:
    """A line per suite for -h: its module docstring's first paragraph (read, not imported: -h
    works before the extensions are built), and whether it needs root."""
    lines = ["suites:"]
    for name, module in SUITES.items():
        source = pathlib.Path(__file__).with_name(module.split(".")[-1] + ".py")
        doc = ast.get_docstring(ast.parse(source.read_text())) if source.exists() else None
        what = " ".join((doc or "").split("\n\n")[0].split())
        what = what.partition(": ")[2] or what
        what += " Needs root and bcc." if name in NEED_ROOT else ""
        lines.append(textwrap.fill(what, 79, initial_indent=f"  {name:10s}", subsequent_indent=" " * 12))
    lines.append(f"  {'all':10s}every suite but compare, in turn (what `make bench` runs)")
    return "\n".join(lines) + "\n\n"


def _policy_names() -> str:
    try:
        from datapath.router import policy_params
        return ", ".join(f"{n} (:X {param.split(':')[0]})" if param else n for n, param in policy_params().items())
    except ImportError:          # the extension not built yet (make setup builds it)
        return "see datapath.router.policies()"


def main(argv=None) -> int:
    from .contract import Report, SuiteFailed, error_text
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["goals"]:
        from . import goals
        return goals.main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_suites_said() + EPILOG)
    p.add_argument("suite", choices=[*SUITES, "all"], help="suite to run (or: goals [DIR ...], see below)")
    p.add_argument("--quick", action="store_true", help="short run (a suite in about 2 minutes or less)")
    p.add_argument("--json", metavar="PATH", help="where to write the JSON (default bench-results/SUITE.json)")
    p.add_argument("--soak", action="store_true", help="snapshot: also run the 1,000-iteration crash soak")
    p.add_argument("--policy", metavar="A,B,...",
                   help=f"compare: routing policies ({_policy_names()}; NAME:X gives the policy's parameter X) "
                        "and batching modes (dynamic, static) to run under the same load; the first is the "
                        "reference every ratio is over. A policy of your own: a C file in native/policies/, a "
                        "line in its registry.c, `sudo make setup` (docs/dataplane.md, \"Routing policies\")")
    p.add_argument("--rate", type=float, help="compare: offered requests/s (default 40, at least 1)")
    p.add_argument("--repeat", type=int, metavar="N",
                   help="compare: rounds of every name, the order rotated by one each round, so N a multiple "
                        "of the names' count balances it (default 2; 1 with --quick)")
    p.add_argument("--device", metavar="PROFILE",
                   help="compare: workers simulate this device's step time (cpu, l4, h100, dpu: "
                        "datapath.serving.devices); default: the tiny model's own step time")
    p.add_argument("--workers", type=int, metavar="N",
                   help="compare: worker processes, 1 to 16 (default 2; they share the cores the poll loop leaves, "
                        "so past two give --device: its step time is spent asleep, the tiny model's own is not)")
    p.add_argument("--straggler", metavar="K:F[@T[-U]][,...]",
                   help="compare: worker K is F times slower (its --device's step time, or its forward pass, "
                        "lasts F times as long: a slow device among healthy ones; F from 1 to 1000, K from 0); the "
                        "table shows the share of requests each policy placed on it, and of the 200s it answered. "
                        "K:F@T: it turns slow T seconds after each run's first request (runs are 10 s, 3 with "
                        "--quick; T leaves two whole seconds), and a timeline shows how fast each policy moved "
                        "off it; K:F@T-U: back to normal at U, and how fast each came back to it")
    # a flag nobody reads is named first: argparse said only that the suite was missing (`bench --bogus`)
    flags = {o for a in p._actions for o in a.option_strings}
    unknown = [a for a in (sys.argv[1:] if argv is None else argv)   # (a prefix of one is argparse's to read)
               if a.startswith("-") and a != "-" and not _number(a)
               and not any(f.startswith(a.split("=", 1)[0]) for f in flags)]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    args = p.parse_args(argv)
    # a flag its suite does not read is refused, not ignored: `bench e2e --policy static` ran plain e2e
    only = {"--policy": ("compare", args.policy is not None), "--rate": ("compare", args.rate is not None),
            "--repeat": ("compare", args.repeat is not None), "--device": ("compare", args.device is not None),
            "--straggler": ("compare", args.straggler is not None), "--workers": ("compare", args.workers is not None),
            "--soak": ("snapshot", args.soak)}
    for flag, (suite, given) in only.items():
        if given and args.suite != suite:
            p.error(f"{flag} is for the {suite} suite, not {args.suite}")
    if args.suite == "compare" and not args.policy:
        p.error("compare needs --policy A,B,... (for example --policy round_robin,affinity,static)")
    if args.suite == "compare":
        try:
            from .compare import check_args
            check_args(args)      # before any pipeline is built or any JSON overwritten
        except ImportError as e:
            p.error(f"the native extensions are not built ({e}): run `sudo make setup`")
        except ValueError as e:
            p.error(str(e))
    names = IN_ALL if args.suite == "all" else [args.suite]
    if args.json and len(names) > 1:
        p.error("--json names one file: use it with a single suite")
    # refused before anything runs or any earlier result is removed: a --json that cannot be written
    # failed once the whole suite had run, and a run without root removed the last report's files
    # before it said it needed root (both found by review)
    if args.json:
        where = pathlib.Path(args.json)
        parent = where.parent if str(where.parent) else pathlib.Path(".")
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            p.error(f"--json {args.json}: cannot make its directory ({e.strerror})")
        # tried, not asked of os.access, which says yes to root wherever the write then fails (/proc)
        try:
            existed = os.path.lexists(where)       # (a dangling link: its target made, then the link unlinked)
            with open(where, "a"):
                pass
            if not existed:
                where.unlink()
        except OSError as e:
            p.error(f"--json {args.json}: not a file this user can write ({e.strerror})")
    if args.suite in ("e2e", "compare", "all"):
        # and its report's directory: a file of that name failed the write once the whole run had
        # run, 9 minutes for e2e, and the report was lost (found by review)
        from .report import REPORT_DEFAULTS, report_path
        for suite in ("e2e",) if args.suite == "all" else (args.suite,):
            out = report_path(args.json, REPORT_DEFAULTS[suite])
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                what = "a file of that name is in the way" if out.exists() else e.strerror
                p.error(f"the report's directory {out} (beside --json PATH, PATH without its suffix): "
                        f"cannot make it ({what})")
    if args.suite in ("snapshot", "nvmetcp", "all"):
        try:
            from .snapshot import bench_dir
            bench_dir()
        except ImportError as e:
            p.error(f"the native extensions are not built ({e}): run `sudo make setup`")
        except ValueError as e:
            p.error(str(e))
    if args.suite in NEED_ROOT:
        try:
            from .e2e import require_root_and_bcc
            require_root_and_bcc(f"bench {args.suite}")
        except ImportError as e:
            p.error(f"the native extensions are not built ({e}): run `sudo make setup`")
        except RuntimeError as e:
            p.error(str(e))
    # SIGTERM unwinds like Ctrl-C: every with-block (namespaces, images, processes) cleans up;
    # what a SIGKILLed run left (its pid dead) goes first
    from datapath.ingress import SigtermExit, Terminated
    signal.signal(signal.SIGTERM, SigtermExit())
    if os.geteuid() == 0:
        from datapath.topology import sweep_stale
        swept = sweep_stale()
        if swept:
            print(f"bench: removed what killed runs left: {', '.join(swept)}", file=sys.stderr)
    failed, judged = [], []
    for name in names:
        report = Report(name, quick=args.quick)
        try:
            importlib.import_module(SUITES[name]).run(report, args)
        except (KeyboardInterrupt, Terminated) as e:
            report.note("interrupted: partial results")
            report.status = "interrupted"
            report.finish(args.json)
            return e.code if isinstance(e, Terminated) else 130
        except SuiteFailed:     # its report says what failed already
            failed.append(name)
        except Exception as e:  # one suite's failure is reported; the others still run
            report.note(f"FAILED: {error_text(e)}")
            report.status = f"failed: {error_text(e)}"
            failed.append(name)
        judged += [(name, j) for j in report.finish(args.json)["goals"]]
    if len(names) > 1 and judged:           # every suite's goals in one place, at the end of the run
        from . import goals
        quick = ", a quick run's: short samples" if args.quick else ""
        print(f"goals (bench.goals, from this run's figures{quick}):")
        for name, j in judged:
            print("  " + goals.lines([j], suite=name)[0])
    if failed:
        print(f"bench: {', '.join(failed)} failed (see the notes above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        rc = main()
        sys.stdout.flush()      # here, not at exit: buffered, a pipe's end fails its flush
        sys.exit(rc)
    except BrokenPipeError:     # `python -m bench goals DIR | head`
        from datapath.cli import reader_left
        sys.exit(reader_left())
