#!/usr/bin/env bash
# One short GPU run: the GPU tests, then the attention sweep, all into one results file.
#
#   bash benchmarks/gpu_check.sh [results file, default gpu_check_results.txt]
#
# Run from a checkout where `import fastformer` works (installed, or PYTHONPATH=<checkout>).
# 1. `pytest -m gpu tests` with TRITON_INTERPRET=0, so Triton compiles its kernels for the GPU
#    (the default test run interprets them on CPU); every backend's GPU tests run.
# 2. python -m fastformer.benchmarks.gpu_attention (autotunes on first use of each shape).
# On a machine without a CUDA GPU it says so and exits 0. Exit status: pytest's, else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check_results.txt}
PY=${PYTHON:-python}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU present (torch.cuda.is_available() is False); nothing to run."
    exit 0
fi

{
    echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    echo
    echo "## pytest -m gpu tests (TRITON_INTERPRET=0)"
} | tee "$OUT"

start=$(date +%s)
TRITON_INTERPRET=0 "$PY" -m pytest -m gpu tests -q -ra 2>&1 | tee -a "$OUT"
tests_rc=${PIPESTATUS[0]}
echo "# tests: exit $tests_rc in $(( $(date +%s) - start )) s" | tee -a "$OUT"

echo -e "\n## attention sweep" | tee -a "$OUT"
TRITON_INTERPRET=0 "$PY" -m fastformer.benchmarks.gpu_attention --out "$OUT"
echo "gpu_check: results in $OUT"
exit "$tests_rc"
