"""``jbatch convert``: HF folder -> orbax checkpoint in the engine's layout, and loading it back.

Single device here; tp=2 and tp=4 (KV heads replicated) in a subprocess with 4 simulated devices
(``tests/convert_worker.py``), started first so it runs while the tests below do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jbatch import LLM
from jbatch.checkpoint import CheckpointError, load_params
from jbatch.cli import main
from jbatch.converted import META_FILE, convert, engine_config, is_converted, restore
from jbatch.engine.config import EngineConfig
from jbatch.models.config import ModelConfig
from jbatch.models.quant import WeightQuant
from tests.convert_worker import SMALL

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def worker(hf_checkpoint, tmp_path_factory):
    hf_dir = hf_checkpoint("llama_tp")[0]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
    cmd = [
        sys.executable,
        "-m",
        "tests.convert_worker",
        str(hf_dir),
        str(tmp_path_factory.mktemp("w")),
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    yield proc
    if proc.poll() is None:
        proc.kill()


def _tree_equal(a, b) -> list[str]:
    """Paths of the leaves whose dtype or values differ (the trees must have one structure)."""
    fa, fb = jax.tree_util.tree_flatten_with_path(a), jax.tree_util.tree_flatten_with_path(b)
    assert fa[1] == fb[1], "different trees"
    return [
        jax.tree_util.keystr(path)
        for (path, x), (_, y) in zip(fa[0], fb[0])
        if x.dtype != y.dtype or not np.array_equal(x, y)
    ]


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("llama", {}),
        ("qwen2", dict(dtype="bfloat16")),  # tied embeddings, qkv bias
        ("llama", dict(quantization="int8", quantize_lm_head=True)),
        ("qwen3_moe", {}),  # MoE param groups
    ],
)
def test_restore_equals_loading_the_hf_folder(hf_checkpoint, tmp_path, name, kwargs):
    hf_dir = hf_checkpoint(name)[0]
    out = convert(hf_dir, tmp_path / "conv", **kwargs)
    cfg = ModelConfig.from_file(hf_dir / "config.json")
    dtype = kwargs.get("dtype", "float32")  # the tiny checkpoints are stored in float32
    quant = WeightQuant("int8", True) if "quantization" in kwargs else None
    assert is_converted(out) and not is_converted(hf_dir)
    meta = json.loads((out / META_FILE).read_text())
    assert meta["dtype"] == dtype and meta["quantization"] == kwargs.get("quantization")
    for f in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (out / f).read_bytes() == (hf_dir / f).read_bytes()
    assert _tree_equal(restore(out, cfg, dtype), load_params(hf_dir, cfg, dtype, quant)) == []


def test_restore_casts_to_the_engine_dtype(hf_checkpoint, tmp_path):
    hf_dir = hf_checkpoint("llama")[0]
    cfg = ModelConfig.from_file(hf_dir / "config.json")
    out = convert(hf_dir, tmp_path / "bf16", dtype="bfloat16")
    params = restore(out, cfg, "float32")
    want = jax.tree.map(lambda a: a.astype("float32"), load_params(hf_dir, cfg, "bfloat16"))
    assert _tree_equal(params, want) == []


def test_cli_convert_then_llm_loads_it(hf_checkpoint, tmp_path, capfd):
    hf_dir = hf_checkpoint("llama")[0]
    out = tmp_path / "conv"
    assert main(["convert", str(hf_dir), str(out), "--quantization", "int8"]) == 0
    stdout, stderr = capfd.readouterr()
    assert stdout.strip() == str(out) and "[jbatch] converted" in stderr  # logs on stderr
    llm = LLM(out, **SMALL)  # quantization: the checkpoint's
    assert llm.config.quantization == "int8"
    want = LLM(hf_dir, quantization="int8", **SMALL).engine.params
    assert _tree_equal(llm.engine.params, want) == []
    assert llm.tokenizer.encode("héllo wörld") == LLM(hf_dir, **SMALL).tokenizer.encode(
        "héllo wörld"
    )


def test_errors(hf_checkpoint, tmp_path):
    hf_dir = hf_checkpoint("llama")[0]
    cfg = ModelConfig.from_file(hf_dir / "config.json")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("keep")
    with pytest.raises(ValueError, match="not a jbatch checkpoint"):
        convert(hf_dir, tmp_path / "busy")
    with pytest.raises(ValueError, match="Hugging Face folder itself"):
        convert(hf_dir, hf_dir)
    out = convert(hf_dir, tmp_path / "q", quantization="int8")
    assert engine_config(out, EngineConfig()).quantization == "int8"  # adopted
    with pytest.raises(ValueError, match="converted with quantization='int8'"):
        engine_config(out, EngineConfig(quantization="int8", quantize_lm_head=True))
    meta = json.loads((out / META_FILE).read_text())
    (out / META_FILE).write_text(json.dumps({**meta, "layout_version": 0}))
    with pytest.raises(ValueError, match="layout_version=0"):
        restore(out, cfg)
    (out / META_FILE).write_text(json.dumps(meta))
    other = ModelConfig.from_file(hf_checkpoint("qwen2")[0] / "config.json")
    with pytest.raises(CheckpointError, match="do not match"):
        restore(out, other)


def test_sharded_convert_and_restore(worker):
    out, err = worker.communicate(timeout=600)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert worker.returncode == 0 and lines, err[-4000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    for name in ("tp1_on_2", "tp4_on_4", "int8_on_2", "llm_tp2"):
        assert result[name] == [], f"{name}: params differ from load_params_sharded"
    assert "convert it again with --tp 2" in result["tp4_on_2"]
    assert "convert it again with --tp 4" in result["tp1_on_4"]
