"""Prefill pacing (jbatch/engine/prefill_pacer.py): a long prompt's chunks take at most their
share of the decoders' time, shrink as the context grows, always progress; on a real model the
outputs are unchanged and nothing compiles."""

from __future__ import annotations

import numpy as np
import pytest

from jbatch import LLM, EngineConfig, SamplingParams
from jbatch.engine.prefill_pacer import PrefillPacer
from jbatch.tiny_model import write_random_llama
from tests.compile_counter import count_compiles


def _simulate(share: float, per_pair: float, prompt: int, budget: int = 248, base: float = 1.0):
    """A device where an ordinary step takes ``base`` and a chunk adds ``per_pair`` per
    query-key pair (+-20% noise), 8 requests decoding throughout. The first ``budget`` tokens
    go at once (measured and owed), as the scheduler does."""
    rng = np.random.default_rng(0)
    pacer = PrefillPacer(share, min_tokens=16)
    for _ in range(5):  # ordinary steps before the long prompt arrives
        pacer.observe(base * rng.uniform(0.9, 1.1), 0, decodes=8)
    start, own, extra, hiccup, sizes = 0, 0.0, 0.0, 0.0, []
    while start < prompt:
        first = start < budget
        if pacer.blocked and not first:
            took, pairs = base * rng.uniform(0.9, 1.1), 0
        else:
            cap = budget - start if first else pacer.chunk_tokens(start)
            n = min(cap or budget, budget, prompt - start)
            pairs = PrefillPacer.pairs(start, n)
            pacer.scheduled()
            took = base + per_pair * pairs * rng.uniform(0.8, 1.2)
            sizes.append((start, n))
            start += n
        pacer.observe(took, pairs, decodes=8)
        own += base
        extra += max(0.0, took - base)
        hiccup = max(hiccup, took - base)
    return own, extra, hiccup, sizes


@pytest.mark.parametrize("share", [0.5, 0.8, 2.0])
@pytest.mark.parametrize("per_pair", [1e-6, 1e-4])
def test_paced_chunks_take_their_share_of_the_decoders_time(share, per_pair):
    own, extra, hiccup, sizes = _simulate(share, per_pair, prompt=16_384)
    assert extra <= share * own * 1.1 + hiccup, (extra, share * own)
    assert all(n >= 16 for _, n in sizes[:-1])  # every paced chunk progresses a block at least
    # the chunk shrinks as the context grows
    firsts = [n for s, n in sizes[1:] if s < 4096]
    lasts = [n for s, n in sizes if s > 12_000]
    assert np.median(lasts) <= np.median(firsts)


def test_without_pacing_the_same_device_gives_the_decoders_far_less():
    """What the pacer prevents (so the bound above can fail): full chunks every step."""
    budget, start, own, extra = 248, 248, 0.0, 0.0
    while start < 16_384:
        extra += 1e-4 * PrefillPacer.pairs(start, budget)
        own += 1.0
        start += budget
    assert extra > 10 * own


def test_the_pacer_only_paces_while_others_decode():
    pacer = PrefillPacer(0.5, min_tokens=16)
    pacer.observe(1.0, 0, decodes=4)
    pacer.scheduled()
    assert pacer.blocked  # one paced step at a time: its cost is not known yet
    pacer.observe(50.0, 10_000, decodes=4)  # a paced step 49 ahead
    assert pacer.blocked and pacer.chunk_tokens(8000) >= 16
    pacer.observe(1.0, 0, decodes=0)  # nobody decodes: the debt is forgiven
    assert not pacer.blocked


@pytest.mark.parametrize("bad", [0, -1.0, "0.5", True, float("nan")])
def test_prefill_pacing_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="prefill_pacing"):
        EngineConfig(prefill_pacing=bad)


def test_paced_long_prompt_beside_decodes_on_a_real_model(tmp_path):
    """A 1 200-token prompt arrives while 3 requests decode: with pacing its prefill takes at
    least as many steps, the pacer measured paced steps, every output is the unpaced one and
    nothing compiles after warm-up."""
    model = write_random_llama(
        tmp_path / "m", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=2048, tokenizer=False,
    )  # fmt: skip
    llm = LLM(model, max_slots=4, max_num_batched_tokens=64, num_pages=160, max_seq_len=1536)
    engine, rng = llm.engine, np.random.default_rng(0)
    long_prompt = rng.integers(3, 512, 1200).tolist()
    shorts = [rng.integers(3, 512, 8).tolist() for _ in range(3)]
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def run() -> tuple[dict, int]:
        ids = [engine.add_request(p, greedy(160)) for p in shorts]
        for _ in range(3):
            engine.step()
        ids.append(engine.add_request(long_prompt, greedy(4)))
        outs, steps_to_first = {i: [] for i in ids}, None
        step = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id] += out.outputs[0].token_ids
                if out.request_id == ids[-1] and steps_to_first is None:
                    steps_to_first = step
            step += 1
        engine.forget_finished()
        return {k: outs[i] for k, i in enumerate(ids)}, steps_to_first

    plain, plain_steps = run()
    engine.set_policies(prefill_pacing=0.5)
    with count_compiles() as compiled:
        paced, paced_steps = run()
    assert compiled == []
    assert paced == plain
    assert paced_steps >= plain_steps
    pacer = engine.scheduler.pacer
    assert pacer.base is not None and pacer.per_pair is not None  # it measured paced steps


def test_a_long_prefill_starts_with_one_budget_measured_and_owed():
    """Beside decodes, only the prompt's first budget's worth goes at once: the first chunk
    (the budget less the decodes), then the few tokens left of that budget — not a second
    whole chunk; both are measured (the first ``per_pair``) and owed. Outputs are exact."""
    from tests.test_scheduler_policies import expected, mock_engine, params

    engine = mock_engine(
        max_slots=4, max_num_batched_tokens=64, num_pages=200, page_size=8, max_seq_len=1024,
        prefill_pacing=0.3, debug_checks=True,
    )  # fmt: skip
    rng = np.random.default_rng(1)
    shorts = [rng.integers(3, 97, 6).tolist() for _ in range(3)]
    long_prompt = rng.integers(3, 97, 700).tolist()
    ids = [engine.add_request(p, params(120)) for p in shorts]
    outs = {i: [] for i in ids}

    def step(outputs=None):
        for out in engine.step() if outputs is None else outputs:
            outs[out.request_id] += out.outputs[0].token_ids

    for _ in range(4):
        step()  # the three decode from here on
    pacer = engine.scheduler.pacer
    long_id = engine.add_request(long_prompt, params(3))
    outs[long_id], chunks, schedule = [], [], engine.scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        chunks.extend((engine.scheduler.num_steps, len(c.token_ids), out.paced_pairs > 0)
                      for c in out.chunks if c.seq.request_id == long_id)  # fmt: skip
        return out

    engine.scheduler.schedule = recording
    step()
    assert pacer.blocked  # the admission's first chunk is in flight, its cost unknown
    step()
    assert [c[1:] for c in chunks] == [(61, True), (3, True)], chunks  # at once, both owed
    assert chunks[1][0] == chunks[0][0] + 1
    step(engine.drain())
    assert pacer.per_pair is not None and pacer.in_flight == 0  # both measured
    while engine.has_unfinished_requests():
        step()
    assert sum(c[1] for c in chunks) == len(long_prompt)
    for i, prompt in zip([*ids, long_id], [*shorts, long_prompt]):
        assert outs[i] == expected(prompt, params(120 if i != long_id else 3))
