"""bench report: the end-to-end run as a directory people can read.

    paths = write_report("bench-results/e2e", results, stages, sweep, memory, scenarios)

writes
  report.md            the machine, kernel and XDP mode; the references measured in
                       the same run; every scenario with its status (and why, when it
                       did not run); the load sweep per mode; each stage's
                       p50/p95/p99/p99.9 and log2 histogram; memory; the ratios
  latency_vs_load.png  p50/p95/p99 against offered load, one colour per mode
  stages.png           each stage's log2 histogram with its percentiles, on one log axis
  memory.png           KV cache resident per mode of scenario 3
  results.json         the bench contract's object plus sweep, memory, scenarios and
                       each stage's summary (NaN written as null)

A plot whose input is empty is not drawn: report.md says the input was
missing instead, so an empty chart never passes for a result.
"""
from __future__ import annotations

import itertools
import json
import math
import pathlib
import time

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from datapath.metrics import Distribution

SWEEP_COLUMNS = [("qps", "nominal qps"), ("offered_qps", "offered qps"), ("achieved_qps", "achieved qps"),
                 ("p50_ms", "p50 ms"),
                 ("p95_ms", "p95 ms"), ("p99_ms", "p99 ms"), ("step_p50_ms", "worker step p50 ms"),
                 ("requests", "requests"), ("errors", "errors"), ("unanswered", "of them unanswered"),
                 ("late_max_ms", "sender late max ms"), ("steal_pct", "host steal %")]
SWEEP_LINES = [("p50_ms", "p50", "-"), ("p95_ms", "p95", "--"), ("p99_ms", "p99", ":")]
STAGE_PERCENTILES = [("p50", "p50", "-"), ("p95", "p95", "--"), ("p99", "p99", "-."), ("p999", "p99.9", ":")]
MACHINE_FIRST = ["cores", "cpu_model", "kernel", "xdp_mode", "xdp_tags_required"]
DPI = 110


REPORT_DEFAULTS = {"e2e": "bench-results/e2e", "compare": "bench-results/compare"}   # the suites with one


def report_path(json_path, default: str) -> pathlib.Path:
    """A suite's report directory: beside --json PATH (PATH without its suffix; PATH_report when
    it has none, since the JSON is written at PATH itself), else default."""
    if json_path:
        p = pathlib.Path(json_path)
        return p.with_suffix("") if p.suffix else p.with_name(p.name + "_report")
    return pathlib.Path(default)


def report_dir(json_path, default: str, files: tuple) -> pathlib.Path:
    """report_path, with what a run before left there of these files removed first, so a run
    interrupted or failed before its report leaves no older one behind to pass for its own (only
    these files: the directory may be the user's)."""
    out = report_path(json_path, default)
    for name in files:
        if (out / name).is_file():
            (out / name).unlink()
    return out


def write_report(outdir, results: dict, stages: dict, sweep: dict, memory: dict, scenarios: dict) -> dict:
    """Write report.md, the PNG plots and results.json into outdir; return {file name: path}.

    stages: {stage: ns samples}; sweep: {mode: [{"qps", "achieved_qps", "p50_ms", "p95_ms",
    "p99_ms", "requests", "errors", "steal_pct"}, ...]}; memory: {scenario or mode: bytes};
    scenarios: {name: {"status": "ran" | "not run" | "failed", "reason": str, "figures": {...}}}.
    Only the plots that have data are written.
    """
    out = pathlib.Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    distributions = {name: Distribution(samples) for name, samples in stages.items()}
    paths = {}
    if any(sweep.values()):
        paths["latency_vs_load.png"] = _plot_latency_vs_load(out / "latency_vs_load.png", sweep)
    if any(d.count for d in distributions.values()):
        paths["stages.png"] = _plot_stages(out / "stages.png", distributions)
    if memory:
        paths["memory.png"] = _plot_memory(out / "memory.png", memory)
    markdown = _markdown(results, distributions, sweep, memory, scenarios, plots=set(paths))
    paths["report.md"] = out / "report.md"
    paths["report.md"].write_text(markdown)
    data = {**results, "sweep": sweep, "memory": memory, "scenarios": scenarios,
            "stages": {name: d.summary() for name, d in distributions.items()}}
    paths["results.json"] = out / "results.json"
    paths["results.json"].write_text(json.dumps(_jsonable(data), indent=2, allow_nan=False) + "\n")
    return paths


# --- report.md ----------------------------------------------------------------------

def _goals_section(judged: list[dict]) -> list[str]:
    if not judged:
        return []
    lines = ["## Goals", "", "Issue 7's, each judged from this run's figures by `bench.goals`.", "",
             "| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {j['goal']} | {j['measured']} | **{j['verdict']}** |" for j in judged]
    return lines + [""]


def _markdown(results, distributions, sweep, memory, scenarios, plots) -> str:
    units = results.get("units", {})
    title = f"# zerolayer {results.get('suite', 'e2e')} benchmark{' (quick run)' if results.get('quick') else ''}"
    lines = [title, "", f"Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
             + (f", the run took {results['duration_s']:.0f} s." if "duration_s" in results else "."), ""]
    lines += _goals_section(results.get("goals", []))
    lines += _machine_section(results.get("machine", {}))
    lines += _scenario_section(scenarios, units)
    lines += ["", "## References, measured in the same run", ""]
    lines += _value_table("reference", results.get("references", {}), units)
    lines += ["", "## Metrics", ""]
    lines += _value_table("metric", results.get("metrics", {}), units)
    lines += ["", "## Ratios", "", "Each is its first figure over its second (a metric over its reference, "
              "or one mode's or scenario's over another's), both from this run.", ""]
    lines += _value_table("ratio", results.get("ratios", {}), {k: "x" for k in results.get("ratios", {})})
    lines += _sweep_section(sweep)
    lines += _stage_section(distributions, "stages.png" in plots)
    lines += _memory_section(memory)
    if results.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in results["notes"]]
    return "\n".join(lines) + "\n"


def _machine_section(machine: dict) -> list[str]:
    lines = ["## Machine", "", "| | |", "|---|---|"]
    for key in [*MACHINE_FIRST, *(k for k in machine if k not in MACHINE_FIRST)]:
        lines.append(f"| {key} | {_cell(machine.get(key, 'not recorded'))} |")
    return lines


def _scenario_section(scenarios: dict, units: dict) -> list[str]:
    lines = ["", "## Scenarios", ""]
    if not scenarios:
        return lines + ["No scenario was run."]
    lines += ["| scenario | status | reason |", "|---|---|---|"]
    lines += [f"| {_cell(name)} | {_cell(s.get('status', 'unknown'))} | {_cell(s.get('reason', ''))} |"
              for name, s in scenarios.items()]
    for name, s in scenarios.items():
        lines += ["", f"### {name}", "", f"Status: **{s.get('status', 'unknown')}**"
                  + (f": {s['reason']}" if s.get("reason") else "")]
        if s.get("figures"):
            lines += ["", "| figure | value |", "|---|---|"]
            lines += [f"| {_cell(k)} | {_number(v)} {units.get(k, '')}".rstrip() + " |"
                      for k, v in s["figures"].items()]
    return lines


def _sweep_section(sweep: dict) -> list[str]:
    lines = ["", "## Latency versus load", ""]
    if not any(sweep.values()):
        return lines + ["No load sweep in this run."]
    lines += ["Latency counts from each request's scheduled (Poisson) send, so a sender that ran late "
              "adds its lag; a request still unanswered when the client stopped waiting counts with the "
              "time it had waited then (a lower bound); a request answered with an error (a 503) is in no "
              "percentile, only in errors: read the two together. Errors: requests not answered 200.", ""]
    for mode, points in sweep.items():
        lines += [f"### {mode}", "", "| " + " | ".join(h for _, h in SWEEP_COLUMNS) + " |",
                  "|" + "---:|" * len(SWEEP_COLUMNS)]
        lines += ["| " + " | ".join(_number(p.get(key)) for key, _ in SWEEP_COLUMNS) + " |"
                  for p in sorted(points, key=lambda p: (p.get("offered_qps") or 0, p.get("qps", 0)))]
        if not points:
            lines.append("| " + " | ".join(["n/a"] * len(SWEEP_COLUMNS)) + " |")
        lines += [line for p in points if p.get("aimed_at_saturation_fraction")
                  for line in ("", f"The row at a nominal {_number(p['qps'])} req/s was aimed to offer "
                                   f"{p['aimed_at_saturation_fraction']:.0%} of the most this mode answered "
                                   f"(its seeded draws read beforehand), where the goal's flatness ends.")]
        lines.append("")
    return lines + ["![p50, p95 and p99 latency versus offered load](latency_vs_load.png)"]


def _stage_section(distributions: dict, plotted: bool) -> list[str]:
    lines = ["", "## Per-stage latency", ""]
    if not distributions:
        return lines + ["No per-stage samples in this run."]
    lines += ["| stage | samples | p50 | p95 | p99 | p99.9 | max |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, d in distributions.items():
        s = d.summary()
        lines.append(f"| {_cell(name)} | {d.count:,} | "
                     + " | ".join(_duration(s[k]) for k in ("p50", "p95", "p99", "p999", "max")) + " |")
    for name, d in distributions.items():
        lines += ["", f"### {name}", ""]
        if d.clamped_low or d.clamped_high:
            lines += [f"{d.clamped_low} samples below 0 and {d.clamped_high} above 1 hour were "
                      "clamped into that range (mismatched clocks or a stall).", ""]
        lines += ["```text", d.log2(f"{name} ns"), "```"]
    if plotted:
        lines += ["", "![each stage's log2 histogram and percentiles](stages.png)"]
    return lines


def _memory_section(memory: dict) -> list[str]:
    lines = ["", "## Memory", ""]
    if not memory:
        return lines + ["No memory figures in this run."]
    lines += ["| scenario 3 mode (KV resident across workers, mean over steps) | bytes | size |", "|---|---:|---:|"]
    lines += [f"| {_cell(name)} | {_number(b)} | {_size(b)} |" for name, b in memory.items()]
    return lines + ["", "![KV cache resident per mode](memory.png)"]


def _value_table(title: str, values: dict, units: dict) -> list[str]:
    if not values:
        return [f"No {title}s in this run."]
    return [f"| {title} | value | unit |", "|---|---:|---|",
            *(f"| {_cell(k)} | {_number(v)} | {units.get(k, '')} |" for k, v in values.items())]


def _cell(value) -> str:
    """Text that stays inside one markdown table cell."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def _number(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value)).lower()
    if isinstance(value, (int, np.integer)):
        return f"{value:,}"
    if isinstance(value, (float, np.floating)):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return _cell(value)


def _duration(ns: float) -> str:
    """ns in the unit that keeps 3-4 digits readable."""
    if math.isnan(ns):
        return "n/a"
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.4g} {unit}"
    return f"{ns:.0f} ns"


def _byte_unit(nbytes: float) -> tuple[str, int]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return unit, scale
    return "bytes", 1


def _size(nbytes: float) -> str:
    unit, scale = _byte_unit(nbytes)
    return f"{nbytes / scale:.4g} {unit}"


def _jsonable(value):
    """Plain JSON types: numpy scalars as Python numbers, NaN and infinities as null."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# --- plots --------------------------------------------------------------------------

def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # no display on a bench host: render straight to PNG
    return fig


def _plot_latency_vs_load(path: pathlib.Path, sweep: dict) -> pathlib.Path:
    fig = _figure(8, 5)
    ax = fig.add_subplot()
    for colour, (mode, points) in zip(_colours(), sweep.items()):
        x = "offered_qps" if all(_plottable(p.get("offered_qps")) for p in points) else "qps"   # as it happened
        points = sorted(points, key=lambda p: p[x])
        for key, label, style in SWEEP_LINES:
            shown = [(p[x], p[key]) for p in points if _plottable(p.get(key))]
            if shown:
                ax.plot(*zip(*shown), style, marker="o", markersize=4, color=colour, label=f"{mode} {label}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("latency (ms, log scale)")
    ax.set_title("Latency versus offered load")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(ncols=2, fontsize="small")
    fig.savefig(path)
    return path


def _plot_stages(path: pathlib.Path, distributions: dict) -> pathlib.Path:
    """One row per stage on a shared log axis: the log2 histogram, the percentiles as lines."""
    shown = {name: d for name, d in distributions.items() if d.count}
    fig = _figure(8, 1.2 + 1.1 * len(shown))
    axes = fig.subplots(len(shown), 1, sharex=True, squeeze=False)[:, 0]
    for ax, colour, (name, d) in zip(axes, _colours(), shown.items()):
        # bucket b >= 1 spans [2^(b-1), 2^b); samples are >= 1 ns, so bucket 0 is empty
        first = int(np.flatnonzero(d.buckets)[0])
        counts = np.asarray(d.buckets[first:], dtype=float)
        edges = np.left_shift(1, np.arange(first - 1, len(d.buckets))).astype(float)
        ax.stairs(100 * counts / d.count, edges, fill=True, color=colour, alpha=0.35)
        summary = d.summary()
        for key, label, style in STAGE_PERCENTILES:
            ax.axvline(summary[key], color="black", linestyle=style, linewidth=1, label=label)
        ax.set_ylabel("% of\nsamples", fontsize="small")
        ax.set_title(f"{name}: {d.count:,} samples, p50 {_duration(summary['p50'])}, "
                     f"p99 {_duration(summary['p99'])}", fontsize="small", loc="left")
    axes[0].set_xscale("log")
    axes[0].xaxis.set_major_formatter(FuncFormatter(lambda ns, _: _duration(ns)))
    axes[-1].set_xlabel("latency (log scale; bars are log2 buckets)")
    fig.legend(*axes[0].get_legend_handles_labels(), title="percentile", loc="outside right upper", fontsize="small")
    fig.suptitle("Per-stage latency")
    fig.savefig(path)
    return path


def _plot_memory(path: pathlib.Path, memory: dict) -> pathlib.Path:
    fig = _figure(7, 4)
    ax = fig.add_subplot()
    unit, scale = _byte_unit(max(memory.values()))
    bars = ax.bar(list(memory), [b / scale for b in memory.values()],
                  color=list(itertools.islice(_colours(), len(memory))))
    ax.bar_label(bars, labels=[_size(b) for b in memory.values()], fontsize="small")
    ax.set_ylabel(f"KV cache ({unit})")
    ax.set_title("KV cache resident across workers (mean over steps), scenario 3")
    ax.margins(y=0.15)
    fig.savefig(path)
    return path


def _colours():
    return itertools.cycle(matplotlib.rcParams["axes.prop_cycle"].by_key()["color"])


def _plottable(value) -> bool:
    """On a log axis: a finite latency above zero."""
    return value is not None and math.isfinite(value) and value > 0
