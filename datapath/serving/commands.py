"""`datapath worker` and `datapath model info`: the serving side's commands.

datapath/cli.py calls add_parsers(); each command returns an exit code and
turns user errors into one sentence.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time

import numpy as np

from ..cli import positive
from .devices import PROFILES

MODEL_INFO_MAX_BYTES = 1 << 30   # model info measures deltas on a model it builds: up to this size

WORKER_EPILOG = """examples:
    datapath worker --lane zl-w0                 # attach the shared-memory lane the router created
    datapath worker --zmq tcp://127.0.0.1:5555 --device l4 --sim busy   # the router connects to it
    datapath worker --zmq tcp://198.18.0.1:5555 --insecure --store tcp://198.18.0.9:5600 --store-secret-file key
    datapath worker --demo 4 --prompt-tokens 300 --output-tokens 16

--lane NAME attaches /dev/shm/dp-NAME.lane and .done (made by the router's
control plane). --zmq ENDPOINT binds a ZeroMQ lane there (datapath.lanes) for
the router to connect to: one message per micro-batch of dp_chunk records,
one dp_completion back. The lane has no authentication: off loopback it
needs --insecure, on a network only the router's host reaches. Ctrl-C stops
the worker. --demo runs the native router in this process with one
shared-memory lane and this worker, feeds it N requests and prints the
responses. --store ENDPOINT attaches the snapshot
store that `snapshotstore serve DEVICE --listen ENDPOINT --secret-file F`
serves, with the master secret in --store-secret-file (every worker sharing
the store and the server hold the same: a tenant's keys are HMACs of it, and
the connection is ZeroMQ CURVE keyed by it): finished turns are put there, and a
session that comes back after running elsewhere (a failover, a spill) is
restored from it. Without one, sessions stay resident and are never evicted,
and a session moved here runs on what this worker holds of it (counted
moved_without_store).
"""

MODEL_EPILOG = """examples:
    datapath model info                          # the default model: 1 KiB of KV per token
    datapath model info --layers 8 --heads 8 --kv-heads 8 --head-dim 64 --d-model 512
    datapath model info --layers 32 --heads 32 --kv-heads 8 --head-dim 128 --d-model 4096   # sizes only

A model over 1 GiB of float32 weights is not built: its KV sizes are printed,
not the measured delta sizes.
"""


def _slowdown(text: str) -> float:
    from .worker import check_slowdown
    try:
        v = float(text)
        check_slowdown(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number from 1 (not slowed) to 1000") from None
    return v


def _model_args(p: argparse.ArgumentParser):
    from .model import ModelConfig
    d = ModelConfig()
    g = p.add_argument_group("model shape (every process that builds the same shape and seed holds the same model)")
    dim = positive(int)
    g.add_argument("--vocab", type=dim, default=d.vocab, help=f"token ids 0..vocab-1 (default {d.vocab})")
    g.add_argument("--layers", type=dim, default=d.n_layers, help=f"transformer layers (default {d.n_layers})")
    g.add_argument("--d-model", type=dim, default=d.d_model, help=f"hidden size (default {d.d_model})")
    g.add_argument("--heads", type=dim, default=d.n_heads, help=f"attention heads (default {d.n_heads})")
    g.add_argument("--kv-heads", type=dim, default=d.n_kv_heads,
                   help=f"KV heads, dividing --heads (grouped-query attention; default {d.n_kv_heads})")
    g.add_argument("--head-dim", type=dim, default=d.head_dim, help=f"per head, even for RoPE (default {d.head_dim})")
    g.add_argument("--d-ff", type=dim, default=d.d_ff, help=f"MLP hidden size (default {d.d_ff})")
    g.add_argument("--seed", type=positive(int, zero_ok=True, most=2**63 - 1), default=0,
                   help="weights seed (default 0)")


def _config(args) -> dict:
    return dict(vocab=args.vocab, n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                n_kv_heads=args.kv_heads, head_dim=args.head_dim, d_ff=args.d_ff)


def add_parsers(sub):
    from .kvdelta import CODECS
    w = sub.add_parser("worker", help="run one worker on a shared-memory or ZeroMQ lane (or an in-process demo)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=WORKER_EPILOG,
                       description="A worker: the tiny model, per-session KV caches, one model step per micro-batch.")
    w.add_argument("--lane", metavar="NAME", help="shared-memory lane to attach (created by the router)")
    w.add_argument("--index", type=positive(int, zero_ok=True, most=0xfffe), default=0, help="this worker's index in completions (default 0)")
    w.add_argument("--zmq", metavar="ENDPOINT", help="bind a ZeroMQ lane at tcp://HOST:PORT or ipc://PATH")
    w.add_argument("--insecure", action="store_true",
                   help="--zmq off loopback: any peer that reaches it can run batches for any tenant and "
                        "session (and, with --store, read and write them in the store), and take answers")
    w.add_argument("--store", metavar="ENDPOINT",
                   help="the snapshot store served at ENDPOINT (snapshotstore serve): needs --store-secret-file")
    w.add_argument("--store-secret-file", metavar="PATH",
                   help="file holding the master secret of the store's keys (at least 16 bytes), "
                        "the same for every worker sharing the store and for its server (--secret-file)")
    w.add_argument("--codec", choices=list(CODECS), default="zstd", help="KV delta codec (default zstd)")
    w.add_argument("--device", choices=list(PROFILES), help="simulate this device's step times")
    w.add_argument("--sim", choices=["sleep", "busy"], default="sleep",
                   help="how simulated time is spent: asleep, or spinning a core (default sleep)")
    w.add_argument("--slowdown", type=_slowdown, default=1.0, metavar="F",
                   help="a straggler: the --device's step time (without one, the forward pass) lasts F times as "
                        "long, 1 to 1000 (default 1: not slowed)")
    w.add_argument("--temperature", type=positive(float, zero_ok=True), default=0.0, help="0 = greedy (default)")
    w.add_argument("--demo", type=positive(int, most=1000), metavar="N",
                   help="run N requests through an in-process router and print them")
    w.add_argument("--prompt-tokens", type=positive(int, most=4096), default=300,
                   help="demo prompt length (default 300)")
    w.add_argument("--output-tokens", type=positive(int, most=256), default=16,
                   help="demo output length, at most the 256 one answer carries (default 16)")
    _model_args(w)
    m = sub.add_parser("model", help="the tiny model: its sizes", formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=MODEL_EPILOG, description="Sizes of the model and of its KV deltas, per codec.")
    msub = m.add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    msub.required = True
    info = msub.add_parser("info", help="parameters, KV bytes per token, stored delta sizes per codec",
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog=MODEL_EPILOG,
                           description="The model's parameters and KV bytes per token, the stored size of a "
                                       "decode step's and a 128-token chunk's KV delta per codec (measured "
                                       "on the model, built), and the simulated devices' step times.")
    _model_args(info)


def run(args) -> int:
    try:
        return model_info(args) if args.command == "model" else worker(args)
    except ValueError as e:  # bad shapes, lengths: already one sentence
        print(f"datapath {args.command}: {e}", file=sys.stderr)
        return 2


def model_info(args) -> int:
    from .model import LLAMA3_8B_KV_BYTES_PER_TOKEN, Model, ModelConfig
    config = ModelConfig(**_config(args))
    c = config
    print(f"model: vocab {c.vocab}, {c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads, "
          f"{c.n_kv_heads} KV heads x head dim {c.head_dim}, d_ff {c.d_ff}, seed {args.seed}")
    print(f"parameters: {c.n_params:,} ({c.n_params * 4 / 2**20:.1f} MiB in float32)")
    print(f"KV per token: 2 x {c.n_layers} layers x {c.n_kv_heads} KV heads x {c.head_dim} x 2 bytes (fp16) "
          f"= {c.kv_bytes_per_token:,} bytes")
    print(f"  for comparison, Llama-3-8B (2 x 32 x 8 x 128 x 2): {LLAMA3_8B_KV_BYTES_PER_TOKEN:,} bytes")
    if c.n_params * 4 > MODEL_INFO_MAX_BYTES:
        print(f"stored delta: not measured (the model would take {c.n_params * 4 / 2**30:.1f} GiB to build; "
              f"raw, a decode step is {c.kv_bytes_per_token:,} bytes plus the header)")
    else:
        _delta_sizes(Model(config, args.seed), config)
    print("simulated devices (Llama-3-8B step times; `datapath/serving/devices.py` has the sources):")
    for p in PROFILES.values():
        print(f"  {p.name:<5} decode {p.decode_s_per_token(1, 2048) * 1e3:6.2f} ms/token at batch 1, "
              f"{p.decode_s_per_token(32, 2048) * 1e3:6.2f} at batch 32 (context 2048); prefill "
              f"{p.prefill_s_per_token(1, 0) * 1e3:6.3f} ms/token; KV room {p.kv_capacity_tokens:>9,} tokens "
              f"({p.kv_budget_bytes(config) / 2**20:,.0f} MiB of this model's KV); USD {p.price_per_hour:.2f}/h")
    return 0


def _delta_sizes(model, config):
    from . import kvdelta
    from .model import KVCache
    cache = KVCache(config)
    model.prefill(cache, np.random.default_rng(0).integers(0, config.vocab, 129))
    print("stored delta (measured on a random 129-token prompt; header included):")
    for name in kvdelta.CODECS:
        step = len(kvdelta.encode(kvdelta.export_delta(cache, 128, 129), config, name))
        chunk = len(kvdelta.encode(kvdelta.export_delta(cache, 0, 128), config, name))
        print(f"  {name:<10} decode step {step:>7,} B   128-token chunk {chunk:>9,} B")


def worker(args) -> int:
    from ..ring import RingError
    from .devices import profile
    from .model import ModelConfig
    from .worker import WorkerOptions, worker_process
    if (args.demo is not None) + bool(args.lane) + bool(args.zmq) != 1:
        print("datapath worker: give one of --lane NAME, --zmq ENDPOINT or --demo N", file=sys.stderr)
        return 2
    if bool(args.store) != bool(args.store_secret_file):
        print("datapath worker: --store and --store-secret-file go together", file=sys.stderr)
        return 2
    if args.store and args.demo is not None:
        print("datapath worker: --demo runs without a store (--store is for --lane or --zmq)", file=sys.stderr)
        return 2
    from snapshotstore.server import check_endpoint, off_loopback
    for flag, endpoint in (("--zmq", args.zmq), ("--store", args.store)):
        try:
            endpoint and check_endpoint(endpoint)
        except ValueError as e:
            print(f"datapath worker: {flag} {e}", file=sys.stderr)
            return 2
    if args.zmq and off_loopback(args.zmq) and not args.insecure:
        # the lane has no authentication: it bound 0.0.0.0 without a word, and a peer that connected
        # ran batches for any tenant and took answers meant for the router (found by review)
        print(f"datapath worker: --zmq {args.zmq} is off loopback: any peer reaching it could run batches for "
              f"any tenant and session and take the router's answers (the lane has no authentication). Bind "
              f"127.0.0.1, or give --insecure on a network only the router's host reaches", file=sys.stderr)
        return 2
    secret = None
    if args.store_secret_file:
        from snapshotstore.errors import SnapshotError
        from snapshotstore.server import read_secret
        try:
            secret = read_secret(args.store_secret_file)
        except SnapshotError as e:
            print(f"datapath worker: {e}", file=sys.stderr)
            return 2
    # the weights are float32 in this process: a shape past half the machine's memory (one of model
    # info's Llama-sized examples asked ~32 GB) was built until it failed or filled the host (review)
    config = ModelConfig(**_config(args))
    weights, memory = config.n_params * 4, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if weights > memory // 2:
        print(f"datapath worker: the model's weights would take {weights / 2**30:.1f} GiB, over half this "
              f"machine's {memory / 2**30:.0f} GiB: a smaller shape (datapath model info prints its size)",
              file=sys.stderr)
        return 2
    # without a store nothing is evicted: over the budget, new sessions are refused 503
    budget = profile(args.device).kv_budget_bytes(config) if args.device else 256 << 20
    opts = WorkerOptions(config=_config(args), seed=args.seed, index=args.index, kv_budget_bytes=budget,
                         codec=args.codec, temperature=args.temperature, device=args.device, sim_mode=args.sim,
                         slowdown=args.slowdown)
    if args.demo is not None:
        from ..ingress import SigtermExit, Terminated
        sigterm = SigtermExit.install()   # SIGTERM unwinds too: its default left the demo's rings in /dev/shm
        try:
            return _demo(opts, args)
        except (KeyboardInterrupt, Terminated) as e:     # (the demo's rings are gone: its finally)
            print("datapath worker: interrupted", file=sys.stderr)
            return e.code if isinstance(e, Terminated) else 130
        finally:
            if sigterm is not None:       # the caller's handler back (main() called in-process)
                signal.signal(signal.SIGTERM, sigterm.old if sigterm.old is not None else signal.SIG_DFL)
    spec = ("shm", args.lane) if args.lane else ("zmq", args.zmq)
    store = None
    if args.store:
        import zmq
        from snapshotstore.api import WorkerStore
        from snapshotstore.server import RemoteStore
        from snapshotstore.errors import SnapshotError
        try:
            remote = RemoteStore(args.store, secret=secret)   # (the connection keyed by it too)
        except zmq.ZMQError as e:
            print(f"datapath worker: --store {args.store}: {e} (tcp://HOST:PORT or ipc://PATH)", file=sys.stderr)
            return 2
        try:
            # asked once now: a store nobody serves, or one keyed by another secret, was found only
            # by the first session's put, as a 503 (found by review)
            remote.stats()
        except SnapshotError as e:
            remote.close()
            print(f"datapath worker: --store: {e}", file=sys.stderr)
            return 1
        store = WorkerStore(remote, secret)
    # said once the lane is attached or bound: before, a lane with a typo read as started, then failed
    banner = (f"worker {args.index}: {spec[0]} lane {spec[1]}, codec {args.codec}"
              + (f", simulating {args.device} ({args.sim})" if args.device else "")
              + (f", slowed {args.slowdown:g}x" if args.slowdown > 1 else "")
              + (f"; snapshot store at {args.store}" if store else
                 "; no snapshot store attached: sessions stay resident (over the KV budget, new ones are "
                 "refused 503), and one moved here from another worker runs on what this one holds of it"))
    # Ctrl-C and SIGTERM set a flag the serving loop reads between its 50 ms waits. As a
    # KeyboardInterrupt, about one SIGINT in 60 was lost here (caught, nothing pending, the worker
    # serving on: seen by hand and in the suite, session 22); where it went was not found. A list,
    # not an Event: a second signal landing inside Event.set would wait on its lock for ever.
    stop = [False]
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.__setitem__(0, True))
    try:
        worker_process(spec, store, opts, lambda: stop[0], serving=lambda: print(banner, flush=True))
    except (OSError, RingError) as e:  # no such ring, or an endpoint that cannot be bound
        print(f"datapath worker: {e}", file=sys.stderr)
        return 1
    return 0


def _demo(opts, args) -> int:
    """The native router, one shared-memory lane and this worker, in this process."""
    import os

    from .. import lanes, records, wire
    from ..ingress import Terminated
    from ..lanes import ShmWorkerLane
    from ..ring import Ring, unlink
    from ..router import Router
    from .worker import one_blas_thread
    tag = f"zl-demo-{os.getpid()}"
    names = [f"{tag}.in", f"{tag}.out"]
    need = args.demo * -(-args.prompt_tokens // wire.MAX_CHUNK_TOKENS)   # every chunk, enqueued up front
    # no store, and the demo's one-shot sessions are never closed: a budget would refuse them 503.
    # The worker first, then the rings, inside the try: a model refused (a bad shape) left them in
    # /dev/shm (found by review)
    w = dataclasses.replace(opts, kv_budget_bytes=1 << 62).build(None)
    router = Router()
    lane = inp = egress = None
    try:
        inp = Ring.create(names[0], records.CHUNK.itemsize, max(1024, 1 << (need - 1).bit_length()), role="producer")
        egress = Ring.create(names[1], records.RESPONSE.itemsize, 256, role="consumer")
        router.add_input(inp)
        router.set_egress(egress)
        router.add_worker(*lanes.create_shm_lane(f"{tag}.w0"))
        lane = ShmWorkerLane(f"{tag}.w0")
        rng = np.random.default_rng(args.seed)
        for rid in range(1, args.demo + 1):
            toks = rng.integers(0, w.model.config.vocab, args.prompt_tokens)
            parts = [toks[i:i + 128] for i in range(0, len(toks), 128)]
            recs = np.zeros(len(parts), dtype=records.CHUNK)
            for i, part in enumerate(parts):
                recs[i]["session_id"], recs[i]["request_id"], recs[i]["kind"] = rid, rid, wire.KIND_CHUNK
                recs[i]["chunk_index"], recs[i]["chunk_count"], recs[i]["n_tokens"] = i, len(parts), len(part)
                recs[i]["max_output_tokens"], recs[i]["t_send"] = args.output_tokens, time.monotonic_ns()
                recs[i]["tokens"][:len(part)] = part
            if inp.enqueue(recs.tobytes()) != len(recs):
                raise RuntimeError("the demo's input ring is full")   # sized above: cannot happen
        router.start()
        got, interrupted = [], 0
        deadline = time.monotonic() + 600
        try:
            with one_blas_thread():
                while len(got) < args.demo and time.monotonic() < deadline:
                    batch = lane.recv_batch(0.01)
                    if batch is not None:
                        done = w.step(batch)          # once: a step changes the sessions' KV
                        while not lane.send_completion(done):
                            time.sleep(1e-4)
                    got += list(np.frombuffer(egress.dequeue(256), dtype=records.RESPONSE))
        except KeyboardInterrupt:     # Ctrl-C: what was answered, then the code a shell expects
            interrupted = 130
        except Terminated as e:       # SIGTERM (SigtermExit): the same, with its code
            interrupted = e.code
        router.stop()
    finally:
        router.close()
        for ring in (lane, inp, egress):
            if ring is not None:
                ring.close()
        for n in names:
            unlink(n)
        lanes.unlink_shm_lane(f"{tag}.w0")
    for r in got:
        ms = (r["t_done"] - r["t_send"]) / 1e6
        toks = r["tokens"][:r["n_out"]].tolist()
        print(f"request {r['request_id']}: status {r['status']}, {r['n_out']} tokens {toks[:8]}..., {ms:.1f} ms")
    st = w.stats
    print(f"worker: {st['steps']} model steps for {st['records']} records, KV resident {w.kv_bytes_resident / 2**10:.0f} KiB"
          + (f", {st['simulated_s']:.3f} s simulated on {opts.device}" if opts.device else ""))
    if interrupted:
        print(f"datapath worker: interrupted, {len(got)} of {args.demo} requests answered", file=sys.stderr)
        return interrupted
    return 0 if len(got) == args.demo else 1
