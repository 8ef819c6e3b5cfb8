#!/usr/bin/env bash
# Does the GPU kernel still lower on a newer jax? Builds a Python 3.12 venv (pyenv) with the newest
# jax pip offers (CPU wheels), then runs the kernel's cross-lowering tests there:
#   tests/test_ragged_paged_attention.py -k lowers_for_cuda_without (Pallas -> Triton
#   for cuda, from a CPU host) and tests/test_tpu_attention.py -k "lowers or layout or auto_picks" (JAX's TPU kernel).
# --noconftest: no torch / transformers in the venv (the HF-checkpoint tests are left out).
# Last run 2026-12-06 with jax 0.11.2 (Python 3.12.1): 1 + 11 passed.
# Usage: ./scripts/check_newer_jax.sh [venv dir (default /tmp/jbatch-newer-jax)] [jax spec]
#   e.g. ./scripts/check_newer_jax.sh /tmp/jax011 'jax==0.11.2'  (the accelerator host's jax)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-/tmp/jbatch-newer-jax}"
spec="${2:-jax}"
py="$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python"
[ -x "$py" ] || py="$(command -v python3.12)"
[ -d "$venv" ] || "$py" -m venv "$venv"
# The project's own dependency list (pyproject.toml), so a new dependency is never missing here;
# then jbatch itself goes again: the venv imports the checkout through PYTHONPATH.
"$venv/bin/pip" install -q -U "$root" "$spec" pytest
"$venv/bin/pip" uninstall -q -y jbatch
"$venv/bin/python" -c "import jax, sys; print('python', sys.version.split()[0], 'jax', jax.__version__)"
cd "$root"
export PYTHONPATH="$root" JAX_PLATFORMS=cpu JBATCH_COMPILATION_CACHE=off
pytest=(timeout 600 "$venv/bin/python" -m pytest --noconftest -q -rs -p no:cacheprovider)
"${pytest[@]}" tests/test_ragged_paged_attention.py -k lowers_for_cuda_without
"${pytest[@]}" tests/test_tpu_attention.py -k "lowers or layout or auto_picks"
