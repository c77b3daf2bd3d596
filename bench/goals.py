"""The goals the issues set, each judged from a suite's results as its JSON has them.

One definition of each: a suite's table and JSON (`goals`), the e2e report's Goals section and
`python -m bench goals DIR` (every suite's JSON in DIR, e.g. a full run's bench-results/ or a
committed run under figures/) all read their verdicts from here, so no verdict is typed by hand.

A verdict is "met", "missed", "no figure" (the run has not the figure: a quick run, a part that
failed), "not judged: why" (the goal's condition does not hold on this machine) or "not
decided: why" (the run's figures bound it on one side only).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import dataclass
from typing import Callable

NO_FIGURE = "no figure"
FLAT_WITHIN = 1.1          # e2e: dynamic's p95 within 10% of its p95 at 10 req/s, both ways ...
FLAT_FLOOR = 0.9           # (no row under 90% of it either)
FLAT_UP_TO = 0.8           # ... up to 80% of saturation
STATIC_OVER_DYNAMIC = 5.0  # e2e: dynamic's p95 at 10 req/s at most 1/5 of static's
XDP_P50_NS = 800.0


@dataclass(frozen=True)
class Goal:
    suite: str
    issue: int
    text: str                                        # the goal as its issue states it
    judge: Callable[[dict], tuple[str, str]]         # results -> (verdict, what was measured)


def _get(results: dict, kind: str, key: str):
    v = results.get(kind, {}).get(key)
    return None if v is None else float(v)


def _ratio(key: str, limit: float, *also: tuple[str, str]):
    """A ratio of the run at most limit; `also`: (ratio key, its name) pairs shown beside it, those the
    run has."""
    def judge(r):
        v = _get(r, "ratios", key)
        if v is None:
            return NO_FIGURE, ""
        extra = "".join(f"; {_get(r, 'ratios', k):.3f}x {name}" for k, name in also
                        if _get(r, "ratios", k) is not None)
        return ("met" if v <= limit else "missed"), f"{v:.3f}x{extra}"
    return judge


def _metric(key: str, limit: float, unit: str, at_least: bool = False, also: tuple[str, str] | None = None):
    """A metric of the run within limit; `also`: (metric key, its name) shown beside it."""
    def judge(r):
        v = _get(r, "metrics", key)
        if v is None:
            return NO_FIGURE, ""
        extra = ""
        if also and _get(r, "metrics", also[0]) is not None:
            extra = f"; {_get(r, 'metrics', also[0]):,.1f} {unit} {also[1]}"
        return ("met" if (v >= limit if at_least else v <= limit) else "missed"), f"{v:,.1f} {unit}{extra}"
    return judge


def _all_ratios(keys: list[str], limit: float, also: tuple[list[str], str] | None = None):
    """Ratios of the run each at most limit; `also`: (ratio keys, their name) shown beside them,
    those the run has."""
    def judge(r):
        vs = [_get(r, "ratios", k) for k in keys]
        if any(v is None for v in vs):
            return NO_FIGURE, ""
        extra = ""
        if also and (seen := [v for v in (_get(r, "ratios", k) for k in also[0]) if v is not None]):
            extra = f"; {' / '.join(f'{v:.3f}x' for v in seen)} {also[1]}"
        return ("met" if max(vs) <= limit else "missed"), " / ".join(f"{v:.3f}x" for v in vs) + extra
    return judge


POLICY_WORKERS = (4, 16, 64, 256)
POLICY_FLAT = 2.0          # "flat from 4 to 256 workers": the most at most twice the least


def _policies(r):
    out, ok = [], True
    for name in ("affinity", "power_of_two"):       # the hash policy (consistent hashing) and power-of-two
        vs = [_get(r, "metrics", f"policy_ns_{name}_{n}") for n in POLICY_WORKERS]
        if any(v is None for v in vs):
            return NO_FIGURE, ""
        ok &= max(vs) <= 50 and max(vs) <= POLICY_FLAT * min(vs)
        out.append(f"{name} {' / '.join(f'{v:.1f}' for v in vs)} ns (most/least {max(vs) / min(vs):.2f}x)")
    return ("met" if ok else "missed"), "; ".join(out)


def _decode_delta(r):
    vs = {k[len("delta_bytes_decode_step_"):]: v for k, v in r.get("metrics", {}).items()
          if k.startswith("delta_bytes_decode_step_") and v is not None}
    if not vs:
        return NO_FIGURE, ""
    codec = max(vs, key=vs.get)
    return ("met" if vs[codec] <= 4096 else "missed"), f"{vs[codec]:,.0f} B a step, the largest codec's mean ({codec})"


def flatness_verdict(spread: float, dip: float | None, aimed: bool) -> str:
    """Dynamic's p95 within 10% both ways of its p95 at 10 req/s over the rows up to 80% of
    saturation (a row under the lightest's by more is no flatness either); decided only when a
    row was aimed at 80% itself, else the rows under it say only that it was missed."""
    flat = spread <= FLAT_WITHIN and (dip is None or dip >= FLAT_FLOOR)
    if not flat:
        return "missed"
    return "met" if aimed else "not decided: no row at 80% of saturation itself"


def _flatness(suffix: str):
    def judge(r):
        key = f"dynamic_p95_spread_to_80pct_saturation{suffix}"
        spread = _get(r, "ratios", key)
        if spread is None and key in r.get("ratios", {}):
            # infinite, written as null: a row within 80% of saturation answered a request other
            # than 200 or left more than 5% unanswered, so its p95 says nothing (e2e's note)
            return "missed", "no finite figure: a row's p95 unreadable"
        if spread is None:
            return NO_FIGURE, ""       # the sweep did not saturate, or had no row to judge (e2e's note)
        dip = _get(r, "ratios", f"dynamic_p95_dip_to_80pct_saturation{suffix}")
        # e2e writes this only for a row aimed at 80% of saturation that offered 99-100% of that
        # (since session 32: an earlier run that was flat there reads "not decided" here)
        aimed = _get(r, "metrics", f"sweep{suffix}_decided_at_fraction_of_saturation") is not None
        low = f" (down to {dip:.3f}x)" if dip is not None and dip < FLAT_FLOOR else ""
        return flatness_verdict(spread, dip, aimed), f"{spread:.3f}x{low}"
    return judge


def _static_over_dynamic(suffix: str):
    def judge(r):
        v = _get(r, "ratios", f"static_vs_dynamic_p95_at_10qps{suffix}")
        if v is None:
            return NO_FIGURE, ""
        # a p95 that is not finite is written as null (the ratio 0 for an infinite dynamic's)
        s, d = (_get(r, "metrics", f"sweep{suffix}_p95_ms_{m}_10") for m in ("static", "dynamic"))
        ms = " / ".join("no finite figure" if x is None else f"{x:,.1f}" for x in (s, d))
        timeout = r.get("machine", {}).get("static_batch_timeout_s")
        nowait = _get(r, "ratios", f"static_nowait_vs_dynamic_p95_at_10qps{suffix}")
        # what static's timeout makes of it: at 10 req/s no batch fills, static waits it out
        said = (f"; static waiting up to {timeout * 1e3:g} ms to fill a batch" if timeout is not None else "") + \
            (f"; with no wait {nowait:.2f}x" if nowait is not None else "")
        return ("met" if v >= STATIC_OVER_DYNAMIC else "missed"), f"{v:.2f}x ({ms} ms{said})"
    return judge


POLLERS = 3     # e2e's polling run: the poll loop, the load generator and its one worker polling its lane


def _xdp_to_worker(r):
    cores = r.get("machine", {}).get("cores", 0)
    v = _get(r, "metrics", "e2e_xdp_to_worker_polling_p50_ns")   # a worker asleep on its futex is no poller
    if v is None:
        return NO_FIGURE, ""
    seen = f"{v / 1000:,.1f} us with the worker polling"
    if cores < POLLERS:
        return f"not judged: {cores} cores for {POLLERS} pollers", seen
    return ("met" if v <= XDP_P50_NS else "missed"), seen


GOALS = [
    Goal("ring", 3, "ring one-way p50 within 1.5x the ping-pong",
         _ratio("ring_oneway_p50_ns_vs_pingpong_oneway_ns", 1.5,
                ("ring_oneway_p50_ns_vs_handoff_oneway_p50_ns", "the bare hand-off stamped as the ring's samples are"),
                # a one-way hand-off is two line transfers, the ping-pong's hop one (bench/ring.py)
                ("ring_oneway_p50_ns_vs_pingpong_2line_oneway_ns", "the ping-pong on two lines, as a one-way "
                                                                   "hand-off's ends"))),
    Goal("ring", 3, ">= 10 M chunks/s batched", _metric("ring_mchunks_per_s", 10, "M chunks/s", at_least=True)),
    Goal("ring", 3, "hash and power-of-two policies <= 50 ns a decision and flat from 4 to 256 workers "
                    f"(the most at most {POLICY_FLAT:g}x the least)", _policies),
    Goal("ingress", 4, "steer_ns <= 3x xdp_count_ns", _ratio("steer_ns_vs_xdp_count_ns", 3.0,
                                                                ("steer_ns_vs_xdp_ring_floor_ns", "its floor"))),
    Goal("ingress", 4, "XDP-to-consumer p50 <= 2x the ping-pong",
         _ratio("xdp_to_consumer_p50_ns_vs_pingpong_oneway_ns", 2.0,
                ("xdp_to_consumer_p50_ns_vs_handoff_oneway_p50_ns", "the stamped bare hand-off"))),
    Goal("ingress", 4, "sender-to-consumer at least 3x better than the UDP socket at p50 and p99",
         _all_ratios(["sender_to_consumer_p50_us_vs_udp_socket_p50_us",
                      "sender_to_consumer_p99_us_vs_udp_socket_p99_us"], 1 / 3,
                     # the socket the issue names is Python's, a wake-up per packet; the C one busy-polls
                     also=(["sender_to_consumer_p50_us_vs_udp_socket_c_p50_us",
                            "sender_to_consumer_p99_us_vs_udp_socket_c_p99_us"],
                           "the busy-polling C recvmmsg receiver"))),
    Goal("worker", 5, "decode-step delta <= 4096 bytes stored", _decode_delta),
    Goal("worker", 5, "restore at 2K context at least 10x faster than recompute",
         _ratio("restore_ms_ctx2048_vs_recompute_ms_ctx2048", 0.1)),
    Goal("snapshot", 6, "put within 1.2x the raw write + sync (p50)",
         _ratio("put_4k_p50_us_vs_raw_write_sync_p50_us", 1.2)),
    Goal("snapshot", 6, "restore within 1.2x the raw reads (chains of 1 / 8 / 64 deltas, p50)",
         _all_ratios([f"restore_chain{n}_p50_us_vs_raw_read_chain{n}_p50_us" for n in (1, 8, 64)], 1.2)),
    Goal("snapshot", 6, "index <= 64 bytes per session", _metric("index_bytes_per_session", 64, "bytes")),
    # the issue's XDP stamp is the program's hand-off; the program's live part before it (its
    # steering and its write into a ring buffer gone cold between requests) is shown beside it
    Goal("e2e", 7, f"XDP-to-lane p50 <= {XDP_P50_NS:.0f} ns",
         _metric("e2e_xdp_to_lane_p50_ns", XDP_P50_NS, "ns",
                 also=("e2e_xdp_validated_to_lane_p50_ns", "from the request validated, before the program's "
                                                           "steering and ring write"))),
    Goal("e2e", 7, f"XDP-to-worker p50 <= {XDP_P50_NS:.0f} ns where a core per poller is available",
         _xdp_to_worker),
    Goal("e2e", 7, "dynamic's p95 at 10 req/s <= 1/5 of static's (tiny model)", _static_over_dynamic("")),
    Goal("e2e", 7, "dynamic's p95 at 10 req/s <= 1/5 of static's (simulated L4)", _static_over_dynamic("_l4")),
    Goal("e2e", 7, "dynamic's p95 flat (+-10%) up to 80% of saturation (tiny model)", _flatness("")),
    Goal("e2e", 7, "dynamic's p95 flat (+-10%) up to 80% of saturation (simulated L4)", _flatness("_l4")),
]


def judge(results: dict) -> list[dict]:
    """The goals of results' suite, each {issue, goal, verdict, measured}."""
    out = []
    for g in GOALS:
        if g.suite == results.get("suite"):
            verdict, measured = g.judge(results)
            out.append({"issue": g.issue, "goal": g.text, "verdict": verdict, "measured": measured})
    return out


def lines(judged: list[dict], suite: str | None = None) -> list[str]:
    return [f"{'[' + j['verdict'] + ']':<12} " + (f"{suite}: " if suite else "") + j["goal"]
            + (f": {j['measured']}" if j["measured"] else "") for j in judged]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench goals",
                                description="Judge the issues' goals from a run's JSON: every SUITE.json "
                                            "in DIR (default bench-results), in the suites' order.")
    p.add_argument("dirs", nargs="*", default=["bench-results"], metavar="DIR")
    p.add_argument("--markdown", action="store_true", help="a Markdown table (the README's is this output)")
    args = p.parse_args(argv)
    order = list(dict.fromkeys(g.suite for g in GOALS))
    for d in args.dirs:
        if not pathlib.Path(d).is_dir():
            p.error(f"{d}: no such directory (a run's results: bench-results, or figures/run-COMMIT)")
        found, count = {}, {}
        # SUITE.json first (a directory may hold another run of a suite, e.g. snapshot-soak.json)
        for path in sorted(pathlib.Path(d).glob("*.json"), key=lambda q: (q.stem not in order, q.name)):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                print(f"goals: {path}: not read ({e})", file=sys.stderr)
                continue
            if not isinstance(data, dict) or data.get("suite") not in order:
                continue
            if data["suite"] in found:
                print(f"goals: {path} not judged: {found[data['suite']][0].name} is that suite's run here",
                      file=sys.stderr)
                continue
            found[data["suite"]] = (path, data)
        if not found:
            print(f"goals: no suite JSON with goals in {d}", file=sys.stderr)
            return 2
        if len({bool(data.get("quick")) for _, data in found.values()}) > 1:
            print(f"goals: {d} holds quick and full runs: the quick ones are marked", file=sys.stderr)
        print(f"{d}:" if not args.markdown else
              "| suite (issue) | goal | measured | verdict |\n|---|---|---|---|")
        for suite in order:
            if suite in found:
                path, data = found[suite]
                judged = judge(data)
                commit = data.get("machine", {}).get("commit", "?")
                if args.markdown:
                    # a quick run's row says so: the table looked a full run's (found by review)
                    quick = ", a quick run" if data.get("quick") else ""
                    for j in judged:
                        print(f"| {suite} ({j['issue']}{quick}) | {j['goal']} | {j['measured']} | **{j['verdict']}** |")
                else:
                    print(f"  {suite} ({path.name}, commit {commit}, {data.get('status')}"
                          + (", quick" if data.get("quick") else "") + ")")
                    for line in lines(judged):
                        print(f"    {line}")
                for j in judged:
                    key = j["verdict"].split(":")[0]
                    count[key] = count.get(key, 0) + 1
        print(("\n" if args.markdown else "") + "goals: " + ", ".join(f"{n} {v}" for v, n in sorted(count.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
