"""bench compare: the same open-loop load through the pipeline once per routing policy or
batching mode, side by side: the researchers' loop.

    sudo python -m bench compare --policy round_robin,power_of_two,affinity,static --rate 40
    sudo python -m bench compare --policy dynamic,static --device l4 --rate 30

A name is a routing policy (datapath.router.policies(), with dynamic batching)
or a batching mode (dynamic, static; with affinity routing, the pipeline's
default, since sessions return). Each gets a fresh
pipeline and the same Poisson schedule (same seed, same requests, same
sessions); the table and `compare.png` show p50/p95/p99 send->response and
what the router did. References: the first name's figures (ratios are
relative to it). --device makes every worker simulate that device profile's step
time (datapath.serving.devices), so policies meet a GPU's step cost, not numpy's.

Every pipeline gets a fresh shared snapshot store: sessions return (61 of
them cycle through the offer), and a policy that sends a session's next request to another
worker must have that worker restore its KV, or the request would run on a
context without its earlier turn (less attention work, a wrong answer, an
unfair comparison). So a spreading policy pays its restores here; the table
counts the requests that moved (router stat `moved`) and the sessions the store
restored.
"""
from __future__ import annotations

import pathlib

from bench.e2e import OUTPUT, PROMPT, _config, _offer, _pcts, _progress, _warm_up, drain_s, fresh_store
from datapath.pipeline import Pipeline
from datapath.router import policies
from datapath.serving.devices import PROFILES

# Sessions the offer cycles through: a prime, so that a session's next request does not land on
# the same worker of a rotation by the arithmetic of the load (with 64 and 2 workers, round_robin
# sent every session back to its worker: affinity by accident).
SESSIONS = 61


def _plot(rows: list[dict], path: pathlib.Path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(1.6 * len(rows) + 3, 4))
    ax = fig.add_subplot(1, 1, 1)
    width = 0.25
    for i, (q, label) in enumerate((("p50_ms", "p50"), ("p95_ms", "p95"), ("p99_ms", "p99"))):
        ax.bar([j + (i - 1) * width for j in range(len(rows))], [r[q] for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows])
    ax.set_ylabel("send -> response (ms)")
    ax.set_title(f"same load for each: {rows[0]['qps']:g} requests/s offered")
    ax.legend()
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))


def run(report, args):
    names = [n.strip() for n in args.policy.split(",") if n.strip()]
    known = set(policies()) | {"dynamic", "static"}
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown policy or batching mode {', '.join(bad)} (known: {', '.join(sorted(known))})")
    device = getattr(args, "device", None)
    if device is not None and device not in PROFILES:
        raise ValueError(f"unknown device profile {device!r} (known: {', '.join(PROFILES)})")
    report.machine["device"] = device or "none (the tiny model's own step time)"
    seconds = 3.0 if args.quick else 10.0
    rows = []
    for i, name in enumerate(names):
        kw = {"batching": name} if name in ("dynamic", "static") else {"policy": name}
        kw["device"] = device
        with fresh_store() as store, Pipeline(_config(shared_store=store, **kw)) as p:
            report.machine["xdp_mode"] = p.xdp_mode
            _warm_up(p, device)
            st0, store0 = p.router.stats(), p.store_stats()     # the counts below are the offer's own
            _progress(f"compare {name}: {args.rate:g} req/s for {seconds:.0f} s ({len(names) - i} left)")
            res = _offer(p, args.rate, seconds, prompt_tokens=PROMPT, max_output_tokens=OUTPUT,
                         sessions=SESSIONS, drain_s=drain_s(device))
            st1, store1 = p.router.stats(), p.store_stats()
        st = {k: st1[k] - st0[k] for k in ("batches", "records_out", "moved", "requests_in")}
        pc = _pcts(res["rtt_ns"], 1e6)
        row = {"name": name, "qps": args.rate, "achieved_qps": res["achieved_qps"], "p50_ms": pc["p50"],
               "p95_ms": pc["p95"], "p99_ms": pc["p99"], "errors": res["errors"], "batches": st["batches"],
               "records_per_batch": st["records_out"] / max(st["batches"], 1), "moved": st["moved"],
               "restores": store1["restores"] - store0["restores"], "requests": st["requests_in"]}
        rows.append(row)
        for key in ("p50_ms", "p95_ms", "p99_ms"):
            (report.reference if i == 0 else report.metric)(f"{name}_{key}", row[key], "ms")
            if i:
                report.ratio(f"{name}_{key}", f"{names[0]}_{key}")
        for key in ("errors", "moved", "restores"):
            report.metric(f"{name}_{key}", row[key])
    out = pathlib.Path(args.json).with_suffix("") if args.json else pathlib.Path("bench-results/compare")
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| policy | offered req/s | achieved | p50 ms | p95 ms | p99 ms | not answered 200 | records per batch "
             "| requests moved | sessions restored |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['name']} | {r['qps']:g} | {r['achieved_qps']:.1f} | {r['p50_ms']:.2f} | {r['p95_ms']:.2f} | "
              f"{r['p99_ms']:.2f} | {r['errors']} | {r['records_per_batch']:.2f} | "
              f"{r['moved']} of {r['requests']} | {r['restores']} |" for r in rows]
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    _plot(rows, out / "compare.png")
    print("\n".join(lines))
    print(f"  table and plot: {out}/compare.md, {out}/compare.png")
