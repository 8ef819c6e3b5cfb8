"""Random-weight benchmark checkpoints by shape, cached under /tmp (used by the bench scripts).

    from bench_shapes import SHAPES, checkpoint_for
    model_dir = checkpoint_for("smollm2-135m")   # /tmp/jbatch-bench-smollm2-135m

* ``toy``: the random 4-layer, 256-wide, vocab-32 000 Llama of ``jbatch.tiny_model`` (numpy
  only), rewritten on every call as the benchmarks always did.
* ``smollm2-135m``: SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536, 9 query / 3 KV heads
  of 64, vocab 49 152, tied embeddings, rope_theta 100 000) with random weights, written by
  transformers itself (``LlamaForCausalLM(config).save_pretrained``, float32) plus a byte-level
  BPE tokenizer. Written once into a temporary folder and renamed into place, then reused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

SHAPES = ("toy", "smollm2-135m")

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
)


def shape_dir(shape: str) -> Path:
    return Path(f"/tmp/jbatch-bench-{'llama' if shape == 'toy' else shape}")


def _write_hf_llama(directory: Path, overrides: dict, seed: int = 0) -> None:
    """``LlamaForCausalLM(config)`` with transformers' own random init, saved float32."""
    import torch
    import transformers

    from jbatch.tiny_model import write_tokenizer

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**overrides)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory)
    write_tokenizer(directory, overrides["vocab_size"])


def _is_complete(directory: Path, overrides: dict) -> bool:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    rope = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    same = rope == overrides["rope_theta"]
    same &= all(config.get(k) == v for k, v in overrides.items() if k != "rope_theta")
    return same and any(directory.glob("*.safetensors")) and (directory / "tokenizer.json").exists()


def checkpoint_for(shape: str) -> Path:
    """The checkpoint folder for ``shape`` (see the module docstring), written if missing."""
    if shape == "toy":
        from jbatch.tiny_model import write_random_llama

        return write_random_llama(shape_dir(shape), vocab_size=32000)
    if shape != "smollm2-135m":
        raise ValueError(f"unknown shape {shape!r}; choose from {SHAPES}")
    final = shape_dir(shape)
    if _is_complete(final, SMOLLM2_135M):
        return final
    print(f"writing a random {shape} checkpoint to {final} (once) ...", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    tmp.chmod(0o755)
    try:
        _write_hf_llama(tmp, SMOLLM2_135M)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
