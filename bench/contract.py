"""The bench contract: every suite reports the same way.

    python -m bench SUITE [--quick] [--json PATH]

A suite fills a Report: references (figures measured in the same run to
compare against), metrics (ours) and ratios (a metric over its reference, named
<metric>_vs_<reference> by ratio(); e2e also sets a few of one mode's figure over
another's, named for both). finish() prints a table and writes one JSON object:
{suite, quick, status, machine, references, metrics, ratios, units, notes, duration_s,
goals}; status is
"ok", "failed: why" or "interrupted", and a figure that is not a finite number
is written as null (JSON has no NaN), named in a note. goals: the issues' goals of the suite,
each judged from these figures by bench.goals (the one definition of each).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import time

from . import goals


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # cores: the ones this run may use (taskset, a cpuset), which the pinning uses too
    return {"cores": len(os.sched_getaffinity(0)), "kernel": platform.release(), "cpu_model": cpu,
            "python": platform.python_version(), "commit": _commit(), "build": build_state(),
            # what the extensions were built from: two runs of one commit with a policy edited
            # between them (and `make setup` run) carried the same stamps (found by review)
            "build_inputs": (_built() or "unknown")[:12]}


ROOT = pathlib.Path(__file__).resolve().parent.parent


def build_inputs() -> str:
    """The hash scripts/setup.sh keeps in .venv/.installed of what the extensions are built from:
    pyproject.toml, setup.py, then every .c, .h and .py under native/ and bpf/ in path order."""
    import hashlib
    files = [ROOT / "pyproject.toml", ROOT / "setup.py"] + sorted(
        (p for d in ("native", "bpf") for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in (".c", ".h", ".py")),
        key=lambda p: p.relative_to(ROOT).as_posix().encode())
    h = hashlib.sha256()
    for p in files:
        h.update(p.read_bytes())
    return h.hexdigest()


def _built() -> str | None:
    """The input hash the build was made of (scripts/setup.sh's .venv/.installed), if it says."""
    try:
        return (ROOT / ".venv" / ".installed").read_text().strip() or None
    except OSError:
        return None


def build_state() -> str:
    """"current" when the built extensions are of native/ and bpf/ as they are; else what is not.
    A run's commit cannot say it: an edited policy file that was never committed (untracked)
    left the commit stamp as it was, and a run without `make setup` measured the old build."""
    built = _built()
    if built is None:
        return "unknown (no .venv/.installed: not built by scripts/setup.sh)"
    return "current" if built == build_inputs() else "stale: native/ or bpf/ changed since the last `make setup`"


def _commit() -> str:
    """The checkout's commit (and "+changes" when its files differ from it), so a figure names its code."""
    root = ROOT
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        # a new native/ or bpf/ file (a policy of one's own) is built in, tracked or not
        dirty += subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=all", "--",
                                 "native", "bpf"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+changes" if dirty else "")) if head else "unknown"


def error_text(e: BaseException) -> str:
    """An error in one line: its type, its message, and its notes (the stage a pipeline's build
    was at, when the error itself does not say)."""
    return f"{type(e).__name__}: {e}" + "".join(f" ({n})" for n in getattr(e, "__notes__", ()))


class SuiteFailed(RuntimeError):
    """A suite ran to its end, wrote its report, and some part of it failed: its status and a
    FAILED note say which already (python -m bench only counts it failed)."""


class Report:
    def __init__(self, suite: str, quick: bool = False):
        self.suite, self.quick = suite, quick
        self.machine = machine()
        if self.machine["build"].startswith("stale"):
            print(f"bench {suite}: the built extensions are older than native/ or bpf/ (run `make setup`): this "
                  f"run measures the old build, and its JSON says so (machine.build)", file=sys.stderr, flush=True)
        self.references: dict[str, float] = {}
        self.metrics: dict[str, float] = {}
        self.ratios: dict[str, float] = {}
        self.units: dict[str, str] = {}
        self.notes: list[str] = []
        self.status = "ok"
        self.started = time.time()

    def reference(self, name: str, value: float, unit: str = ""):
        self.references[name] = float(value)
        self.units[name] = unit

    def metric(self, name: str, value: float, unit: str = ""):
        self.metrics[name] = float(value)
        self.units[name] = unit

    def ratio(self, metric: str, reference: str) -> float:
        """Record metrics[metric] / references[reference] as <metric>_vs_<reference>; a reference of 0
        gives no ratio (null, said in a note), not an exception that failed the suite's other figures."""
        ref = self.references[reference]
        if ref == 0:
            self.note(f"{metric}_vs_{reference}: the reference measured 0, no ratio")
            r = math.nan
        else:
            r = self.metrics[metric] / ref
        self.ratios[f"{metric}_vs_{reference}"] = r
        return r

    def note(self, text: str):
        self.notes.append(text)

    @contextlib.contextmanager
    def gated(self):
        """Figures written (or overwritten) in the block are taken back if it raises: a measurement
        that failed part-way leaves no plausible number behind (the exception goes on). Its notes
        stay, for what they tell of the failure, each marked as the failed block's: a verdict among
        them ("flatness goal ... met") read as the run's, its figure gone (found by review)."""
        kinds = ("references", "metrics", "ratios", "units")
        before = {kind: dict(getattr(self, kind)) for kind in kinds}
        noted = len(self.notes)
        try:
            yield
        except BaseException:
            for kind in kinds:
                getattr(self, kind).clear()
                getattr(self, kind).update(before[kind])
            self.notes[noted:] = [f"(of a part that then failed, its figures withdrawn) {n}"
                                  for n in self.notes[noted:]]
            raise

    def as_dict(self) -> dict:
        bad = [k for d in (self.references, self.metrics, self.ratios) for k, v in d.items() if not math.isfinite(v)]
        notes = self.notes + ([f"not finite, written as null: {', '.join(bad)}"] if bad else [])
        clean = lambda d: {k: (v if math.isfinite(v) else None) for k, v in d.items()}
        data = {"suite": self.suite, "quick": self.quick, "status": self.status, "machine": self.machine,
                "references": clean(self.references), "metrics": clean(self.metrics),
                "ratios": clean(self.ratios), "units": self.units, "notes": notes,
                "duration_s": round(time.time() - self.started, 3)}
        data["goals"] = goals.judge(data)
        return data

    def table(self, data: dict | None = None) -> str:
        m = self.machine
        lines = [f"suite {self.suite}{' (quick)' if self.quick else ''} on {m['cores']} cores, "
                 f"{m['cpu_model']}, kernel {m['kernel']}" + (f", XDP {m['xdp_mode']}" if "xdp_mode" in m else "")]
        for title, d in (("reference", self.references), ("metric", self.metrics)):
            for k, v in d.items():
                lines.append(f"  {title:<9} {k:<40} {v:>14.3f} {self.units.get(k, '')}")
        for k, v in self.ratios.items():
            lines.append(f"  {'ratio':<9} {k:<40} {v:>14.3f} x")
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  goal {line}" for line in goals.lines((data or self.as_dict())["goals"])]
        return "\n".join(lines)

    def finish(self, json_path: str | os.PathLike | None) -> dict:
        data = self.as_dict()
        print(self.table(data))
        path = pathlib.Path(json_path or f"bench-results/{self.suite}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"  json: {path}")
        return data
