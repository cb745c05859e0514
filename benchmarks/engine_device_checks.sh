#!/usr/bin/env bash
# The engine's accelerator checks in one run (a lent GPU's time is short), each stage under its own time limit so
# one that hangs leaves the others their turn; every stage writes into OUT_DIR as it goes:
#   info.txt                 Python, JAX, Flax, devices, nvidia-smi
#   tests.txt                the attention seam at kernel-sized shapes and the whole model against the float64
#                            reference, compiled for the device (pallas and xla), float32 products at full precision
#   engine_device_pallas.*   benchmarks/engine_device.py with the Pallas kernels (the kernel path)
#   engine_device_xla.*      the same with the portable xla attention, for the A/B
#   weight_copies_*.*        with WEIGHT_COPY_AB=1: decode only (pallas), the scanned loop as it is, with XLA's
#                            dynamic-slice fusion, and unrolled: the A/B for the weight copies an H200 showed
#                            (docs/benchmarks/engine.md, twenty-third session)
# Usage: bash benchmarks/engine_device_checks.sh OUT_DIR [engine_device.py arguments...]
set -u
out=${1:?usage: engine_device_checks.sh OUT_DIR [engine_device.py arguments...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_FLAGS="" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import sys, jax, flax; print(sys.version); print("jax", jax.__version__, "flax", flax.__version__, jax.devices())' \
  2>&1 | tee "$out/info.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee -a "$out/info.txt"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${TESTS_S:-120}" python3 -m pytest -q -o addopts="-p no:cacheprovider" \
  tests/test_attention.py tests/test_engine.py \
  -k "${TESTS_K:-kernel_sized or reference_greedy or matches_reference or equals_unchunked}" 2>&1 | tee "$out/tests.txt"
for impl in pallas xla; do
  timeout "${BENCH_S:-180}" python3 benchmarks/engine_device.py --attention "$impl" --json "$out/engine_device_$impl.json" \
    "$@" 2>&1 | tr '\r' '\n' | grep -v '%|' | tee "$out/engine_device_$impl.txt"
done
if [ "${WEIGHT_COPY_AB:-0}" = 1 ]; then
  for variant in scanned dsfusion unrolled; do
    flags=""; scan=on
    [ $variant = dsfusion ] && flags="--xla_gpu_enable_dynamic_slice_fusion=true"
    [ $variant = unrolled ] && scan=off
    XLA_FLAGS="$flags" timeout "${BENCH_S:-180}" python3 benchmarks/engine_device.py --attention pallas --prefill "" \
      --scan-layers $scan --json "$out/weight_copies_$variant.json" "$@" 2>&1 | tr '\r' '\n' | grep -v '%|' \
      | tee "$out/weight_copies_$variant.txt"
  done
fi
