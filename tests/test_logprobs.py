"""Top-k and prompt logprobs: HF's log_softmax (fp32, teacher-forced) within 1e-4, highest first,
no effect on the tokens of a mixed batch, no recompiles; the OpenAI shapes through the official
``openai`` client (completions with echo, chat top_logprobs, streaming) and the gRPC fields.

One engine for the module; the server takes it over for the serving tests (after the engine
tests, which use it directly).
"""

from __future__ import annotations

import json

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import torch

from jbatch import LLM, SamplingParams
from jbatch.engine.logprobs import prompt_top_logprobs, top_logprobs
from serving.chat_template import render_chat
from serving.proto.jbatch.v1 import generation_pb2 as pb
from serving.proto.jbatch.v1 import generation_pb2_grpc as pb_grpc
from serving.server import BackgroundServer, ServeConfig
from tests.compile_counter import count_compiles
from tests.hf_models import make_checkpoint

ENGINE = dict(
    max_slots=4, page_size=8, num_pages=64, max_num_batched_tokens=64, max_seq_len=160, block_q=16
)
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("logprobs_llama")
    model = make_checkpoint("llama", path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return LLM(path, **ENGINE), model


def hf_logprobs(model, ids: list[int]) -> np.ndarray:
    """HF's fp32 log_softmax at every position of ``ids`` (row i predicts token i + 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


def assert_position(entries: dict, row: np.ndarray, own: int, k: int) -> None:
    """``entries`` (one position's dict) against HF's row: the top k in order, every value."""
    ids = list(entries)
    expected = np.argsort(-row, kind="stable")[:k].tolist()  # highest first, ties: lower id
    assert ids[:k] == expected, (ids, expected)
    assert own in entries and len(entries) == k + (own not in expected)
    for t, lp in entries.items():
        assert abs(lp.logprob - row[t]) < TOL, (t, lp.logprob, row[t])
    assert [entries[t].rank for t in ids[:k]] == list(range(1, k + 1))
    if own not in expected:  # its rank: 1 + the tokens above it (up to HF's rounding)
        above = lambda tol: 1 + int(np.sum(row > row[own] + tol))
        assert above(TOL) <= entries[own].rank <= above(-TOL)


def test_top_logprobs_order_and_ties():
    logits = jnp.array([[1.0, 3.0, 3.0, 2.0, 3.0] + [-5.0] * 19])
    out = jax.jit(top_logprobs)(logits, jnp.array([3]))
    assert out.ids[0, :4].tolist() == [1, 2, 4, 3]  # ties by lower id, then the rest
    ref = jax.nn.log_softmax(logits[0])
    np.testing.assert_allclose(out.values[0], ref[out.ids[0]], atol=1e-6)
    assert int(out.rank[0]) == 4 and abs(float(out.logprob[0]) - float(ref[3])) < 1e-6


@pytest.mark.parametrize("rows", [16, 64, 256])
def test_prompt_rows_only_where_asked(rows):
    """Several blocks (256 rows: 4 of 64) or one; a block without a target stays zero."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(32, 50)), jnp.float32)
    hidden = jnp.asarray(rng.normal(size=(rows, 32)), jnp.float32)
    targets = np.full(rows, -1, np.int32)
    asked = np.array([1, rows - 1] + ([70, 71, 200] if rows == 256 else []))
    targets[asked] = rng.integers(0, 50, asked.size)
    got = jax.jit(prompt_top_logprobs, static_argnums=(0, 3))(lambda h: h @ w, hidden, targets, 16)
    ref = top_logprobs(hidden @ w, jnp.maximum(jnp.asarray(targets), 0))
    for name in ("logprob", "rank", "ids", "values"):
        g, r = np.asarray(getattr(got, name)), np.asarray(getattr(ref, name))
        np.testing.assert_allclose(g[asked], r[asked], atol=1e-5)
        if rows == 256:
            assert not np.any(g[128:192]), name  # block 2: nobody asked, never computed


def test_engine_logprobs_match_hf_and_leave_tokens_alone(tiny):
    llm, model = tiny
    vocab = llm.engine.model_cfg.vocab_size
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, vocab, size=n).tolist() for n in (100, 7, 30, 1, 45, 12)]
    base = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, max_tokens=6, ignore_eos=True),
    ]
    plain = [base[i % 2] for i in range(len(prompts))]
    asks = [  # a mixed batch: some requests with logprobs, some without
        base[0].replace(logprobs=5, prompt_logprobs=3),  # a prompt over two chunks
        base[1].replace(logprobs=20),
        base[0],
        base[1].replace(prompt_logprobs=0),
        base[0].replace(logprobs=0),
        base[1],
    ]
    with count_compiles() as compiled:
        ref = llm.generate(prompts, plain, use_tqdm=False)
        got = llm.generate(prompts, asks, use_tqdm=False)
        hits = llm.engine.stats().prefix_cache_hits
        again = llm.generate(prompts[:1], asks[:1], use_tqdm=False)[0]  # cached prompt pages
    assert compiled == [], compiled
    assert llm.engine.stats().prefix_cache_hits == hits, "prompt_logprobs reused cached pages"
    for r, g, p, params in zip(ref, got, prompts, asks):
        out = g.outputs[0]
        assert out.token_ids == r.outputs[0].token_ids  # logprobs never change the tokens
        rows = hf_logprobs(model, p + out.token_ids)
        if params.logprobs is None:
            assert out.top_logprobs is None
        else:
            assert len(out.top_logprobs) == len(out.token_ids)
            for j, (t, entries) in enumerate(zip(out.token_ids, out.top_logprobs)):
                assert_position(entries, rows[len(p) - 1 + j], t, params.logprobs)
                assert entries[t].logprob == pytest.approx(out.logprobs[j], abs=1e-6)
        if params.prompt_logprobs is None:
            assert g.prompt_logprobs is None
        else:
            assert len(g.prompt_logprobs) == len(p) and g.prompt_logprobs[0] is None
            for i in range(1, len(p)):
                assert_position(g.prompt_logprobs[i], rows[i - 1], p[i], params.prompt_logprobs)
    assert [list(e) for e in again.prompt_logprobs[1:]] == [
        list(e) for e in got[0].prompt_logprobs[1:]
    ]


@pytest.fixture(scope="module")
def served(tiny):
    llm, model = tiny
    bg = BackgroundServer(llm.engine, ServeConfig(grpc_port=0, http_port=0, model_name="tiny"))
    bg.start()
    server = bg.server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="-")
    yield client, f"127.0.0.1:{server.grpc_port}", llm.tokenizer, model
    bg.stop()


def test_openai_completions_logprobs_with_echo(served):
    client, _, tok, model = served
    prompt = "The quick brown fox"
    ids = tok.encode(prompt)
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=3, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = r.choices[0]
    out_ids = choice.model_extra["token_ids"]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    rows = hf_logprobs(model, ids + out_ids)
    all_ids = ids + out_ids
    for i in range(1, len(all_ids)):
        assert abs(lp.token_logprobs[i] - rows[i - 1][all_ids[i]]) < TOL
        values = list(lp.top_logprobs[i].values())
        assert values == sorted(values, reverse=True) and len(values) <= 3
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_openai_chat_top_logprobs_and_streaming(served):
    client, _, tok, model = served
    messages = [{"role": "user", "content": "pages of keys"}]
    kw = dict(model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True)
    r = client.chat.completions.create(top_logprobs=4, **kw)
    content = r.choices[0].logprobs.content
    out_ids = r.choices[0].model_extra["token_ids"]
    assert len(content) == len(out_ids)
    prompt_ids = tok.encode(render_chat(tok, messages), add_special_tokens=False)
    rows = hf_logprobs(model, prompt_ids + out_ids)
    for j, (t, c) in enumerate(zip(out_ids, content)):
        row = rows[len(prompt_ids) - 1 + j]
        assert abs(c.logprob - row[t]) < TOL
        values = [x.logprob for x in c.top_logprobs]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        np.testing.assert_allclose(values, np.sort(row)[::-1][:4], atol=TOL)
        assert isinstance(c.bytes, list)
    streamed = []
    for chunk in client.chat.completions.create(top_logprobs=4, stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(top_logprobs=21, **kw)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, top_logprobs=2
        )
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=-1)


def test_grpc_logprob_fields(served):
    _, target, _, model = served
    prompt = [5, 17, 42, 99, 7]
    params = pb.SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling_params=params)
    with grpc.insecure_channel(target) as channel:
        responses = list(pb_grpc.GenerationStub(channel).Generate(req, timeout=30))
    first = responses[0]
    assert len(first.prompt_logprobs) == len(prompt)
    assert not first.prompt_logprobs[0].HasField("token") and not first.prompt_logprobs[0].top
    assert all(not r.prompt_logprobs for r in responses[1:])
    out_ids = [t for r in responses for t in r.token_ids]
    per_token = [p for r in responses for p in r.logprobs]
    rows = hf_logprobs(model, prompt + out_ids)
    for i in range(1, len(prompt)):
        p = first.prompt_logprobs[i]
        assert p.token.token_id == prompt[i] and abs(p.token.logprob - rows[i - 1][prompt[i]]) < TOL
        assert len(p.top) == 1 and p.top[0].rank == 1
    assert len(per_token) == len(out_ids) == 3
    for j, (t, p) in enumerate(zip(out_ids, per_token)):
        assert p.token.token_id == t and p.token.rank == 1  # greedy: the top token
        assert [x.token_id for x in p.top] == np.argsort(-rows[len(prompt) - 1 + j])[:2].tolist()


def test_prompt_positions_once_through_recompute_preemptions():
    """Host bookkeeping on the numpy MockCore (no compiles): a request preempted and prefilled
    again still gets each prompt position once, in order."""
    import types

    from jbatch.engine.config import EngineConfig
    from jbatch.engine.llm_engine import LLMEngine
    from jbatch.engine.mock_core import MockCore

    cfg = EngineConfig(
        max_slots=3, page_size=4, num_pages=12, max_num_batched_tokens=16, max_seq_len=40,
        block_q=4, preemption_mode="recompute",
    )  # fmt: skip
    model_cfg = types.SimpleNamespace(vocab_size=64, max_position_embeddings=64)
    engine = LLMEngine(model_cfg, None, cfg, core=MockCore(cfg, 64))
    prompts = [[(7 * i + j) % 61 + 3 for j in range(18)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    firsts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in firsts, "prompt logprobs sent twice"
                firsts[out.request_id] = out.prompt_logprobs
    assert engine.stats().preemptions > 0
    for i, p in enumerate(prompts):
        got = firsts[str(i)]
        assert len(got) == len(p) and got[0] is None
        assert [next(iter(e)) for e in got[1:]] == p[1:]  # MockCore: only the token itself
