"""`datapath ingress stats` reads a running ingress from outside: counters and the consumer's histogram."""
import io
import re
import subprocess
import sys
import threading

import pytest

from datapath import client, ingress_stats
from test_ingress_live import live, rings, sessions  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.root, pytest.mark.bpf]


def test_one_interval_shows_what_was_sent(live, monkeypatch):
    topo, ig, consumer = live
    prog_id = ig.attachments[0].prog_id()
    assert prog_id in ingress_stats.steer_programs()
    # Send only once the interval's first snapshot is taken: opening the maps can take longer than the
    # client needs to send everything, and packets counted before it belong to no interval.
    started, snapshot = threading.Event(), ingress_stats.SteerMaps.snapshot
    monkeypatch.setattr(ingress_stats.SteerMaps, "snapshot", lambda self: (snapshot(self), started.set())[0])
    out = io.StringIO()
    t = threading.Thread(target=ingress_stats.run, kwargs=dict(interval=8.0, count=1, prog_id=prog_id, out=out))
    t.start()
    assert started.wait(30), "ingress stats never took its first snapshot"
    res = client.send_from(topo.client_ns[0], topo.host_ip[0], sessions(8, 4), rate=5_000, count=1_000, duration=3)
    t.join()
    text = out.getvalue()
    assert res["sent"] == 1_000
    pkts = [int(n) for n in re.search(r"^  pkts (.*)$", text, re.M).group(1).split()]
    assert len(pkts) == 4 and sum(pkts) == 1_000, text
    assert "drops: none" in text
    hist = [int(m) for m in re.findall(r"-> \d+\s*: (\d+)", text)]
    assert sum(hist) == 1_000, text
    assert sum(ig.table("lat_hist")[k].value for k in ig.table("lat_hist").keys()) == consumer.records == 1_000


def test_errors_are_one_sentence():
    r = subprocess.run([sys.executable, "-m", "datapath", "ingress", "stats", "-p", "999999", "0.1", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "datapath", "ingress", "stats", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "must be positive" in r.stderr
    r = subprocess.run([sys.executable, "-m", "datapath", "ingress", "stats", "--ebpf"], capture_output=True, text=True)
    assert r.returncode == 0 and "int xdp_steer(struct xdp_md *ctx)" in r.stdout
