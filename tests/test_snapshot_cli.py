"""The snapshotstore command: format, inspect, fsck, stats; user errors in one sentence."""
import json
import os
import subprocess
import sys

import pytest

from snapshotstore import Delta, LogStore, session_key
from snapshotstore import format as fmt
from snapshotstore.device import BlockDevice, aligned_buffer


def cli(*args):
    return subprocess.run([sys.executable, "-m", "snapshotstore", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def store_image(tmp_path):
    image = str(tmp_path / "s.img")
    assert cli("format", image, "--size", "2M").returncode == 0
    with LogStore(image) as s:
        for n in range(3):
            for i in range(2):
                s.put(session_key(b"cli-tenant-secret!", n), Delta(bytes([n]) * 1000, tokens=(i * 10, i * 10 + 10)))
    return image


def reader_gone(argv):
    """argv run with its stdout a pipe whose reader left before it wrote (`... | head`): (exit
    status, stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}   # buffered, as from a shell
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.close()
    try:
        return p.wait(timeout=60), p.stderr.read().decode()
    finally:
        p.stderr.close()


def test_a_reader_that_leaves_ends_inspect_quietly(store_image):
    """`snapshotstore inspect | head`: a BrokenPipeError traceback at exit's flush, status 0 (as
    if all was written); now 141, as a shell reports SIGPIPE, and nothing on stderr."""
    assert reader_gone([sys.executable, "-m", "snapshotstore", "inspect", store_image]) == (141, "")


def test_format_creates_a_sparse_image(tmp_path):
    image = tmp_path / "new.img"
    r = cli("format", str(image), "--size", "8M")
    assert r.returncode == 0, r.stderr
    assert "created" in r.stdout and "2046 log blocks of 4096 bytes" in r.stdout
    assert image.stat().st_size == 8 << 20


def test_format_takes_a_block_size_a_power_of_two(tmp_path):
    """A store over NVMe/TCP takes the namespace's LBA size, and a 512e disk's namespace says 512:
    --block-size 4K formats it in its physical sectors' blocks."""
    image = str(tmp_path / "b.img")
    r = cli("format", image, "--size", "4M", "--block-size", "3000")
    assert r.returncode == 1 and "power of two from 512 to 64K" in r.stderr and not os.path.exists(image)
    assert cli("format", image, "--size", "4M", "--block-size", "8K").returncode == 0
    assert json.loads(cli("stats", image, "--json").stdout)["block_size"] == 8192


def test_inspect_lists_records_and_stats_counts_them(store_image):
    r = cli("inspect", store_image)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if " delta " in line]
    assert len(rows) == 6 and all(row.split()[-1] == "live" for row in rows)
    r = cli("stats", store_image, "--json")
    st = json.loads(r.stdout)
    assert (st["sessions"], st["records"], st["superblocks_valid"]) == (3, 6, 2)


def test_fsck_clean_then_damage_found(store_image):
    r = cli("fsck", store_image)
    assert r.returncode == 0 and "clean" in r.stdout, r.stdout + r.stderr
    dev = BlockDevice(store_image)
    buf = aligned_buffer(dev.block_size)
    dev.read_into(buf, fmt.LOG_START + 1, 1)             # the second record
    buf[fmt.HEADER_SIZE + 10] ^= 0xFF
    dev.write_from(buf, 0, fmt.LOG_START + 1, 1)
    dev.sync()
    dev.close()
    r = cli("fsck", store_image)
    assert r.returncode == 1 and "corrupt blocks in the durable part" in r.stdout, r.stdout


ERRORS = [  # args, the one sentence expected on stderr
    (["stats", "/nonexistent/x.img"], "does not exist"),
    (["inspect", "/dev/null"], "neither a block device nor a regular file"),
    (["format", "/nonexistent-dir/x.img", "--size", "1M"], "cannot create"),
    (["format", "zl-does-not-exist.img"], "pass --size"),   # relative: nothing is created
    # the target has no authentication: off loopback only when asked (it served 0.0.0.0 without a
    # word, while serve refuses a tcp:// endpoint off loopback without a secret: found by review)
    (["target", "/nonexistent/x.img", "--listen", "0.0.0.0:0"], "is off loopback: any peer reaching it"),
]


@pytest.mark.parametrize("args,msg", ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_user_errors_are_one_sentence(args, msg):
    r = cli(*args)
    assert r.returncode == 1
    assert msg in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_errors_on_a_formatted_store(store_image, tmp_path):
    r = cli("format", store_image)
    assert r.returncode == 1 and "already holds a snapshot store: pass --force" in r.stderr
    blank = tmp_path / "blank.img"
    blank.write_bytes(bytes(1 << 20))
    r = cli("fsck", str(blank))
    assert r.returncode == 1 and "holds no snapshot store" in r.stderr and "Traceback" not in r.stderr


def test_help_has_examples_and_bad_size_is_a_usage_error():
    r = cli("-h")
    assert r.returncode == 0 and "examples:" in r.stdout and "fsck" in r.stdout
    for bad in ("12Q", "0", "-1M", "infG", "nan"):            # 0 made the default 1 GiB image before
        r = cli("format", "x.img", f"--size={bad}")
        assert r.returncode == 2 and "is not a size" in r.stderr, (bad, r.stderr)
    r = cli("inspect", "x.img", "--limit", "-1")
    assert r.returncode == 2 and "is not a count" in r.stderr
    # a bad --listen is a usage error too (exit 1 before, as a device's error), the file never touched
    r = cli("serve", "x.img", "--listen", "tcp://127.0.0.1:99999")
    assert r.returncode == 2 and "the port a number from 1 to 65535" in r.stderr and "usage:" in r.stderr
    r = cli("target", "x.img", "--maxh2cdata", "3")            # under the spec's floor: exit 1 before
    assert r.returncode == 2 and "is 4096 bytes to 4 GiB - 1" in r.stderr and "usage:" in r.stderr
    r = cli("target", "x.img", "--maxh2cdata", "4G")           # over ICResp's 32 bits: it served, and every
    assert r.returncode == 2 and "32-bit field" in r.stderr      # queue's thread died packing (a review)
    r = cli("target", "x.img", "--listen", "[::1]:0")           # IPv6: it failed binding "[::1]" as a name
    assert r.returncode == 2 and "is IPv6" in r.stderr
    r = cli("fsck", "nvme-tcp://[::1]:4420/nqn.x")
    assert r.returncode == 1 and "over IPv4 only" in r.stderr


def test_format_refuses_data_that_is_not_a_store_without_force(tmp_path):
    """A mistyped path to a disk with a file system on it: before, format overwrote its first blocks."""
    junk = tmp_path / "junk.img"
    junk.write_bytes(bytes(4096) + b"\x53\xef" + bytes((1 << 20) - 4098))    # data in its second block
    r = cli("format", str(junk))
    assert r.returncode == 1 and "holds data that is not a snapshot store" in r.stderr, r.stderr
    assert junk.read_bytes()[4096:4098] == b"\x53\xef", "untouched"
    assert cli("format", str(junk), "--force").returncode == 0
    zeroed = tmp_path / "zeroed.img"
    zeroed.write_bytes(bytes(1 << 20))
    assert cli("format", str(zeroed)).returncode == 0, "zeroed blocks need no --force"


def test_an_image_too_large_for_the_file_system_leaves_no_file(tmp_path):
    image = tmp_path / "huge.img"
    for size in ("99999T", "1e20"):                   # EFBIG; past what ftruncate takes (OverflowError)
        r = cli("format", str(image), "--size", size)
        assert r.returncode == 1 and "cannot make" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not image.exists(), "a retry must not find an empty file"
