"""cffi builder for datapath._dataplane: the ring, the router, its policies and the C
benchmark loops. The cdef is read from the headers themselves (their LAYOUT and
CDEF sections, verbatim), so every record and prototype has one statement."""
import pathlib

from cffi import FFI

NATIVE = pathlib.Path(__file__).resolve().parent
BPF = NATIVE.parent / "bpf"
# every file in policies/ is built: a new policy is its file and its line in policies/registry.c
SOURCES = ["ring.c", "ring_bench.c", "router.c", "egress.c", "loop.c", "admission.c",
           *sorted(f"policies/{p.name}" for p in (NATIVE / "policies").glob("*.c"))]


def layout(path: pathlib.Path) -> str:
    """A header's LAYOUT section: the records."""
    return path.read_text().split("/* LAYOUT BEGIN */", 1)[1].split("/* LAYOUT END */", 1)[0]


def api(path: pathlib.Path) -> str:
    """A header's CDEF section: the types and prototypes Python may call."""
    text = path.read_text().split("/* CDEF BEGIN", 1)[1].split("/* CDEF END */", 1)[0]
    return text.split("*/", 1)[1]


CDEF = "typedef uint8_t __u8; typedef uint16_t __u16; typedef uint32_t __u32; typedef uint64_t __u64;\n"
CDEF += layout(BPF / "wire.h") + layout(NATIVE / "chunk.h")
CDEF += "".join(api(NATIVE / h) for h in ("ring.h", "policy.h", "admission.h", "router.h", "ring_bench.h", "egress.h", "loop.h"))

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "datapath._dataplane",
    '#include "ring.h"\n#include "ring_bench.h"\n#include "router.h"\n#include "egress.h"\n#include "loop.h"\n',
    sources=[f"native/{s}" for s in SOURCES],  # relative: setuptools refuses absolute paths
    include_dirs=[str(NATIVE), str(BPF)],
    extra_compile_args=["-O2", "-Wall", "-std=gnu11"],
    libraries=["rt", "pthread", "zmq", "m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
