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
can be told from one that cannot (round_robin). --straggler K:F@T turns worker K
slow T seconds after each run's first request instead (a device throttled
mid-run): compare.md and timeline.png then show, second by second from the
turn, the share placed on it and the p95 of the requests that finished, and
when each policy settled (every second from then on, two at least, placing at
most half an even share there): how fast a policy notices.

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
import time

import numpy as np

from bench.e2e import (OUTPUT, PROMPT, _config, _idle, _left_out, _offer, _pcts, _progress, _warm_up, drain_s,
                       fresh_store, require_root_and_bcc)
from bench.report import _jsonable, report_dir
from datapath import client
from datapath.pipeline import Pipeline
from datapath.records import KIND_DECODE
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


def _timeline_table(rows: list[dict], turn_s: float, even_share: float) -> list[str]:
    windows = rows[0]["timeline"]["windows"]
    head = ["before"] + [f"{w['from_s']:g}-{w['to_s']:g} s" for w in windows[1:]]
    cell = lambda w: ("n/a" if not w["placed"] else
                      f"{100 * w['straggler_share']:.0f}% · "
                      + (f"none of {w['placed']} finished" if w["p95_ms"] is None else f"{w['p95_ms']:.0f} ms"
                         + (f" ({w['finished']} of {w['placed']} finished)" if w["finished"] < 0.95 * w["placed"]
                            else "")))
    settled = lambda r: (f"{r['timeline']['settled_within_s']:g} s" if r["timeline"]["settled_within_s"] is not None
                         else "not in this run")
    return ["", f"After the turn ({turn_s:g} s after each run's first request was placed): per second from it, the "
                f"share of the requests placed on the straggler (the router's `placed`, read every "
                f"{SAMPLE_S * 1e3:g} ms), and the p95 from send to last token of the requests taken in that "
                f"second that finished, on any worker (the workers' traces; where fewer than 95% finished, "
                f"the cell says so, and that p95, of the others, is a lower bound); settled: the end of the "
                f"first second from which on every one, two at least, placed at most half an even share "
                f"({100 * even_share / 2:g}%) there.", "",
            "| policy | " + " | ".join(head) + " | settled within |",
            "|---|" + "---:|" * (len(head) + 1)] + [
        f"| {r['name']} | " + " | ".join(cell(w) for w in r["timeline"]["windows"]) + f" | {settled(r)} |"
        for r in rows]


def _plot_timeline(rows: list[dict], path: pathlib.Path, stragglers: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter
    fig = Figure(figsize=(8, 6))
    share = fig.add_subplot(2, 1, 1)
    p95 = fig.add_subplot(2, 1, 2, sharex=share)
    for r in rows:
        ws = r["timeline"]["windows"][1:]
        placed = [((w["from_s"] + w["to_s"]) / 2, 100 * w["straggler_share"]) for w in ws if w["placed"]]
        done = [((w["from_s"] + w["to_s"]) / 2, w["p95_ms"]) for w in ws if w["p95_ms"] is not None]
        if placed:
            share.plot(*zip(*placed), marker="o", label=r["name"])
        if done:
            p95.plot(*zip(*done), marker="o", label=r["name"])
    share.set_ylabel("placed on the straggler (%)")
    share.set_title(f"after the turn: {stragglers}")
    share.legend(fontsize="small")
    p95.set_ylabel("p95 send -> last token (ms), of the finished")
    p95.set_yscale("log")
    for ticks in (p95.yaxis.set_major_formatter, p95.yaxis.set_minor_formatter):
        ticks(FuncFormatter(lambda v, _: f"{v:g}"))
    p95.set_xlabel("seconds after the straggler turned slow")
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
# a straggler that turns slow mid-run (--straggler K:F@T): the timeline after its turn
WINDOW_S = 1.0     # the timeline's step
SAMPLE_S = 0.02    # how often the router's placements are read
MIN_WINDOWS = 2    # whole seconds after the turn a run must hold (check_args leaves room for them)


def parse_stragglers(spec: str | None, workers: int = WORKERS,
                     seconds: float | None = None) -> dict[int, tuple[float, float | None]]:
    """"K:F[@T],..." -> {worker K: (slowdown F, T)}: slowed from the start (T None), or from T
    seconds into each run, before its end (`seconds`): a straggler that turns slow mid-run. Every
    T given is the same (the turn the timeline counts from). ValueError for a worker out of
    range, a factor out of 1..1000 (serving.worker.check_slowdown), or one named twice."""
    from datapath.serving.worker import check_slowdown
    out: dict[int, tuple[float, float | None]] = {}
    if spec is not None and not spec.strip(" ,"):
        raise ValueError("--straggler names no worker: give WORKER:FACTOR, e.g. 1:4")
    for part in (x.strip() for x in (spec or "").split(",")):
        if not part:
            continue
        k, sep, rest = part.partition(":")
        f, at, t = rest.partition("@")
        try:
            k, f, t = int(k), float(f), float(t) if at else None
        except ValueError:
            raise ValueError(f"--straggler {part!r}: give WORKER:FACTOR, e.g. 1:4 (worker 1's steps take 4x), "
                             f"or WORKER:FACTOR@SECONDS, e.g. 1:4@3 (from 3 s into each run)") from None
        if not sep:
            raise ValueError(f"--straggler {part!r}: give WORKER:FACTOR, e.g. 1:4 (worker 1's steps take 4x)")
        if not 0 <= k < workers:
            raise ValueError(f"--straggler {part!r}: the worker is 0..{workers - 1} (--workers {workers})")
        if k in out:
            raise ValueError(f"--straggler names worker {k} twice")
        check_slowdown(f)
        latest = (seconds - MIN_WINDOWS * WINDOW_S - 0.5) if seconds else math.inf   # (the schedule's draws
        if t is not None and not (math.isfinite(t) and 0 < t <= latest):             #  may run it short)
            raise ValueError(f"--straggler {part!r}: the turn must come after the run starts and leave "
                             f"{MIN_WINDOWS} whole seconds to time before it ends (0 < T <= {latest:g} s)"
                             if seconds else f"--straggler {part!r}: T must be > 0 s")
        out[k] = (f, t)
    if len({t for _, t in out.values() if t is not None}) > 1:
        raise ValueError("--straggler: every @T must be the same (one turn, which the timeline counts from)")
    return out


def straggler_said(stragglers: dict[int, tuple[float, float | None]]) -> str:
    return ", ".join(f"worker {k} x{f:g}" + (f" from {t:g} s" if t is not None else "")
                     for k, (f, t) in stragglers.items()) or "none"


def check_args(args):
    """Everything compare can refuse, before it builds anything (ValueError)."""
    parse_names(args.policy or "")
    if args.workers is not None and not 1 <= args.workers <= MAX_WORKERS:
        raise ValueError(f"--workers must be 1..{MAX_WORKERS}, not {args.workers}")
    parse_stragglers(args.straggler, args.workers or WORKERS, run_seconds(args.quick))
    if not args.rate > 0:
        raise ValueError(f"--rate must be > 0 requests/s, not {args.rate:g}")
    if args.device is not None and args.device not in PROFILES:
        raise ValueError(f"unknown device profile {args.device!r} (known: {', '.join(PROFILES)})")
    if args.repeat is not None and args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, not {args.repeat}")


def run_seconds(quick: bool) -> float:
    """Each run's offer: long enough for 400 requests at the default 40 req/s."""
    return 3.0 if quick else 10.0


def _one(label: str, name: str, param: float | None, device: str | None, rate: float, seconds: float,
         seed: int, workers: int, stragglers: dict[int, tuple[float, float | None]]) -> dict:
    """One offer through a fresh pipeline and store: its latencies and what the router did; with a
    straggler that turns slow mid-run, the router's placements per worker and each request's
    latency by when it came (`timeline`)."""
    import threading
    kw = {"batching": name} if name in ("dynamic", "static") else {"policy": name}
    if param is not None:
        kw["policy_param"] = param
    # the same key secret for every name: which sessions share a slot of the router's last-run table
    # (flagged moved, a store lookup) was drawn anew for each run
    start = {k: f for k, (f, t) in stragglers.items() if t is None}
    live = {k: f for k, (f, t) in stragglers.items() if t is not None}
    with fresh_store() as store, Pipeline(_config(shared_store=store, device=device, key_secret=seed,
                                                  workers=workers, stragglers=start, **kw)) as p:
        _warm_up(p, device)
        # the warm-up's last answers (a straggler's come late) are not the offer's
        _idle(p, 30.0 * max(start.values(), default=1))
        st0, store0 = p.router.stats(), p.store_stats()     # the counts below are the offer's own
        per0 = [p.router.worker_stats(k) for k in range(workers)]
        p.reset_trace()
        samples: list[tuple[int, list[int]]] = []      # (monotonic ns, requests placed per worker)
        turned: list[int] = []                          # when the live stragglers turned (monotonic ns)
        failed: list[BaseException] = []
        done = threading.Event()
        turn_s = next((t for _, t in stragglers.values() if t is not None), None)

        def sample():
            """The router's placements per worker every SAMPLE_S, and the turn, T s after the first
            request was placed (the client's schedule starts when its process has: 0.1-1 s after
            the offer is called): a request placed on the straggler and never run is in no trace,
            but counted here."""
            try:
                first = None
                while not done.is_set():
                    now = time.monotonic_ns()
                    placed = [p.router.worker_stats(k)["placed"] for k in range(workers)]
                    if first is None and samples and sum(placed) > sum(samples[0][1]):
                        first = now
                    if first is not None and not turned and now - first >= turn_s * 1e9:
                        for k, f in live.items():
                            p.set_slowdown(k, f)
                        turned.append(time.monotonic_ns())
                    samples.append((now, placed))
                    done.wait(SAMPLE_S)
            except BaseException as e:             # said by _one, not lost with the thread
                failed.append(e)
        sampler = threading.Thread(target=sample, daemon=True) if live else None
        if sampler:
            sampler.start()
        try:
            res = _offer(p, rate, seconds, prompt_tokens=PROMPT, max_output_tokens=OUTPUT,
                         sessions=SESSIONS, drain_s=drain_s(device), seed=seed)
        finally:
            done.set()
            if sampler:
                sampler.join()
        if failed:
            raise RuntimeError(f"{label}: the straggler's sampler failed: {failed[0]!r}") from failed[0]
        if live:
            if not turned:
                raise RuntimeError(f"{label}: the offer ended before the straggler's turn")
            traces = [p.trace(k) for k in range(workers)]
            # the schedule's start: its first send (in every trace's t_send) less its first gap
            first_send = min(int(t["t_send"][t["t_send"] > 0].min()) for t in traces if (t["t_send"] > 0).any())
            t_schedule = first_send - int(client.schedule_span_s(rate, 1, seed) * 1e9)
            res["timeline"] = _timeline(traces, samples, turned[0], t_schedule + int(res["sending_s"] * 1e9))
        st1, store1 = p.router.stats(), p.store_stats()
        per1 = [p.router.worker_stats(k) for k in range(workers)]
        for key in ("placed", "answered"):     # the offer's own, per worker
            res[f"{key}_per_worker"] = [b[key] - a[key] for a, b in zip(per0, per1)]
        res["xdp_mode"] = p.xdp_mode
    res["router"] = {k: st1[k] - st0[k]
                     for k in ("batches", "records_out", "moved", "requests_in", "bad_picks")}
    res["restores"] = store1["restores"] - store0["restores"]
    return res


def _timeline(traces: list[np.ndarray], samples: list, turn_ns: int, end_ns: int) -> dict:
    """One run's timeline, in seconds from the turn: the router's placements per worker as
    sampled (`samples`: (ns, placed per worker)); each request by when the router took it in
    (its first prompt record) and, if it finished (its last token stamped on a record, on any
    worker), its latency from its send to that token; and the end of the offer's sends."""
    prompts = [t[(t["kind"] != KIND_DECODE) & (t["t_router"] > 0)] for t in traces]
    rid = np.concatenate([p["request_id"] for p in prompts])
    t_in = np.concatenate([p["t_router"] for p in prompts]).astype(np.int64)
    t_send = np.concatenate([p["t_send"] for p in prompts]).astype(np.int64)
    order = np.argsort(t_in, kind="stable")
    _, first = np.unique(rid[order], return_index=True)     # a replay's later record left out
    first = order[first]
    last = np.concatenate([t[t["t_last_token"] > 0] for t in traces])
    finished = dict(zip(last["request_id"].tolist(), last["t_last_token"].astype(np.int64).tolist()))
    t_last = np.array([finished.get(r, 0) for r in rid[first].tolist()], dtype=np.int64)
    return {"t_s": (t_in[first] - turn_ns) / 1e9,
            "latency_ns": np.where(t_last > 0, t_last - t_send[first], -1),    # -1: not finished
            "sample_t_s": np.array([(t - turn_ns) / 1e9 for t, _ in samples]),
            "placed": np.array([placed for _, placed in samples], dtype=np.int64).reshape(len(samples), -1),
            "end_s": (end_ns - turn_ns) / 1e9}


def _windows(timelines: list[dict], slow: list[int], even_share: float, end_s: float) -> dict:
    """The rounds' timelines pooled, per WINDOW_S from the turn up to end_s (before it: one
    window from the first sample): the requests placed, the share placed on the straggler(s),
    how many of those the router took in then finished, and their p95 (on any worker: fewer
    finished than placed, it is of the others); and when the policy settled: the end of the
    first window after the turn from which on every one, two at least, placed at most half
    an even share there (None: not within this run)."""
    def placed(x: dict, at_s: float) -> np.ndarray:        # per worker, by the last sample at or before
        i = np.searchsorted(x["sample_t_s"], at_s, side="right") - 1
        return x["placed"][max(i, 0)]
    t = np.concatenate([x["t_s"] for x in timelines])
    lat = np.concatenate([x["latency_ns"] for x in timelines])
    edges = [(-math.inf, 0.0)] + [(w * WINDOW_S, (w + 1) * WINDOW_S) for w in range(int(end_s // WINDOW_S))]
    out = []
    for a, b in edges:
        d = sum(placed(x, b) - (x["placed"][0] if a == -math.inf else placed(x, a)) for x in timelines)
        n = int(d.sum())
        m = (t >= a) & (t < b) & (lat >= 0)
        out.append({"from_s": None if a == -math.inf else a, "to_s": b, "placed": n, "finished": int(m.sum()),
                    "straggler_share": float(d[slow].sum() / n) if n else None,
                    "p95_ms": _pcts(lat[m], 1e6)["p95"] if m.any() else None})
    after = out[1:]
    calm = [w["straggler_share"] is not None and w["straggler_share"] <= even_share / 2 for w in after]
    settled = next((w["to_s"] for i, w in enumerate(after) if len(after) - i >= 2 and all(calm[i:])), None)
    return {"windows": out, "settled_within_s": settled}


def run(report, args):
    check_args(args)
    names = parse_names(args.policy)
    out = report_dir(args.json, "bench-results/compare", ("compare.md", "rows.json", "compare.png", "timeline.png"))
    require_root_and_bcc("bench compare")
    device = args.device
    workers = args.workers or WORKERS
    seconds = run_seconds(args.quick)
    stragglers = parse_stragglers(args.straggler, workers, seconds)
    slow_said = straggler_said(stragglers)
    live = [k for k, (_, t) in stragglers.items() if t is not None]     # those that turn slow mid-run
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
    if live:
        end_s = min(r["timeline"]["end_s"] for rs in runs.values() for r in rs)   # whole windows in every run
        if end_s < MIN_WINDOWS * WINDOW_S:
            raise RuntimeError(f"compare: a run's offer ended {end_s:.2f} s after its straggler's turn: fewer than "
                               f"{MIN_WINDOWS} whole seconds to time (an earlier @T, or a longer run)")
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
        if live:
            row["timeline"] = _windows([r["timeline"] for r in rs], live, len(live) / workers, end_s)
            if row["timeline"]["settled_within_s"] is not None:
                report.metric(f"{label}_straggler_settled_within_s", row["timeline"]["settled_within_s"], "s")
            else:
                report.note(f"{label}: did not settle in this run (place at most half an even share on the "
                            f"straggler in every second from one on to the run's end, two at least): no "
                            f"settled_within_s")
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
    if live:
        lines += _timeline_table(rows, stragglers[live[0]][1], len(live) / workers)
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    (out / "rows.json").write_text(json.dumps(_jsonable(rows), indent=1, allow_nan=False) + "\n")
    _plot(rows, out / "compare.png", slow_said)
    if live:
        _plot_timeline(rows, out / "timeline.png", slow_said)
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
