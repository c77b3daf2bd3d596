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
most half an even share there): how fast a policy notices. K:F@T-U brings it
back to normal at U, and the timeline goes on from there: how fast a policy
gives a recovered worker its share back ("recovered within").

Every pipeline gets a fresh shared snapshot store: sessions return (61 of
them cycle through the offer), and a policy that sends a session's next request to another
worker must have that worker restore its KV, or the request would run on a
context without its earlier turn (less attention work, a wrong answer, an
unfair comparison). So a spreading policy pays its restores here; the table
counts the requests that moved (router stat `moved`) and the sessions the store
restored.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import pickle
import signal
import sys
import time
import traceback
from typing import NamedTuple

import numpy as np

from bench.e2e import (MIN_REQUESTS, OUTPUT, PROMPT, _RUN, _config, _idle, _left_out, _offer, _pcts, _progress, _warm_up,
                       drain_s, fresh_store, require_root_and_bcc)
from bench.contract import build_state
from bench.report import REPORT_DEFAULTS, _jsonable, report_dir
from datapath import client
from datapath.pipeline import Pipeline
from datapath.records import KIND_DECODE
from datapath.router import check_policy, policy_params
from datapath.serving.devices import PROFILES
from datapath.topology import sweep_stale

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
    # each round's p95 as a point on its bar: how much one round moved
    xs = [j for j, r in enumerate(rows) for x in r["p95_ms_per_round"] if x is not None]
    ys = [x for r in rows for x in r["p95_ms_per_round"] if x is not None]
    if len(ys) > len(rows):
        ax.scatter(xs, ys, color="black", s=12, zorder=3, label="p95, each round")
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows])
    ax.set_ylabel("send -> response (ms)")
    # the nominal rate: each round offers its seed's Poisson draws (the table has the offer as it was)
    ax.set_title(f"same load for each: {rows[0]['qps']:g} requests/s nominal"
                 + (f"; straggler {stragglers}" if stragglers != "none" else ""))
    ax.legend()
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))


def _timeline_table(rows: list[dict], when: Straggler, even_share: float) -> list[str]:
    windows = rows[0]["timeline"]["windows"]
    head = [("before" if w["phase"] == "before" else
             f"{w['from_s']:g}-{w['to_s']:g} s" if w["phase"] == "slow" else f"back +{w['from_s']:g}-{w['to_s']:g} s")
            for w in windows]
    cell = lambda w: ("n/a" if not w["placed"] else
                      f"{100 * w['straggler_share']:.0f}% · "
                      + (f"none of {w['placed']} finished" if w["p95_ms"] is None else f"{w['p95_ms']:.0f} ms"
                         + (f" ({w['finished']} of {w['placed']} finished)" if w["finished"] < 0.95 * w["placed"]
                            else "")))
    said = lambda v: f"{v:g} s" if v is not None else "not in this run"
    back = when.until_s is not None
    return ["", f"After the turn ({when.at_s:g} s after each run's first request was placed"
                + (f"; back to normal {when.until_s - when.at_s:g} s after it" if back else "")
                + "): per second from it, the share of the requests placed on the straggler (the router's "
                f"`placed`, read every {SAMPLE_S * 1e3:g} ms), and the p95 from send to last token of the "
                f"requests taken in that second that finished, on any worker (the workers' traces; where "
                f"fewer than 95% finished, the cell says so, and that p95, of the others, is a lower bound); "
                f"settled: the end of the first second from which on every one, two at least, placed at most "
                f"half an even share ({100 * even_share / 2:g}%) there"
                + ("; recovered: the same after the recovery, at least that share (at once for a policy "
                   "that never moved off it)" if back else "") + ".", "",
            "| policy | " + " | ".join(head) + " | settled within |" + (" recovered within |" if back else ""),
            "|---|" + "---:|" * (len(head) + 1 + back)] + [
        f"| {r['name']} | " + " | ".join(cell(w) for w in r["timeline"]["windows"])
        + f" | {said(r['timeline']['settled_within_s'])} |"
        + (f" {said(r['timeline']['recovered_within_s'])} |" if back else "") for r in rows]


def _plot_timeline(rows: list[dict], path: pathlib.Path, stragglers: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter
    fig = Figure(figsize=(8, 6))
    share = fig.add_subplot(2, 1, 1)
    p95 = fig.add_subplot(2, 1, 2, sharex=share)
    for r in rows:
        ws = r["timeline"]["windows"][1:]
        placed = [(w["mid_s"], 100 * w["straggler_share"]) for w in ws if w["placed"]]
        done = [(w["mid_s"], w["p95_ms"]) for w in ws if w["p95_ms"] is not None]
        if placed:
            share.plot(*zip(*placed), marker="o", label=r["name"])
        if done:
            p95.plot(*zip(*done), marker="o", label=r["name"])
    if rows[0]["timeline"]["recover_s"] is not None:
        for ax in (share, p95):
            ax.axvline(rows[0]["timeline"]["recover_s"], color="grey", linestyle="--", linewidth=1)
    share.set_ylabel("placed on the straggler (%)")
    share.set_title(f"after the turn: {stragglers}")
    share.legend(fontsize="small")
    p95.set_ylabel("p95 send -> last token (ms), of the finished")
    p95.set_yscale("log")
    for ticks in (p95.yaxis.set_major_formatter, p95.yaxis.set_minor_formatter):
        ticks(FuncFormatter(lambda v, _: f"{v:g}"))
    p95.set_xlabel("seconds after the straggler turned slow"
                   + (" (dashed: back to normal)" if rows[0]["timeline"]["recover_s"] is not None else ""))
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
        name, colon, param = label.partition(":")
        if name not in known:
            state = build_state()
            raise ValueError(f"unknown policy or batching mode {name!r} (known: {', '.join(sorted(known))})"
                             + ("" if state == "current" else
                                f"; the build is {state.split(':')[0]}: a policy added since is in it after "
                                f"`sudo make setup`"))
        if colon and name in ("dynamic", "static"):
            raise ValueError(f"{label!r}: a batching mode takes no parameter")
        try:
            value = float(param) if colon else None
        except ValueError:
            value = float("nan")
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{label!r}: the parameter after ':' must be a number > 0 (leave it off for the policy's default)")
        if name in params and value is not None:
            check_policy(name, value)
        out.append((label, name, value))
    if not out:
        raise ValueError("--policy names nothing")
    # by what runs, not how it is spelled: affinity,affinity: and affinity:0.1,affinity:0.10 ran one
    # configuration twice (found by review)
    if len({(name, value) for _, name, value in out}) != len(out):
        raise ValueError("--policy names one twice")
    return out


WORKERS = 2        # by default (bench.e2e._config pins them all to the cores the poll loop leaves: one here)
MAX_WORKERS = 16   # each a process holding a model: more is a test of the host, not of a policy
# a straggler that turns slow mid-run (--straggler K:F@T): the timeline after its turn
WINDOW_S = 1.0     # the timeline's step
SAMPLE_S = 0.02    # how often the router's placements are read
MIN_WINDOWS = 2    # whole seconds after the turn a run must hold (check_args leaves room for them)


class Straggler(NamedTuple):
    factor: float               # its steps last this many times as long
    at_s: float | None          # from this many seconds after each run's first request (None: from the start)
    until_s: float | None       # and back to normal from this many (None: to the run's end)


def parse_stragglers(spec: str | None, workers: int = WORKERS, seconds: float | None = None) -> dict[int, Straggler]:
    """"K:F[@T[-U]],..." -> {worker K: Straggler}: slowed from the start, or from T seconds after
    each run's first request (a straggler that turns slow mid-run), and back to normal at U if
    given, each leaving MIN_WINDOWS whole seconds to time before the next and before the run's end
    (`seconds`). Every T (and U) given is the same: the turn the timeline counts from. ValueError
    for a worker out of range, a factor out of 1..1000 (serving.worker.check_slowdown), a time
    out of place, or a worker named twice."""
    from datapath.serving.worker import check_slowdown
    out: dict[int, Straggler] = {}
    if spec is not None and not spec.strip(" ,"):
        raise ValueError("--straggler names no worker: give WORKER:FACTOR, e.g. 1:4")
    room = MIN_WINDOWS * WINDOW_S
    latest = (seconds - room - 0.5) if seconds else math.inf    # (the schedule's draws may run it short)
    for part in (x.strip() for x in (spec or "").split(",")):
        if not part:
            continue
        k, sep, rest = part.partition(":")
        f, at, when = rest.partition("@")
        t, dash, u = when.partition("-")
        try:
            k, f = int(k), float(f)
            t, u = float(t) if at else None, float(u) if dash else None
        except ValueError:
            raise ValueError(f"--straggler {part!r}: give WORKER:FACTOR, e.g. 1:4 (worker 1's steps take 4x), "
                             f"or WORKER:FACTOR@SECONDS, e.g. 1:4@3 (from 3 s into each run), or "
                             f"WORKER:FACTOR@FROM-TO, e.g. 1:4@2-5") from None
        if not sep:
            raise ValueError(f"--straggler {part!r}: give WORKER:FACTOR, e.g. 1:4 (worker 1's steps take 4x)")
        if not 0 <= k < workers:
            raise ValueError(f"--straggler {part!r}: the worker is 0..{workers - 1} (--workers {workers})")
        if k in out:
            raise ValueError(f"--straggler names worker {k} twice")
        check_slowdown(f)
        if u is not None and latest - room <= 0:
            raise ValueError(f"--straggler {part!r}: runs of {seconds:g} s leave no room for a turn and a "
                             f"recovery {MIN_WINDOWS} whole seconds apart and from the end (drop --quick)")
        if t is not None and not (math.isfinite(t) and 0 < t <= (latest if u is None else latest - room)):
            raise ValueError(f"--straggler {part!r}: the turn must come after the run starts and leave "
                             f"{MIN_WINDOWS} whole seconds to time before it ends"
                             + (f" (0 < T <= {latest:g} s)" if u is None and seconds else "")
                             + (f", and before the recovery (0 < T <= {latest - room:g} s)" if u is not None else ""))
        if u is not None and not (math.isfinite(u) and t + room <= u <= latest):
            raise ValueError(f"--straggler {part!r}: the recovery must come {MIN_WINDOWS} whole seconds at least "
                             f"after the turn and leave as many before the run ends ({t + room:g} <= U <= "
                             f"{latest:g} s)")
        out[k] = Straggler(f, t, u)
    if len({(x.at_s, x.until_s) for x in out.values() if x.at_s is not None}) > 1:
        raise ValueError("--straggler: every @T (and -U) must be the same (one turn, which the timeline counts from)")
    return out


def straggler_said(stragglers: dict[int, Straggler]) -> str:
    return ", ".join(f"worker {k} x{x.factor:g}" + (f" from {x.at_s:g} s" if x.at_s is not None else "")
                     + (f" to {x.until_s:g} s" if x.until_s is not None else "")
                     for k, x in stragglers.items()) or "none"


DEFAULT_RATE = 40.0
MIN_RATE = 1.0     # requests/s: a run sends MIN_REQUESTS at least, so lasts at most MIN_REQUESTS / MIN_RATE s


def rate_of(args) -> float:
    """--rate, or the default (None when not given, so other suites can refuse it given)."""
    return DEFAULT_RATE if args.rate is None else args.rate


MAX_REPEAT = 20   # rounds: each runs every name once, 10 s a run (3 with --quick)


def rounds(args) -> int:
    return args.repeat or (1 if args.quick else 2)


def check_args(args):
    """Everything compare can refuse, before it builds anything (ValueError)."""
    parse_names(args.policy or "")
    if args.workers is not None and not 1 <= args.workers <= MAX_WORKERS:
        raise ValueError(f"--workers must be 1..{MAX_WORKERS}, not {args.workers}")
    rate = rate_of(args)
    if not (rate >= MIN_RATE and math.isfinite(rate)):      # inf passed, and failed after a pipeline was built
        raise ValueError(f"--rate must be a finite number >= {MIN_RATE:g} requests/s, not {rate:g} (a run sends "
                         f"{MIN_REQUESTS} requests at least: at 0.001 req/s, one run lasted hours)")
    stragglers = parse_stragglers(args.straggler, args.workers or WORKERS, run_seconds(args.quick, rate))
    wanted = rate * run_seconds(args.quick, rate)    # (a float: 1e308 req/s made int() of inf raise)
    if wanted > client.MAX_COUNT:
        raise ValueError(f"--rate {rate:g} makes {wanted:,.0f} requests a run: at most {client.MAX_COUNT:,}")
    count = max(MIN_REQUESTS, int(wanted))
    if args.device is not None and args.device not in PROFILES:
        raise ValueError(f"unknown device profile {args.device!r} (known: {', '.join(PROFILES)})")
    if args.repeat is not None and not 1 <= args.repeat <= MAX_REPEAT:    # (1e8 was taken, and ran for days)
        raise ValueError(f"--repeat must be 1..{MAX_REPEAT}, not {args.repeat}")
    _check_turn_fits(stragglers, rate, count, rounds(args))


def _check_turn_fits(stragglers: dict[int, Straggler], rate: float, count: int, repeat: int):
    """Each round's sends last MIN_WINDOWS whole seconds past the straggler's turn (and its recovery),
    by its seed's schedule from its first send: the draws may end a round short of the run's
    length (at 40 req/s, seed 2's 400 sends span 9.47 s), and a turn that left too little was
    refused only after every run, the old report already removed (found by review)."""
    turn = next((x for x in stragglers.values() if x.at_s is not None), None)
    if turn is None:
        return
    last = turn.until_s if turn.until_s is not None else turn.at_s
    for seed in range(1, repeat + 1):
        sends = client.schedule_span_s(rate, count, seed) - client.schedule_span_s(rate, 1, seed)
        if sends - last < MIN_WINDOWS * WINDOW_S:
            raise ValueError(f"--straggler: round {seed}'s sends (its seeded schedule at {rate:g} req/s) end "
                             f"{sends:.2f} s after its first, {sends - last:.2f} s after the "
                             f"{'recovery' if turn.until_s is not None else 'turn'} at {last:g} s: fewer than "
                             f"{MIN_WINDOWS} whole seconds to time (an earlier time after @, or fewer --repeat "
                             f"rounds)")


def run_seconds(quick: bool, rate: float) -> float:
    """Each run's offer: long enough for 400 requests at the default 40 req/s, and for the
    MIN_REQUESTS an offer sends at least (at 1 req/s a --quick run said 3 s and lasted 10: found
    by review)."""
    return max(3.0 if quick else 10.0, MIN_REQUESTS / rate)


def _one(label: str, name: str, param: float | None, device: str | None, rate: float, seconds: float,
         seed: int, workers: int, stragglers: dict[int, Straggler]) -> dict:
    """One offer through a fresh pipeline and store: its latencies and what the router did; with a
    straggler that turns slow mid-run, the router's placements per worker and each request's
    latency by when it came (`timeline`)."""
    import threading
    kw = {"batching": name} if name in ("dynamic", "static") else {"policy": name}
    if param is not None:
        kw["policy_param"] = param
    # the same key secret for every name: which sessions share a slot of the router's last-run table
    # (flagged moved, a store lookup) was drawn anew for each run
    start = {k: x.factor for k, x in stragglers.items() if x.at_s is None}
    live = {k: x.factor for k, x in stragglers.items() if x.at_s is not None}
    when = next((x for x in stragglers.values() if x.at_s is not None), None)
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
        recovered: list[int] = []                       # and when they came back, if they do
        failed: list[BaseException] = []
        done = threading.Event()

        def sample():
            """The router's placements per worker every SAMPLE_S, the turn, T s after the first
            request was placed (the client's schedule starts when its process has: 0.1-1 s after
            the offer is called), and the recovery U - T after the turn: a request placed on the
            straggler and never run is in no trace, but counted here."""
            try:
                first = None
                while not done.is_set():
                    now = time.monotonic_ns()
                    placed = [p.router.worker_stats(k)["placed"] for k in range(workers)]
                    if first is None and samples and sum(placed) > sum(samples[0][1]):
                        first = now
                    if first is not None and not turned and now - first >= when.at_s * 1e9:
                        for k, f in live.items():
                            p.set_slowdown(k, f)
                        turned.append(time.monotonic_ns())
                    elif (turned and when.until_s is not None and not recovered
                          and now - turned[0] >= (when.until_s - when.at_s) * 1e9):
                        for k in live:
                            p.set_slowdown(k, 1.0)
                        recovered.append(time.monotonic_ns())
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
            if not turned or (when.until_s is not None and not recovered):
                raise RuntimeError(f"{label}: the offer ended before the straggler's "
                                   f"{'turn' if not turned else 'recovery'}")
            traces = [p.trace(k) for k in range(workers)]
            # the schedule's start: its first send (in every trace's t_send) less its first gap
            first_send = min(int(t["t_send"][t["t_send"] > 0].min()) for t in traces if (t["t_send"] > 0).any())
            t_schedule = first_send - int(client.schedule_span_s(rate, 1, seed) * 1e9)
            res["timeline"] = _timeline(traces, samples, turned[0], t_schedule + int(res["sending_s"] * 1e9),
                                        recovered[0] if recovered else None)
        st1, store1 = p.router.stats(), p.store_stats()
        per1 = [p.router.worker_stats(k) for k in range(workers)]
        for key in ("placed", "answered"):     # the offer's own, per worker
            res[f"{key}_per_worker"] = [b[key] - a[key] for a, b in zip(per0, per1)]
        res["xdp_mode"] = p.xdp_mode
    res["router"] = {k: st1[k] - st0[k]
                     for k in ("batches", "records_out", "moved", "requests_in", "bad_picks")}
    res["restores"] = store1["restores"] - store0["restores"]
    return res


def _timeline(traces: list[np.ndarray], samples: list, turn_ns: int, end_ns: int,
              recover_ns: int | None = None) -> dict:
    """One run's timeline, in seconds from the turn: the router's placements per worker as
    sampled (`samples`: (ns, placed per worker)); each request by when the router took it in
    (its first prompt record) and, if it finished (its last token stamped on a record, on any
    worker), its latency from its send to that token; the end of the offer's sends, and the
    straggler's recovery if it had one."""
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
            "end_s": (end_ns - turn_ns) / 1e9,
            "recover_s": None if recover_ns is None else (recover_ns - turn_ns) / 1e9}


def _window_counts(timelines: list[dict]) -> tuple[int, int]:
    """Whole seconds from the turn to the recovery (or the end of the sends) and from the
    recovery to the end, in the run that has fewest: the same for every name, so their tables
    line up."""
    back = [x["recover_s"] for x in timelines]
    n_slow = int(min(b if b is not None else x["end_s"] for b, x in zip(back, timelines)) // WINDOW_S)
    n_back = int(min(x["end_s"] - b for b, x in zip(back, timelines)) // WINDOW_S) if back[0] is not None else 0
    return n_slow, n_back


def _windows(timelines: list[dict], slow: list[int], even_share: float, counts: tuple[int, int]) -> dict:
    """The rounds' timelines pooled, per WINDOW_S: one before the turn (from the first sample),
    the whole ones from the turn to the recovery (or the end of the sends), and the whole ones
    from the recovery, if any, to the end, each round's own seconds from its own turn and
    recovery (`counts`, _window_counts of every name's runs). Each: the requests placed, the share
    placed on the straggler(s), how many of those the router took in then finished, and their
    p95 (on any worker: fewer finished than placed, it is of the others). Settled: the end of
    the first slow second from which on every one, two at least, placed at most half an even
    share there; recovered: the end of the first second after the recovery from which on every
    one, two at least, placed at least that much there (None: not within this run)."""
    def placed(x: dict, at_s: float) -> np.ndarray:        # per worker, by the last sample at or before
        i = np.searchsorted(x["sample_t_s"], at_s, side="right") - 1
        return x["placed"][max(i, 0)]
    back = [x["recover_s"] for x in timelines]
    n_slow, n_back = counts
    phases = ([("before", None)] + [("slow", w) for w in range(n_slow)] + [("recovered", w) for w in range(n_back)])
    out = []
    for phase, w in phases:
        d, ts, lat = 0, [], []
        for x, b in zip(timelines, back):
            a, z = ((x["sample_t_s"][0], 0.0) if phase == "before" else
                    (w * WINDOW_S, (w + 1) * WINDOW_S) if phase == "slow" else
                    (b + w * WINDOW_S, b + (w + 1) * WINDOW_S))
            d = d + placed(x, z) - (x["placed"][0] if phase == "before" else placed(x, a))
            m = (x["t_s"] >= a) & (x["t_s"] < z) & (x["latency_ns"] >= 0)
            lat.append(x["latency_ns"][m])
            ts.append(a + WINDOW_S / 2 if phase != "before" else None)
        n, lat = int(np.sum(d)), np.concatenate(lat)
        out.append({"phase": phase, "from_s": None if phase == "before" else w * WINDOW_S,
                    "to_s": None if phase == "before" else (w + 1) * WINDOW_S,
                    "mid_s": None if phase == "before" else float(np.mean(ts)),   # from the turn
                    "placed": n, "finished": len(lat),
                    "straggler_share": float(d[slow].sum() / n) if n else None,
                    "p95_ms": _pcts(lat, 1e6)["p95"] if len(lat) else None})

    def within(phase: str, ok) -> float | None:
        ws = [w for w in out if w["phase"] == phase]
        good = [w["straggler_share"] is not None and ok(w["straggler_share"]) for w in ws]
        return next((w["to_s"] for i, w in enumerate(ws) if len(ws) - i >= 2 and all(good[i:])), None)
    return {"windows": out, "settled_within_s": within("slow", lambda x: x <= even_share / 2),
            "recovered_within_s": within("recovered", lambda x: x >= even_share / 2) if n_back else None,
            "recover_s": None if back[0] is None else float(np.mean(back))}


def run(report, args):
    check_args(args)
    names = parse_names(args.policy)
    out = report_dir(args.json, REPORT_DEFAULTS["compare"], ("compare.md", "rows.json", "compare.png", "timeline.png"))
    require_root_and_bcc("bench compare")
    device = args.device
    workers = args.workers or WORKERS
    # Rounds, the order rotated by one each (A B C, B C A, C A B, ...): on this shared machine a
    # slow spell that fell on one name's run alone moved its figures more than most policies differ.
    repeat, rate = rounds(args), rate_of(args)
    seconds = run_seconds(args.quick, rate)
    stragglers = parse_stragglers(args.straggler, workers, seconds)
    slow_said = straggler_said(stragglers)
    live = [k for k, x in stragglers.items() if x.at_s is not None]     # those that turn slow mid-run
    report.machine.update(device=device or "none (the tiny model's own step time)", rate_per_s=rate,
                          seconds_per_run=seconds, sessions=SESSIONS, repeat=repeat, workers=workers,
                          stragglers=slow_said)
    runs = {label: [] for label, _, _ in names}
    died: dict[str, str] = {}
    _RUN.update(t0=time.monotonic(), scenario="", suite="compare")
    for k in range(repeat):
        order = names[k % len(names):] + names[:k % len(names)]
        for i, (label, name, param) in enumerate(order):
            if label in died:
                continue
            _progress(f"{label}: {rate:g} req/s for {seconds:.0f} s, round {k + 1} of {repeat}, run {i + 1} "
                      f"of {len(order)} in the round")
            res = _isolated(_one, label, name, param, device, rate, seconds, seed=k + 1,   # a round's own schedule
                            workers=workers, stragglers=stragglers)
            if isinstance(res, str):
                died[label] = f"{label}: its run died of {res} in round {k + 1} (run {i + 1} of the round)"
                _progress(died[label] + ": its other rounds are not run")
                continue
            report.machine["xdp_mode"] = res["xdp_mode"]
            runs[label].append(res)
    if died:
        for why in died.values():
            report.note(why + "; not compared (a policy's C runs in the router: a fault in it kills the run's "
                              "process, the comparison goes on)")
        names = [n for n in names if n[0] not in died]
        runs = {label: rs for label, rs in runs.items() if label not in died}
        if not names:
            raise RuntimeError(f"compare: every name's run died: {'; '.join(died.values())}")
    rows = []
    if live:
        timelines = [r["timeline"] for rs in runs.values() for r in rs]
        counts = _window_counts(timelines)
        recovers = timelines[0]["recover_s"] is not None
        if counts[recovers] < MIN_WINDOWS:
            raise RuntimeError(f"compare: a run's offer ended {counts[recovers]} whole seconds after its "
                               f"straggler's {'recovery' if recovers else 'turn'}, fewer than {MIN_WINDOWS} to time "
                               f"(earlier times after @, or a longer run)")
    for i, (label, _, _) in enumerate(names):
        rs = runs[label]
        pc = _pcts(np.concatenate([r["rtt_ns"] for r in rs]), 1e6)   # the rounds pooled
        st = {key: sum(r["router"][key] for r in rs) for key in rs[0]["router"]}
        placed, answered = (np.sum([r[f"{key}_per_worker"] for r in rs], axis=0) for key in ("placed", "answered"))
        row = {"name": label, "qps": rate,
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
            row["timeline"] = tl = _windows([r["timeline"] for r in rs], live, len(live) / workers, counts)
            if tl["settled_within_s"] is not None:
                report.metric(f"{label}_straggler_settled_within_s", tl["settled_within_s"], "s")
            else:
                report.note(f"{label}: did not settle while the straggler was slow (place at most half an even "
                            f"share on it in every second from one on, two at least): no settled_within_s")
            if tl["recover_s"] is not None and tl["recovered_within_s"] is not None:
                report.metric(f"{label}_straggler_recovered_within_s", tl["recovered_within_s"], "s")
            elif tl["recover_s"] is not None:
                report.note(f"{label}: did not give the recovered worker back half an even share in every "
                            f"second from one on, two at least, to the run's end: no recovered_within_s")
        if i:
            # each round's p95 over the first name's in the same round (the same seed, so the same
            # arrivals): the spread of these is what one round moves, which the pooled ratio hides
            # (a review's A/A pair, affinity against affinity:0.25, read 0.20-2.47x round by round)
            ref = rows[0]["p95_ms_per_round"]
            row["p95_vs_first_per_round"] = [a / b if a is not None and b else None
                                             for a, b in zip(row["p95_ms_per_round"], ref)]
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
    spread = _round_spread(rows, repeat)
    report.note(spread)
    out.mkdir(parents=True, exist_ok=True)
    slow = f" | placed on / answered by the straggler{'s' if len(stragglers) > 1 else ''}" if stragglers else ""
    lines = ["| policy | offered req/s | achieved | p50 ms | p95 ms (each round) | p99 ms | not answered 200 "
             f"| records per batch | requests moved | sessions restored{slow} |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if stragglers else "")]
    lines = [_context(report, args, repeat, rate, seconds, workers, device), "", spread, ""] + lines
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
        lines += _timeline_table(rows, stragglers[live[0]], len(live) / workers)
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    (out / "rows.json").write_text(json.dumps(_jsonable(rows), indent=1, allow_nan=False) + "\n")
    _plot(rows, out / "compare.png", slow_said)
    if live:
        _plot_timeline(rows, out / "timeline.png", slow_said)
    print("\n".join(lines))
    print(f"  table and plot: {out}/compare.md, {out}/compare.png")
    if died:
        raise RuntimeError(f"compare: {'; '.join(died.values())} (the table above has the others)")
    _all_compared(runs)


def _isolated(fn, *args, **kw):
    """fn(*args, **kw) in a forked child, its result (or its exception, raised here) sent back
    pickled; the name of the signal if the child died of one. A routing policy is C the router runs
    in the run's process: a policy that faulted (a researcher's new one) killed the whole comparison
    with it, no table, no JSON, the reference's finished runs lost, and its namespaces, rings and
    store image left behind until the next run's sweep (found by review)."""
    sys.stdout.flush(), sys.stderr.flush()       # (or the child's exit writes the parent's buffer again)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:                                 # the child: never back into the parent's stack
        code = 0
        try:
            os.close(rfd)
            try:
                out = ("ok", fn(*args, **kw))
            except BaseException as e:           # raised in the parent as it was raised here
                traceback.print_exc()
                out = ("raised", e)
            try:
                data = pickle.dumps(out)
            except Exception as e:               # an exception that does not pickle: said, not lost
                data = pickle.dumps(("raised", RuntimeError(f"{type(out[1]).__name__}: {out[1]} ({e})")))
            with os.fdopen(wfd, "wb") as f:
                f.write(data)
        except BaseException:
            code = 1
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)
    os.close(wfd)
    done = False
    try:
        with os.fdopen(rfd, "rb") as f:
            data = f.read()
        done = True
    finally:
        if not done:                             # interrupted here: the child is told to stop too
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sweep_stale()                            # its namespaces, rings and store image
        return signal.Signals(os.WTERMSIG(status)).name
    if not data:
        raise RuntimeError(f"compare: a run's process exited {os.WEXITSTATUS(status)} without a result")
    kind, value = pickle.loads(data)
    if kind == "raised":
        raise value
    return value


def _context(report, args, repeat: int, rate: float, seconds: float, workers: int, device) -> str:
    """What the table is of, said with it (compare.md alone did not say the run's length, rounds,
    workers or build)."""
    m = report.machine
    return (f"`bench compare --policy {args.policy}{' --quick' if args.quick else ''}`: {rate:g} requests/s "
            f"nominal for {seconds:.0f} s a run, {repeat} round{'s' if repeat > 1 else ''} (the order rotated "
            f"each), {workers} workers, device {device or 'none (the tiny model)'}; commit {m.get('commit')}, "
            f"build {m.get('build')} (of inputs {m.get('build_inputs')}), {m.get('cores')} cores, "
            f"{m.get('cpu_model')}.")


def _round_spread(rows: list[dict], repeat: int) -> str:
    """What one round moved, beside what the names differ by: each name's p95 over the first's,
    round by round (same seed, same arrivals)."""
    if repeat < 2:
        return ("One round: how much a round moves is not measured, so a difference between the names "
                "may be the host's (`--repeat 3` or more to see it).")
    said, within, few = [], [], []
    for r in rows[1:]:
        xs = [x for x in r["p95_vs_first_per_round"] if x is not None]
        if not xs:
            continue
        said.append(f"{r['name']} {min(xs):.2f}-{max(xs):.2f}x")
        if min(xs) < 1 < max(xs):
            within.append(r["name"])
        elif 2.0 ** (1 - len(xs)) > SIGN_LEVEL:
            few.append((r["name"], len(xs)))
    text = (f"p95 over {rows[0]['name']}'s, round by round (the same arrivals): " + "; ".join(said) + ".")
    if within:
        text += (f" The rounds disagree on which is faster for {', '.join(within)}: that difference is within "
                 f"what one round moves on this host.")
    if few:
        # a sign test: two equal configurations' rounds fall all on one side 2^(1-n) of the time (a
        # review's A/A pair, affinity against affinity:0.25, read 0.40-0.55x in each of 3 rounds)
        n = min(k for _, k in few)
        text += (f" The rounds agree for {', '.join(name for name, _ in few)}, but {n} rounds of two equal "
                 f"configurations agree 1 time in {2 ** (n - 1)}: no evidence of a difference at "
                 f"{SIGN_LEVEL:.0%} before {SIGN_ROUNDS} rounds all agree (--repeat {SIGN_ROUNDS}).")
    return text


SIGN_LEVEL = 0.05   # the sign test's: all n rounds on one side by chance, 2^(1-n), is below it from n = 6
SIGN_ROUNDS = next(n for n in range(1, 64) if 2.0 ** (1 - n) <= SIGN_LEVEL)


def _all_compared(runs: dict[str, list[dict]]):
    """The table is written; the suite fails if a name's figures leave requests out (e2e._left_out,
    the unanswered allowed: a name past what it sustains is slow, not failed), or if it has no
    latency at all, no figure to compare (its ratios were null, its status ok)."""
    bad = []
    for label, rs in runs.items():
        total = {k: sum(r[k] for r in rs) for k in ("errors", "unanswered", "duplicates", "send_errors", "unsent")}
        first = next((r for r in rs if r.get("sample_status")), {})    # its body says why, if it has one
        total.update(sample_status=first.get("sample_status", 0), sample_body=first.get("sample_body", ""))
        what = _left_out(total, unanswered_ok=True)
        if not sum(len(r["rtt_ns"]) for r in rs):
            what.append("no latency measured")
        if what:
            bad.append(f"{label}: {', '.join(what)}")
    if bad:
        raise RuntimeError(f"compare: {'; '.join(bad)} (the table above shows them; its figures would leave "
                           f"them out)")
