#!/bin/bash
# The decode GEMV of block weights for one token alone (scripts/bench_block_gemv.cu): the 9B's
# shapes in Q4_K and its LM head in Q6_K, the 16-bit inputs against the int8 inputs of
# precision=fast (the engine's kernel and variants of it), against the GPU's copy bandwidth.
# Run from the repository root on a machine with an NVIDIA GPU and nvcc:
#   bash scripts/bench-block-gemv.sh
# With NCU=1, Nsight Compute then profiles one launch of a kernel (NCU_KERNEL, a regex;
# default the 16-bit Q4_K GEMV): its stall reasons, occupancy and waves.
set -eu
export PATH=$PATH:/usr/local/cuda/bin
K=crates/tandem-core/src/backend/cuda/kernels
T=$(mktemp -d)
cp $K/common.cuh $K/norm.cu $K/blocks.cu $K/gemv.cu scripts/bench_block_gemv.cu $T/
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
nvcc -O3 -arch=sm_$arch -std=c++17 -o $T/bench $T/bench_block_gemv.cu
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
$T/bench
if [ -n "${NCU:-}" ]; then ncu --kernel-name regex:${NCU_KERNEL:-gemv_q4_k_t1_plain} --launch-skip 40 --launch-count 1 --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section SpeedOfLight $T/bench 2>&1 | grep -v "^==PROF==" | tail -80; fi
