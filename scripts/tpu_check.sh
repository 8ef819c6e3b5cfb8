#!/usr/bin/env bash
# TPU check for attn_impl="tpu" (JAX's ragged paged attention kernel), one command on a TPU VM
# (never run: no TPU was lent to this project so far):
#   1. tests/test_tpu_attention.py natively: the adapter through the real kernel (the "native"
#      cases, skipped off TPU) and through JAX's reference, and the lowering tests;
#   2. the engine end to end: greedy tokens of the demo model with attn_impl="tpu" vs "xla";
#   3. scripts/bench_offline.py-style tok/s with attn_impl auto (tpu) vs xla.
# Assumes jax[tpu] is installed. Usage: ./scripts/tpu_check.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export JBATCH_COMPILATION_CACHE="${JBATCH_COMPILATION_CACHE:-off}"
python -c "import jaxtyping, pytest" 2>/dev/null || pip install -q jaxtyping pytest
python - <<'PY'
import jax
assert jax.default_backend() == "tpu", f"no TPU visible to jax ({jax.devices()})"
print("jax", jax.__version__, jax.devices())
PY

echo "== TPU attention tests, native =="
timeout 600 python -m pytest --noconftest -q -rs tests/test_tpu_attention.py

echo "== engine: greedy tokens, tpu vs xla =="
timeout 600 python - <<'PY'
import time
from jbatch import LLM, SamplingParams
from jbatch.demo import demo_model_path

prompts = ["The quick brown fox", "def fibonacci(n):", "Once upon a time"] * 8
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
tokens = {}
for impl in ("tpu", "xla"):
    llm = LLM(str(demo_model_path()), attn_impl=impl, dtype="float32")
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens[impl] = [o.outputs[0].token_ids for o in outs]
    print(f"{impl}: {sum(map(len, tokens[impl])) / dt:.0f} tok/s (f32, 24 prompts x 64)")
same = sum(a == b for a, b in zip(tokens["tpu"], tokens["xla"]))
print(f"greedy outputs identical: {same}/{len(prompts)}")
PY
