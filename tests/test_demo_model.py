"""The shipped demo model: transformers loads it, greedy output equals jbatch's, the CLI uses
it when --model is not given."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch

from jbatch import LLM, SamplingParams
from jbatch.demo import demo_model_path
from jbatch.models.lm_head import HEAD_T

try:
    DEMO = demo_model_path()
except FileNotFoundError as e:  # pragma: no cover - only before the model is trained
    pytest.skip(f"no demo model: {e}", allow_module_level=True)

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\nclass ", "The "]


def test_transformers_greedy_equals_jbatch():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    llm = LLM(DEMO, max_slots=4, max_num_batched_tokens=64, max_seq_len=256, num_pages=64)
    assert HEAD_T in llm.engine.params  # the CPU engine's LM head copy is what runs here
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            hf = model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=24,
                min_new_tokens=24,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        assert out.outputs[0].token_ids == hf


def test_cli_generate_uses_the_demo_model_and_caches_its_programs(tmp_path):
    """The README's demo command; run twice with a compilation cache, the second start loads
    every step program the first one compiled."""
    cache = tmp_path / "xla"

    def generate() -> subprocess.CompletedProcess:
        args = ["--max-tokens", "16", "--max-num-batched-tokens", "64", "--max-seq-len", "256"]
        return subprocess.run(
            [sys.executable, "-m", "jbatch.cli", "generate", *args, "def main():",
             "--compilation-cache", str(cache)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    t0 = time.time()
    first = generate()
    assert first.returncode == 0, first.stderr
    assert "def main():" in first.stdout and "16 tokens" in first.stdout
    assert time.time() - t0 < 120
    compiled = re.search(r"step programs: (\d+) compiled, 0 loaded; cache (\S+)\)", first.stderr)
    assert compiled and compiled[2] == str(cache), first.stderr
    second = generate()
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout  # greedy: the loaded programs give the same text
    assert f"step programs: 0 compiled, {compiled[1]} loaded; cache {cache})" in second.stderr
