"""The snapshot store's packed index (native/snapindex.c through snapshotstore/index.py),
checked op by op against a model made of Python dicts and lists."""
import collections
import os
import random

import pytest

from snapshotstore import Delta, LogStore, format_device
from snapshotstore.device import create_image
from snapshotstore import format as fmt
from snapshotstore.format import HEADER_SIZE, KIND_BASE, KIND_DELTA, KIND_PAD, KIND_TOMBSTONE, RecordHeader
from snapshotstore._snapindex import ffi, lib
from snapshotstore.index import Index


def header(kind, key, tokens, raw_len, layers=(0, 4), codec="f16", seq=1, parent=0):
    """A record's header packed as on the device: what Index.apply reads."""
    buf = bytearray(HEADER_SIZE)
    fmt.pack_record_into(buf, 0, RecordHeader(kind, 0, 0, 0, 0, seq, parent, key, tokens[0], tokens[1],
                                              layers[0], layers[1], 1, raw_len, 0, codec, 0), b"")
    return bytes(buf)


class Model:
    """What the index must say, kept the plain way."""

    def __init__(self, first_rid):
        self.recs = {}                            # rid -> [lpos, seq, nblocks, kind, live]
        self.head = self.tail = first_rid
        self.lpos = self.seq = 0
        self.chains = collections.OrderedDict()   # key -> {rids, tokens, raw_len, layers, codec}, LRU first

    def append(self, kind, nblocks):
        self.seq += 1
        self.recs[self.tail] = [self.lpos, self.seq if kind != KIND_PAD else 0, nblocks, kind, False]
        self.lpos += nblocks
        self.tail += 1
        return self.tail - 1


def check(ix: Index, m: Model):
    assert (ix.head, ix.tail) == (m.head, m.tail)
    for rid in range(m.head, m.tail):
        r = ix.rec(rid)
        assert [r.lpos, r.seq, r.nblocks, r.kind, r.live] == m.recs[rid], rid
    assert ix.keys() == list(m.chains)
    assert ix.sessions == len(m.chains)
    assert ix.live_records == sum(len(c["rids"]) for c in m.chains.values())
    assert ix.live_blocks == sum(m.recs[r][2] for c in m.chains.values() for r in c["rids"])
    for key, c in m.chains.items():
        chain = ix.find(key)
        assert [r.rid for r in ix.records(chain)] == c["rids"]
        assert (chain.records, chain.tokens, chain.raw_len, chain.layers, chain.codec) == \
               (len(c["rids"]), c["tokens"], c["raw_len"], c["layers"], c["codec"])
        assert (ix.first_seq(chain), chain.last_seq) == (m.recs[c["rids"][0]][1], m.recs[c["rids"][-1]][1])
        assert chain.gen == c["gen"]              # a base, a copy, a touch keep the chain's number
        assert all(ix.key_of(r) == key for r in ix.records(chain))


@pytest.mark.parametrize("first_rid", [0, 2**32 - 500, 2**33 - 1], ids=["rid 0", "rids across 2^32", "past 2^33"])
@pytest.mark.parametrize("seed", range(3))
def test_the_index_agrees_with_a_plain_model_op_by_op(seed, first_rid):
    """Links hold a rid's low 32 bits: every value of them is some record's (the 2^32-1th one's
    was taken for "none" and cut chains), so the rids here also run across 2^32."""
    rng = random.Random(seed)
    ix, m = Index(), Model(first_rid)
    ix._ix.head = ix._ix.tail = first_rid        # as if that many records had come and gone
    # keys that differ in one byte, mostly zeros, as well as random ones: the hash mixes all 32 bytes
    keys = [bytes(31) + bytes([i]) for i in range(200)] + [os.urandom(32) for _ in range(600)]
    gens = set()
    for step in range(6000):
        op = rng.random()
        live = list(m.chains)
        if op < 0.35 or not live:                 # a new session, its first record
            key = rng.choice(keys)
            if key in m.chains:
                continue
            rid = m.append(KIND_DELTA, rng.randint(1, 3))
            ix.append(*m.recs[rid][:4])
            assert ix.apply(rid, header(KIND_DELTA, key, (0, 10), 100, codec=rng.choice(["f16", "zstd"]),
                                        seq=m.recs[rid][1])) == lib.SIX_LINKED
            gen = ix.find(key).gen
            assert gen not in gens                # a chain's number is its own, a new one's new
            gens.add(gen)
            m.recs[rid][4] = True
            m.chains[key] = dict(rids=[rid], tokens=(0, 10), raw_len=100, layers=(0, 4),
                                 codec=ix.find(key).codec, gen=gen)
        elif op < 0.55:                           # a delta joins a chain
            key = rng.choice(live)
            c = m.chains[key]
            rid = m.append(KIND_DELTA, 1)
            ix.append(*m.recs[rid][:4])
            lo, hi = rng.randint(0, 3), rng.randint(4, 8)
            assert ix.apply(rid, header(KIND_DELTA, key, (c["tokens"][1], c["tokens"][1] + 5), 50, (lo, hi),
                                        c["codec"], m.recs[rid][1], m.recs[c["rids"][-1]][1])) == lib.SIX_LINKED
            m.recs[rid][4] = True
            c.update(rids=c["rids"] + [rid], tokens=(0, c["tokens"][1] + 5), raw_len=c["raw_len"] + 50,
                     layers=(min(lo, c["layers"][0]), max(hi, c["layers"][1])))
            m.chains.move_to_end(key)
        elif op < 0.62:                           # compacted into a base
            key = rng.choice(live)
            c = m.chains[key]
            rid = m.append(KIND_BASE, 2)
            ix.append(*m.recs[rid][:4])
            ix.apply(rid, header(KIND_BASE, key, c["tokens"], 7, (1, 2), c["codec"], m.recs[rid][1]))
            for r in c["rids"]:
                m.recs[r][4] = False
            m.recs[rid][4] = True
            c.update(rids=[rid], raw_len=7, layers=(1, 2))   # its LRU place kept (relocation's base)
        elif op < 0.72:                           # a live record copied to the tail
            key = rng.choice(live)
            c = m.chains[key]
            old = rng.choice(c["rids"])
            lpos, seq, nblocks, kind, _ = m.recs[old]
            new = m.tail
            m.recs[new] = [m.lpos, seq, nblocks, kind, True]
            m.lpos += nblocks
            m.tail += 1
            ix.append(m.recs[new][0], seq, nblocks, kind)
            ix.swap(old, new)
            m.recs[old][4] = False
            c["rids"][c["rids"].index(old)] = new
        elif op < 0.85:                           # a chain dropped (deleted, evicted)
            key = rng.choice(live)
            ix.drop(ix.find(key))
            for r in m.chains.pop(key)["rids"]:
                m.recs[r][4] = False
        elif op < 0.90:
            key = rng.choice(live)
            ix.touch(ix.find(key))
            m.chains.move_to_end(key)
        elif op < 0.93:
            rid = m.append(KIND_PAD, 4)
            ix.append(*m.recs[rid][:4])
        else:                                     # the head passes dead records
            while m.head < m.tail and not m.recs[m.head][4]:
                ix.pop()
                del m.recs[m.head]
                m.head += 1
        if step % 97 == 0:
            check(ix, m)
    check(ix, m)
    for key in keys:
        assert (ix.find(key) is not None) == (key in m.chains)
    protect = set(list(m.chains)[:3])
    assert ix.least_recent(protect) == next((k for k in m.chains if k not in protect), None)


def test_a_record_joins_its_chain_by_its_parent():
    """The rule a staged record and a recovered one both follow (six_apply_header)."""
    ix, key, other = Index(), bytes(31) + b"\1", bytes(31) + b"\2"

    def apply(kind, seq, parent, k=key, tokens=(0, 1)):
        rid = ix.append(seq, seq, 1, kind)
        return ix.apply(rid, header(kind, k, tokens, 10, seq=seq, parent=parent))

    assert apply(KIND_DELTA, 1, 7) == lib.SIX_UNLINKED and key not in ix     # its chain's start is gone
    assert apply(KIND_DELTA, 2, 0) == lib.SIX_LINKED and ix.find(key).records == 1
    assert apply(KIND_DELTA, 3, 2, tokens=(1, 2)) == lib.SIX_LINKED and ix.find(key).tokens == (0, 2)
    assert apply(KIND_DELTA, 4, 2) == lib.SIX_DAMAGED and key not in ix      # not after its chain's end
    assert ix.rec(ix.tail - 2).live is False                                 # the dropped chain's records
    assert apply(KIND_DELTA, 5, 3) == lib.SIX_UNLINKED                       # nothing to follow now
    assert apply(KIND_BASE, 6, 0, tokens=(0, 9)) == lib.SIX_LINKED and ix.find(key).tokens == (0, 9)
    gen = ix.find(key).gen
    assert apply(KIND_BASE, 7, 0, tokens=(0, 12)) == lib.SIX_LINKED           # a base keeps its chain
    assert ix.find(key).gen == gen and ix.find(key).records == 1
    assert apply(KIND_DELTA, 8, 0, other) == lib.SIX_LINKED
    assert apply(KIND_TOMBSTONE, 9, 0) == lib.SIX_LINKED and key not in ix and other in ix
    assert ix.live_records == 1


def test_the_native_crc32c_is_the_crc32c_package_s():
    """Recovery checks CRCs in C: hardware and table versions, every length and alignment."""
    rng = random.Random(3)
    for n in list(range(0, 40)) + [127, 128, 4096, 4097, 65539]:
        data = rng.randbytes(n + 7)
        for start in (0, 1, 3, 7):
            chunk = data[start:start + n]
            want = fmt.crc32c(chunk)
            assert lib.six_crc32c(0, chunk, n) == want == lib.six_crc32c_soft(0, chunk, n)
            assert lib.six_crc32c(fmt.crc32c(b"abc"), chunk, n) == fmt.crc32c(chunk, fmt.crc32c(b"abc"))


def test_the_native_record_header_is_the_format_s():
    """native/snapindex.h's struct six_hdr and snapshotstore.format.RECORD, field by field."""
    fields = [name for name, _ in ffi.typeof("struct six_hdr").fields]
    assert fields == [name for name, _ in fmt.RECORD.fields]
    for name in fields:
        assert ffi.offsetof("struct six_hdr", name) == fmt.RECORD.offsets[name], name
    assert ffi.sizeof("struct six_hdr") == fmt.HEADER_SIZE == lib.SIX_HEADER_SIZE
    assert lib.SIX_RECORD_MAGIC.to_bytes(4, "little") == fmt.RECORD_MAGIC
    assert (lib.SIX_KIND_DELTA, lib.SIX_KIND_BASE, lib.SIX_KIND_TOMBSTONE, lib.SIX_KIND_PAD) == \
           (fmt.KIND_DELTA, fmt.KIND_BASE, fmt.KIND_TOMBSTONE, fmt.KIND_PAD)


def test_the_index_costs_bytes_per_session_not_objects():
    """One-record sessions, as the benchmark's: the tables grow by a quarter, the hash doubles
    at 3/4 full, so a session costs its entry and its record (76 + 32 bytes), a quarter of that
    again at most, and the hash's 4 bytes per slot."""
    entry = ffi.sizeof("struct six_session") + ffi.sizeof("struct six_rec")
    ix = Index()
    for i in range(20000):
        rid = ix.append(i, i + 1, 1, KIND_DELTA)
        key = i.to_bytes(32, "little")
        ix.apply(rid, header(KIND_DELTA, key, (0, 1), 3000, seq=i + 1))
    assert ix.sessions == 20000
    assert entry == 76 + 32 and ix.nbytes / 20000 <= entry * 1.25 + 4 / 0.375


def test_inspect_reads_each_record_s_header_from_the_device(tmp_path):
    """entries() gives what the headers say (the index keeps little of it), dead and live."""
    path = str(tmp_path / "s.img")
    create_image(path, 1 << 20)
    format_device(path)
    key = bytes(range(32))
    with LogStore(path) as s:
        s.put(key, Delta(b"a" * 100, tokens=(0, 7), layers=(1, 3), codec="zstd"))
        s.put(key, Delta(b"b" * (4096 - HEADER_SIZE + 1), tokens=(7, 9), layers=(0, 2), codec="zstd"))
        s.delete(key)
        first, second, tomb = s.entries()
        assert (first.kind, first.key, first.tokens, first.layers, first.codec, first.raw_len, first.live) == \
               (KIND_DELTA, key, (0, 7), (1, 3), "zstd", 100, False)
        assert (second.parent, second.seq, second.nblocks, second.tokens) == (first.seq, first.seq + 1, 2, (7, 9))
        assert tomb.lpos == second.lpos + 2 and len(s.entries(1)) == 1


def test_inspect_reads_around_a_bad_sector(tmp_path, monkeypatch):
    """A window read that fails (EIO) is retried for each record's own block: the others read
    whole, the one on the bad sector as unknown. Before, the window kept the failed read's place
    and the next record was read from no view at all (TypeError: inspect crashed)."""
    import errno
    path = str(tmp_path / "s.img")
    create_image(path, 1 << 20)
    format_device(path)
    keys = [bytes([k]) * 32 for k in range(1, 4)]
    with LogStore(path) as s:
        for k in keys:
            s.put(k, Delta(b"x" * 100, tokens=(0, 1), codec="raw"))
        bad = s.log_start + s.entries()[1].lpos % s.log_blocks
        real = s.dev.read_into

        def read_into(buf, block, nblocks):
            if block <= bad < block + nblocks:
                raise OSError(errno.EIO, "bad sector")
            return real(buf, block, nblocks)
        monkeypatch.setattr(s.dev, "read_into", read_into)
        got = s.entries()
        assert [e.key for e in got] == [keys[0], bytes(32), keys[2]] and got[1].codec == "?"


def test_a_copy_whose_header_does_not_fit_its_record_is_refused():
    """six_stage_copy lays out what the record's header says; a header (CRC whole) whose blocks
    are not those read, or whose payload runs past them, is refused with nothing staged."""
    from snapshotstore.device import aligned_buffer
    from snapshotstore.index import STAGE_REFUSED
    ix, t = Index(), Index.new_tail()
    t.log_blocks, t.block_size = 64, 4096
    keep = Index.tail_buffer(t, aligned_buffer(1 << 16))
    record = bytearray(4096)

    def with_sizes(stored_len, nblocks):
        fmt.pack_record_into(record, 0, RecordHeader(KIND_DELTA, 0, 0, 0, 0, 5, 0, b"k" * 32, 0, 1, 0, 1, nblocks,
                                                     stored_len, stored_len, "f16", 0), b"")
        return bytes(record)

    assert ix.stage_copy(t, with_sizes(100, 1)) == 0 and (t.tail, t.woff) == (1, 4096)
    for stored_len, nblocks in ((4096, 1), (100, 2), (10, 0)):        # past its blocks; not the blocks read
        assert ix.stage_copy(t, with_sizes(stored_len, nblocks)) == STAGE_REFUSED
    assert (t.tail, t.woff, len(ix)) == (1, 4096, 1)
    del keep
