"""Speculative decoding with a draft model, end to end (``LLM(..., speculative_model=DIR)``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jbatch import LLM, SamplingParams
from jbatch.engine.config import EngineConfig
from tests.compile_counter import count_compiles
from tests.test_engine import assert_drained, assert_teacher_forced

ENGINE = dict(
    max_slots=2, page_size=8, num_pages=12, max_num_batched_tokens=8, max_seq_len=80,
    block_q=8, dtype="float32", attn_impl="xla", num_speculative_tokens=3,
    speculative_max_batch=2, preemption_mode="swap", debug_checks=True,
)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def self_draft(hf_checkpoint):
    """The target as its own draft: every greedy proposal must be accepted (up to float
    noise) as long as the draft pool holds the same tokens as the target's — swaps and
    prefix-cache hits included."""
    path, model = hf_checkpoint("llama")
    return LLM(path, speculative_model=str(path), **ENGINE), model


def test_greedy_output_is_the_targets_and_the_draft_pool_stays_in_sync(self_draft):
    llm, model = self_draft
    rng = np.random.RandomState(1)
    prompts = [rng.randint(3, 384, int(n)).tolist() for n in (5, 19, 11, 30)]
    prompts[3][:17] = prompts[1][:17]  # two full pages from the prefix cache
    opt_out = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, speculative=False)
    params = [GREEDY, GREEDY, opt_out, GREEDY]
    before = llm.engine.stats()
    with count_compiles() as compiled:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert compiled == [], f"compiled after warm-up: {compiled}"
    for prompt, out in zip(prompts, outs):
        assert len(out.outputs[0].token_ids) == 40
        assert_teacher_forced(model, prompt, out.outputs[0].token_ids)
    stats = llm.engine.stats()
    assert stats.swap_outs > before.swap_outs, "the pool was meant to force swaps"
    assert llm.engine.scheduler.allocator.hits > 0, "prefix pages were meant to be reused"
    proposed = stats.spec_proposed_tokens - before.spec_proposed_tokens
    accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
    assert proposed > 50 and accepted >= 0.95 * proposed, (accepted, proposed)
    assert_drained(llm)


def test_seeded_sampling_with_a_draft_is_deterministic(self_draft):
    llm, _ = self_draft
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
    prompt = list(range(3, 15))
    before = llm.engine.stats().spec_accepted_tokens
    with count_compiles() as compiled:
        a, b = (llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids for _ in "ab")
    assert compiled == []
    assert a == b and len(a) == 24
    assert llm.engine.stats().spec_accepted_tokens > before  # rejection sampling accepted some


def test_speculative_model_needs_the_draft_method(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    with pytest.raises(ValueError, match="speculative_model"):
        LLM(path, speculative="ngram", speculative_model=str(path), warmup=False)
    with pytest.raises(ValueError, match="role='decode'"):
        EngineConfig(speculative_model=str(path), role="decode")


def test_demo_model_with_its_trained_draft():
    """The shipped pair: greedy output is the demo model's own (HF transformers'), and the
    distilled draft gets a good share of its proposals accepted."""
    from transformers import AutoModelForCausalLM

    from jbatch.demo import demo_draft_path, demo_model_path

    model = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    llm = LLM(
        demo_model_path(), speculative_model=str(demo_draft_path()), max_slots=1, page_size=16,
        num_pages=16, max_num_batched_tokens=16, max_seq_len=128, block_q=16, dtype="float32",
        speculative_max_batch=1,
    )  # fmt: skip
    prompts = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\nclass "]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
    for out in outs:
        assert_teacher_forced(model, out.prompt_token_ids, out.outputs[0].token_ids)
    stats = llm.engine.stats()
    assert stats.spec_proposed_tokens > 0 and stats.spec_acceptance_rate > 0.3, stats
