"""vmguest: inside the VM, the snapshot store on a real NVMe-oF namespace over the kernel's NVMe/TCP.

Run by the guest's init (datapath/vmtest.py builds it), as root in a chroot of
the host's root filesystem (read-only), with the nvmet, nvmet-tcp, nvme-tcp
and null_blk modules loaded:

  1. a Linux nvmet target through configfs: one subsystem, one namespace on
     /dev/nullb0 (memory-backed, 4 KiB blocks), a TCP port on 127.0.0.1:4420;
  2. the kernel's NVMe/TCP initiator connected to it (options written to
     /dev/nvme-fabrics, as nvme-cli does), so /dev/nvmeXnY appears;
  3. `snapshotstore format` on it, real KV deltas of the tiny model put through
     LogStore, the store reopened (recovery scan) and every chain restored and
     compared, `snapshotstore fsck`;
  4. crash consistency on the namespace: writers SIGKILLed mid-stream
     (snapshotstore/crashtest.py), then fsck again;
  5. interoperability of the project's own NVMe/TCP with Linux, each with and
     without header and data digests: the kernel's initiator against
     `snapshotstore target` (127.0.0.1:4421, /dev/nullb1), the store run on the
     namespace it attaches; the project's initiator (LogStore on an
     nvme-tcp:// URL) against nvmet, once the kernel host has disconnected;
  6. result.json in --out. The init powers the guest off afterwards.

USAGE (only inside the guest): python -m datapath.vmguest --out /run/vmtest/result.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
import uuid

NQN = "nqn.2026-01.io.zerolayer:vmtest"
HOSTNQN = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
ADDR, PORT = "127.0.0.1", 4420
BACKING = "/dev/nullb0"
USER_NQN, USER_PORT, USER_BACKING = "nqn.2026-01.io.zerolayer:vmtest-user", 4421, "/dev/nullb1"   # our target
NVMET = "/sys/kernel/config/nvmet"
SECRET = b"vmtest-tenant-secret-0123456789"
CODECS = ("raw", "zstd", "lz4")          # lossless: a restored cache must equal the original bit for bit
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"vmguest [{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


# --- target and initiator -------------------------------------------------------

def start_kernel_target(backing: str) -> None:
    """A Linux nvmet subsystem with one namespace on backing, exported on ADDR:PORT over TCP."""
    sub = f"{NVMET}/subsystems/{NQN}"
    os.mkdir(sub)
    write(f"{sub}/attr_allow_any_host", "1")
    os.mkdir(f"{sub}/namespaces/1")
    write(f"{sub}/namespaces/1/device_path", backing)
    write(f"{sub}/namespaces/1/enable", "1")
    port = f"{NVMET}/ports/1"
    os.mkdir(port)
    for attr, value in (("trtype", "tcp"), ("adrfam", "ipv4"), ("traddr", ADDR), ("trsvcid", str(PORT))):
        write(f"{port}/addr_{attr}", value)
    os.symlink(sub, f"{port}/subsystems/{NQN}")


# The project's own target (snapshotstore/nvmetcp) is started beside nvmet, not
# instead of it: kernel_initiator_on_user_target() below.


def connect(addr: str, port: int, nqn: str, digests: bool = False) -> str:
    """Attach the kernel's NVMe/TCP initiator (what `nvme connect -t tcp [-g -G]` does); the controller's name."""
    opts = f"transport=tcp,traddr={addr},trsvcid={port},nqn={nqn},hostnqn={HOSTNQN}"
    fd = os.open("/dev/nvme-fabrics", os.O_RDWR)
    try:
        os.write(fd, (opts + (",hdr_digest,data_digest" if digests else "")).encode())
        reply = os.read(fd, 4096).decode()          # "instance=0,cntlid=1"
    finally:
        os.close(fd)
    fields = dict(kv.split("=", 1) for kv in reply.strip().split(","))
    return f"nvme{fields['instance']}"


def namespace_of(ctrl: str, timeout: float = 60) -> str:
    """The controller's first namespace, /dev/nvmeXnY, once its node exists (devtmpfs, no udev)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ns in sorted(glob.glob(f"/sys/class/nvme/{ctrl}/{ctrl}n*")):
            dev = f"/dev/{os.path.basename(ns)}"
            if os.path.exists(dev):
                return dev
        time.sleep(0.2)
    raise RuntimeError(f"no namespace appeared under controller {ctrl} in {timeout:.0f} s")


def disconnect(ctrl: str) -> None:
    write(f"/sys/class/nvme/{ctrl}/delete_controller", "1")     # synchronous: the controller is gone after it


# What Linux says of NVMe peers that work: anything else about nvme is a complaint (a refusal, a
# data digest error it recovered from, a timeout, a reconnect, a keep-alive that expired), which
# the checks by "failed" alone let by (a review)
KERNEL_NVME_OK = re.compile(
    r"nvmet: adding nsid \d+ to subsystem |nvmet_tcp: enabling port |nvmet: creating nvm controller \d+ for "
    r"|nvme nvme\d+: (creating \d+ I/O queues\.|mapped [\d/]+ default/read/poll queues\.|new ctrl: |"
    r"Removing ctrl: |queue_size \d+ > ctrl sqsize \d+, clamping down)")


def kernel_complaints(lines: list[str]) -> list[str]:
    return [line for line in lines if "nvme" in line.lower() and not KERNEL_NVME_OK.search(line)]


def kernel_messages() -> list[str]:
    """The kernel log, whole (what Linux said about our peers: a refusal, a digest error, a timeout,
    a reconnect); dmesg failing is an error, not an empty log."""
    return subprocess.run(["dmesg"], capture_output=True, text=True, check=True).stdout.splitlines()


# --- the store on the namespace ---------------------------------------------------

def cli(*args: str) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "snapshotstore", *args], capture_output=True, text=True)
    return r.returncode, (r.stdout + r.stderr).strip()


def kv_round_trip(dev: str, sessions: int = 3) -> dict:
    """Real KV deltas (prefill chunks and decode steps) put, the store reopened, every chain restored."""
    import numpy as np
    from datapath.serving import kvdelta
    from datapath.serving.model import KVCache, Model, ModelConfig
    from snapshotstore import Delta, LogStore, session_key

    config = ModelConfig()
    model = Model(config, seed=1)
    rng = np.random.default_rng(1)
    written, caches, put_us = {}, {}, []
    with LogStore(dev, group_commit_us=0) as store:
        for sid in range(sessions):
            codec, key, cache = CODECS[sid % len(CODECS)], session_key(SECRET, sid), KVCache(config)
            written[sid] = []
            # a 128-token chunk is a multi-block record, a 40-token one a few blocks, a decode step one block
            for step in (128, 40, 1, 1, 1):
                if step == 1:
                    model.decode(cache, int(rng.integers(config.vocab)))
                else:
                    model.prefill(cache, rng.integers(0, config.vocab, step))
                d = kvdelta.export_delta(cache)
                blob = kvdelta.encode(d, config, codec)
                t = time.perf_counter()
                store.put(key, Delta(blob, tokens=(d.token_start, d.token_end), layers=(0, config.n_layers),
                                     codec=codec))
                put_us.append((time.perf_counter() - t) * 1e6)
                cache.snapshot_len = cache.length
                written[sid].append(blob)
            caches[sid] = cache
        block_size = store.block_size                 # what format wrote in the superblock
    restored, bit_exact, problems = 0, True, []
    with LogStore(dev) as store:                      # reopen: the index comes from scanning the namespace
        recovery = store.stats()
        for sid, blobs in written.items():
            snap = store.restore(session_key(SECRET, sid))
            parts = list(snap.parts) if snap else []
            restored += sum(a == b for a, b in zip(parts, blobs))
            if parts != blobs:
                problems.append(f"session {sid}: {len(parts)} deltas restored, {len(blobs)} written, "
                                f"{sum(a == b for a, b in zip(parts, blobs))} identical")
                bit_exact = False
                continue
            got, want = kvdelta.restore(parts, config), caches[sid]
            n = want.length
            if not (got.length == n and np.array_equal(got.k[:, :, :n], want.k[:, :, :n])
                    and np.array_equal(got.v[:, :, :n], want.v[:, :, :n])):
                problems.append(f"session {sid}: the restored KV cache differs from the one written")
                bit_exact = False
    return dict(sessions=sessions, records_written=sum(map(len, written.values())), records_restored=restored,
                bytes_written=sum(len(b) for bs in written.values() for b in bs), kv_bit_exact=bit_exact,
                codecs=list(CODECS), put_us_p50=round(statistics.median(put_us), 1),
                put_us_max=round(max(put_us), 1), store_block_size=block_size, recovery=recovery,
                problems=problems)


def crash_check(dev: str, iterations: int) -> dict:
    from snapshotstore import crashtest
    # Under TCG a put takes milliseconds, not the tens of microseconds crashtest's default 12 ms
    # kill window was made for: a wider window (it adapts down when writers finish) lands kills mid-work.
    res = crashtest.run(dev, iterations, seed=11, max_delay_s=0.3)     # formats the namespace first
    ok = (not res.failures and res.iterations == iterations and res.acked_puts > 0
          and res.writer_finished < iterations)
    return dict(ok=ok, iterations=res.iterations, acked_puts=res.acked_puts,
                records_verified=res.records_verified, writer_finished=res.writer_finished,
                torn_records_skipped=res.torn_records_skipped, failures=res.failures[:10],
                seconds=round(res.seconds, 1))


def store_on_512e(timeout: float = 30) -> dict:
    """The store on scsi_debug's 512e disk (512-byte LBAs, 4 KiB physical sectors): it must take
    4 KiB blocks, so none of its writes shares a physical sector with an acknowledged record or
    the other superblock copy; then the KV round trip and fsck on it."""
    from snapshotstore.device import BlockDevice
    deadline, disk = time.monotonic() + timeout, None
    while disk is None:
        for model in glob.glob("/sys/block/sd*/device/model"):
            if read(model).strip() == "scsi_debug":
                disk = model.split("/")[3]
        if disk is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no scsi_debug disk after {timeout:g} s")
            time.sleep(0.2)
    dev, q = f"/dev/{disk}", f"/sys/block/{disk}/queue"
    bd = BlockDevice(dev)
    res = dict(device=dev, logical_block_size=int(read(f"{q}/logical_block_size")),
               physical_block_size=int(read(f"{q}/physical_block_size")), store_block_size=bd.block_size)
    bd.close()
    problems = res["problems"] = []
    if (res["logical_block_size"], res["physical_block_size"]) != (512, 4096):
        problems.append(f"scsi_debug gave {res['logical_block_size']}/{res['physical_block_size']}-byte "
                        f"logical/physical blocks, not 512/4096")
    res.update(store_checks(dev, problems))
    if res["kv"] and res["kv"]["store_block_size"] != 4096:
        problems.append(f"the store took {res['kv']['store_block_size']}-byte blocks on a 512e disk, not 4096")
    # a store formatted in 512-byte blocks there (as before session 16) still opens, in its own blocks
    from snapshotstore import Delta, LogStore, session_key
    from snapshotstore.log import format_device
    format_device(dev, force=True, block_size=512)
    with LogStore(dev) as store:
        res["old_store_block_size"] = store.block_size
        store.put(session_key(SECRET, 1), Delta(b"o" * 3000, tokens=(0, 3), codec="raw"))
    with LogStore(dev) as store:
        snap = store.restore(session_key(SECRET, 1))
        res["old_store_restored"] = snap is not None and snap.payload == b"o" * 3000
    if res["old_store_block_size"] != 512 or not res["old_store_restored"]:
        problems.append(f"a 512-byte-block store on the 512e disk: blocks {res['old_store_block_size']}, "
                        f"restored {res['old_store_restored']}")
    res["ok"] = not problems
    return res


# --- interoperability of the project's NVMe/TCP with Linux ---------------------------

def store_checks(dev: str, problems: list) -> dict:
    """format, the KV round trip and fsck on dev (a block device or an nvme-tcp:// URL)."""
    rc, out = cli("format", dev, "--force")
    res = dict(format_rc=rc, format_output=out)
    t = time.monotonic()
    res["kv"] = kv_round_trip(dev) if rc == 0 else None
    res["kv_seconds"] = round(time.monotonic() - t, 1)
    res["fsck_rc"], res["fsck_output"] = cli("fsck", dev)
    problems += [f"format exited {rc}: {out[-300:]}"] if rc else []
    problems += res["kv"]["problems"] if res["kv"] else []
    if res["fsck_rc"]:
        problems.append(f"fsck exited {res['fsck_rc']}: {res['fsck_output'][-300:]}")
    return res


def kernel_initiator_on_user_target(digests: bool) -> dict:
    """Linux's nvme-tcp host -> `snapshotstore target` on USER_BACKING: the namespace it attaches, as
    sysfs and BLKSSZGET see it, then the store on it; disconnect, stop the target."""
    from snapshotstore.device import BlockDevice
    from snapshotstore.nvmetcp.process import TargetProcess
    res, problems = dict(digests=digests, ok=False), []
    t0 = time.monotonic()
    target = TargetProcess(USER_BACKING, USER_NQN, f"{ADDR}:{USER_PORT}")
    ctrl = None
    try:
        res["target_banner"] = target.banner           # "serving PATH (N blocks of B bytes) at URL"
        blocks, bsize = (int(x) for x in re.search(r"\((\d+) blocks of (\d+) bytes\)", target.banner).groups())
        res["target_bytes"] = blocks * bsize
        ctrl = connect(ADDR, USER_PORT, USER_NQN, digests)
        dev = namespace_of(ctrl)
        sysfs, name = f"/sys/class/nvme/{ctrl}", os.path.basename(dev)
        res.update(controller=ctrl, device=dev, transport=read(f"{sysfs}/transport"),
                   address=read(f"{sysfs}/address"), subsysnqn=read(f"{sysfs}/subsysnqn"),
                   model=read(f"{sysfs}/model"), connect_seconds=round(time.monotonic() - t0, 1),
                   sysfs_logical_block_size=int(read(f"/sys/block/{name}/queue/logical_block_size")),
                   sysfs_bytes=int(read(f"/sys/block/{name}/size")) * 512)
        bd = BlockDevice(dev, readonly=True)
        res.update(logical_block_size=bd.block_size, device_bytes=bd.size)
        bd.close()
        res.update(store_checks(dev, problems))
        want = dict(transport="tcp", subsysnqn=USER_NQN, logical_block_size=4096, sysfs_logical_block_size=4096,
                    sysfs_bytes=res["target_bytes"], device_bytes=res["target_bytes"])
        problems += [f"{k} is {res[k]!r}, not {v!r}" for k, v in want.items() if res[k] != v]
    except Exception as e:                             # the target's log and dmesg say more: keep them
        problems.append(f"{type(e).__name__}: {e}")
        log(traceback.format_exc())
    finally:
        if ctrl:
            try:            # a failed disconnect must not leave the target holding its port and device
                disconnect(ctrl)
            except OSError as e:
                problems.append(f"disconnect {ctrl}: {e}")
            res["disconnected"] = not os.path.exists(f"/sys/class/nvme/{ctrl}")
        res["target_exit"] = target.stop()
        res["target_log"] = target.output                # one line per queue the kernel connected
        res["seconds"] = round(time.monotonic() - t0, 1)
    if ctrl and not res["disconnected"]:
        problems.append(f"{ctrl} is still there after delete_controller")
    if res["target_exit"] != 0:
        problems.append(f"the target exited {res['target_exit']}: {target.stderr.strip()[-300:]}")
    on = "on" if digests else "off"
    for qid in (0, 1):          # the admin queue and the I/O queue, each with the digests asked for
        if not any(f"queue {qid} connected:" in line and f"header digest {on}, data digest {on}" in line
                   for line in res["target_log"]):
            problems.append(f"the target logged no queue {qid} with digests {on}: {res['target_log']}")
    res.update(problems=problems, ok=not problems)
    return res


def user_initiator_on_kernel_target(digests: bool) -> dict:
    """The project's initiator (NvmeTcpDevice, LogStore on an nvme-tcp:// URL) -> Linux nvmet."""
    from snapshotstore.nvmetcp import NvmeTcpDevice
    url = f"nvme-tcp://{ADDR}:{PORT}/{NQN}" + ("?digests" if digests else "")
    res = dict(digests=digests, url=url, ok=False)
    t0 = time.monotonic()
    dev = NvmeTcpDevice(url)
    try:
        res.update(block_size=dev.block_size, blocks=dev.blocks, header_digest=dev.io.channel.hdgst,
                   data_digest=dev.io.channel.ddgst, in_capsule=dev.io.in_capsule, maxh2cdata=dev.io.maxh2cdata)
    finally:
        dev.close()
    problems = []
    res.update(store_checks(url, problems))
    res["seconds"] = round(time.monotonic() - t0, 1)
    if (res["header_digest"], res["data_digest"]) != (digests, digests):
        problems.append(f"digests negotiated: header {res['header_digest']}, data {res['data_digest']}")
    if res["block_size"] != 4096:
        problems.append(f"the namespace's block size is {res['block_size']}, not 4096")
    res.update(problems=problems, ok=not problems)
    return res


def interop(result: dict) -> None:
    """Both directions, each with and without digests; every failure recorded, none stops the others."""
    checks = (("kernel_initiator_user_target", kernel_initiator_on_user_target),
              ("user_initiator_kernel_target", user_initiator_on_kernel_target))
    for name, check in checks:
        result[name] = []
        for digests in (False, True):
            log(f"interop: {name}, digests {'on' if digests else 'off'}")
            try:
                res = check(digests)
            except Exception as e:
                res = dict(digests=digests, ok=False, problems=[f"{type(e).__name__}: {e}"])
                log(traceback.format_exc())
            result[name].append(res)
            result["problems"] += [f"{name} (digests {digests}): {p}" for p in res["problems"]]
            log(f"interop: {name}, digests {digests}: {'ok' if res['ok'] else res['problems']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m datapath.vmguest")
    p.add_argument("--out", required=True, help="result.json path (the shared scratch directory)")
    p.add_argument("--crash-iterations", type=int, default=50)
    args = p.parse_args(argv)
    result = dict(ok=False, accel=os.environ.get("ZL_VM_ACCEL"), kernel=os.uname().release, problems=[])
    problems = result["problems"]
    ctrl = None
    try:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)   # the guest's only network
        start_kernel_target(BACKING)
        log(f"nvmet: {NQN} on {BACKING}, tcp {ADDR}:{PORT}")
        ctrl = connect(ADDR, PORT, NQN)
        dev = namespace_of(ctrl)
        sysfs = f"/sys/class/nvme/{ctrl}"
        result.update(controller=ctrl, device=dev, transport=read(f"{sysfs}/transport"),
                      address=read(f"{sysfs}/address"), subsysnqn=read(f"{sysfs}/subsysnqn"),
                      model=read(f"{sysfs}/model"),
                      sysfs_logical_block_size=int(read(f"/sys/block/{os.path.basename(dev)}/queue/logical_block_size")))
        log(f"connected: {ctrl} -> {dev} over {result['transport']} ({result['address']})")

        from snapshotstore.device import BlockDevice
        bd = BlockDevice(dev, readonly=True)
        result.update(is_block_device=bd.is_block, logical_block_size=bd.block_size, device_bytes=bd.size)
        bd.close()

        rc, out = cli("format", dev, "--force")
        result.update(format_rc=rc, format_output=out)
        log(out)
        t = time.monotonic()
        result["kv"] = kv_round_trip(dev)
        result["kv"]["seconds"] = round(time.monotonic() - t, 1)
        problems += result["kv"]["problems"]
        log(f"kv: {result['kv']['records_restored']}/{result['kv']['records_written']} deltas restored, "
            f"put p50 {result['kv']['put_us_p50']} us")
        rc, out = cli("fsck", dev)
        result.update(fsck_rc=rc, fsck_output=out)
        log(out)

        log(f"crash check: {args.crash_iterations} SIGKILLed writers")
        result["crash"] = crash_check(dev, args.crash_iterations)
        problems += result["crash"]["failures"]
        rc, out = cli("fsck", dev)
        result.update(crash_fsck_rc=rc, crash_fsck_output=out)
        log(f"crash: {result['crash']}")
        log(out)

        if result["transport"] != "tcp":
            problems.append(f"the namespace's transport is {result['transport']}, not tcp")
        if result["logical_block_size"] != result["sysfs_logical_block_size"]:
            problems.append("the store's block size is not the namespace's logical block size (sysfs)")
        for step in ("format_rc", "fsck_rc", "crash_fsck_rc"):
            if result[step]:
                problems.append(f"{step.removesuffix('_rc')} exited {result[step]}")
        if not result["crash"]["ok"]:
            problems.append("the crash check failed")

        disconnect(ctrl)                              # nvmet's namespace is the project's initiator's now
        ctrl = None
        # the store the kernel's initiator left, read through the project's initiator
        result["user_fsck_rc"], result["user_fsck_output"] = cli("fsck", f"nvme-tcp://{ADDR}:{PORT}/{NQN}")
        if result["user_fsck_rc"]:
            problems.append(f"fsck through the project's initiator exited {result['user_fsck_rc']}")
        interop(result)
        log("512e: the store on scsi_debug's 512-byte LBAs over 4 KiB sectors")
        try:
            result["store_512e"] = store_on_512e()
        except Exception as e:
            result["store_512e"] = dict(ok=False, problems=[f"{type(e).__name__}: {e}"])
            log(traceback.format_exc())
        problems += [f"512e: {p}" for p in result["store_512e"]["problems"]]
        log(f"512e: {'ok' if result['store_512e']['ok'] else result['store_512e']['problems']}")
        result["ok"] = not problems
    except Exception as e:
        problems.append(f"{type(e).__name__}: {e}")
        log(traceback.format_exc())
    finally:
        if ctrl:
            try:
                disconnect(ctrl)
            except OSError as e:
                log(f"disconnect {ctrl}: {e}")
        try:
            result["dmesg"] = kernel_messages()
            complaints = [f"the kernel said: {line}" for line in kernel_complaints(result["dmesg"])]
        except (OSError, subprocess.CalledProcessError) as e:
            complaints = [f"dmesg: {e}"]
        if complaints:
            problems += complaints
            result["ok"] = False
        result["guest_seconds"] = round(time.monotonic() - T0, 1)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        log(f"{'ok' if result['ok'] else 'FAILED'}: {problems or 'no problems'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
