#!/usr/bin/env bash
# Build fastformer._C with -fsanitize=address,undefined (FASTFORMER_SANITIZE=1) in a scratch copy
# of the repository and run the cpu-backend tests under it: odd shapes, strided inputs, masks,
# tails, fuzzing and the 64-bit index tests. Any report aborts the run (exit != 0).
# Usage: bash .ci/sanitize.sh   (with the test environment's python active)
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
# FASTFORMER_SANITIZE_DIR=path keeps the scratch copy (and its objects: rebuilds are incremental)
if [ -n "${FASTFORMER_SANITIZE_DIR:-}" ]; then
  work=$FASTFORMER_SANITIZE_DIR
  mkdir -p "$work"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
(cd "$src" && git ls-files -z | xargs -0 cp -p --parents -t "$work")
cd "$work"
ln -sfn ../triton_kernels fastformer/triton_kernels
ln -sfn ../benchmarks fastformer/benchmarks
start=$(date +%s)
# Only the levels this CPU runs (the others are the same source with wider vectors).
level=$(python -c "import torch; print(torch.backends.cpu.get_cpu_capability().replace('AVX512', 'AVX512').split('_')[0])")
FASTFORMER_SANITIZE=1 FASTFORMER_BUILD_CUDA=0 FASTFORMER_CPU_LEVELS="DEFAULT,$level" \
  python setup.py -q build_ext --inplace >build.log 2>&1 \
  || { tail -50 build.log; exit 1; }
echo "sanitized build: $(( $(date +%s) - start )) s"
asan=$(c++ -print-file-name=libasan.so)
ubsan=$(c++ -print-file-name=libubsan.so)
# Leaks: torch and CPython keep allocations alive at exit by design. ODR: torch's own libraries.
export ASAN_OPTIONS=detect_leaks=0:detect_odr_violation=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
# Backend: auto, which is cpu for every CPU call the kernels take (-k picks the cpu cases)
export FASTFORMER_REQUIRE_EXT=1
set +e
LD_PRELOAD="$asan $ubsan" PYTHONPATH="$work" python -m pytest -q -x -p no:cacheprovider -m "not slow" \
  tests/test_norm.py tests/test_attention.py tests/test_special_values.py tests/test_large.py \
  tests/test_determinism.py tests/test_fuzz.py tests/test_ffn.py tests/test_positional.py \
  tests/test_linear_rows.py tests/test_clamped_gate.py tests/test_relative_bias.py \
  -k "cpu or large or determinism or special or thread or offsets or in_major or each_level" > test.log 2>&1
status=$?
set -e
tail -15 test.log
echo "sanitized tests: $(( $(date +%s) - start )) s"
exit "$status"
