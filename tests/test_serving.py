"""The serving stack end to end on 127.0.0.1: gRPC and OpenAI-HTTP streams equal LLM.generate,
health / reflection, every error status, engine-fault recovery, and a 200+ stream load test
with cancellations and deadlines that must leave no page or slot behind.

One server for the whole module (engine warm-up dominates); reference outputs are computed with
``LLM.generate`` on the same engine *before* the server takes it over.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from types import SimpleNamespace

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

import serving.context
from jbatch import LLM, SamplingParams
from serving.chat_template import render_chat
from serving.client import GenerationClient, build_request, finish_reason_name
from serving.context import ServingContext
from serving.errors import ServingError
from serving.proto.jbatch.v1 import generation_pb2 as pb
from serving.proto.jbatch.v1 import generation_pb2_grpc as pb_grpc
from serving.server import BackgroundServer, ServeConfig
from tests.hf_models import make_checkpoint
from tests.serving_harness import slow_steps

ENGINE = dict(
    max_slots=8, page_size=8, num_pages=128, max_num_batched_tokens=64, max_seq_len=256, block_q=16
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The fox?"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
N_LOAD = 220


def _cases(llm: LLM) -> list[tuple[str | list[int], SamplingParams]]:
    """Greedy and seeded requests, text and token-id prompts, and a stop string that fires."""
    cases = [
        ("The quick brown fox", GREEDY),
        ([5, 17, 99, 3, 250], GREEDY.replace(max_tokens=20)),
        ("héllo wörld 🙂", SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16)),
        (
            [9] * 40,
            SamplingParams(
                temperature=1.1,
                top_k=40,
                min_p=0.05,
                repetition_penalty=1.3,
                presence_penalty=0.5,
                frequency_penalty=0.3,
                seed=123,
                max_tokens=14,
                ignore_eos=True,
            ),
        ),
    ]
    text = llm.generate("Pages of keys", GREEDY.replace(max_tokens=24), use_tqdm=False)[0]
    stop = text.outputs[0].text[8:11]
    if stop.strip() and "\ufffd" not in stop:
        cases.append(("Pages of keys", GREEDY.replace(max_tokens=24, stop=[stop])))
        cases.append(
            ("Pages of keys", GREEDY.replace(stop=[stop], include_stop_str_in_output=True))
        )
    return cases


def _load_workload(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.RandomState(0)
    work = []
    for i in range(N_LOAD):
        prompt = rng.randint(3, vocab, size=int(rng.randint(1, 40))).tolist()
        max_tokens = int(rng.randint(2, 12))
        if i % 2:
            params = GREEDY.replace(max_tokens=max_tokens)
        else:
            params = SamplingParams(temperature=0.9, seed=i, max_tokens=max_tokens, top_k=50)
        work.append((prompt, params))
    return work


class Served:
    def __init__(self, llm: LLM, bg: BackgroundServer):
        self.llm, self.bg, self.server = llm, bg, bg.server
        self.grpc_target = f"127.0.0.1:{self.server.grpc_port}"
        self.http = f"http://127.0.0.1:{self.server.http_port}"
        self.thread = self.server.engine_thread


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_llama")
    make_checkpoint("llama", path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": CHAT_TEMPLATE})
    )
    llm = LLM(path, **ENGINE)
    cases = _cases(llm)
    load = _load_workload(llm.engine.model_cfg.vocab_size)
    chat_ids = llm.tokenizer.encode(render_chat(llm.tokenizer, MESSAGES), add_special_tokens=False)
    prompts = [c[0] for c in cases] + [p for p, _ in load] + [chat_ids]
    params = [c[1] for c in cases] + [p for _, p in load] + [GREEDY]
    refs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    bg = BackgroundServer(llm.engine, ServeConfig(grpc_port=0, http_port=0, model_name="tiny"))
    s = Served(llm, bg.start())
    s.cases = list(zip(cases, refs[: len(cases)]))
    s.load = list(zip(load, refs[len(cases) : -1]))
    s.chat_ref = refs[-1]
    yield s
    bg.stop()


def assert_drained(s: Served, timeout: float = 10.0) -> None:
    """No request left and every page and slot back (checked on the engine thread)."""
    for _ in range(int(timeout / 0.02)):
        if s.thread.num_outstanding == 0:
            break
        time.sleep(0.02)
    assert s.thread.num_outstanding == 0, "requests still outstanding"

    def snapshot(engine):
        sched = engine.scheduler
        sched.check_invariants()
        return dict(
            free_pages=sched.allocator.num_free,
            free_slots=len(sched.free_slots),
            running=len(sched.running),
            waiting=len(sched.waiting),
            requests=len(engine.requests),
            unfinished=engine.has_unfinished_requests(),
        )

    snap = s.thread.call(snapshot).result(10)
    assert snap == dict(
        free_pages=ENGINE["num_pages"],
        free_slots=ENGINE["max_slots"],
        running=0,
        waiting=0,
        requests=0,
        unfinished=False,
    ), snap


async def _grpc_stream(target: str, prompt, params, **kw) -> list[pb.GenerateResponse]:
    async with GenerationClient(target) as client:
        return [r async for r in client.generate(prompt, params, **kw)]


def _grpc_error(target: str, request: pb.GenerateRequest, timeout=10.0) -> grpc.RpcError:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=timeout))
    return info.value


def _sse_events(s: Served, path: str, body: dict) -> list[dict | str]:
    events = []
    with httpx.stream("POST", s.http + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: ")
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _http_body(prompt, p: SamplingParams) -> dict:
    body = {
        "prompt": prompt,
        **{k: getattr(p, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed")},
        **{k: getattr(p, k) for k in ("repetition_penalty", "presence_penalty")},
        "frequency_penalty": p.frequency_penalty,
        "max_tokens": p.max_tokens,
        "stop": list(p.stop),
        "ignore_eos": p.ignore_eos,
        "include_stop_str_in_output": p.include_stop_str_in_output,
    }
    return body


# ---- health, reflection, model info -------------------------------------------------------------
def test_health_reflection_and_model_info(served):
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", "jbatch.v1.Generation"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "jbatch.v1.Generation" in services and "grpc.health.v1.Health" in services
        info = pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert (info.model, info.vocab_size, info.max_seq_len) == ("tiny", 384, 256)
    assert info.has_chat_template and list(info.eos_token_ids) == [2]
    assert httpx.get(served.http + "/health").json() == {"status": "ok"}
    models = httpx.get(served.http + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny"


# ---- fidelity -----------------------------------------------------------------------------------
def test_grpc_streams_equal_llm_generate(served):
    assert len(served.cases) >= 5
    for (prompt, params), ref in served.cases:
        resps = asyncio.run(_grpc_stream(served.grpc_target, prompt, params, request_id="r1"))
        assert [t for r in resps for t in r.token_ids] == ref.token_ids
        assert "".join(r.text for r in resps) == ref.text
        assert all(r.request_id == "r1" for r in resps)
        assert all(not r.finish_reason for r in resps[:-1])
        last = resps[-1]
        assert finish_reason_name(last) == ref.finish_reason
        assert last.usage.completion_tokens == len(ref.token_ids)
        if isinstance(ref.stop_reason, str):
            assert last.stop_string == ref.stop_reason
    assert_drained(served)


def test_http_sse_and_json_equal_llm_generate(served):
    for (prompt, params), ref in served.cases:
        events = _sse_events(served, "/v1/completions", _http_body(prompt, params))
        assert events[-1] == "[DONE]"
        chunks = [e["choices"][0] for e in events[:-1]]
        assert [t for c in chunks for t in c["token_ids"]] == ref.token_ids
        assert "".join(c["text"] for c in chunks) == ref.text
        assert chunks[-1]["finish_reason"] == ref.finish_reason
        assert all(c["finish_reason"] is None for c in chunks[:-1])
    (prompt, params), ref = served.cases[2]
    body = _http_body(prompt, params)
    r = httpx.post(served.http + "/v1/completions", json=body, timeout=30).json()
    assert r["choices"][0]["token_ids"] == ref.token_ids and r["choices"][0]["text"] == ref.text
    assert r["usage"]["completion_tokens"] == len(ref.token_ids)
    events = _sse_events(
        served, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert events[-2]["usage"]["completion_tokens"] == len(ref.token_ids)
    assert_drained(served)


def test_chat_completions(served):
    ref = served.chat_ref
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    r = httpx.post(served.http + "/v1/chat/completions", json=body, timeout=30).json()
    assert r["object"] == "chat.completion"
    assert r["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    assert r["choices"][0]["token_ids"] == ref.token_ids
    events = _sse_events(served, "/v1/chat/completions", body)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d["content"] for d in deltas) == ref.text
    tok = served.llm.tokenizer
    saved, tok.chat_template = tok.chat_template, None
    try:
        r = httpx.post(served.http + "/v1/chat/completions", json=body, timeout=30)
    finally:
        tok.chat_template = saved
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    assert_drained(served)


def _cancelled_count(served) -> float:
    labels = {"status": "cancelled", "finish_reason": "abort"}
    registry = served.server.ctx.metrics.registry
    return registry.get_sample_value("jbatch_requests_total", labels) or 0.0


def test_http_client_disconnect_aborts(served):
    with _slow_steps(served):
        _client_disconnect_aborts(served)


def _client_disconnect_aborts(served):
    before = _cancelled_count(served)
    body = {"prompt": [3, 4, 5], "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", served.http + "/v1/completions", json={**body, "stream": True}) as r:
        first = next(line for line in r.iter_lines() if line)
        assert json.loads(first[len("data: ") :])["choices"][0]["token_ids"]
    # Leaving the block closed the connection: the request must be aborted long before its
    # 240 tokens would have been generated.
    assert_drained(served, timeout=5)
    assert _cancelled_count(served) == before + 1


def _slow_steps(served, seconds: float = 0.02):
    """Each engine step takes at least ``seconds`` (a long request outlasts a disconnect check
    however fast the engine is)."""
    return slow_steps(served.thread, seconds)


def test_http_non_streaming_disconnect_aborts(served):
    with _slow_steps(served):
        _non_streaming_disconnect_aborts(served)


def _non_streaming_disconnect_aborts(served):
    import socket
    from urllib.parse import urlparse

    before = _cancelled_count(served)
    body = json.dumps(
        {"prompt": [3, 4, 5], "max_tokens": 250, "temperature": 0, "ignore_eos": True}
    ).encode()
    url = urlparse(served.http)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        # Close as soon as the request runs, long before its 250 tokens are done.
        running = lambda: served.thread.call(lambda e: len(e.scheduler.running)).result(10)
        for _ in range(500):
            if running():
                break
            time.sleep(0.002)
        assert running(), "the request never started"
    assert_drained(served, timeout=5)
    assert _cancelled_count(served) == before + 1


# ---- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "request_kw, needle",
    [
        (dict(text="hi", sampling_params=pb.SamplingParams(temperature=-1)), "temperature"),
        (dict(text="hi", sampling_params=pb.SamplingParams(top_p=0)), "top_p"),
        (dict(text="hi", sampling_params=pb.SamplingParams(seed=2**40)), "seed"),
        (dict(text="hi", sampling_params=pb.SamplingParams(max_tokens=0)), "max_tokens"),
        (dict(text="hi", sampling_params=pb.SamplingParams(stop=[""])), "stop"),
        (dict(text="hi", sampling_params=pb.SamplingParams(min_tokens=3)), "min_tokens"),
        (dict(token_ids=pb.TokenIds(ids=[1, 5000])), "vocabulary"),
        (dict(token_ids=pb.TokenIds(ids=[])), "prompt"),
        (dict(token_ids=pb.TokenIds(ids=[5] * 300)), "max_seq_len"),
        (dict(), "prompt is required"),
    ],
)
def test_grpc_invalid_argument(served, request_kw, needle):
    err = _grpc_error(served.grpc_target, pb.GenerateRequest(**request_kw))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.details()


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "n": 0}, "n must be >= 1"),
        ({"prompt": "hi", "n": 17}, "max_n=16"),
        ({"prompt": "hi", "max_tokens": "lots"}, "max_tokens"),
        ({"prompt": "hi", "min_tokens": 3}, "min_tokens"),
        ({"prompt": [1, 99999]}, "vocabulary"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
    ],
)
def test_http_invalid_argument(served, body, needle):
    r = httpx.post(served.http + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_front_ends_tokenize_text_prompts(served, monkeypatch):
    """The engine thread receives token ids only: the front ends encode text prompts."""
    submitted = []
    real_submit = served.thread.submit

    def recording_submit(prompt, params, priority=0, tenant=None, **kw):
        submitted.append(prompt)
        return real_submit(prompt, params, priority, tenant, **kw)

    monkeypatch.setattr(served.thread, "submit", recording_submit)
    (text, params), ref = served.cases[0]
    resps = asyncio.run(_grpc_stream(served.grpc_target, text, params))
    assert [t for r in resps for t in r.token_ids] == ref.token_ids
    body = _http_body(text, params)
    r = httpx.post(served.http + "/v1/completions", json=body, timeout=30).json()
    assert r["choices"][0]["text"] == ref.text
    chat = {"messages": MESSAGES, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    r = httpx.post(served.http + "/v1/chat/completions", json=chat, timeout=30).json()
    assert r["choices"][0]["token_ids"] == served.chat_ref.token_ids
    tok = served.llm.tokenizer
    chat_ids = tok.encode(render_chat(tok, MESSAGES), add_special_tokens=False)
    assert submitted == [tok.encode(text), tok.encode(text), chat_ids]
    assert_drained(served)


def test_text_prompt_without_tokenizer_names_prompt(served, monkeypatch):
    monkeypatch.setattr(served.llm.engine, "tokenizer", None)
    err = _grpc_error(served.grpc_target, pb.GenerateRequest(text="hi"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("prompt: a text prompt needs a tokenizer")
    r = httpx.post(served.http + "/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt: ")
    monkeypatch.undo()
    test_errors_leave_the_server_serving(served)


def test_long_text_prompts_are_encoded_off_the_event_loop(monkeypatch):
    encoded_on = []

    class Tokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            encoded_on.append(threading.get_ident())
            return [1] * add_special_tokens + [ord(c) for c in text]

    ctx = ServingContext("m")
    with pytest.raises(ServingError, match="loading"):
        asyncio.run(ctx.encode_prompt("hi"))
    ctx.engine_thread = SimpleNamespace(engine=SimpleNamespace(tokenizer=Tokenizer()))
    monkeypatch.setattr(serving.context, "ENCODE_OFF_LOOP_CHARS", 3)
    assert asyncio.run(ctx.encode_prompt("hi")) == [1, 104, 105]
    assert asyncio.run(ctx.encode_prompt("hi!", add_special_tokens=False)) == [104, 105, 33]
    assert encoded_on == [threading.get_ident(), encoded_on[1]]
    assert encoded_on[1] != threading.get_ident(), "a long prompt was encoded on the loop"
    ctx.engine_thread.engine.tokenizer = None
    with pytest.raises(ValueError, match="^prompt: "):
        asyncio.run(ctx.encode_prompt("hi"))


def test_errors_leave_the_server_serving(served):
    (prompt, params), ref = served.cases[0]
    resps = asyncio.run(_grpc_stream(served.grpc_target, prompt, params))
    assert [t for r in resps for t in r.token_ids] == ref.token_ids
    assert_drained(served)


def test_queue_full_is_resource_exhausted_and_429(served):
    served.thread.max_queue = 1
    params = GREEDY.replace(max_tokens=24)

    async def grpc_burst():
        async with GenerationClient(served.grpc_target) as client:
            calls = [client.complete([7, 8, 9], params, timeout=30) for _ in range(40)]
            return await asyncio.gather(*calls, return_exceptions=True)

    async def http_burst():
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"prompt": [7, 8, 9], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            posts = [client.post(served.http + "/v1/completions", json=body) for _ in range(40)]
            return await asyncio.gather(*posts)

    try:
        results = asyncio.run(grpc_burst())
        statuses = [r.status_code for r in asyncio.run(http_burst())]
    finally:
        served.thread.max_queue = 1024
    errors = [r for r in results if isinstance(r, Exception)]
    assert errors and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errors)
    assert "max_queue=1" in errors[0].details()
    assert len(errors) < len(results), "some requests must get through"
    assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}
    assert_drained(served)
    test_errors_leave_the_server_serving(served)


def test_deadline_exceeded_frees_the_slot(served):
    request = build_request(
        [11, 12, 13], SamplingParams(temperature=0, ignore_eos=True, max_tokens=240)
    )
    err = _grpc_error(served.grpc_target, request, timeout=0.05)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_drained(served)
    test_errors_leave_the_server_serving(served)


def _inject_step_fault(engine) -> None:
    """The engine's next device step is dispatched (state donated, request admitted), then its
    host wrapper raises: the engine must recover by itself and name the failed requests."""
    core = engine.core

    def faulty(*args):
        del core.step  # back to the real method for later steps
        type(core).step(core, *args)
        raise RuntimeError("injected fault")

    core.step = faulty


def test_engine_fault_is_internal_then_recovers(served):
    engine = served.llm.engine
    served.thread.call(_inject_step_fault).result(10)
    request = build_request([21, 22, 23], GREEDY)
    err = _grpc_error(served.grpc_target, request)
    assert err.code() == grpc.StatusCode.INTERNAL and "injected fault" in err.details()
    assert_drained(served)
    test_errors_leave_the_server_serving(served)

    served.thread.call(_inject_step_fault).result(10)
    body = {"prompt": [21, 22, 23], "max_tokens": 4, "temperature": 0}
    r = httpx.post(served.http + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    assert "step" not in vars(engine.core)
    assert_drained(served)
    test_errors_leave_the_server_serving(served)


def test_persistent_engine_fault_fails_queued_requests(served):
    """A step that raises before admitting anything must not keep a queued request forever."""

    def broken():
        raise RuntimeError("broken device")

    served.thread.call(lambda engine: setattr(engine, "step", broken)).result(10)
    try:
        err = _grpc_error(served.grpc_target, build_request([21, 22], GREEDY))
    finally:
        served.thread.call(lambda engine: delattr(engine, "step")).result(10)
    assert err.code() == grpc.StatusCode.INTERNAL and "broken device" in err.details()
    assert_drained(served)
    test_errors_leave_the_server_serving(served)


# ---- load ---------------------------------------------------------------------------------------
def test_load_with_cancellations_and_deadlines(served):
    """220 concurrent streams: ~20% cancelled mid-stream, ~10% with short deadlines."""

    async def one(client: GenerationClient, i: int, prompt, params) -> tuple[str, list[int]]:
        got: list[int] = []
        cancel_after = 1 + i % 3 if i % 5 == 0 else None
        timeout = 0.05 + 0.05 * (i % 4) if i % 10 == 3 else 60.0
        try:
            n = 0
            stream = client.generate(prompt, params, timeout=timeout)
            async with contextlib.aclosing(stream):  # leaving the block cancels the call
                async for resp in stream:
                    got.extend(resp.token_ids)
                    n += 1
                    if cancel_after is not None and n >= cancel_after and not resp.finish_reason:
                        return "cancelled", got
                    if resp.finish_reason:
                        assert finish_reason_name(resp) in ("stop", "length")
                        assert resp.usage.completion_tokens == len(got)
            return "done", got
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
            return "deadline", got

    async def run():
        clients = [GenerationClient(served.grpc_target) for _ in range(4)]
        try:
            jobs = [one(clients[i % 4], i, p, sp) for i, ((p, sp), _) in enumerate(served.load)]
            return await asyncio.gather(*jobs)
        finally:
            for c in clients:
                await c.close()

    t0 = time.perf_counter()
    results = asyncio.run(run())
    elapsed = time.perf_counter() - t0
    kinds = [k for k, _ in results]
    for (kind, got), (_, ref) in zip(results, served.load):
        if kind == "done":
            assert got == ref.token_ids  # nothing lost, nothing duplicated, equal to solo
        else:
            assert got == ref.token_ids[: len(got)]
    assert kinds.count("done") >= N_LOAD // 2
    assert kinds.count("cancelled") >= N_LOAD // 10
    assert_drained(served)
    assert elapsed < 60, f"load test took {elapsed:.1f}s"


def test_metrics_endpoint(served):
    test_errors_leave_the_server_serving(served)
    r = httpx.post(served.http + "/v1/completions", json={"prompt": "hi", "top_p": 2})
    assert r.status_code == 400
    text = httpx.get(served.http + "/metrics").text
    for name in (
        "jbatch_time_to_first_token_seconds_count",
        "jbatch_inter_token_latency_seconds_count",
        "jbatch_e2e_request_latency_seconds_count",
        "jbatch_queue_depth",
        "jbatch_running_slots",
        "jbatch_slot_utilization",
        "jbatch_kv_pages_used",
        "jbatch_preemptions_total",
        "jbatch_prefix_cache_hit_rate",
        'jbatch_requests_total{finish_reason="length",status="ok"}',
        'jbatch_requests_total{finish_reason="",status="invalid_argument"}',
    ):
        assert name in text, name
    ttft = [
        ln for ln in text.splitlines() if ln.startswith("jbatch_time_to_first_token_seconds_count")
    ]
    assert float(ttft[0].split()[-1]) > 0


# ---- tenants (fair share) -----------------------------------------------------------------------
def test_tenant_reaches_the_engine_from_both_front_ends_and_is_validated(served):
    """HTTP: X-Tenant-Id header, else the OpenAI ``user`` field; gRPC: x-tenant-id metadata,
    else the ``tenant`` field; none -> "default". Per-tenant series appear in /metrics."""
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    url = served.http + "/v1/completions"
    assert httpx.post(url, json={**body, "user": "u-http"}, timeout=30).status_code == 200
    hdr = {"X-Tenant-Id": "h-http"}
    r = httpx.post(url, json={**body, "user": "u-lost"}, headers=hdr, timeout=30)
    assert r.status_code == 200
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        req = build_request([5, 6, 7], GREEDY.replace(max_tokens=3), tenant="g-field")
        list(stub.Generate(req, timeout=30))
        req = build_request([5, 6, 7], GREEDY.replace(max_tokens=3), tenant="g-lost")
        list(stub.Generate(req, metadata=[("x-tenant-id", "g-meta")], timeout=30))
    tenants = served.thread.call(lambda e: e.stats().tenants).result(10)
    for name in ("u-http", "h-http", "g-field", "g-meta"):
        assert tenants[name].output_tokens == 3 and tenants[name].prompt_tokens == 3, name
    assert not {"u-lost", "g-lost"} & set(tenants)
    r = httpx.post(url, json=body, headers={"X-Tenant-Id": "a b"}, timeout=30)
    assert r.status_code == 400 and "X-Tenant-Id" in r.json()["error"]["message"]
    r = httpx.post(url, json={**body, "user": "x" * 200}, timeout=30)
    assert r.status_code == 400 and "user" in r.json()["error"]["message"]
    err = _grpc_error(served.grpc_target, build_request([5], tenant="bad tenant"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "tenant" in err.details()
    text = httpx.get(served.http + "/metrics").text
    assert 'jbatch_tenant_output_tokens_total{tenant="g-meta"} 3.0' in text
    assert 'jbatch_tenant_queue_depth{tenant="u-http"} 0.0' in text
    assert_drained(served)
