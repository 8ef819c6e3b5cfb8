#!/usr/bin/env bash
# GPU check for the ragged Pallas paged-attention kernel, one command (< 8 min on an H100/H200):
#   1. the kernel tests natively on the GPU (TestRaggedPagedAttention, not the interpret copy),
#   2. scripts/bench_kernels.py at Llama-3-8B shapes -> bench_kernels.json + a markdown table.
# Assumes jax with its CUDA plugin is installed. No torch needed: conftest.py (HF test oracle) is
# skipped (with the two tests that need its HF checkpoints), so only jaxtyping + pytest are
# installed if missing, not the whole ".[test]" extra.
# Usage: ./scripts/gpu_check.sh [output.json]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/bench_kernels.json}"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"

python -c "import jaxtyping, pytest" 2>/dev/null || pip install -q jaxtyping pytest
python - <<'PY'
import jax
assert jax.default_backend() == "gpu", f"no GPU visible to jax ({jax.devices()})"
print("jax", jax.__version__, jax.devices())
PY

echo "== kernel tests, native GPU =="
timeout 240 python -m pytest --noconftest -q -rs tests/test_ragged_paged_attention.py \
  -k "not Interpret and not engine and not model_step"

echo "== kernel benchmark =="
timeout 300 python scripts/bench_kernels.py --out "$out"
