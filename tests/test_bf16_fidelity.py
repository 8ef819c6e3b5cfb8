"""bfloat16 end to end against HF transformers in bfloat16 (the accelerators' default dtype).

Tolerance (documented in docs/architecture.md, "Default dtype"): bf16 keeps 8 bits of mantissa,
so two correct bf16 implementations that sum in different orders disagree by about as much as
bf16 itself moves HF's own logits away from float32. Per position, with ``noise`` = the largest
|HF bf16 - HF fp32| logit difference in that row:
- teacher forcing: jbatch's greedy token is within ``2 * noise`` of HF bf16's best logit;
- its logprob (jbatch reports the raw model's, computed in float32 from bf16 logits) is within
  ``4 * noise`` of HF bf16's log-softmax at that token.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from jbatch import LLM, SamplingParams

ENGINE = dict(max_slots=4, page_size=8, num_pages=64, max_num_batched_tokens=32, max_seq_len=128,
              block_q=16, dtype="bfloat16")  # fmt: skip


def _logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("variant", ["llama", "qwen3", "gemma2"])
def test_bf16_greedy_matches_hf_bf16(variant, hf_checkpoint):
    path, model = hf_checkpoint(variant)
    hf16 = copy.deepcopy(model).to(torch.bfloat16)
    llm = LLM(path, **ENGINE)
    vocab = llm.engine.model_cfg.vocab_size
    rng = np.random.RandomState(3)
    prompts = [rng.randint(3, vocab, size=int(n)).tolist() for n in (1, 5, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ids = out.outputs[0].token_ids
        rows = slice(len(prompt) - 1, len(prompt) - 1 + len(ids))
        got16, got32 = _logits(hf16, prompt + ids)[rows], _logits(model, prompt + ids)[rows]
        noise = np.abs(got16 - got32).max(-1)  # [T] bf16's own effect on HF's logits
        assert noise.max() > 0, "HF did not run in bf16"
        gap = got16.max(-1) - got16[np.arange(len(ids)), ids]
        assert np.all(gap <= 2 * noise), (variant, gap, noise)
        lp = _log_softmax(got16)[np.arange(len(ids)), ids]
        err = np.abs(np.asarray(out.outputs[0].logprobs) - lp)
        assert np.all(err <= 4 * noise), (variant, err, noise)
