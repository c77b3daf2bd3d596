"""cffi builder for snapshotstore._snapindex: the snapshot store's packed index. The cdef is
the CDEF section of native/snapindex.h, verbatim."""
import pathlib

from cffi import FFI

NATIVE = pathlib.Path(__file__).resolve().parent
HEADER = NATIVE / "snapindex.h"

ffibuilder = FFI()
ffibuilder.cdef(HEADER.read_text().split("/* CDEF BEGIN", 1)[1].split("*/", 1)[1].split("/* CDEF END */", 1)[0])
ffibuilder.set_source(
    "snapshotstore._snapindex",
    '#include "snapindex.h"\n',
    sources=["native/snapindex.c"],  # relative: setuptools refuses absolute paths
    include_dirs=[str(NATIVE)],
    extra_compile_args=["-O2", "-Wall", "-std=gnu11"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
