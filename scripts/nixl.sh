#!/usr/bin/env bash
# Install what a tandem built with NIXL needs, into target/tools (nothing system-wide):
#   - the NIXL libraries (libnixl_capi.so, libnixl.so, the UCX plugin and UCX itself) from the
#     PyPI wheel nixl-cu12 or nixl-cu13 (the wheel's shared libraries only; no Python package is
#     installed, and any Python version works);
#   - libclang from the PyPI wheel `libclang`, which the nixl-sys crate's build needs (bindgen).
# Then print the environment to build and run with, for `eval`:
#
#     eval "$(scripts/nixl.sh)"
#     cargo build --release --features nixl
#
# TANDEM_NIXL_CUDA=12|13 picks the wheel (default: 13 where nvidia-smi reports a CUDA 13 driver,
# else 12; the CPU transports are the same in both). Needs python3 with pip, and g++ for the build.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tools="${CARGO_TARGET_DIR:-$root/target}/tools"
nixl_version=1.5.1
clang_version=18.1.1

cuda="${TANDEM_NIXL_CUDA:-}"
if [ -z "$cuda" ]; then
  cuda=12
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi 2>/dev/null | grep -q 'CUDA Version: 1[3-9]'; then
    cuda=13
  fi
fi
case "$cuda" in 12|13) ;; *) echo "TANDEM_NIXL_CUDA must be 12 or 13, not '$cuda'" >&2; exit 2 ;; esac

command -v python3 >/dev/null || { echo "scripts/nixl.sh: python3 (with pip) is needed to fetch the NIXL wheel" >&2; exit 1; }

# fetch NAME VERSION DIR: download the manylinux wheel of NAME==VERSION and unpack it into DIR.
fetch() {
  local name="$1" version="$2" dir="$3"
  [ -f "$dir/.complete" ] && return 0
  rm -rf "$dir" "$dir.download"
  mkdir -p "$dir.download"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --platform manylinux_2_28_x86_64 --platform manylinux2010_x86_64 \
    --dest "$dir.download" "$name==$version" >&2
  python3 - "$dir.download" "$dir" <<'EOF'
import pathlib, sys, zipfile
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for wheel in src.glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dst)
EOF
  rm -rf "$dir.download"
  touch "$dir/.complete"
}

nixl_dir="$tools/nixl-cu$cuda-$nixl_version"
clang_dir="$tools/libclang-$clang_version"
fetch "nixl-cu$cuda" "$nixl_version" "$nixl_dir"
fetch libclang "$clang_version" "$clang_dir"

lib="$nixl_dir/.nixl_cu$cuda.mesonpy.libs/libnixl_capi.so"
[ -f "$lib" ] || { echo "scripts/nixl.sh: the wheel holds no $lib" >&2; exit 1; }
clang_lib="$clang_dir/libclang-$clang_version.data/platlib/clang/native"
[ -f "$clang_lib/libclang.so" ] || { echo "scripts/nixl.sh: the wheel holds no $clang_lib/libclang.so" >&2; exit 1; }
# The libclang wheel has no compiler headers (stddef.h and the like); the C compiler's serve.
cc_include="$(gcc -print-file-name=include 2>/dev/null || true)"

echo "export TANDEM_NIXL_LIB='$lib'"
echo "export LIBCLANG_PATH='$clang_lib'"
if [ -n "$cc_include" ] && [ -d "$cc_include" ]; then
  echo "export BINDGEN_EXTRA_CLANG_ARGS='-I$cc_include'"
fi
