"""Speculative decoding end to end (n-gram proposals): greedy output is HF's, architecture by
architecture, under preemption, swap and prefix caching; no recompiles whatever the mix of
speculating and non-speculating requests; deterministic seeded sampling; no page leaks."""

from __future__ import annotations

import numpy as np
import pytest

from jbatch import LLM, SamplingParams
from tests.compile_counter import count_compiles
from tests.test_engine import assert_drained, assert_teacher_forced, churn_with_random_aborts

SPEC = dict(
    max_slots=4,
    page_size=8,
    num_pages=64,
    max_num_batched_tokens=32,
    max_seq_len=192,
    block_q=16,
    speculative="ngram",
    num_speculative_tokens=3,
    speculative_max_batch=4,
    ngram_min=1,
    ngram_max=3,
    preemption_mode="swap",
    debug_checks=True,
)
# The other architectures: the fewest programs that still speculate (one slot, one group).
SMALL = {**SPEC, "max_slots": 1, "speculative_max_batch": 1, "max_num_batched_tokens": 16}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def repetitive_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random span (so proposals exist from the first step)."""
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        span = rng.randint(3, vocab, int(rng.randint(3, 9))).tolist()
        out.append(rng.randint(3, vocab, int(rng.randint(1, 12))).tolist() + span * 3)
    return out


@pytest.fixture(scope="module")
def spec_llama(hf_checkpoint):
    path, model = hf_checkpoint("llama")
    return LLM(path, **SPEC), model


@pytest.mark.parametrize(
    "variant", ["llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "phi3"]
)
def test_greedy_speculative_output_is_hfs(variant, hf_checkpoint, spec_llama):
    path, model = hf_checkpoint(variant)
    llm = spec_llama[0] if variant == "llama" else LLM(path, **SMALL)
    n = 6 if variant == "llama" else 3
    prompts = repetitive_prompts(llm.engine.model_cfg.vocab_size, n, seed=len(variant))
    before = llm.engine.stats()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        assert_teacher_forced(model, prompt, out.outputs[0].token_ids)
    stats = llm.engine.stats()
    assert stats.spec_steps > before.spec_steps
    assert stats.spec_accepted_tokens > before.spec_accepted_tokens, "nothing was accepted"
    assert_drained(llm)


def test_speculation_under_swap_preemption_and_prefix_cache(spec_llama):
    """A workload larger than the pool (swap preemption) sharing a system prefix: HF's tokens,
    pages swapped and reused, none leaked, nothing compiled."""
    llm, model = spec_llama
    rng = np.random.RandomState(4)
    system = rng.randint(3, 384, 16).tolist()
    own = lambda: rng.randint(3, 384, 30).tolist()
    prompts = [system + own() + p for p in repetitive_prompts(384, 8, seed=5)]
    params = [GREEDY.replace(max_tokens=int(m)) for m in rng.randint(90, 100, len(prompts))]
    with count_compiles() as compiled:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert compiled == [], f"compiled after warm-up: {compiled}"
    for prompt, out in zip(prompts, outs):
        assert_teacher_forced(model, prompt, out.outputs[0].token_ids)
    stats = llm.engine.stats()
    assert stats.swap_outs > 0 and stats.prefix_cache_hits > 0 and stats.spec_accepted_tokens > 0
    assert_drained(llm)


def test_any_mix_of_requests_compiles_nothing_and_sampling_is_deterministic(spec_llama):
    """Greedy, seeded sampled, penalised, logprob and opted-out requests side by side; the
    same workload twice gives the same tokens; no program is compiled after warm-up."""
    llm, _ = spec_llama
    prompts = repetitive_prompts(384, 8, seed=7)
    base = SamplingParams(max_tokens=24, ignore_eos=True)
    params = [
        base.replace(temperature=0.0),
        base.replace(temperature=0.8, seed=1),
        base.replace(temperature=1.0, top_k=5, seed=2),
        base.replace(temperature=0.0, presence_penalty=0.5),
        base.replace(temperature=0.0, logprobs=2),
        base.replace(temperature=0.0, speculative=False),
        base.replace(temperature=0.7, top_p=0.9, seed=3),
        base.replace(temperature=0.0, stop_token_ids=[7]),
    ]
    with count_compiles() as compiled:
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False)
    assert compiled == [], f"compiled after warm-up: {compiled}"
    for a, b in zip(first, second):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert len(first[4].outputs[0].logprobs) == 24  # one logprob dict per token
    # n-gram proposals are verified by the coupled rule (spec_verify.py): a seeded request's
    # tokens are its tokens without speculation, whatever was proposed.
    seeded = [1, 2, 6]
    alone = llm.generate(
        [prompts[i] for i in seeded],
        [params[i].replace(speculative=False) for i in seeded],
        use_tqdm=False,
    )
    for i, out in zip(seeded, alone):
        assert first[i].outputs[0].token_ids == out.outputs[0].token_ids, i
    plain = llm.engine.core.programs_run
    assert any(key[0] == "spec" for key, n in plain.items() if n)
    assert_drained(llm)


def test_opted_out_and_penalised_requests_are_decoded_as_without_speculation(
    spec_llama, hf_checkpoint
):
    llm, model = spec_llama
    prompts = repetitive_prompts(384, 2, seed=8)
    before = llm.engine.stats().spec_proposed_tokens
    outs = llm.generate(prompts, GREEDY.replace(speculative=False), use_tqdm=False)
    assert llm.engine.stats().spec_proposed_tokens == before
    for prompt, out in zip(prompts, outs):
        assert_teacher_forced(model, prompt, out.outputs[0].token_ids)


def test_speculative_steps_overlap_and_the_device_clips_to_the_pool(spec_llama, monkeypatch):
    """A speculative step is planned while the previous one runs (the host guesses how far it
    got; the device picks the proposals that follow its real last token): most speculative
    steps of one long request are dispatched with another in flight. Runs up to
    ``max_seq_len`` stay HF's (the device clips proposals to the pool it knows)."""
    llm, model = spec_llama
    engine = llm.engine
    overlapped = []
    dispatch = engine.core.step

    def step(params, state, inp, bitmask=None):
        if inp.layout.key[0] == "spec":
            prev = engine._inflight[-1][0] if engine._inflight else None
            overlapped.append(prev is not None and prev.drafts is not None)
        return dispatch(params, state, inp, bitmask)

    monkeypatch.setattr(engine.core, "step", step)
    prompt = repetitive_prompts(384, 1, seed=21)[0]
    out = llm.generate([prompt], GREEDY.replace(max_tokens=None), use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    assert len(tokens) == SPEC["max_seq_len"] - len(prompt), out.outputs[0].finish_reason
    assert_teacher_forced(model, prompt, tokens)
    assert len(overlapped) > 10 and sum(overlapped) >= 0.7 * len(overlapped), overlapped
    assert_drained(llm)


def test_stop_conditions_cut_an_accepted_run(spec_llama):
    """A stop token or max_tokens inside an accepted run ends the output exactly there."""
    assert_stops_cut_runs(spec_llama[0])


def assert_stops_cut_runs(llm: LLM) -> None:
    """A stop token or max_tokens inside an accepted run (or a block of steps) ends the
    output exactly there."""
    prompt = repetitive_prompts(384, 1, seed=9)[0]
    full = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop = full[10]
    cut = llm.generate([prompt], GREEDY.replace(stop_token_ids=[stop]), use_tqdm=False)[0]
    assert cut.outputs[0].token_ids == full[: full.index(stop) + 1]
    assert cut.outputs[0].finish_reason == "stop"
    for m in (1, 2, 5, 13):
        short = llm.generate([prompt], GREEDY.replace(max_tokens=m), use_tqdm=False)[0]
        assert short.outputs[0].token_ids == full[:m]
    assert_drained(llm)


def test_no_page_leaks_after_many_speculative_requests_with_aborts(spec_llama):
    llm, _ = spec_llama
    churn_with_random_aborts(llm.engine, repetitive_prompts(384, 40, seed=12), 1000, 12)
    assert llm.engine.stats().spec_accepted_tokens > 0
    assert_drained(llm)


def test_served_speculation_with_real_clients(spec_llama):
    """The OpenAI client (streaming, ``speculative`` as an extra field) and a raw gRPC stub
    get the engine's greedy tokens; /metrics reports the acceptance."""
    import grpc
    import httpx
    import openai

    from serving.proto.jbatch.v1 import generation_pb2 as pb
    from serving.proto.jbatch.v1 import generation_pb2_grpc as pb_grpc
    from serving.server import BackgroundServer, ServeConfig

    llm, _ = spec_llama
    prompt = repetitive_prompts(384, 1, seed=13)[0]
    want = llm.generate([prompt], GREEDY.replace(max_tokens=20), use_tqdm=False)[0]
    want = want.outputs[0].token_ids
    bg = BackgroundServer(llm.engine, ServeConfig(grpc_port=0, http_port=0, model_name="tiny"))
    bg.start()
    try:
        server = bg.server
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x")
        for speculative in (True, False):
            stream = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "speculative": speculative},
            )  # fmt: skip
            ids = [t for chunk in stream for t in (chunk.choices[0].model_extra or {}).get(
                "token_ids", []
            )]  # fmt: skip
            assert ids == want
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling_params=pb.SamplingParams(
                    temperature=0, max_tokens=20, ignore_eos=True, speculative=True
                ),
            )
            got = [
                t for r in pb_grpc.GenerationStub(channel).Generate(request) for t in r.token_ids
            ]
        assert got == want
        metrics = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics").text
        accepted = [ln for ln in metrics.splitlines() if ln.startswith("jbatch_spec_accepted")]
        assert accepted and float(accepted[0].split()[-1]) > 0
        assert "jbatch_spec_acceptance_rate" in metrics
    finally:
        bg.stop()
