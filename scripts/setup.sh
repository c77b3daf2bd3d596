#!/usr/bin/env bash
# setup.sh - install what the data path needs, idempotently, then get out of the way.
#
#   Debian packages   bcc (python3-bpfcc), bpftool, libbpf, iproute2, build tools, libzmq3-dev, tshark
#                     (its NVMe/TCP dissector checks the snapshot target's framing)
#   kernel headers    the running kernel's; else Debian's linux-headers-<arch>,
#                     linked where bcc looks (/lib/modules/$(uname -r)/build)
#   .venv             Debian's python3 + a path file that makes bcc importable
#                     (bcc is not on PyPI), the package installed editable with
#                     its cffi extensions compiled
#
# A second run does no install work: packages are checked with dpkg-query and
# the package is reinstalled only when its build inputs changed (stamp file).
# USAGE: sudo scripts/setup.sh
set -euo pipefail

case "${1:-}" in
    -h|--help) sed -n '2,/^# USAGE/s/^# \{0,1\}//p' "$0"; exit 0 ;;
    "") ;;
    *) echo "setup: takes no arguments, not '$1' (scripts/setup.sh -h says what it does)" >&2; exit 2 ;;
esac

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV="$ROOT/.venv"
PKGS=(python3-bpfcc bpftool libbpf1 libbpf-dev iproute2 iputils-ping util-linux build-essential
      python3-dev python3-venv pkg-config libelf-dev zlib1g-dev libzmq3-dev tshark)

say() { echo "setup: $*"; }

if [ "$(id -u)" -ne 0 ]; then
    echo "setup: needs root to install packages and kernel headers: run it with sudo" >&2
    exit 1
fi

if ! command -v apt-get >/dev/null || ! command -v dpkg-query >/dev/null; then
    cat >&2 <<'MSG'
setup: this is not a Debian/Ubuntu host, so the automatic setup cannot run. Install instead:
  - bcc with its Python bindings (Fedora: bcc python3-bcc; Arch: bcc python-bcc)
  - bpftool, libbpf (>= 1.0, with headers), iproute2, gcc, make, Python 3.11+ with venv and headers
  - kernel headers for the running kernel (Fedora: kernel-devel; Arch: linux-headers)
then create .venv so that `import bcc` works in it and run: .venv/bin/pip install -e '.[test]'
MSG
    exit 1
fi

# --- Debian packages --------------------------------------------------------
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
apt_updated=0
apt_update_once() { if [ $apt_updated -eq 0 ]; then apt-get update -qq; apt_updated=1; fi; }
apt_install() {
    apt_update_once
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    apt_install "${missing[@]}"
fi

# --- kernel headers for bcc ---------------------------------------------------
KREL=$(uname -r)
BUILD="/lib/modules/$KREL/build"
if [ -e "$BUILD/include/linux" ] || [ -e "$BUILD/include/generated" ]; then
    :  # the running kernel's headers (or a fallback linked on an earlier run) are in place
elif apt_update_once && apt-cache show "linux-headers-$KREL" >/dev/null 2>&1; then
    say "installing linux-headers-$KREL (the running kernel's)"
    apt_install "linux-headers-$KREL"
else
    ARCH=$(dpkg --print-architecture)
    dpkg-query -W -f='${Status}' "linux-headers-$ARCH" 2>/dev/null | grep -q "install ok installed" \
        || apt_install "linux-headers-$ARCH"
    # the exact package the metapackage depends on (a glob could pick a -cloud- or -rt- flavour)
    PKG=$(dpkg-query -W -f='${Depends}' "linux-headers-$ARCH" | grep -o "linux-headers-[^ ,]*-$ARCH" | head -1)
    HDR=${PKG:+/usr/src/$PKG}
    [ -n "$HDR" ] && [ -d "$HDR" ] || HDR=""
    COMMON=${HDR%-"$ARCH"}-common
    if [ -z "$HDR" ] || [ ! -d "$COMMON" ]; then
        echo "setup: no kernel headers found under /usr/src after installing linux-headers-$ARCH" >&2
        exit 1
    fi
    mkdir -p "/lib/modules/$KREL"
    ln -sfn "$HDR" "$BUILD"
    ln -sfn "$COMMON" "/lib/modules/$KREL/source"
    say "no headers package for kernel $KREL: linked Debian's $(basename "$HDR") there (UAPI-only BPF programs compile)"
fi

# --- virtualenv ---------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    /usr/bin/python3 -m venv "$VENV"
fi
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Only bcc from Debian's dist-packages, not everything else there.
mkdir -p "$VENV/debian-bcc"
ln -sfn /usr/lib/python3/dist-packages/bcc "$VENV/debian-bcc/bcc"
echo "$VENV/debian-bcc" > "$SITE/debian-bcc.pth"

# --- the package and its cffi extensions -----------------------------------------
STAMP="$VENV/.installed"
# (path order byte by byte, whatever the locale: bench/contract.py, build_inputs, computes it again)
INPUTS=$(cd "$ROOT" && cat pyproject.toml setup.py $(find native bpf -type f \( -name '*.c' -o -name '*.h' -o -name '*.py' \) | LC_ALL=C sort) | sha256sum | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$INPUTS" ] || ! "$VENV/bin/python" -c 'import datapath._wire_layout' 2>/dev/null; then
    say "installing the package and building its cffi extensions"
    "$VENV/bin/pip" install -q --disable-pip-version-check "setuptools>=64" wheel "cffi>=1.15" 2>&1 | grep -v '^WARNING: Location' || true
    rm -f "$ROOT"/datapath/_*.so "$ROOT"/snapshotstore/_*.so     # a failed build must not leave the old extensions looking current
    set +e
    (cd "$ROOT" && "$VENV/bin/pip" install -q --disable-pip-version-check --no-build-isolation -e ".[test]") 2>&1 \
        | grep -v '^WARNING: Location'
    rc=${PIPESTATUS[0]}
    set -e
    [ "$rc" -eq 0 ] || { echo "setup: building the package failed (see pip's output above)" >&2; exit 1; }
    "$VENV/bin/python" -c 'import bcc; from datapath.doctor import EXTENSIONS; import importlib; [importlib.import_module(m) for m in EXTENSIONS]' \
        || { echo "setup: the install did not produce an importable package" >&2; exit 1; }
    echo "$INPUTS" > "$STAMP"
fi
