"""bench compare: the same open-loop load through the pipeline for each routing policy or
batching mode, side by side: the researchers' loop.

    sudo python -m bench compare --policy round_robin,power_of_two,affinity,static --rate 40
    sudo python -m bench compare --policy affinity,affinity:0.05 --repeat 4
    sudo python -m bench compare --policy dynamic,static --device l4 --rate 30

A name is a routing policy (datapath.router.policies(), with dynamic batching;
"name:x" passes it parameter x, e.g. affinity's load bound, default 0.25) or a
batching mode (dynamic, static; with affinity routing, the pipeline's default,
since sessions return). Each run gets a fresh pipeline and, within a round,
the same Poisson schedule (same seed, same requests, same sessions); each
round has its own seed, so the pooled rounds are that many schedules, and the router's key
secret is the round's (the same sessions collide in its tables for every name). The names run
in rounds (--repeat, 2 by default, 1 with --quick), the order rotated by one each round (a
Latin square: a count that is a multiple of the names' gives every name each place equally
often, two names with two rounds among them; reversing every other round, before, gave the
middle names of four the middle places only; --quick's one round balances nothing),
and each name's latencies are pooled over its rounds, so a slow spell of this
shared machine does not fall on one name alone. The table (compare.md, and
rows.json with each round's p95) and `compare.png` show p50/p95/p99
send->response and what the router did; the JSON has every figure, the
offered and achieved rates, the requests not answered 200 and the host's
steal. References: the first name's figures (ratios are relative to it).
--device makes every worker simulate that device profile's step time
(datapath.serving.devices), so policies meet a GPU's step cost, not numpy's.
--workers N runs N worker processes (default 2; they share the cores the poll
loop leaves, one on a 2-core machine, so workers on the tiny model's own step
time slow each other: with --device the simulated time is spent asleep).
--straggler K:F makes worker K F times slower: its device's step time (without
--device, its forward pass) lasts F times as long (a throttled or shared device
among healthy ones). The table then shows the share of the requests placed on
the slow worker(s) (router worker stat `placed`: the policy's decisions) and of
the 200s they answered (`answered`), so a policy that notices one (peak_ewma)
can be told from one that cannot (round_robin).

Every pipeline gets a fresh shared snapshot store: sessions return (61 of
them cycle through the offer), and a policy that sends a session's next request to another
worker must have that worker restore its KV, or the request would run on a
context without its earlier turn (less attention work, a wrong answer, an
unfair comparison). So a spreading policy pays its restores here; the table
counts the requests that moved (router stat `moved`) and the sessions the store
restored.
"""
from __future__ import annotations

import json
import math
import pathlib

import numpy as np

from bench.e2e import (OUTPUT, PROMPT, _config, _idle, _left_out, _offer, _pcts, _progress, _warm_up, drain_s,
                       fresh_store, require_root_and_bcc)
from bench.report import _jsonable, report_dir
from datapath.pipeline import Pipeline
from datapath.router import policy_params, refuse_unread_param
from datapath.serving.devices import PROFILES

# Sessions the offer cycles through: a prime, so that a session's next request does not land on
# the same worker of a rotation by the arithmetic of the load (with 64 and 2 workers, round_robin
# sent every session back to its worker: affinity by accident).
SESSIONS = 61


def _plot(rows: list[dict], path: pathlib.Path, stragglers: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(1.6 * len(rows) + 3, 4))
    ax = fig.add_subplot(1, 1, 1)
    width = 0.25
    for i, (q, label) in enumerate((("p50_ms", "p50"), ("p95_ms", "p95"), ("p99_ms", "p99"))):
        ax.bar([j + (i - 1) * width for j in range(len(rows))], [r[q] for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows])
    ax.set_ylabel("send -> response (ms)")
    ax.set_title(f"same load for each: {rows[0]['qps']:g} requests/s offered"
                 + (f"; straggler {stragglers}" if stragglers != "none" else ""))
    ax.legend()
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))


def parse_names(spec: str) -> list[tuple[str, str, float | None]]:
    """"a,b:0.1,..." -> [(label, name, param)]: a routing policy (datapath.router.policies(), with
    dynamic batching; ":x" gives it parameter x, e.g. affinity's load bound) or a batching mode
    (dynamic, static). ValueError, naming what is known, for anything else."""
    params = policy_params()
    known = set(params) | {"dynamic", "static"}
    out = []
    for label in (n.strip() for n in spec.split(",")):
        if not label:
            continue
        name, _, param = label.partition(":")
        if name not in known:
            raise ValueError(f"unknown policy or batching mode {name!r} (known: {', '.join(sorted(known))})")
        if param and name in ("dynamic", "static"):
            raise ValueError(f"{label!r}: a batching mode takes no parameter")
        try:
            value = float(param) if param else None
        except ValueError:
            value = float("nan")
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{label!r}: the parameter after ':' must be a number > 0 (leave it off for the policy's default)")
        if name in params and value is not None:
            refuse_unread_param(name, value)
        out.append((label, name, value))
    if not out:
        raise ValueError("--policy names nothing")
    if len({label for label, _, _ in out}) != len(out):
        raise ValueError("--policy names one twice")
    return out


WORKERS = 2        # by default (bench.e2e._config pins them all to the cores the poll loop leaves: one here)
MAX_WORKERS = 16   # each a process holding a model: more is a test of the host, not of a policy


def parse_stragglers(spec: str | None, workers: int = WORKERS) -> dict[int, float]:
    """"K:F,..." -> {worker K: slowdown F}; ValueError for a worker out of range, a factor out of
    1..1000 (serving.worker.check_slowdown), or one named twice."""
    from datapath.serving.worker import check_slowdown
    out: dict[int, float] = {}
    if spec is not None and not spec.strip(" ,"):
        raise ValueError("--straggler names no worker: give WORKER:FACTOR, e.g. 1:4")
    for part in (x.strip() for x in (spec or "").split(",")):
        if not part:
            continue
        k, sep, f = part.partition(":")
        try:
            k, f = int(k), float(f)
        except ValueError:
            raise ValueError(f"--straggler {part!r}: give WORKER:FACTOR, e.g. 1:4 (worker 1's steps take 4x)") from None
        if not sep:
            raise ValueError(f"--straggler {part!r}: give WORKER:FACTOR, e.g. 1:4 (worker 1's steps take 4x)")
        if not 0 <= k < workers:
            raise ValueError(f"--straggler {part!r}: the worker is 0..{workers - 1} (--workers {workers})")
        if k in out:
            raise ValueError(f"--straggler names worker {k} twice")
        check_slowdown(f)
        out[k] = f
    return out


def check_args(args):
    """Everything compare can refuse, before it builds anything (ValueError)."""
    parse_names(args.policy or "")
    if args.workers is not None and not 1 <= args.workers <= MAX_WORKERS:
        raise ValueError(f"--workers must be 1..{MAX_WORKERS}, not {args.workers}")
    parse_stragglers(args.straggler, args.workers or WORKERS)
    if not args.rate > 0:
        raise ValueError(f"--rate must be > 0 requests/s, not {args.rate:g}")
    if args.device is not None and args.device not in PROFILES:
        raise ValueError(f"unknown device profile {args.device!r} (known: {', '.join(PROFILES)})")
    if args.repeat is not None and args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, not {args.repeat}")


def _one(label: str, name: str, param: float | None, device: str | None, rate: float, seconds: float,
         seed: int, workers: int, stragglers: dict[int, float]) -> dict:
    """One offer through a fresh pipeline and store: its latencies and what the router did."""
    kw = {"batching": name} if name in ("dynamic", "static") else {"policy": name}
    if param is not None:
        kw["policy_param"] = param
    # the same key secret for every name: which sessions share a slot of the router's last-run table
    # (flagged moved, a store lookup) was drawn anew for each run
    with fresh_store() as store, Pipeline(_config(shared_store=store, device=device, key_secret=seed,
                                                  workers=workers, stragglers=stragglers, **kw)) as p:
        _warm_up(p, device)
        # the warm-up's last answers (a straggler's come late) are not the offer's
        _idle(p, 30.0 * max(stragglers.values(), default=1))
        st0, store0 = p.router.stats(), p.store_stats()     # the counts below are the offer's own
        per0 = [p.router.worker_stats(k) for k in range(workers)]
        res = _offer(p, rate, seconds, prompt_tokens=PROMPT, max_output_tokens=OUTPUT,
                     sessions=SESSIONS, drain_s=drain_s(device), seed=seed)
        st1, store1 = p.router.stats(), p.store_stats()
        per1 = [p.router.worker_stats(k) for k in range(workers)]
        for key in ("placed", "answered"):     # the offer's own, per worker
            res[f"{key}_per_worker"] = [b[key] - a[key] for a, b in zip(per0, per1)]
        res["xdp_mode"] = p.xdp_mode
    res["router"] = {k: st1[k] - st0[k]
                     for k in ("batches", "records_out", "moved", "requests_in", "bad_picks")}
    res["restores"] = store1["restores"] - store0["restores"]
    return res


def run(report, args):
    check_args(args)
    names = parse_names(args.policy)
    out = report_dir(args.json, "bench-results/compare", ("compare.md", "rows.json", "compare.png"))
    require_root_and_bcc("bench compare")
    device = args.device
    workers = args.workers or WORKERS
    stragglers = parse_stragglers(args.straggler, workers)
    slow_said = ", ".join(f"worker {k} x{f:g}" for k, f in stragglers.items()) or "none"
    seconds = 3.0 if args.quick else 10.0
    # Rounds, the order rotated by one each (A B C, B C A, C A B, ...): on this shared machine a
    # slow spell that fell on one name's run alone moved its figures more than most policies differ.
    repeat = args.repeat or (1 if args.quick else 2)
    report.machine.update(device=device or "none (the tiny model's own step time)", rate_per_s=args.rate,
                          seconds_per_run=seconds, sessions=SESSIONS, repeat=repeat, workers=workers,
                          stragglers=slow_said)
    runs = {label: [] for label, _, _ in names}
    for k in range(repeat):
        order = names[k % len(names):] + names[:k % len(names)]
        for i, (label, name, param) in enumerate(order):
            _progress(f"compare {label}: {args.rate:g} req/s for {seconds:.0f} s, round {k + 1} of {repeat} "
                      f"({len(order) - i} left in the round)")
            res = _one(label, name, param, device, args.rate, seconds, seed=k + 1,   # a round's own schedule
                       workers=workers, stragglers=stragglers)
            report.machine["xdp_mode"] = res["xdp_mode"]
            runs[label].append(res)
    rows = []
    for i, (label, _, _) in enumerate(names):
        rs = runs[label]
        pc = _pcts(np.concatenate([r["rtt_ns"] for r in rs]), 1e6)   # the rounds pooled
        st = {key: sum(r["router"][key] for r in rs) for key in rs[0]["router"]}
        placed, answered = (np.sum([r[f"{key}_per_worker"] for r in rs], axis=0) for key in ("placed", "answered"))
        row = {"name": label, "qps": args.rate,
               "offered_qps": float(np.mean([r["offered_qps"] for r in rs])),
               "achieved_qps": float(np.mean([r["achieved_qps"] for r in rs])),
               "p50_ms": pc["p50"], "p95_ms": pc["p95"], "p99_ms": pc["p99"],
               "p95_ms_per_round": [_pcts(r["rtt_ns"], 1e6)["p95"] for r in rs],
               "requests": sum(r["requests"] for r in rs), "errors": sum(r["errors"] for r in rs),
               "unanswered": sum(r["unanswered"] for r in rs),
               "late_max_ms": max(r["late_max_ms"] for r in rs),
               "steal_pct": float(np.mean([r["steal_pct"] for r in rs])),
               "batches": st["batches"], "records_per_batch": st["records_out"] / max(st["batches"], 1),
               "moved": st["moved"], "routed": st["requests_in"], "restores": sum(r["restores"] for r in rs),
               "placed_per_worker": placed.tolist(), "answered_per_worker": answered.tolist()}
        if stragglers:
            row["straggler_placed_share"] = float(sum(placed[k] for k in stragglers) / max(placed.sum(), 1))
            row["straggler_answered_share"] = float(sum(answered[k] for k in stragglers) / max(answered.sum(), 1))
        rows.append(row)
        for key in ("p50_ms", "p95_ms", "p99_ms"):
            (report.reference if i == 0 else report.metric)(f"{label}_{key}", row[key], "ms")
            if i:
                report.ratio(f"{label}_{key}", f"{names[0][0]}_{key}")
        for key, unit in (("offered_qps", "req/s"), ("achieved_qps", "req/s"), ("late_max_ms", "ms"),
                          ("steal_pct", "%")):
            report.metric(f"{label}_{key}", row[key], unit)
        for key in ("requests", "errors", "unanswered", "moved", "restores"):
            report.metric(f"{label}_{key}", row[key])
        if stragglers:
            for key in ("straggler_placed_share", "straggler_answered_share"):
                report.metric(f"{label}_{key}", row[key])
        if st["bad_picks"]:
            report.note(f"{label}: the policy picked a worker out of range or down, or none with one up, "
                        f"{st['bad_picks']} times (router stat bad_picks): those requests were answered 503")
        if row["errors"] > 0.01 * row["requests"]:
            report.note(f"{label}: {row['errors']} of {row['requests']} requests not answered 200; the "
                        f"percentiles count 200s and the unanswered, not other answers (a policy that "
                        f"fails fast would look fast)")
        if row["achieved_qps"] < 0.95 * row["offered_qps"]:
            said = f"{label}: answered {row['achieved_qps']:.1f} of {row['offered_qps']:.1f} req/s offered"
            report.note(f"{said}, counted from its first answer to its last, which the straggler's slow answers "
                        f"stretch past the offer; every request was answered within the drain: read the percentiles"
                        if stragglers and not row["unanswered"] else
                        f"{said}: past what it sustains, its percentiles grow with the run's length")
    report.note("send->response from each request's scheduled send; percentiles over the rounds pooled "
                "(200 answers, and the unanswered at the time they had waited); p95_ms_per_round in rows.json, "
                "beside the table, shows how much one round moved")
    out.mkdir(parents=True, exist_ok=True)
    slow = f" | placed on / answered by the straggler{'s' if len(stragglers) > 1 else ''}" if stragglers else ""
    lines = ["| policy | offered req/s | achieved | p50 ms | p95 ms (each round) | p99 ms | not answered 200 "
             f"| records per batch | requests moved | sessions restored{slow} |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if stragglers else "")]
    lines += [f"| {r['name']} | {r['offered_qps']:.1f} | {r['achieved_qps']:.1f} | {r['p50_ms']:.2f} | "
              f"{r['p95_ms']:.2f} ({', '.join(f'{x:.2f}' for x in r['p95_ms_per_round'])}) | "
              f"{r['p99_ms']:.2f} | {r['errors']} of {r['requests']} | {r['records_per_batch']:.2f} | "
              f"{r['moved']} of {r['routed']} | {r['restores']} |"
              + (f" {100 * r['straggler_placed_share']:.0f}% / {100 * r['straggler_answered_share']:.0f}% |"
                 if stragglers else "") for r in rows]
    if stragglers:
        lines.append(f"\nStraggler: {slow_said} (its device's steps, or forward passes, last that many "
                     f"times as long); {workers} workers, so an even spread places "
                     f"{100 * len(stragglers) / workers:.0f}% of the requests there. Placed: where each request "
                     f"went as it came (router worker stat `placed`: the policy's decision); answered: of the "
                     f"requests answered 200, those that ended there (`answered`: a failover counts where it "
                     f"ended; a request still queued when the offer ended is placed, not answered)."
                     + (" A batching mode's row (dynamic, static) routes by affinity." if any(
                         name in ("dynamic", "static") for _, name, _ in names) else ""))
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    (out / "rows.json").write_text(json.dumps(_jsonable(rows), indent=1, allow_nan=False) + "\n")
    _plot(rows, out / "compare.png", slow_said)
    print("\n".join(lines))
    print(f"  table and plot: {out}/compare.md, {out}/compare.png")
    _all_compared(runs)


def _all_compared(runs: dict[str, list[dict]]):
    """The table is written; the suite fails if a name's figures leave requests out (e2e._left_out,
    the unanswered allowed: a name past what it sustains is slow, not failed), or if it has no
    latency at all, no figure to compare (its ratios were null, its status ok)."""
    bad = []
    for label, rs in runs.items():
        total = {k: sum(r[k] for r in rs) for k in ("errors", "unanswered", "duplicates", "send_errors", "unsent")}
        what = _left_out(total, unanswered_ok=True)
        if not sum(len(r["rtt_ns"]) for r in rs):
            what.append("no latency measured")
        if what:
            bad.append(f"{label}: {', '.join(what)}")
    if bad:
        raise RuntimeError(f"compare: {'; '.join(bad)} (the table above shows them; its figures would leave "
                           f"them out)")
