"""cffi builder for datapath._wire_layout: the wire structs as the C compiler lays them out.

The cdef is the text between the LAYOUT markers of bpf/wire.h, taken verbatim,
so the layout has one definition; tests compare it with datapath/wire.py.
"""
import pathlib

from cffi import FFI

BPF_DIR = pathlib.Path(__file__).resolve().parent.parent / "bpf"


def layout_cdef(header: str) -> str:
    text = (BPF_DIR / header).read_text()
    return text.split("/* LAYOUT BEGIN */", 1)[1].split("/* LAYOUT END */", 1)[0]


ffibuilder = FFI()
ffibuilder.cdef(
    "typedef uint8_t __u8; typedef uint16_t __u16; typedef uint32_t __u32; typedef uint64_t __u64;"
    + layout_cdef("wire.h")
    # the count slots, which by_status reads in wire.STATUSES' order (tests compare the two)
    + "int dp_status_slot(__u16 status); int dp_status_known(__u16 status);"
)
ffibuilder.set_source(
    "datapath._wire_layout",
    '#include "wire.h"',
    include_dirs=[str(BPF_DIR)],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
