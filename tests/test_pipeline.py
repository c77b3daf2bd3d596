"""The assembled pipeline (datapath.pipeline: netns, XDP, the native loop, worker processes), as
bench e2e builds it, checked on its own."""
import errno
import json
import os
import signal
import threading
import time
from unittest.mock import ANY

import numpy as np
import pytest

from bench.e2e import _config, fresh_store
from datapath import client
from datapath.pipeline import Pipeline
from datapath.serving.model import KVCache, ModelConfig


def offer_with(p: Pipeline, fault, after_s: float, count: int, sessions: int) -> dict:
    """An offer at 20 req/s of `count` requests of 16 tokens out, fault() `after_s` into it: its result."""
    out = {}
    load = threading.Thread(target=lambda: out.update(
        r=p.offer(20, count, max_output_tokens=16, sessions=sessions, drain_s=10)))
    load.start()
    time.sleep(after_s)
    try:
        fault()
    finally:
        load.join(120)
    return out["r"]


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.parametrize("lane", ["shm", "zmq"])
def test_a_worker_that_dies_unannounced_is_failed_over_and_nothing_is_lost(lane):
    """Failover ran only when someone called set_up(k, False) (kill_worker did): a worker that
    crashed by itself kept its requests, and its sessions' later ones, unanswered for good. The
    pipeline now watches its worker processes. The same with the workers behind ZeroMQ lanes:
    the replacement binds the dead one's endpoint, and nothing of the batch replayed reaches it."""
    with fresh_store() as store, Pipeline(_config(workers=2, shared_store=store, lane=lane)) as p:
        # a crash: nobody tells the router
        r = offer_with(p, lambda: os.kill(p.workers[1].pid, signal.SIGKILL), 1.0, 60, sessions=20)
        assert p.worker_exits == [(1, -signal.SIGKILL)]
        assert [r["worker"] for r in p.worker_replacements] == [1]
        deadline = time.monotonic() + 30                   # (its replacement may still be starting)
        while not p.worker_replacements[0]["t_up"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert p.router.worker_stats(1)["up"] == 1
        after = p.offer(20, 20, sessions=20)               # the replacement serves its lane
        assert after["by_status"] == {200: 20} and p.router.worker_stats(1)["completions"] >= 1
        picked_up = p.trace(1)
        assert (picked_up["t_pickup"] > 0).any()           # traced through its lane, as shm's are
    assert r["requests"] == 60 and r["resp_ok"] == 60 and r["unanswered"] == 0, r["by_status"]
    assert r["by_status"] == {200: 60}, "by status, as send() keys it (JSON made the keys strings)"


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.parametrize("lane", ["shm", "zmq"])
def test_a_worker_that_hangs_holding_a_batch_is_killed_and_failed_over(lane):
    """A worker alive but stuck (here SIGSTOPped) held its batch, and its sessions, forever: a
    process watcher alone cannot see it. One that holds a batch worker_hang_s without completing
    anything is now killed, and failed over like a crash."""
    with fresh_store() as store, Pipeline(_config(workers=2, shared_store=store, worker_hang_s=1.0, lane=lane)) as p:
        p.offer(10, 10, sessions=10)       # both workers past their first (slowest) steps
        r = offer_with(p, lambda: os.kill(p.workers[1].pid, signal.SIGSTOP), 1.0, 60, sessions=20)
        assert p.worker_hangs == [1] and p.worker_exits == [(1, -signal.SIGKILL)]
        assert [x["worker"] for x in p.worker_replacements] == [1]
    assert r["requests"] == 60 and r["resp_ok"] == 60 and r["unanswered"] == 0, r["by_status"]


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.parametrize("lane", ["shm", "zmq"])
def test_a_stopped_worker_is_stalled_and_its_new_requests_go_to_the_others_until_it_wakes(lane):
    """A worker alive but stopped drew its share of new requests, which waited with it until the
    hang kill (30 s). Its batch unanswered worker_stall_s, it is now stalled: what is queued for it
    and what comes next go to the other worker (restored from the shared store) while the
    request in its lane, and its session's next one, wait for it; woken, it answers them,
    nothing replayed and nothing killed."""
    with fresh_store() as store, Pipeline(_config(workers=2, shared_store=store, worker_stall_s=0.3, lane=lane)) as p:
        p.offer(10, 10, sessions=10)
        before = p.router.worker_stats(0)["answered"]
        os.kill(p.workers[1].pid, signal.SIGSTOP)
        try:
            out = {}
            load = threading.Thread(target=lambda: out.update(
                r=p.offer(20, 40, max_output_tokens=8, sessions=20, drain_s=15)))
            load.start()
            time.sleep(3.5)                         # the 40 sent (2 s), the stall seen, the rest run
            while_stopped = p.router.worker_stats(0)["answered"] - before
            stats = p.router.stats()
        finally:
            os.kill(p.workers[1].pid, signal.SIGCONT)
        load.join(60)
        assert stats["stalls"] >= 1 and stats["stall_moved"] >= 1 and stats["replayed"] == 0
        assert while_stopped >= 34, (while_stopped, stats["stall_moved"])   # all but its batch's and their sessions'
        assert p.worker_hangs == [] and p.worker_exits == []
        assert p.router.worker_stats(1)["stalled"] == 0 and p.router.worker_stats(1)["answered"] >= 1
    r = out["r"]
    assert r["requests"] == 40 and r["by_status"] == {200: 40}, r["by_status"]


@pytest.mark.root
@pytest.mark.bpf
def test_a_dead_worker_is_marked_down_by_its_pidfd_while_its_spawner_is_stopped():
    """A worker's death came only as its spawner's report: with the spawner stopped (SIGSTOP, a
    host not scheduling it), the dead worker stayed up, and what it held waited until the spawner
    ran again (found by review: 33 s). Its pidfd now marks it down at once; the replacement
    waits for the spawner."""
    with fresh_store() as store, Pipeline(_config(workers=2, shared_store=store)) as p:
        p.offer(10, 10, sessions=10)
        os.kill(p._spawner.pid, signal.SIGSTOP)
        try:
            r = offer_with(p, lambda: signal.pidfd_send_signal(p.workers[1].pidfd, signal.SIGKILL), 0.5, 20,
                           sessions=20)
            down_while_stopped = p.router.worker_stats(1)["up"] == 0
            assert p.worker_exits == [], "the spawner, stopped, reported nothing"
        finally:
            os.kill(p._spawner.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not (p.worker_replacements and p.worker_replacements[0]["t_up"]):
            assert time.monotonic() < deadline, p.worker_replacements
            time.sleep(0.05)
        assert p.worker_exits == [(1, -signal.SIGKILL)] and p.worker_hangs == []
    assert down_while_stopped
    assert r["requests"] == 20 and r["by_status"] == {200: 20}, r["by_status"]


@pytest.mark.root
@pytest.mark.bpf
def test_a_store_server_that_dies_is_started_again_and_the_sessions_go_on():
    """The shared store server killed: every worker's store call timed out and every request was
    answered 503 for good, nothing said (found by review). The watcher starts it again on the same
    image (its log recovered) and endpoint, which the workers reconnect to."""
    with fresh_store() as store, Pipeline(_config(workers=2, shared_store=store, policy="round_robin")) as p:
        r = p.offer(20, 40, sessions=10)                  # round robin: sessions restored across workers
        assert r["by_status"] == {200: 40}, r["by_status"]
        before = p.store_stats()
        dead = p._store_proc.pid
        os.kill(dead, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not (p.store_restarts and p.store_restarts[0]["t_up"]):
            assert time.monotonic() < deadline, p.store_restarts
            time.sleep(0.05)
        assert p._store_proc.pid != dead and p.store_restarts[0]["exitcode"] == -signal.SIGKILL
        time.sleep(0.5)                                   # (the workers' sockets reconnect: 100 ms)
        r = p.offer(20, 40, sessions=10)                  # 10 new sessions, stored by the new server
        assert r["by_status"] == {200: 40}, r["by_status"]
        st = p.store_stats()                              # (a fresh server's counters: from its start)
    assert before["sessions"] == 10 and before["puts"] > 0
    assert st["puts"] > 0 and st["sessions"] == 20, st   # the first 10 recovered from its log


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.parametrize("hold_s", [2.0, 0.0])
def test_with_its_only_worker_killed_requests_wait_for_the_replacement_not_503(hold_s):
    """A pipeline of one worker answered 503 to what its dead worker held and to each request
    until the replacement served; they now wait for it (worker_hold_s), and with worker_hold_s 0
    are answered 503 at once as before."""
    with fresh_store() as store, Pipeline(_config(workers=1, shared_store=store, worker_hold_s=hold_s)) as p:
        r = offer_with(p, lambda: os.kill(p.workers[0].pid, signal.SIGKILL), 0.5, 40, sessions=10)
        st = p.router.stats()
    assert r["requests"] == 40 and r["unanswered"] == 0, r["by_status"]
    assert st["waiting_for_worker"] == 0
    if hold_s:
        assert r["by_status"] == {200: 40} and st["no_worker"] == 0 and st["waited_for_worker"] >= 1, (r, st)
    else:
        assert r["by_status"].get(503, 0) >= 1 and st["waited_for_worker"] == 0, (r, st)


@pytest.mark.root
@pytest.mark.bpf
def test_killed_workers_are_replaced_by_fresh_processes_until_their_limit():
    """A killed worker was failed over but never replaced: once every worker had died, every
    request was answered 503 for the rest of the run. Now a fresh process on a fresh lane takes
    each one's place, worker_respawns times per worker."""
    def served(k):
        return p.router.worker_stats(k)["completions"]

    with fresh_store() as store, Pipeline(_config(workers=2, shared_store=store, worker_respawns=1)) as p:
        p.offer(20, 10, sessions=10)
        first = [w.pid for w in p.workers]
        for k in (0, 1):
            p.kill_worker(k)
        deadline = time.monotonic() + 30
        while not (len(p.worker_replacements) == 2 and all(r["t_up"] for r in p.worker_replacements)):
            assert time.monotonic() < deadline, p.worker_replacements
            time.sleep(0.01)
        assert sorted(r["worker"] for r in p.worker_replacements) == [0, 1]
        assert all(w.pid not in first and w.is_alive() for w in p.workers)
        before = [served(0), served(1)]
        r = p.offer(20, 20, sessions=20)
        assert r["resp_ok"] == 20 and r["unanswered"] == 0, r["by_status"]
        assert served(0) + served(1) > sum(before)        # run by the replacements
        p.kill_worker(1)                                  # past its limit: it stays down
        time.sleep(0.5)
        assert len(p.worker_replacements) == 2 and p.router.worker_stats(1)["up"] == 0
        r = p.offer(20, 20, sessions=20)
        assert r["resp_ok"] == 20 and r["unanswered"] == 0, r["by_status"]
        assert p.worker_exits == [(0, -signal.SIGKILL), (1, -signal.SIGKILL), (1, -signal.SIGKILL)]
    assert p._spawner.proc.exitcode == 0         # it saw the pipeline close its end: not killed


@pytest.mark.root
@pytest.mark.bpf
def test_a_spawner_that_dies_is_taken_over_by_its_heir_which_forks_every_worker_again():
    """The worker spawner was one process: killed, it took every worker with it, none replaced,
    and every later request was answered 503 (a review's probe: 19 of 80 answered). Now its
    heir, a standby spawner it forked, takes its place: the workers are marked down once gone,
    forked again, and serve, while what they held and what came meanwhile waits for them (it was
    answered 503 until session 43); a new heir stands by, and a standby heir that dies is
    replaced. None of them outlives the pipeline."""
    procs = []
    with fresh_store() as store, Pipeline(_config(workers=2, shared_store=store)) as p:
        p.offer(20, 10, sessions=10)
        spawner, heir = p._spawner, p._heir
        procs += [spawner.pid, heir.pid, *(w.pid for w in p.workers)]
        r = offer_with(p, lambda: os.kill(spawner.pid, signal.SIGKILL), 1.0, 60, sessions=20)
        assert r["requests"] == 60 and r["by_status"] == {200: 60}, r["by_status"]

        def replaced(n):
            deadline = time.monotonic() + 30
            while not (len(p.worker_replacements) == n and all(x["t_up"] for x in p.worker_replacements)):
                assert time.monotonic() < deadline, p.worker_replacements
                time.sleep(0.01)
        replaced(2)
        assert p.spawner_takeovers == [{"pid": spawner.pid, "code": -signal.SIGKILL, "t_exit": ANY, "workers": 2,
                                        "heir": heir.pid}]
        assert sorted(p.worker_exits) == [(0, -signal.SIGKILL), (1, -signal.SIGKILL)]
        assert p._spawner is heir and p._heir is not None and p._heir.pid not in procs
        assert p.offer(20, 20, sessions=20)["by_status"] == {200: 20}
        standby = p._heir.pid
        os.kill(standby, signal.SIGKILL)                # the standby heir dies: another is forked
        deadline = time.monotonic() + 10
        while p._heir is None or p._heir.pid == standby:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        second = p._spawner.pid
        procs += [standby, second, p._heir.pid, *(w.pid for w in p.workers)]
        os.kill(second, signal.SIGKILL)                 # and the heir, now the spawner, dies in turn
        replaced(4)
        assert [t["pid"] for t in p.spawner_takeovers] == [spawner.pid, second]
        assert p.offer(20, 20, sessions=20)["by_status"] == {200: 20}
        procs += [p._spawner.pid, p._heir.pid, *(w.pid for w in p.workers)]
    deadline = time.monotonic() + 10
    while not all(_gone(x) for x in procs):
        assert time.monotonic() < deadline, [x for x in procs if not _gone(x)]
        time.sleep(0.02)


@pytest.mark.root
@pytest.mark.bpf
def test_spawners_lost_in_a_row_soon_after_starting_stop_at_the_respawn_limit():
    """Heirs are bounded as workers are (worker_respawns in a row, each lost within
    CRASH_LOOP_S of starting): past it there is no heir, and the spawner's death leaves every
    worker down, said once; with worker_respawns 0 no heir is forked at all."""
    with Pipeline(_config(workers=1, worker_respawns=1)) as p:
        first = p._heir.pid
        os.kill(first, signal.SIGKILL)                  # lost 1 in a row: a new one
        deadline = time.monotonic() + 10
        while p._heir is None or p._heir.pid == first:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(p._heir.pid, signal.SIGKILL)            # lost 2 in a row: past the limit
        deadline = time.monotonic() + 10
        while p._heir is not None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(p._spawner.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not p.spawner_takeovers:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.5)
        assert p.spawner_takeovers[0]["heir"] is None and p.worker_replacements == []
        assert p.router.worker_stats(0)["up"] == 0 and p.worker_exits == [(0, -signal.SIGKILL)]
        r = p.offer(20, 5, sessions=5)
        assert r["by_status"] == {503: 5}, r["by_status"]
    with Pipeline(_config(workers=1, worker_respawns=0)) as p:
        assert p._heir is None


@pytest.mark.root
@pytest.mark.bpf
def test_an_heir_that_cannot_be_forked_is_tried_again_until_one_is(monkeypatch):
    """A failed heir fork (out of processes, for a moment) left no heir for the pipeline's life,
    and the spawner's next death took every worker for good (review). It is tried again after
    1 s, 2, ... and the failure is not counted as an heir lost."""
    from datapath.pipeline import WorkerSpawner
    real, fails = WorkerSpawner.spawn_heir, [2]

    def spawn_heir(self, timeout_s=30.0):
        if fails[0]:
            fails[0] -= 1
            raise RuntimeError("the worker spawner could not fork: BlockingIOError: [Errno 11] (injected)")
        return real(self, timeout_s)
    with Pipeline(_config(workers=1, worker_respawns=1)) as p:
        monkeypatch.setattr(WorkerSpawner, "spawn_heir", spawn_heir)
        lost = p._heir.pid
        os.kill(lost, signal.SIGKILL)
        deadline = time.monotonic() + 15                # after two failures: 1 s, then 2 s
        while p._heir is None or p._heir.pid == lost:
            assert time.monotonic() < deadline, fails
            time.sleep(0.05)
        assert fails == [0]
        p.kill_spawner()
        deadline = time.monotonic() + 30
        while not (p.worker_replacements and p.worker_replacements[-1]["t_up"]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert p.offer(20, 5, sessions=5)["by_status"] == {200: 5}


@pytest.mark.root
@pytest.mark.bpf
def test_a_spawner_that_dies_while_forking_an_heir_is_taken_over_not_retried(monkeypatch, capfd):
    """The spawner's death while asked for an heir was logged as a failed fork "tried again in
    1 s" (and a death while asked for a worker, as that worker staying down), though the takeover
    was what came next. It goes to the takeover now: here there is no heir, said once."""
    from datapath.pipeline import WorkerSpawner
    real = WorkerSpawner.spawn_heir

    def spawn_heir(self, timeout_s=30.0):
        signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        assert self.exited(10)
        return real(self, timeout_s)
    with Pipeline(_config(workers=1, worker_respawns=1)) as p:
        monkeypatch.setattr(WorkerSpawner, "spawn_heir", spawn_heir)
        spawner = p._spawner.pid
        os.kill(p._heir.pid, signal.SIGKILL)            # another heir is asked for: the spawner dies then
        deadline = time.monotonic() + 10
        while not p.spawner_takeovers:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert p.spawner_takeovers[0]["pid"] == spawner and p.spawner_takeovers[0]["heir"] is None
    err = capfd.readouterr().err
    assert "could not fork an heir" not in err and "no heir: they stay down" in err, err


@pytest.mark.root
@pytest.mark.bpf
def test_a_takeover_that_fails_leaves_every_worker_down_and_every_request_answered(monkeypatch):
    """take_over ran in the watcher's EOFError handler, outside its guard: one exception there
    ended the watcher with the router still taking the dead workers for up, and an offer of 20
    drew no answer at all (review). Now every worker is marked down: answered 503."""
    from datapath import pipeline
    real, armed = pipeline.join_all, [False]

    def join_all(procs, timeout):
        if armed[0]:
            armed[0] = False
            raise OSError(errno.EIO, "injected")
        return real(procs, timeout)
    monkeypatch.setattr(pipeline, "join_all", join_all)
    with Pipeline(_config(workers=2)) as p:
        p.offer(20, 5, sessions=5)
        armed[0] = True
        os.kill(p._spawner.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(p.router.worker_stats(k)["up"] for k in (0, 1)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = p.offer(20, 10, sessions=10, drain_s=3)
        assert r["by_status"] == {503: 10} and r["unanswered"] == 0, r["by_status"]


PID1_SCRIPT = """
import json, os, time
from bench.e2e import _config
from datapath.pipeline import Pipeline

def zombies():
    found = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                found += [int(d)] if f.read().rsplit(")", 1)[1].split()[0] == "Z" else []
        except FileNotFoundError:
            pass
    return found

with Pipeline(_config(workers=2)) as p:
    p.kill_spawner()
    deadline = time.monotonic() + 30
    while not (len(p.worker_replacements) == 2 and all(r["t_up"] for r in p.worker_replacements)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    after_takeover = zombies()
    status = p.offer(20, 5, sessions=5)["by_status"]
time.sleep(1)
print(json.dumps({"pid": os.getpid(), "after_takeover": after_takeover, "after_teardown": zombies(),
                  "status": {str(k): v for k, v in status.items()}}))
"""


@pytest.mark.root
@pytest.mark.bpf
def test_a_pipeline_that_is_pid_1_reaps_what_its_spawner_s_death_leaves_it():
    """In a container the pipeline is PID 1: a dead spawner's workers, and later the heir it had
    promoted, are re-parented to it, and it never waited for them (review: zombies for the
    pipeline's life, workers + 1 a takeover). Now each is reaped."""
    import subprocess
    import sys
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", PID1_SCRIPT],
                         capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["pid"] == 1 and got["status"] == {"200": 5}, got
    assert got["after_takeover"] == [] and got["after_teardown"] == [], got


def test_the_spawner_s_pidfd_past_1023_is_waited_for(monkeypatch):
    """WorkerSpawner.exited used select(), which refuses an fd past 1023: a process holding over a
    thousand fds lost its takeover (the watcher died) and every teardown raised (review)."""
    import resource
    from datapath.pipeline import SharedFlag, WorkerSpawner
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    spare = []
    try:
        spare = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
        spawner = WorkerSpawner.start([], None, [], None, SharedFlag())
        try:
            heir = spawner.spawn_heir(timeout_s=10)
            assert spawner.pidfd > 1023 and heir.pidfd > 1023
            assert not spawner.exited() and not heir.exited()
            os.kill(spawner.pid, signal.SIGKILL)
            assert spawner.exited(10) and spawner.exitcode() == -signal.SIGKILL and not heir.exited()
            heir.close()
        finally:
            spawner.close()
    finally:
        for fd in spare:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.root
@pytest.mark.bpf
def test_a_replaced_worker_s_pidfd_is_closed_once_it_is_long_gone(monkeypatch):
    """A replaced worker's pidfd was kept until the teardown (a kill_worker racing the replacement
    must not find its number reused): every takeover left one more open a worker, without bound
    in a long run (review). It is closed RETIRED_S after the replacement."""
    from datapath import pipeline
    monkeypatch.setattr(pipeline, "RETIRED_S", 0.2)
    with Pipeline(_config(workers=1, worker_hang_s=2.0)) as p:       # (a watcher pass every 0.5 s)
        old = p.workers[0]
        p.kill_worker(0)
        deadline = time.monotonic() + 15
        while p._retired or old.pidfd >= 0:
            assert time.monotonic() < deadline, p._retired
            time.sleep(0.05)
        assert p.workers[0] is not old and p.workers[0].pidfd >= 0


@pytest.mark.root
@pytest.mark.bpf
def test_the_respawn_limit_counts_deaths_in_a_row_a_worker_that_served_a_while_starts_it_again(monkeypatch):
    """worker_respawns counted every replacement of a worker's life: crashes hours apart left a
    long run short of it for good. One that served CRASH_LOOP_S (here 1 s) starts the count again."""
    from datapath import pipeline
    monkeypatch.setattr(pipeline, "CRASH_LOOP_S", 1.0)

    def serving(n):
        deadline = time.monotonic() + 30
        while not (len(p.worker_replacements) == n and p.worker_replacements[-1]["t_up"]):
            assert time.monotonic() < deadline, p.worker_replacements
            time.sleep(0.01)

    with Pipeline(_config(workers=2, worker_respawns=1)) as p:
        p.kill_worker(1)                     # 1 in a row: replaced
        serving(1)
        time.sleep(1.2)
        p.kill_worker(1)                     # it had served 1 s: the count starts again, replaced
        serving(2)
        p.kill_worker(1)                     # 1 in a row: replaced
        serving(3)
        p.kill_worker(1)                     # 2 in a row: it stays down
        time.sleep(0.5)
        assert len(p.worker_replacements) == 3 and p.router.worker_stats(1)["up"] == 0
        assert len(p.worker_exits) == 4


@pytest.mark.root
@pytest.mark.bpf
def test_a_replacement_that_dies_starting_is_replaced_again_to_the_limit(tmp_path):
    """A replacement that dies before it serves its lane (here its store cannot open) is never set
    up; it is replaced in turn until worker_respawns, and the slot then stays down."""
    broken = tmp_path / "store-broken"

    def store_factory(index):
        if broken.exists():
            raise OSError("the store is gone")
        return None

    with Pipeline(_config(workers=2, store_factory=store_factory, worker_respawns=2)) as p:
        broken.touch()
        p.kill_worker(1)
        deadline = time.monotonic() + 30
        while len(p.worker_exits) < 3:
            assert time.monotonic() < deadline, p.worker_exits
            time.sleep(0.01)
        time.sleep(0.3)
        assert p.worker_exits == [(1, -signal.SIGKILL), (1, 1), (1, 1)]
        assert len(p.worker_replacements) == 2 and not any(r["t_up"] for r in p.worker_replacements)
        assert p.router.worker_stats(1)["up"] == 0
        r = p.offer(20, 20, sessions=20)
        assert r["resp_ok"] == 20 and r["unanswered"] == 0, r["by_status"]


@pytest.mark.root
@pytest.mark.bpf
def test_a_worker_that_cannot_start_fails_the_build_in_one_sentence():
    """The build returned with a worker that had died starting up still up in the router."""
    with pytest.raises(RuntimeError, match=r"worker 0 exited while starting \(code 1"):
        with Pipeline(_config(workers=1, worker_cpus=[4096])):    # no such CPU: its affinity fails
            pass


@pytest.mark.root
@pytest.mark.bpf
def test_an_error_building_the_pipeline_names_the_stage_it_was_at():
    """A build error that does not say where it came from (a netlink errno, an EADDRINUSE) was all
    bench's FAILED line said: it now carries the stage, as a note, shown by error_text."""
    from bench.contract import error_text
    with pytest.raises(ValueError) as got:
        with Pipeline(_config(workers=1, queues=0)):     # refused where the XDP program is built
            pass
    assert "while building the pipeline: the XDP program" in error_text(got.value)
    assert error_text(got.value).startswith("ValueError: queues must be")


def _signalled_pipeline(patch: str, body: str, codes: tuple[int, ...]):
    """A pipeline in a child process, topology.netns.<patch's name> patched to send it SIGTERM, its
    with-block running `body`: it must exit by the signal and leave no namespace or /dev/shm file."""
    import subprocess
    import sys
    script = ("import os, signal\n"
              "from datapath import topology\n"
              "from datapath.pipeline import Pipeline, PipelineConfig\n"
              f"{patch}\n"
              "with Pipeline(PipelineConfig(workers=1)):\n"
              f"    {body}\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in codes, err[-2000:]
    netns_dir = "/run/netns"
    left = [n for n in (os.listdir(netns_dir) if os.path.isdir(netns_dir) else []) if n.startswith(f"dp{proc.pid}t")]
    assert left == [], left
    assert not [n for n in os.listdir("/dev/shm") if f"pl{proc.pid}-" in n]


@pytest.mark.root
def test_a_sigterm_while_the_pipeline_is_built_leaves_no_namespace():
    """SIGTERM was turned into an unwinding exit only while the ingress was open: one during the
    topology's build (or its teardown) killed the process with its namespaces left behind. Here
    the build signals itself right after creating its first namespace."""
    _signalled_pipeline("real = topology.netns.create\n"
                        "def create(name, *a, **k):\n"
                        "    real(name, *a, **k)\n"
                        "    os.kill(os.getpid(), signal.SIGTERM)\n"
                        "topology.netns.create = create", "pass", (128 + signal.SIGTERM,))


def test_the_caller_s_sigterm_handler_is_back_after_nested_teardowns():
    """A Pipeline installs its SIGTERM handler, then its Ingress (inside it) did too: the pipeline's
    teardown then restored the Ingress's, stale, instead of the caller's (found by review). The
    same calls as they nest there, without root."""
    from datapath.ingress import SigtermExit, signals_held

    def callers(signum, frame):
        pass
    before = signal.signal(signal.SIGTERM, callers)
    try:
        outer = SigtermExit.install()              # Pipeline.__enter__
        inner = SigtermExit.install()              # Ingress.__enter__, inside it
        assert outer is not None and inner is None, "this process's own is in place: the outer restores"
        with signals_held(outer):                  # Pipeline._teardown
            with signals_held(inner):              # Ingress.__exit__, in the pipeline's exit stack
                pass
        assert signal.getsignal(signal.SIGTERM) is callers
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_signal_before_the_teardown_s_hold_still_leaves_the_teardown_done(monkeypatch):
    """A second Ctrl-C landing as the teardown began, before its signals were held, skipped the
    whole teardown: namespaces, XDP attachments and rings left behind (found by review)."""
    import contextlib

    from datapath import pipeline

    calls = []

    @contextlib.contextmanager
    def interrupted(sigterm=None):        # the first one, before it could hold anything
        calls.append(sigterm)
        if len(calls) == 1:
            raise KeyboardInterrupt
        yield
    monkeypatch.setattr(pipeline, "signals_held", interrupted)
    p = Pipeline.__new__(Pipeline)
    p._stack, p._sigterm, done = contextlib.ExitStack(), None, []
    p._stack.callback(done.append, "removed")
    with pytest.raises(KeyboardInterrupt):
        p._teardown()
    assert done == ["removed"] and len(calls) == 2, "the second pass ran it, held too"


def test_a_child_whose_parent_is_not_the_one_it_was_given_exits_at_once():
    """child_of_this_process asked whether the parent was init: a pipeline that is PID 1 (in a
    container) lost every child at once, and under a subreaper an orphan went on (review)."""
    from datapath.pipeline import child_of_this_process
    for parent, code in ((os.getpid(), 0), (os.getpid() + 1_000_000, 1)):
        pid = os.fork()
        if pid == 0:
            try:
                child_of_this_process(parent)
            finally:
                os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == code


def test_a_spawner_that_died_is_named_not_a_bare_eoferror():
    from datapath.pipeline import SharedFlag, WorkerSpawner
    spawner = WorkerSpawner.start([], None, [], None, SharedFlag())
    try:
        os.kill(spawner.pid, signal.SIGKILL)
        spawner.proc.join(10)
        with pytest.raises(RuntimeError, match=r"the worker spawner \(pid \d+\) exited when asked to fork worker 0 "
                                               r"\(code -9\)"):
            spawner.spawn(0, "no-lane", timeout_s=5)
    finally:
        spawner.close()


def _gone(pid: int) -> bool:
    """Exited (a zombie too: an orphan's reaper is init's business)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_spawner_and_its_heir_exit_when_the_pipeline_process_dies_without_closing_them():
    """An heir is forked by the spawner, not the pipeline, and outlives the spawner by design: it
    must still go when the pipeline does (it watches the pipeline's pidfd), as must the spawner."""
    from datapath.pipeline import SharedFlag, WorkerSpawner
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                     # the "pipeline": starts both, then dies unclean
        code = 1
        try:
            os.close(r)
            spawner = WorkerSpawner.start([], None, [], None, SharedFlag())
            heir = spawner.spawn_heir(timeout_s=10)
            os.write(w, f"{spawner.pid} {heir.pid}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        pids = [int(x) for x in f.read().split()]
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 and len(pids) == 2
    deadline = time.monotonic() + 10
    while not all(_gone(x) for x in pids):
        assert time.monotonic() < deadline, [x for x in pids if not _gone(x)]
        time.sleep(0.02)


def test_workers_that_do_not_stop_are_waited_for_under_one_deadline_not_one_each(monkeypatch):
    """The teardown joined its workers one after another, 5 s each (and 5 more each for the kill):
    four that ignored the stop held it 20 s before the first kill (review). Here the wait is
    0.5 s: one after another, four take 2 s before the first kill."""
    import subprocess
    from datapath import pipeline
    from datapath.pipeline import SharedFlag, WorkerProcess, join_all
    monkeypatch.setattr(pipeline, "REAP_WAIT_S", 0.5)
    kids = [subprocess.Popen(["sleep", "60"]) for _ in range(4)]          # they ignore the stop flag
    procs = [WorkerProcess(k, k, c.pid, os.pidfd_open(c.pid)) for k, c in enumerate(kids)]
    p = Pipeline.__new__(Pipeline)
    p._stop_workers, p.workers, p._retired, p._spawner, p._heir = SharedFlag(), procs, [], None, None
    reaped = False
    try:
        assert join_all(procs, 0) == procs and join_all([], None) == []
        t = time.monotonic()
        p._reap_workers()                                  # (closes their pidfds)
        reaped = True
        assert time.monotonic() - t < 1.9, "one after another, 0.5 s each, takes 2 s before a kill"
        assert all(c.wait(10) == -signal.SIGKILL for c in kids)
    finally:
        for c in kids:
            c.kill()
            c.wait()
        for w in procs if not reaped else ():
            w.close()


@pytest.mark.root
@pytest.mark.bpf
def test_a_second_sigterm_during_the_teardown_leaves_no_namespace():
    """A first SIGTERM unwinds the pipeline; a second lands in the teardown, as a namespace is
    removed. It was raised there: that namespace was already off the list, the loop over the
    others stopped, and both were left behind (found by review). Held until the teardown ends, it
    is delivered then (the default handler's, the pipeline's own restored)."""
    _signalled_pipeline("real = topology.netns.remove\n"
                        "def remove(name, *a, **k):\n"
                        "    os.kill(os.getpid(), signal.SIGTERM)\n"
                        "    real(name, *a, **k)\n"
                        "topology.netns.remove = remove", "os.kill(os.getpid(), signal.SIGTERM)",
                        (-signal.SIGTERM, 128 + signal.SIGTERM))


@pytest.mark.root
@pytest.mark.bpf
def test_new_sessions_a_store_less_worker_has_no_kv_room_for_run_on_the_next_worker():
    """Two store-less workers with KV room for about six sessions each, the policy sending every
    session to worker 0: past its six it refuses new ones (503, CE_KV_FULL), and the router moves
    them to worker 1. Before, six of the twelve clients got 503 with worker 1 empty."""
    one_session = KVCache(ModelConfig()).nbytes          # a 64-token prompt and 4 tokens out fit in it
    with Pipeline(_config(workers=2, policy="weighted", kv_budget_bytes=int(5.5 * one_session))) as p:
        p.router.set_weight(1, 0)
        r = p.offer(50, 12, sessions=12)
        st = p.router.stats()
    assert r["resp_ok"] == 12 and r["unanswered"] == 0, r["by_status"]
    assert st["kv_moved"] >= 1 and st["refused_by_worker"] == 0


@pytest.mark.root
@pytest.mark.bpf
def test_a_worker_s_refusal_reaches_the_client_with_a_body_saying_why():
    """Through XDP, the router, a worker process and egress: a prompt with a token past the model's
    vocabulary is refused 400 by the worker, and the client's answer says why (it was a bare 400)."""
    vocab = ModelConfig().vocab
    with Pipeline(_config(workers=1)) as p:
        r = p.offer(50, 1, prompts=[[1, 2, vocab + 7, 3]], sessions=1)
    assert r["by_status"] == {400: 1} and r["sample_status"] == 400, r
    assert json.loads(r["sample_body"]) == {"status": 400,
                                            "error": "a token of the prompt is outside the model's vocabulary"}


@pytest.mark.root
@pytest.mark.bpf
def test_records_past_the_trace_buffer_are_counted_and_said(capsys):
    """A worker stopped tracing once its buffer was full, and the stage figures silently left the
    rest out."""
    with Pipeline(_config(workers=1, trace_records=8)) as p:
        r = p.offer(50, 20, sessions=20)
        assert r["resp_ok"] == 20
        assert len(p.trace()) == 8
    assert "records ran past the trace buffers (8 a worker) untraced" in capsys.readouterr().err


@pytest.mark.root
@pytest.mark.bpf
def test_each_stored_turn_is_traced_to_its_durable_ack():
    """The trace's last stage: the record that finished a request carries its last token's step
    and the store's durable ack of its turn, in that order and inside the step. It was stamped by
    the worker and read by nobody: the snapshot stage was missing from the report (found by review)."""
    with fresh_store() as store, Pipeline(_config(workers=1, shared_store=store)) as p:
        r = p.offer(20, 20, max_output_tokens=2, sessions=20)
        assert r["resp_ok"] == 20
        trace = p.trace()
    acked = trace[trace["t_snapshot"] > 0]
    assert len(acked) == 20 and len(set(acked["request_id"].tolist())) == 20
    assert (acked["t_last_token"] > acked["t_start"]).all()
    assert (acked["t_snapshot"] > acked["t_last_token"]).all() and (acked["t_snapshot"] <= acked["t_end"]).all()


@pytest.mark.root
@pytest.mark.bpf
def test_a_teardown_kills_the_sender_of_an_offer_running_in_another_thread():
    """An offer in another thread kept its sender process, and this one, alive for the offer's
    whole duration and drain after the pipeline was torn down (on a SIGTERM: found by review)."""
    out = {}
    with Pipeline(_config(workers=1)) as p:
        load = threading.Thread(target=lambda: out.update(r=_catch(lambda: p.offer(5, 300, drain_s=10))))
        load.start()
        time.sleep(2.0)
        t0 = time.monotonic()
    load.join(30)
    assert not load.is_alive() and time.monotonic() - t0 < 10
    assert isinstance(out["r"], RuntimeError) and "exit -9" in str(out["r"])


def _catch(fn):
    try:
        return fn()
    except Exception as e:
        return e


@pytest.mark.root
@pytest.mark.bpf
def test_with_tags_required_only_requests_tagged_with_their_tenant_s_key_are_served():
    """bench e2e's pipeline requires tags: its own offers (keys it issued) are answered; the same
    requests tagged with a wrong key, or as a tenant it issued no key to, are dropped in XDP
    unanswered and counted."""
    with Pipeline(_config(workers=1)) as p:
        assert p.cfg.require_tags
        served = p.offer(100, 20, tenant=3, sessions=4)
        assert served["by_status"] == {200: 20}
        pkts = client.request_packets(3, 77, 0, range(16), max_output_tokens=2)
        for keys, counter in (({3: bytes(16)}, "drop_bad_tag"),
                              ({4: p.issue_tenant_key(3)}, "drop_unknown_tenant")):
            sent = pkts if 3 in keys else client.request_packets(4, 77, 0, range(16), max_output_tokens=2)
            before = p.ingress.counters()[counter]
            res = client.send_from(p.topo.client_ns[0], p.topo.host_ip[0], sent, rate=100, count=20, duration=5,
                                   drain_ms=300, seq_base=next(p._ids) * 1_000_000_000, keys=keys)
            assert res["sent"] == 20 and res["responses"] == 0, counter
            assert p.ingress.counters()[counter] - before == 20


@pytest.mark.root
@pytest.mark.bpf
def test_set_slowdown_turns_a_serving_worker_slow_and_back_and_its_replacement_keeps_it():
    """A straggler that turns slow mid-run: the worker reads its factor from the pipeline's shared
    slot at every step, and a replacement forked later reads the same slot. On a simulated L4 a
    step's time is the profile's (~67 ms here), so the factor shows in the trace as it is."""
    from bench.e2e import _step_ns
    with fresh_store() as store, Pipeline(_config(workers=2, device="l4", shared_store=store)) as p:
        def step_ms(k: int) -> float:
            p.reset_trace()
            r = p.offer(20, 20, sessions=10, drain_s=10)
            assert r["resp_ok"] == 20, r["by_status"]
            return float(np.median(_step_ns(p.trace(k)))) / 1e6
        normal = step_ms(0)
        p.set_slowdown(0, 3)
        assert 2.5 * normal < step_ms(0) < 3.5 * normal
        os.kill(p.workers[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (p.worker_replacements and p.worker_replacements[0]["t_up"]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert 2.5 * normal < step_ms(0) < 3.5 * normal, "the replacement lost the factor"
        p.set_slowdown(0, 1)
        assert step_ms(0) < 1.5 * normal
        with pytest.raises(ValueError, match="worker 2 is not one of the 2 workers"):
            p.set_slowdown(2, 3)
        with pytest.raises(ValueError, match="slowdown must be a number from 1"):
            p.set_slowdown(1, 0.5)


def test_a_straggler_that_is_not_one_of_the_workers_is_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="stragglers: worker 2 is not one of the 2 workers"):
        with Pipeline(_config(workers=2, stragglers={2: 4})):
            pass
    with pytest.raises(ValueError, match="slowdown must be a number from 1"):
        with Pipeline(_config(workers=2, stragglers={1: 0.5})):
            pass
    with pytest.raises(ValueError, match="stragglers: worker True is not one of"):
        with Pipeline(_config(workers=2, stragglers={True: 4})):
            pass


def test_the_teardown_closes_every_pidfd_whatever_one_of_them_raises(monkeypatch):
    """A close that raised stopped the teardown there: the later workers' pidfds and the spawner
    stayed open (session 31's review). Now each is closed, the first error raised after; and a
    WorkerProcess closes its pidfd once (a second close would close whatever file has the number
    by then), a closed one neither signalled nor waited for."""
    import subprocess
    from datapath import pipeline
    from datapath.pipeline import SharedFlag, WorkerProcess, join_all
    monkeypatch.setattr(pipeline, "REAP_WAIT_S", 0.5)
    kids = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    procs = [WorkerProcess(k, k, c.pid, os.pidfd_open(c.pid)) for k, c in enumerate(kids)]
    first = procs[0].pidfd
    p = Pipeline.__new__(Pipeline)
    p._stop_workers, p.workers, p._retired = SharedFlag(), procs[:2], procs[2:]
    p._spawner, p._heir = None, None
    real_close = os.close

    def close(fd):
        if fd == first:
            real_close(fd)
            raise OSError(errno.EIO, "a close that fails")
        real_close(fd)
    monkeypatch.setattr(os, "close", close)
    try:
        with pytest.raises(OSError, match="a close that fails"):
            p._reap_workers()
        monkeypatch.setattr(os, "close", real_close)
        assert [w.pidfd for w in procs] == [-1, -1, -1]
        assert kids[0].wait(10) == kids[1].wait(10) == -signal.SIGKILL    # ignored the stop: killed
        procs[0].close()                                  # again: nothing closed
        procs[0].kill()                                   # closed: nothing signalled
        assert join_all(procs, None) == [] and not procs[0].is_alive()
    finally:
        monkeypatch.setattr(os, "close", real_close)
        for c in kids:
            c.kill()
            c.wait()


@pytest.mark.parametrize("field, value", [("lane", "rdma"), ("lane_wait", "nap")])
def test_a_lane_or_lane_wait_it_does_not_know_is_refused_before_anything_is_built(field, value):
    with pytest.raises(ValueError, match=f"{field} must be one of .*not '{value}'"):
        with Pipeline(_config(**{field: value})):
            pass
