#!/bin/sh
# Print an LD_LIBRARY_PATH that holds the CUDA libraries tandem loads at run time (libnvrtc,
# libcublas), wherever they are: a CUDA toolkit under /usr/local or /opt, or the nvidia-* wheels
# that PyTorch installs (not the toolkit's link-time stubs, whose libcuda.so is no driver). Use: export LD_LIBRARY_PATH="$(scripts/cuda-libs.sh)"
dirs="/usr/local /usr/lib /usr/lib64 /opt"
if command -v python3 >/dev/null 2>&1; then
  dirs="$dirs $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)"
fi
found=$(find $dirs \( -name 'libnvrtc.so*' -o -name 'libcublas.so*' \) 2>/dev/null | grep -v /stubs/ | xargs -r -n1 dirname | sort -u | tr '\n' ':')
printf '%s%s\n' "$found" "$LD_LIBRARY_PATH"
