"""The continuous-batching engine end to end: fidelity vs HF, batch invariance, no recompiles,
no leaks, stop conditions, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jbatch import LLM, SamplingParams
from jbatch.engine import buckets
from tests.compile_counter import count_compiles

ENGINE = dict(
    max_slots=32,  # decode buckets 1..32: steps with few busy slots run compacted
    page_size=8,
    num_pages=40,
    max_num_batched_tokens=64,
    max_seq_len=256,
    block_q=16,
    debug_checks=True,  # page/slot invariants after every step
)
# Engines whose test is not about the decode buckets: 8 slots compile 8 step programs, not 12
# (most of such a test's time on CI); the small pool still forces preemption.
SMALL_ENGINE = {**ENGINE, "max_slots": 8}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def workload(vocab: int, n: int = 32, seed: int = 0):
    """Prompt lengths spanning 1..200 and varied max_tokens."""
    rng = np.random.RandomState(seed)
    lengths = np.linspace(1, 200, n).astype(int)
    rng.shuffle(lengths)
    prompts = [rng.randint(3, vocab, size=int(n_)).tolist() for n_ in lengths]
    params = [GREEDY.replace(max_tokens=int(rng.randint(1, 40))) for _ in range(n)]
    return prompts, params


def assert_teacher_forced(model, prompt, output_ids, tol=1e-3):
    """Every generated token is HF's argmax at its position, up to a near-tie of ``tol``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output_ids])).logits[0].numpy()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(output_ids)]
    gap = rows.max(-1) - rows[np.arange(len(output_ids)), output_ids]
    assert np.all(gap <= tol), f"token {int(np.argmax(gap))} is {gap.max():.4g} below HF's argmax"


def assert_drained(llm: LLM):
    sched = llm.engine.scheduler
    sched.check_invariants()
    assert sched.allocator.num_free == llm.config.num_pages, "pages leaked"
    assert len(sched.free_slots) == llm.config.max_slots, "slots leaked"
    assert not sched.running and not sched.waiting


def churn_with_random_aborts(engine, prompts, requests: int, max_tokens: int, seed: int = 11):
    """Add ``requests`` greedy requests (1 to ``max_tokens - 1`` tokens each, prompts cycled),
    stepping after about half of them and aborting a random earlier one after about 15%, then
    run everything out and forget it (page-leak tests: ``assert_drained`` after this)."""
    rng = np.random.RandomState(seed)
    live: list[str] = []
    for i in range(requests):
        p = SamplingParams(temperature=0.0, max_tokens=int(rng.randint(1, max_tokens)),
                           ignore_eos=True)  # fmt: skip
        live.append(engine.add_request(prompts[i % len(prompts)], p))
        if rng.rand() < 0.5:
            engine.step()
        if rng.rand() < 0.15:
            engine.abort_request(live[rng.randint(len(live))])
    while engine.has_unfinished_requests():
        engine.step()
    engine.forget_finished()


@pytest.fixture(scope="module")
def llama(hf_checkpoint):
    path, model = hf_checkpoint("llama")
    return LLM(path, **ENGINE), model


@pytest.mark.parametrize(
    "variant", ["llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "phi3"]
)
def test_greedy_fidelity_vs_hf_through_small_pool(variant, hf_checkpoint, llama):
    path, model = hf_checkpoint(variant)
    llm = llama[0] if variant == "llama" else LLM(path, **SMALL_ENGINE)
    prompts, params = workload(llm.engine.model_cfg.vocab_size)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outs):
        completion = out.outputs[0]
        assert len(completion.token_ids) == p.max_tokens
        assert completion.finish_reason == "length"
        assert_teacher_forced(model, prompt, completion.token_ids)
    assert_drained(llm)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool should have forced preemptions"


def test_every_decode_bucket_matches_hf(hf_checkpoint):
    """32 requests whose decodes end one step apart walk every decode-only bucket (32 rows down
    to 1) and the mixed ones; longer prompts queued behind them are admitted into the busy batch
    (the prefill buckets between the 4x rungs, 32 and 48 rows, with a full decode bucket).
    Each program's tokens are HF's argmax."""
    path, model = hf_checkpoint("llama")
    llm = LLM(path, **{**ENGINE, "num_pages": 400, "debug_checks": False})
    rng = np.random.RandomState(3)
    prompts = [rng.randint(3, 384, size=1 + i % 8).tolist() for i in range(32)]
    prompts += [rng.randint(3, 384, size=n).tolist() for n in (25, 40, 20, 30)]  # the last: alone
    params = [GREEDY.replace(max_tokens=8 + i) for i in range(32)]
    params += [GREEDY.replace(max_tokens=4)] * 4
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_teacher_forced(model, prompt, out.outputs[0].token_ids)
    ran = llm.engine.core.programs_run
    decode_only = {d for (rows, d), n in ran.items() if rows == 0 and n}
    assert decode_only == set(buckets.decode_buckets(llm.config, 0)), decode_only
    assert any(rows and n for (rows, _), n in ran.items())  # and steps with prompt rows
    assert ran[(32, 32)] and ran[(48, 32)], ran


def test_a_packed_prompt_region_matches_hf_without_compiles(hf_checkpoint):
    """A 128-token budget makes its top prefill bucket a packed region (128 dense rows in 160
    block rows, ``buckets.region_rows``). Four 25-token prompts (128 block rows, 100 tokens)
    arrive together: they prefill in one step of that program, compiled at warm-up, and every
    generated token is HF's argmax."""
    path, model = hf_checkpoint("llama")
    cfg = dict(max_slots=4, page_size=8, num_pages=64, max_num_batched_tokens=128,
               max_seq_len=96, block_q=16, debug_checks=True)  # fmt: skip
    llm = LLM(path, **cfg)
    region = buckets.prefill_buckets(llm.config)[-1]
    assert (region, buckets.dense_rows(llm.config, region)) == (160, 128)
    rng = np.random.RandomState(8)
    prompts = [rng.randint(3, 384, size=25).tolist() for _ in range(4)]
    with count_compiles() as compiled:
        outs = llm.generate(prompts, GREEDY.replace(max_tokens=6), use_tqdm=False)
    assert compiled == [], f"compiled after warm-up: {compiled}"
    assert llm.engine.core.programs_run[(region, 4)] == 1, llm.engine.core.programs_run
    for prompt, out in zip(prompts, outs):
        assert_teacher_forced(model, prompt, out.outputs[0].token_ids)
    assert_drained(llm)


def test_batch_invariance_greedy_and_seeded(llama):
    llm, _ = llama
    rng = np.random.RandomState(5)
    prompts = [rng.randint(3, 384, size=int(n)).tolist() for n in (3, 70, 17, 150, 1, 40)]
    params = [GREEDY.replace(max_tokens=12)] * 3 + [
        SamplingParams(
            temperature=0.9,
            top_p=0.9,
            top_k=50,
            seed=s,
            max_tokens=12,
            ignore_eos=True,
            repetition_penalty=1.2,
            frequency_penalty=0.5,
        )
        for s in (1, 2, 3)
    ]
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, together):
        alone = llm.generate([prompt], p, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
    assert_drained(llm)


def test_no_compiles_after_warmup(llama):
    llm, _ = llama
    rng = np.random.RandomState(9)
    prompts = [rng.randint(3, 384, size=int(n)).tolist() for n in rng.randint(1, 220, 12)]
    params = [
        SamplingParams(
            temperature=float(t),
            top_k=int(k),
            top_p=float(tp),
            min_p=float(mp),
            presence_penalty=0.3,
            seed=int(s),
            max_tokens=int(m),
            ignore_eos=True,
        )
        for t, k, tp, mp, s, m in zip(
            rng.uniform(0, 2, 12),
            rng.randint(0, 60, 12),
            rng.uniform(0.1, 1, 12),
            rng.uniform(0, 0.2, 12),
            rng.randint(0, 1000, 12),
            rng.randint(1, 30, 12),
        )
    ]
    with count_compiles() as compiled:
        llm.generate(prompts[:6], params[:6], use_tqdm=False)
        for prompt, p in zip(prompts[6:], params[6:]):  # staggered arrivals
            llm.engine.add_request(prompt, p)
            llm.engine.step()
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert compiled == [], f"compiled after warm-up: {compiled}"
    llm.engine.forget_finished()
    assert_drained(llm)


def test_stop_strings_tokens_and_eos(llama):
    llm, _ = llama
    prompt = "The quick brown fox"
    base = llm.generate(prompt, GREEDY.replace(max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 24
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = llm.generate(prompt, GREEDY.replace(max_tokens=24, stop=[stop]), use_tqdm=False)[0]
    c = cut.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == text[: text.index(stop)] and stop not in c.text
    keep = llm.generate(
        prompt,
        GREEDY.replace(max_tokens=24, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert keep.text == text[: text.index(stop) + len(stop)]
    tok = base.token_ids[5]
    st = llm.generate(prompt, GREEDY.replace(max_tokens=24, stop_token_ids=[tok]), use_tqdm=False)[
        0
    ].outputs[0]
    assert st.token_ids == base.token_ids[: base.token_ids.index(tok) + 1]
    assert (st.finish_reason, st.stop_reason) == ("stop", tok)
    # EOS: make the engine treat the 4th generated token as EOS unless ignore_eos is set.
    eos_engine = llm.engine
    old = eos_engine.eos_ids
    eos_engine.eos_ids = frozenset({base.token_ids[3]})
    try:
        e = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[
            0
        ].outputs[0]
        assert e.token_ids == base.token_ids[: base.token_ids.index(base.token_ids[3]) + 1]
        assert e.finish_reason == "stop"
        ig = llm.generate(prompt, GREEDY.replace(max_tokens=24), use_tqdm=False)[0].outputs[0]
        assert ig.token_ids == base.token_ids
    finally:
        eos_engine.eos_ids = old
    assert_drained(llm)


def test_max_seq_len_caps_length(llama):
    llm, _ = llama
    prompt = list(range(3, 3 + 250))
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 256 - 250 and out.finish_reason == "length"


def test_streaming_deltas_add_up(llama):
    """Streamed deltas (one token each, running totals alongside) add up to the whole output
    that ``generate`` returns for the same request."""
    llm, _ = llama
    params = GREEDY.replace(max_tokens=20)
    deltas, ids, logprobs = [], [], []
    for out in llm.generate_stream("Pages of keys", params):
        c = out.outputs[0]
        assert len(c.token_ids) == 1 and c.num_tokens == len(ids) + 1
        deltas.append(c.text)
        ids += c.token_ids
        logprobs += c.logprobs
        assert c.cumulative_logprob == pytest.approx(sum(logprobs))
    whole = llm.generate("Pages of keys", params, use_tqdm=False)[0].outputs[0]
    assert out.finished and "".join(deltas) == whole.text and ids == whole.token_ids
    assert logprobs == whole.logprobs and c.finish_reason == whole.finish_reason


def test_abort_frees_slot_and_pages(llama):
    llm, _ = llama
    eng = llm.engine
    rid = eng.add_request(list(range(3, 100)), GREEDY.replace(max_tokens=200))
    other = eng.add_request([5, 6, 7], GREEDY.replace(max_tokens=5))
    for _ in range(4):
        eng.step()
    eng.abort_request(rid)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert eng.requests[rid].finish_reason == "abort"
    assert [o for o in outs if o.request_id == other][-1].finished
    eng.forget_finished()
    assert_drained(llm)


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], SamplingParams(), "prompt is empty"),
        ([1, 2, 10_000], SamplingParams(), "token id 10000"),
        (list(range(3, 260)), SamplingParams(), "max_seq_len=256"),
        ("hi", SamplingParams(min_tokens=2), "min_tokens=2"),
        ([1.5], SamplingParams(), "must be ints"),
    ],
)
def test_invalid_requests_raise_and_engine_keeps_running(llama, prompt, params, match):
    llm, _ = llama
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6], prompt], params, use_tqdm=False)
    assert_drained(llm)
    assert llm.generate([5, 6], GREEDY.replace(max_tokens=2), use_tqdm=False)[0].outputs[0]


def test_sampling_params_errors_name_the_field():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)


def test_n_completions_use_successive_seeds(llama):
    llm, _ = llama
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    out = llm.generate([[5, 6, 7]], p, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    single = llm.generate([[5, 6, 7]], p.replace(n=1, seed=12), use_tqdm=False)[0]
    assert out.outputs[1].token_ids == single.outputs[0].token_ids


def test_compile_counter_sees_compiles():
    import jax
    import jax.numpy as jnp

    with count_compiles() as compiled:
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7))
    assert "Compiling jit(<lambda>)" in compiled


def test_swap_preemption_and_prefix_cache_with_the_real_model(hf_checkpoint):
    """A pool too small for the workload, swap preemption, and prompts sharing a long system
    prefix: outputs still match HF, pages were swapped, and prefix pages were reused."""
    path, model = hf_checkpoint("llama")
    llm = LLM(path, **{**SMALL_ENGINE, "num_pages": 36}, preemption_mode="swap")
    rng = np.random.RandomState(2)
    system = rng.randint(3, 384, 70).tolist()
    prompts = [system + rng.randint(3, 384, int(n)).tolist() for n in rng.randint(1, 30, 10)]
    prompts += [rng.randint(3, 384, int(n)).tolist() for n in rng.randint(100, 200, 4)]
    params = [GREEDY.replace(max_tokens=int(m)) for m in rng.randint(20, 60, len(prompts))]
    with count_compiles() as compiled:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert compiled == [], f"swapping recompiled: {compiled}"
    for prompt, out in zip(prompts, outs):
        assert_teacher_forced(model, prompt, out.outputs[0].token_ids)
    assert llm.engine.stats().swap_outs > 0
    assert llm.engine.scheduler.allocator.hits > 0
    assert_drained(llm)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_policies_workload_equals_solo_runs_real_model(llama, data):
    """Shared prefixes, priorities, a mid-run abort, recompute preemption in a small pool: every
    finished request equals its solo run (greedy or seeded), and nothing leaks."""
    llm, _ = llama
    eng = llm.engine
    rng = np.random.RandomState(data.draw(st.integers(0, 10_000)))
    prefix = rng.randint(3, 384, 40).tolist()
    n = data.draw(st.integers(3, 7))
    prompts = [
        (prefix if data.draw(st.booleans()) else [])
        + rng.randint(3, 384, 1 + rng.randint(30)).tolist()
        for _ in range(n)
    ]
    params = [
        GREEDY.replace(max_tokens=int(rng.randint(1, 30)))
        if data.draw(st.booleans())
        else SamplingParams(
            temperature=0.8, seed=int(rng.randint(1000)), max_tokens=12, ignore_eos=True
        )
        for _ in range(n)
    ]
    ids = [
        eng.add_request(p, sp, priority=data.draw(st.integers(0, 2)))
        for p, sp in zip(prompts, params)
    ]
    victim = data.draw(st.sampled_from(ids))
    for _ in range(3):
        eng.step()
    eng.abort_request(victim)
    while eng.has_unfinished_requests():
        eng.step()
    for rid, prompt, sp in zip(ids, prompts, params):
        seq = eng.requests[rid]
        if seq.finish_reason == "abort":
            continue
        solo = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
        assert seq.output_ids == solo
    eng.forget_finished()
    assert_drained(llm)
