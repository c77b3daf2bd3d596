"""cffi builder for datapath._ingress: the ingress consumers, the load generator, the ping-pong reference.

The cdef is the LAYOUT sections of bpf/wire.h, native/chunk.h and bpf/steer.h and
the CDEF section of native/ingress.h, taken verbatim, so Python sees the C
structs and the drop-reason names as the compiler lays them out. Links libbpf
(bpf_obj_get_info_by_fd: a ring buffer's size); compiles native/ring.c for the output ring.
"""
import pathlib
import subprocess

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
BPF_DIR = HERE.parent / "bpf"


def layout_cdef(path: pathlib.Path) -> str:
    return path.read_text().split("/* LAYOUT BEGIN */", 1)[1].split("/* LAYOUT END */", 1)[0]


def api_cdef(path: pathlib.Path) -> str:
    return path.read_text().split("/* CDEF BEGIN", 1)[1].split("*/", 1)[1].split("/* CDEF END */", 1)[0]


def libbpf_flags() -> tuple[list[str], list[str]]:
    try:
        out = subprocess.run(["pkg-config", "--cflags", "--libs", "libbpf"], capture_output=True,
                             text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = ["-lbpf"]
    return [f for f in out if not f.startswith("-l")], [f[2:] for f in out if f.startswith("-l")]


cflags, libs = libbpf_flags()
ffibuilder = FFI()
ffibuilder.cdef(
    "typedef uint8_t __u8; typedef uint16_t __u16; typedef uint32_t __u32; typedef uint64_t __u64;"
    "typedef unsigned long pthread_t; struct dp_ring;"
    + layout_cdef(BPF_DIR / "wire.h") + layout_cdef(HERE / "chunk.h") + layout_cdef(BPF_DIR / "steer.h")
    + api_cdef(HERE / "ingress.h")
)
ffibuilder.set_source(
    "datapath._ingress",
    '#include "chunk.h"\n#include "steer.h"\n#include "ingress.h"',
    sources=["native/ingress.c", "native/loadgen.c", "native/ring.c"],   # relative: setuptools refuses absolute paths
    include_dirs=[str(HERE), str(BPF_DIR)],
    extra_compile_args=["-O2", "-std=gnu11", *cflags],
    libraries=[*libs, "m", "pthread", "rt"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
