"""n > 1 in the engine: n child sequences share the prompt's pages and decode in their own slots
with seeds ``seed + i``. MockCore (exact outputs, hypothesis workloads), the tiny HF llama (each
child equals its solo run, no recompiles), HTTP with the ``openai`` client, and gRPC."""

from __future__ import annotations

import asyncio
import json
import re
import types

import grpc
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jbatch import LLM, EngineConfig, LLMEngine, SamplingParams
from jbatch.batch_job import BatchJob
from jbatch.demo import demo_model_path
from jbatch.engine.interface import StepFailed
from jbatch.engine.mock_core import MockCore, expected_tokens
from jbatch.engine.parent_request import child_seed
from jbatch.outputs import OutputKind
from jbatch.structured_output import StructuredOutput
from jbatch.tokenizer import Tokenizer
from serving.client import GenerationClient
from serving.proto.jbatch.v1 import generation_pb2 as pb
from serving.proto.jbatch.v1 import generation_pb2_grpc as pb_grpc
from tests.compile_counter import count_compiles
from tests.fault_injection import fail_step_at
from tests.serving_harness import VOCAB as SERVING_VOCAB
from tests.serving_harness import assert_drained, hardened_llm, running_server  # noqa: F401

VOCAB = 97


def mock_engine(**kw) -> LLMEngine:
    cfg = EngineConfig(
        **{"block_q": 4, "max_slots": 4, "page_size": 4, "num_pages": 40, "max_seq_len": 48,
           "max_num_batched_tokens": 32, "debug_checks": True, **kw}
    )  # fmt: skip
    model_cfg = types.SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=1 << 20)
    return LLMEngine(model_cfg, None, cfg, core=MockCore(cfg, VOCAB))


def sampled(n: int, seed: int | None = 5, max_tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(
        n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True, **kw
    )


def run(eng: LLMEngine) -> list:
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    return outs


def tokens_by_child(outs, rid: str) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    for out in outs:
        if out.request_id == rid:
            for c in out.outputs:
                got.setdefault(c.index, []).extend(c.token_ids)
    return got


def drained(eng: LLMEngine) -> None:
    sched = eng.scheduler
    sched.check_invariants()
    assert not sched.running and not sched.waiting and not eng._inflight
    assert sched.allocator.num_used == 0 and len(sched.free_slots) == eng.cfg.max_slots
    assert sched.allocator.num_free == eng.cfg.num_pages, "pages lost"


# ---- the scheduler on the MockCore ------------------------------------------------------------
@pytest.mark.parametrize(
    "caching, penalty, shares",
    [(True, {}, True), (False, {}, True), (False, {"presence_penalty": 0.5}, True),
     (True, {"repetition_penalty": 1.3}, False)],
)  # fmt: skip
def test_children_share_the_prompt_pages(caching, penalty, shares):
    eng = mock_engine(enable_prefix_caching=caching, max_num_batched_tokens=48)
    prompt, n, page = list(range(3, 17)), 3, 4  # 14 tokens: 3 full pages before the last token
    rid = eng.add_request(prompt, sampled(n, **penalty))
    eng.step()
    children = eng.parents[rid].children
    assert all(c.slot is not None for c in children)
    refs = [eng.scheduler.allocator.refcount(p) for p in children[0].pages]
    assert refs == ([n] * 3 + [1] if shares else [1] * 4), refs
    outs = run(eng)
    partial = len(prompt) - 3 * page
    computed = len(prompt) + (n - 1) * (partial if shares else len(prompt))
    assert eng.stats().prompt_tokens == computed  # the shared pages once, the last page n times
    got = tokens_by_child(outs, rid)
    for i in range(n):
        assert got[i] == expected_tokens(prompt, 6, child_seed(5, i), True, VOCAB), i
    assert eng.forget(rid) and not eng.requests and not eng.parents
    drained(eng)


@pytest.mark.parametrize("caching", [True, False])
def test_children_wait_for_a_sibling_still_prefilling(caching):
    """A prompt prefilled over several steps: the other children wait for its pages instead of
    computing them too."""
    eng = mock_engine(enable_prefix_caching=caching, max_num_batched_tokens=8)
    prompt = list(range(3, 33))  # 30 tokens: 7 full pages before the last token, 4 steps
    rid = eng.add_request(prompt, sampled(3))
    outs = run(eng)
    assert eng.stats().prompt_tokens == 30 + 2 * 2
    got = tokens_by_child(outs, rid)
    assert [got[i] for i in range(3)] == [
        expected_tokens(prompt, 6, child_seed(5, i), True, VOCAB) for i in range(3)
    ]
    drained(eng)


def test_greedy_children_are_equal_and_final_output_has_all():
    eng = mock_engine(max_slots=2)  # three children, two slots: the third waits for one
    prompt = list(range(3, 13))
    greedy = SamplingParams(n=3, temperature=0.0, max_tokens=5, ignore_eos=True)
    rid = eng.add_request(prompt, greedy, output_kind=OutputKind.FINAL)
    outs = run(eng)
    assert len(outs) == 1 and outs[0].finished and outs[0].request_id == rid
    want = expected_tokens(prompt, 5, 0, False, VOCAB)
    assert [(c.index, c.token_ids) for c in outs[0].outputs] == [(i, want) for i in range(3)]
    assert eng.forget(rid)
    drained(eng)


def test_deltas_merge_per_step_and_finish_with_the_last_child():
    eng = mock_engine()
    rid = eng.add_request([5, 6, 7], sampled(3, seed=None))
    lengths = {0: 2, 1: 5, 2: 3}
    for child in eng.parents[rid].children:  # children of different lengths
        child.max_tokens = lengths[child.index]
    outs = run(eng)
    assert all(len(o.outputs) == len({c.index for c in o.outputs}) for o in outs)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    got = tokens_by_child(outs, rid)
    assert {i: len(t) for i, t in got.items()} == lengths
    seeds = [c.seed for c in eng.parents[rid].children]  # a random seed, then seed + i
    assert seeds == [child_seed(seeds[0], i) for i in range(3)]
    assert eng.forget(rid)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("caching", [True, False])
def test_a_child_is_preempted_and_resumes_exactly(mode, caching):
    """Three children need 2 shared + 3 x 6 own pages; the pool has 14: children are evicted
    (recompute or swap), come back and still produce exactly their solo outputs."""
    eng = mock_engine(num_pages=14, preemption_mode=mode, enable_prefix_caching=caching)
    prompt = list(range(3, 13))
    rid = eng.add_request(prompt, sampled(3, max_tokens=20))
    outs = run(eng)
    stats = eng.stats()
    assert stats.preemptions > 0 and (stats.swap_outs > 0) == (mode == "swap")
    got = tokens_by_child(outs, rid)
    for i in range(3):
        assert got[i] == expected_tokens(prompt, 20, child_seed(5, i), True, VOCAB), i
    assert eng.forget(rid)
    drained(eng)


def test_structured_children_each_follow_the_grammar():
    """Each child has its own grammar matcher: every completion matches the regex."""
    cfg = EngineConfig(block_q=4, page_size=4, num_pages=40, max_seq_len=64, max_slots=4,
                       debug_checks=True)  # fmt: skip
    model_cfg = types.SimpleNamespace(vocab_size=2048, max_position_embeddings=1 << 20)
    tok = Tokenizer.from_dir(demo_model_path())
    eng = LLMEngine(model_cfg, None, cfg, tokenizer=tok, eos_token_ids=[2],
                    core=MockCore(cfg, 2048))  # fmt: skip
    regex = r"[0-9]{3}-[a-z]{2,4}"
    p = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=30,
                       structured=StructuredOutput(regex=regex))  # fmt: skip
    rid = eng.add_request(list(range(3, 20)), p, output_kind=OutputKind.FINAL)
    (out,) = run(eng)
    matchers = {id(c.matcher) for c in eng.parents[rid].children}
    assert len(matchers) == 3
    assert all(re.fullmatch(regex, c.text) for c in out.outputs), [c.text for c in out.outputs]
    drained(eng)


def test_snapshot_and_restore_keep_the_family(tmp_path):
    """An n = 3 request snapshotted mid-run (children swapped out, one finished and forgotten)
    finishes in a new engine with its solo outputs."""
    kw = dict(num_pages=10, max_seq_len=32, preemption_mode="swap")
    first, second = mock_engine(**kw), mock_engine(**kw)
    prompt = list(range(3, 13))
    rid = first.add_request(prompt, sampled(3, max_tokens=20))
    first.parents[rid].children[2].max_tokens = 3  # finishes early
    children, outs = first.parents[rid].children, []
    for _ in range(100):  # until a child sits in host RAM
        outs += first.step()
        if any(c.swapped is not None for c in children):
            break
    first.forget_finished()
    assert any(c.swapped is not None for c in children) and children[2].finished
    assert (rid, 2) not in first.requests
    outs += first.snapshot(tmp_path / "snap")
    second.restore(tmp_path / "snap")
    outs += run(second)
    got = tokens_by_child(outs, rid)
    want = [expected_tokens(prompt, m, child_seed(5, i), True, VOCAB)
            for i, m in enumerate((20, 20, 3))]  # fmt: skip
    assert [got[i] for i in range(3)] == want and outs[-1].finished
    assert second.forget(rid) and not second.parents and not second.requests
    drained(second)


def test_abort_aborts_every_child_and_frees_everything():
    eng = mock_engine(max_slots=2)
    rid = eng.add_request(list(range(3, 20)), sampled(4, max_tokens=20))
    other = eng.add_request([9, 9, 9], sampled(1, max_tokens=4))
    for _ in range(3):
        eng.step()
    assert not eng.forget(rid)  # still running
    eng.abort_request(rid)
    assert {c.finish_reason for c in eng.parents[rid].children} == {"abort"}
    run(eng)
    assert eng.requests[other].finish_reason == "length"
    assert eng.forget(rid) and eng.forget(other)
    drained(eng)
    eng.add_request([5], sampled(2), request_id=rid)  # forgotten: the id is free again
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([5], sampled(1), request_id=rid)
    run(eng)


def test_failed_step_fails_the_whole_request_once():
    eng = mock_engine()
    rid = eng.add_request(list(range(3, 12)), sampled(3), output_kind=OutputKind.FINAL)
    eng.step()
    fail_step_at(eng)
    with pytest.raises(StepFailed) as info:
        eng.step()
    assert info.value.failed == [rid]
    (out,) = info.value.outputs
    assert out.finished and out.error and [c.index for c in out.outputs] == [0, 1, 2]
    assert {c.finish_reason for c in out.outputs} == {"error"}
    assert eng.forget(rid) and not eng.parents
    drained(eng)


request = st.fixed_dictionaries(
    {
        "prefix": st.integers(0, 2),
        "suffix": st.lists(st.integers(3, VOCAB - 1), min_size=0, max_size=9),
        "n": st.sampled_from([1, 1, 2, 3, 4]),
        "max_tokens": st.integers(1, 8),
        "seed": st.one_of(st.none(), st.integers(0, 1000)),
        "penalty": st.sampled_from(
            [{}, {}, {"presence_penalty": 0.5}, {"repetition_penalty": 1.2}]
        ),
        "arrival": st.integers(0, 10),
        "abort_at": st.one_of(st.none(), st.integers(0, 25)),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request, min_size=1, max_size=8),
    slots=st.integers(1, 4),
    page_size=st.sampled_from([2, 4]),
    spare_pages=st.integers(0, 8),
    budget=st.sampled_from([4, 8, 16]),
    caching=st.booleans(),
    async_scheduling=st.booleans(),
    preemption=st.sampled_from(["recompute", "swap", "auto"]),
)
def test_random_workloads_with_n_keep_invariants_and_exact_outputs(
    reqs, slots, page_size, spare_pages, budget, caching, async_scheduling, preemption
):
    """Every child equals its request run alone with seed + i, through preemption (recompute
    and swap) in tiny pools, aborts and the prefix cache; invariants after every step."""
    eng = mock_engine(
        max_slots=slots, page_size=page_size, num_pages=48 // page_size + spare_pages,
        max_num_batched_tokens=budget, enable_prefix_caching=caching,
        async_scheduling=async_scheduling, preemption_mode=preemption,
    )  # fmt: skip
    rng = np.random.RandomState(0)
    prefixes = [rng.randint(3, VOCAB, n).tolist() for n in (0, 9, 21)]
    prompts = [(prefixes[r["prefix"]] + r["suffix"]) or [5] for r in reqs]
    ps = [
        SamplingParams(
            n=r["n"],
            temperature=1.0 if r["seed"] is not None else 0.0,
            seed=r["seed"],
            max_tokens=r["max_tokens"],
            ignore_eos=True,
            **r["penalty"],
        )
        for r in reqs
    ]
    ids: list[str | None] = [None] * len(reqs)
    outs = []
    for step in range(3000):
        for i, r in enumerate(reqs):
            if r["arrival"] == step:
                ids[i] = eng.add_request(prompts[i], ps[i])
            if r["abort_at"] == step and ids[i] is not None:
                eng.abort_request(ids[i])
        outs += eng.step()
        if step > 10 and not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests(), "the workload did not finish"
    drained(eng)
    for i, (prompt, p) in enumerate(zip(prompts, ps)):
        got = tokens_by_child(outs, ids[i])
        children = eng.parents[ids[i]].children if p.n > 1 else [eng.requests[ids[i]]]
        for child in children:
            if child.finish_reason == "abort":
                continue
            want = expected_tokens(prompt, p.max_tokens, p.seed or 0, p.seed is not None, VOCAB)
            if p.seed is not None:
                want = expected_tokens(prompt, p.max_tokens, child_seed(p.seed, child.index),
                                       True, VOCAB)  # fmt: skip
            assert got[child.index] == want == child.output_ids, (i, child.index)


# ---- the real model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    # 3 slots (decode buckets 1 and 3), one prompt bucket: 3 step programs to compile. No
    # prefix cache: the children's shared pages can only come from their siblings.
    cfg = dict(max_slots=3, page_size=8, num_pages=48, max_num_batched_tokens=16, block_q=16)
    return LLM(path, max_seq_len=96, debug_checks=True, enable_prefix_caching=False, **cfg)


def test_real_model_children_equal_their_solo_runs_without_recompiles(llm):
    rng = np.random.RandomState(4)
    prompt = rng.randint(3, 384, 29).tolist()  # 3 full pages, then 5 tokens
    p = sampled(3, seed=21, max_tokens=10, top_k=40)
    greedy = SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True)
    solo = [
        llm.generate([prompt], p.replace(n=1, seed=child_seed(21, i)), use_tqdm=False)[0]
        for i in range(3)
    ]
    before = llm.engine.stats().prompt_tokens
    with count_compiles() as compiled:
        out, g = llm.generate([prompt, prompt[:20]], [p, greedy], use_tqdm=False)
    assert compiled == [], f"n > 1 compiled: {compiled}"
    assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in solo]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds differ
    assert [c.index for c in g.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in g.outputs}) == 1  # greedy children are equal
    # Each prompt's full pages (3 and 2 of 8 tokens) are computed once, the rest per child.
    assert llm.engine.stats().prompt_tokens - before == (29 + 2 * 5) + (20 + 2 * 4)
    sched = llm.engine.scheduler
    assert not sched.running and sched.allocator.num_used == 0


# ---- the servers ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(hardened_llm):  # noqa: F811
    with running_server(hardened_llm) as s:
        s.h = hardened_llm
        yield s


def test_http_n_with_the_openai_client(served):
    client = openai.OpenAI(base_url=served.http + "/v1", api_key="none")
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    want = [expected_tokens(prompt, 6, child_seed(3, i), True, SERVING_VOCAB) for i in range(3)]
    done = client.completions.create(
        model="tiny", prompt=prompt, n=3, max_tokens=6, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in done.choices] == want
    assert done.usage.completion_tokens == 18 and done.usage.prompt_tokens == len(prompt)
    chunks = client.completions.create(
        model="tiny", prompt=prompt, n=3, max_tokens=6, temperature=1.0, seed=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    got: dict[int, list[int]] = {}
    usage = None
    for chunk in chunks:
        for c in chunk.choices:
            got.setdefault(c.index, []).extend(c.model_extra["token_ids"])
        usage = chunk.usage or usage
    assert [got[i] for i in range(3)] == want and usage.completion_tokens == 18
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "the quick brown fox"}], n=3,
        max_tokens=5, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts = [c.message.content for c in chat.choices]
    assert [c.index for c in chat.choices] == [0, 1, 2] and len(set(texts)) == 1
    assert chat.usage.completion_tokens == 15
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "the quick brown fox"}], n=2,
        max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    parts: dict[int, str] = {}
    roles = []
    for chunk in stream:
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
            roles += [c.index] if c.delta.role else []
    assert sorted(roles) == [0, 1] and parts[0] == parts[1] == texts[0]
    assert_drained(served)


def test_grpc_n(served):
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=4, ignore_eos=True)

    async def go():
        async with GenerationClient(served.grpc_target) as c:
            return [r async for r in c.generate(prompt, params, timeout=30)]

    responses = asyncio.run(go())
    got: dict[int, list[int]] = {}
    for r in responses:
        got.setdefault(r.index, []).extend(r.token_ids)
    assert got == {i: expected_tokens(prompt, 4, 9 + i, True, SERVING_VOCAB) for i in range(3)}
    finals = [r for r in responses if r.finish_reason]
    assert sorted(r.index for r in finals) == [0, 1, 2] and responses[-1] in finals
    assert all(r.usage.completion_tokens == 4 for r in finals)
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5]), n=-1)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(req, timeout=10))
    assert (
        info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must" in info.value.details()
    )
    assert_drained(served)


def test_batch_job_line_with_n(hardened_llm, tmp_path):  # noqa: F811
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    body = {"prompt": prompt, "n": 3, "max_tokens": 4, "temperature": 1.0, "seed": 2,
            "ignore_eos": True}  # fmt: skip
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}
    (tmp_path / "in.jsonl").write_text(json.dumps(line) + "\n")
    BatchJob(hardened_llm.engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl",
             progress=False).run()  # fmt: skip
    (result,) = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    choices = result["response"]["body"]["choices"]
    want = [expected_tokens(prompt, 4, 2 + i, True, SERVING_VOCAB) for i in range(3)]
    assert [(c["index"], c["token_ids"]) for c in choices] == list(enumerate(want))
    assert result["response"]["body"]["usage"]["completion_tokens"] == 12
