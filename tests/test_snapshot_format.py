"""The on-device format: every offset pinned, checksums that catch a flipped bit."""
import pytest

from snapshotstore import format as fmt

SUPERBLOCK_OFFSETS = {
    "magic": 0, "version": 8, "block_size": 12, "store_id": 16, "capacity_blocks": 24, "log_start": 32,
    "log_blocks": 40, "head": 48, "tail": 56, "generation": 64, "last_seq": 72, "epoch": 80, "checksum": 88,
    "reserved": 92,
}
RECORD_OFFSETS = {
    "magic": 0, "kind": 4, "flags": 5, "reserved0": 6, "store_id": 8, "lpos": 16, "epoch": 24, "seq": 32,
    "parent_seq": 40, "key": 48, "token_start": 80, "token_end": 84, "layer_start": 88, "layer_end": 90,
    "nblocks": 92, "raw_len": 96, "stored_len": 100, "codec": 104, "crc": 120, "reserved1": 124,
}


def test_superblock_offsets_are_pinned():
    assert fmt.SUPERBLOCK.offsets == SUPERBLOCK_OFFSETS
    assert fmt.SUPERBLOCK.size == 96


def test_record_header_offsets_are_pinned():
    assert fmt.RECORD.offsets == RECORD_OFFSETS
    assert fmt.HEADER_SIZE == fmt.RECORD.size == 128


def test_constants():
    assert (fmt.SB_MAGIC, fmt.RECORD_MAGIC, fmt.VERSION, fmt.LOG_START) == (b"ZLSNAPSB", b"ZLR1", 2, 2)
    assert (fmt.KIND_DELTA, fmt.KIND_BASE, fmt.KIND_TOMBSTONE, fmt.KIND_PAD) == (1, 2, 3, 4)


def test_crc32c_is_castagnoli():
    assert fmt.crc32c(b"123456789") == 0xE3069283     # the check value of CRC-32C (RFC 3720)


def _sb():
    return fmt.Superblock(block_size=4096, store_id=0x1122334455667788, capacity_blocks=1000, log_start=2,
                          log_blocks=998, head=17, tail=40, generation=9, last_seq=123,
                          epoch=8)


def test_superblock_round_trip_and_bytes():
    raw = fmt.pack_superblock(_sb())
    assert len(raw) == fmt.SUPERBLOCK.size and raw[:8] == b"ZLSNAPSB"
    assert int.from_bytes(raw[48:56], "little") == 17                    # head, little-endian
    assert int.from_bytes(raw[88:92], "little") == fmt.crc32c(raw[:88])
    assert fmt.unpack_superblock(raw) == _sb()


@pytest.mark.parametrize("byte", [0, 12, 48, 81, 87, 89])
def test_superblock_with_a_flipped_bit_is_rejected(byte):
    raw = bytearray(fmt.pack_superblock(_sb()))
    raw[byte] ^= 0x10
    assert fmt.unpack_superblock(raw) is None


def _header(stored_len, block_size=4096):
    return fmt.RecordHeader(fmt.KIND_DELTA, 0, 7, 5, 2, 11, 10, bytes(range(32)), 128, 256, 0, 4,
                            fmt.record_blocks(stored_len, block_size), stored_len, stored_len, "f16", 0)


def test_record_round_trip_crc_covers_header_and_payload():
    payload = bytes(range(256)) * 4
    buf = bytearray(8192)
    fmt.pack_record_into(buf, 0, _header(len(payload)), payload)
    h = fmt.unpack_header(buf)
    assert h._replace(crc=0) == _header(len(payload))
    assert fmt.record_crc_ok(buf, 0, h)
    assert bytes(buf[fmt.HEADER_SIZE:fmt.HEADER_SIZE + len(payload)]) == payload
    for at in (3 + fmt.HEADER_SIZE, 40, 85):          # payload, seq, token_end
        bad = bytearray(buf)
        bad[at] ^= 1
        assert not fmt.record_crc_ok(bad, 0, fmt.unpack_header(bad))


@pytest.mark.parametrize("block_size", [512, 4096])
def test_a_delta_that_fits_one_block_is_one_block(block_size):
    fits = block_size - fmt.HEADER_SIZE
    assert fmt.record_blocks(fits, block_size) == 1
    assert fmt.record_blocks(fits + 1, block_size) == 2
    assert fmt.record_blocks(0, block_size) == 1


@pytest.mark.parametrize("parts", [[b""], [b"a"], [b"abc", b"", b"defgh" * 100]])
def test_base_payload_keeps_the_parts(parts):
    packed = fmt.pack_parts(parts)
    assert packed[:4] == len(parts).to_bytes(4, "little") and packed.endswith(b"".join(parts))
    assert fmt.unpack_parts(packed) == parts
