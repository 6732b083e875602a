#!/bin/bash
# The batched DeltaNet decode step (deltanet_step_batch_128) alone, at the 0.8B's shapes, built
# with nvcc at several launch bounds (the least blocks per SM the compiler must fit: 2, 3, 4),
# for 64 and 256 sequences, against a device-to-device copy of the same states. Run from the
# repository root on a machine with an NVIDIA GPU and nvcc:  bash scripts/bench-deltanet-step.sh
set -eu
export PATH=$PATH:/usr/local/cuda/bin
K=crates/tandem-core/src/backend/cuda/kernels
T=$(mktemp -d)
cp $K/common.cuh $K/norm.cu $K/gemv.cu $K/gemm.cu scripts/bench_deltanet_step.cu $T/
for lb in 2 3 4; do
  sed -E 's/__launch_bounds__\(512(, [0-9]+)?\) NAME\(float\* const\* convs/__launch_bounds__(512, LB) NAME(float* const* convs/' $K/deltanet.cu > $T/deltanet_v.cu
  grep -q "__launch_bounds__(512, LB)" $T/deltanet_v.cu || { echo "the batched step's launch bounds were not found in deltanet.cu"; exit 1; }
  nvcc -O3 -arch=sm_90 -std=c++17 -DLB=$lb -o $T/b$lb $T/bench_deltanet_step.cu
done
for rep in 1 2; do for lb in 2 3 4; do for B in 64 256; do $T/b$lb $B; done; done; done
