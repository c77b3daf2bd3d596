"""cffi builder for datapath._chunk_layout: struct dp_chunk as the C compiler lays it out.

The cdef is the text between the LAYOUT markers of bpf/wire.h (for
DP_MAX_CHUNK_TOKENS) and native/chunk.h, taken verbatim, so the record has one
definition; tests/test_chunk_layout.py compares it with datapath/chunk.py.
"""
import pathlib

from cffi import FFI

ROOT = pathlib.Path(__file__).resolve().parent.parent


def layout_cdef(path: pathlib.Path) -> str:
    return path.read_text().split("/* LAYOUT BEGIN */", 1)[1].split("/* LAYOUT END */", 1)[0]


ffibuilder = FFI()
ffibuilder.cdef(
    "typedef uint8_t __u8; typedef uint16_t __u16; typedef uint32_t __u32; typedef uint64_t __u64;"
    + layout_cdef(ROOT / "bpf" / "wire.h") + layout_cdef(ROOT / "native" / "chunk.h")
)
ffibuilder.set_source(
    "datapath._chunk_layout",
    '#include "chunk.h"',
    include_dirs=[str(ROOT / "bpf"), str(ROOT / "native")],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
