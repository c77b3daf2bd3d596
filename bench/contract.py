"""The bench contract: every suite reports the same way.

    python -m bench SUITE [--quick] [--json PATH]

A suite fills a Report: references (figures measured in the same run to
compare against), metrics (ours) and ratios (metric / reference, named
<metric>_vs_<reference>). finish() prints a table and writes one JSON object:
{suite, quick, machine, references, metrics, ratios, notes}.
"""
from __future__ import annotations

import json
import os
import pathlib
import platform
import time


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cores": os.cpu_count(), "kernel": platform.release(), "cpu_model": cpu,
            "python": platform.python_version()}


class Report:
    def __init__(self, suite: str, quick: bool = False):
        self.suite, self.quick = suite, quick
        self.machine = machine()
        self.references: dict[str, float] = {}
        self.metrics: dict[str, float] = {}
        self.ratios: dict[str, float] = {}
        self.units: dict[str, str] = {}
        self.notes: list[str] = []
        self.started = time.time()

    def reference(self, name: str, value: float, unit: str = ""):
        self.references[name] = float(value)
        self.units[name] = unit

    def metric(self, name: str, value: float, unit: str = ""):
        self.metrics[name] = float(value)
        self.units[name] = unit

    def ratio(self, metric: str, reference: str) -> float:
        """Record metrics[metric] / references[reference] as <metric>_vs_<reference>."""
        r = self.metrics[metric] / self.references[reference]
        self.ratios[f"{metric}_vs_{reference}"] = r
        return r

    def note(self, text: str):
        self.notes.append(text)

    def as_dict(self) -> dict:
        return {"suite": self.suite, "quick": self.quick, "machine": self.machine,
                "references": self.references, "metrics": self.metrics, "ratios": self.ratios,
                "units": self.units, "notes": self.notes,
                "duration_s": round(time.time() - self.started, 3)}

    def table(self) -> str:
        m = self.machine
        lines = [f"suite {self.suite}{' (quick)' if self.quick else ''} on {m['cores']} cores, "
                 f"{m['cpu_model']}, kernel {m['kernel']}" + (f", XDP {m['xdp_mode']}" if "xdp_mode" in m else "")]
        for title, d in (("reference", self.references), ("metric", self.metrics)):
            for k, v in d.items():
                lines.append(f"  {title:<9} {k:<40} {v:>14.3f} {self.units.get(k, '')}")
        for k, v in self.ratios.items():
            lines.append(f"  {'ratio':<9} {k:<40} {v:>14.3f} x")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def finish(self, json_path: str | os.PathLike | None) -> dict:
        data = self.as_dict()
        print(self.table())
        path = pathlib.Path(json_path or f"bench-results/{self.suite}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"  json: {path}")
        return data
