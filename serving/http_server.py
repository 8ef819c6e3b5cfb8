"""The OpenAI-compatible HTTP front end (FastAPI): completions, chat completions, models, health,
and Prometheus ``/metrics``.

Beyond OpenAI's fields, requests accept every other SamplingParams field the ``http`` surface of
``jbatch.sampling_surfaces`` exposes (``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``prompt_logprobs``, ...) and ``priority``; every choice
carries the generated ``token_ids``. Logprobs come in OpenAI's shapes
(``serving/openai_logprobs.py``). Text prompts are tokenized here, so the engine thread
receives token ids.
Errors are ``{"error": {"message", "type", "code"}}`` with the HTTP status of
:class:`serving.errors.Status`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, create_model
from starlette.exceptions import HTTPException

from jbatch.sampling_params import MAX_LOGPROBS, SamplingParams
from jbatch.sampling_surfaces import SurfaceField, surface_fields
from serving.chat_template import render_chat
from serving.context import ServingContext
from serving.engine_thread import Delta, RequestStream
from serving.errors import ServingError, Status
from serving.http_guard import HttpGuard, error_body
from serving.openai_logprobs import LogprobFormatter
from serving.tenant import http_tenant

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is there


class _RequestFields(BaseModel):
    """What both endpoints take besides the sampling fields (:func:`sampling_request_model`)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1  # OpenAI's choices per request: one here
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    priority: int = 0
    user: str | None = None  # OpenAI's end-user id: the tenant (the X-Tenant-Id header wins)

    sampling_fields: ClassVar[tuple[SurfaceField, ...]] = ()
    params_cls: ClassVar[type[SamplingParams]] = SamplingParams

    def sampling_params(self) -> SamplingParams:
        """Absent or null fields take the Python default; raises ValueError naming a field."""
        if self.n != 1:
            raise ValueError(f"n must be 1 (one completion per request), got {self.n}")
        kwargs = {}
        for field in self.sampling_fields:
            value = getattr(self, field.surface_name)
            kwargs[field.name] = field.default if value is None else value
        return self.params_cls(**{**kwargs, **self.logprob_params()})

    def logprob_params(self) -> dict[str, Any]:
        """SamplingParams fields the endpoint takes in its own (OpenAI) form."""
        return {}


def _json_type(field: SurfaceField) -> Any:
    """The request type of a field, always nullable (null means the default)."""
    kind = field.shape.kind
    if not field.shape.repeated:
        return kind | None
    if field.shape.accepts_single:
        return kind | list[kind] | None
    return list[kind] | None


def sampling_request_model(params_cls: type[SamplingParams] = SamplingParams) -> type:
    """:class:`_RequestFields` plus one field per SamplingParams field the ``http`` surface
    exposes (``jbatch.sampling_surfaces``), under its surface name."""
    fields = tuple(surface_fields("http", params_cls))
    definitions: dict[str, Any] = {f.surface_name: (_json_type(f), None) for f in fields}
    clash = sorted(set(definitions) & set(_RequestFields.model_fields))
    if clash:
        raise TypeError(f"http: SamplingParams fields {clash} clash with request fields")
    model = create_model("SamplingFields", __base__=_RequestFields, **definitions)
    model.sampling_fields = fields
    model.params_cls = params_cls
    return model


_SamplingFields = sampling_request_model()


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None  # top logprobs per token; with echo, of the prompt's too

    def logprob_params(self) -> dict[str, Any]:
        if self.logprobs is None:
            return {}
        if self.echo and self.prompt_logprobs is None:
            return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs}
        return {"logprobs": self.logprobs}


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: this many top tokens per token

    def logprob_params(self) -> dict[str, Any]:
        k = self.top_logprobs
        if not self.logprobs:
            if k is not None:
                raise ValueError(f"top_logprobs={k} needs logprobs: true")
            return {}
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {k}")
        return {"logprobs": 0 if k is None else k}


def _error(status: Status, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status.http_status)


def _sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def build_app(ctx: ServingContext) -> FastAPI:
    """The FastAPI application of one server."""
    app = FastAPI(title="jbatch", docs_url=None, redoc_url=None)
    app.add_middleware(
        HttpGuard, keys=ctx.api_keys, limit=ctx.limits.max_body_bytes, metrics=ctx.metrics
    )

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own errors (404, 405, a body over the limit) in the OpenAI shape."""
        body = {"error": {"message": str(exc.detail), "type": "http", "code": exc.status_code}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        ctx.metrics.outcome(Status.INVALID_ARGUMENT.label)
        return _error(Status.INVALID_ARGUMENT, f"{field}: {first.get('msg', 'invalid value')}")

    @app.get("/health")
    async def health() -> Response:
        if ctx.ready:
            return JSONResponse({"status": "ok"})
        state = "loading" if ctx.engine_thread is None else "shutting down"
        return JSONResponse({"status": state}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> Response:
        info = ctx.model_info()
        if info is None:
            return _error(Status.UNAVAILABLE, "the model is still loading")
        card = {
            "id": ctx.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "jbatch",
            "max_model_len": info["max_seq_len"],
            "limits": info["limits"],
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                msg = f"prompt: one prompt per request, got a list of {len(prompt)}"
                return _fail(ctx, Status.INVALID_ARGUMENT, msg)
            prompt = prompt[0]
        return await _generate(ctx, req, prompt, chat=False, raw=raw, echo=req.echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        if req.max_completion_tokens is not None:
            req.max_tokens = req.max_completion_tokens
        try:
            messages = [_flatten_content(m) for m in req.messages]
            text = render_chat(ctx.tokenizer, messages, req.add_generation_prompt)
            # The template writes special tokens (BOS...) itself.
            prompt = await ctx.encode_prompt(text, add_special_tokens=False)
        except ValueError as e:
            return _fail(ctx, Status.INVALID_ARGUMENT, str(e))
        except ServingError as e:
            return _fail(ctx, e.status, e.message)
        return await _generate(ctx, req, prompt, chat=True, raw=raw)

    return app


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content parts ``[{"type": "text", "text": ...}]`` -> one string."""
    content = message.get("content")
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and "text" in p]
        message = {**message, "content": "".join(parts)}
    return message


def _fail(ctx: ServingContext, status: Status, message: str) -> JSONResponse:
    ctx.metrics.outcome(status.label)
    return _error(status, message)


async def _generate(
    ctx: ServingContext,
    req: _SamplingFields,
    prompt: str | list[int],
    chat: bool,
    raw: Request,
    echo: bool = False,
) -> Response:
    try:
        params = req.sampling_params()
        thread = ctx.engine_thread_or_raise()
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str):
            prompt = await ctx.encode_prompt(prompt)  # the engine thread gets token ids only
        ctx.check_limits(prompt, params)
        if echo and text is None:
            text = "" if ctx.tokenizer is None else ctx.tokenizer.decode(prompt)
        fmt = LogprobFormatter(
            ctx.tokenizer, chat, params.logprobs, (text, prompt) if echo else None,
            params.prompt_logprobs,
        )  # fmt: skip
        tenant = http_tenant(raw.headers, req.user)
        stream = thread.submit(prompt, params, req.priority, tenant=tenant)
    except ValueError as e:
        return _fail(ctx, Status.INVALID_ARGUMENT, str(e))
    except ServingError as e:
        return _fail(ctx, e.status, e.message)
    meta = {
        "id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12),
        "created": int(time.time()),
        "model": ctx.model_name,
    }
    try:
        first = await anext(stream)  # errors before the first token keep their HTTP status
    except ServingError as e:
        return _error(e.status, e.message)
    except BaseException:
        stream.abort()
        raise
    if req.stream:
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        body = _stream_body(stream, first, meta, fmt, include_usage)
        return StreamingResponse(body, media_type="text/event-stream")
    return await _collect(stream, first, meta, fmt, raw)


def _choice(delta: Delta, fmt: LogprobFormatter, streaming: bool, first: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0}
    text = fmt.text(delta.text, first)
    if fmt.chat:
        if streaming:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    prompt = delta.prompt_logprobs if first else None
    choice["logprobs"] = fmt.choice_logprobs(delta.token_ids, delta.top_logprobs, prompt)
    if first and fmt.prompt_k is not None:
        choice["prompt_logprobs"] = fmt.prompt_logprobs(delta.prompt_logprobs)
    choice["token_ids"] = delta.token_ids
    choice["finish_reason"] = delta.finish_reason
    if delta.finished:
        choice["stop_reason"] = delta.stop_reason
    return choice


def _usage(delta: Delta) -> dict[str, int]:
    return {
        "prompt_tokens": delta.prompt_tokens,
        "completion_tokens": delta.completion_tokens,
        "total_tokens": delta.prompt_tokens + delta.completion_tokens,
    }


async def _stream_body(
    stream: RequestStream, first: Delta, meta: dict, fmt: LogprobFormatter, include_usage: bool
) -> AsyncIterator[bytes]:
    chat = fmt.chat
    kind: Literal["chat.completion.chunk", "text_completion"] = (
        "chat.completion.chunk" if chat else "text_completion"
    )
    delta, is_first = first, True
    try:
        while True:
            chunk = {**meta, "object": kind, "choices": [_choice(delta, fmt, True, is_first)]}
            yield _sse(chunk)
            is_first = False
            if delta.finished:
                if include_usage:
                    yield _sse({**meta, "object": kind, "choices": [], "usage": _usage(delta)})
                break
            try:
                delta = await anext(stream)
            except ServingError as e:  # the status line is sent already: report in-band
                body = {"message": e.message, "type": e.status.label, "code": e.status.http_status}
                yield _sse({"error": body})
                break
        yield _sse("[DONE]")
    finally:
        stream.abort()  # client disconnected: free the slot (no-op when finished)


async def _rest(stream: RequestStream, first: Delta) -> list[Delta]:
    deltas = [first]
    while not deltas[-1].finished:
        deltas.append(await anext(stream))
    return deltas


async def _collect(
    stream: RequestStream, first: Delta, meta: dict, fmt: LogprobFormatter, raw: Request
) -> Response:
    """Gather a whole completion; a client that disconnects meanwhile aborts the request."""
    task = asyncio.ensure_future(_rest(stream, first))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                return Response(status_code=499)  # nobody is listening; the abort is below
        deltas = task.result()
    except ServingError as e:
        return _error(e.status, e.message)
    finally:
        stream.abort()
    last = deltas[-1]
    whole = Delta(
        token_ids=[t for d in deltas for t in d.token_ids],
        text="".join(d.text for d in deltas),
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        top_logprobs=_joined_top_logprobs(deltas),
        prompt_logprobs=first.prompt_logprobs,
    )
    body = {
        **meta,
        "object": "chat.completion" if fmt.chat else "text_completion",
        "choices": [_choice(whole, fmt, False, True)],
        "usage": _usage(whole),
    }
    return JSONResponse(body)


def _joined_top_logprobs(deltas: list[Delta]) -> list | None:
    tops = [d.top_logprobs for d in deltas if d.top_logprobs is not None]
    return [t for top in tops for t in top] if tops else None
