"""The OpenAI-compatible HTTP front end (FastAPI): completions, chat completions, models, health,
and Prometheus ``/metrics``. Routes and streaming only: the request models, their translation
into token ids and SamplingParams, and the response bodies are ``serving/openai_protocol.py``
(shared with the batch job).

Beyond OpenAI's fields, requests accept every other SamplingParams field the ``http`` surface of
``jbatch.sampling_surfaces`` exposes (``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ...) and ``priority``; every choice carries the generated
``token_ids``. Text prompts are tokenized here, so the engine thread receives token ids.
Errors are ``{"error": {"message", "type", "code"}}`` with the HTTP status of
:class:`serving.errors.Status`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from serving.context import ServingContext
from serving.engine_thread import Delta, RequestStream
from serving.errors import ServingError, Status
from serving.http_guard import HttpGuard, error_body
from serving.openai_logprobs import LogprobFormatter
from serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    Translated,
    choice,
    joined,
    response_body,
    response_meta,
    translate_chat,
    translate_completion,
    usage,
    validation_message,
)
from serving.tenant import http_tenant
from serving.tool_output import ToolStream

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is there


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
        ctx.metrics.outcome(Status.INVALID_ARGUMENT.label)
        return _error(Status.INVALID_ARGUMENT, validation_message(exc.errors()))

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
        return await _generate(ctx, req, lambda: translate_completion(req), raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        parser = ctx.tool_call_parser
        return await _generate(ctx, req, lambda: translate_chat(req, ctx.tokenizer, parser), raw)

    return app


def _fail(ctx: ServingContext, status: Status, message: str) -> JSONResponse:
    ctx.metrics.outcome(status.label)
    return _error(status, message)


async def _generate(
    ctx: ServingContext,
    req: OpenAIRequest,
    translate: Callable[[], Translated],
    raw: Request,
) -> Response:
    try:
        t = translate()
        if isinstance(t.prompt, str):  # the engine thread gets token ids only
            prompt = await ctx.encode_prompt(t.prompt, add_special_tokens=t.add_special_tokens)
        else:
            prompt = t.prompt
        thread = ctx.engine_thread_or_raise()
        ctx.check_limits(prompt, t.params)
        tenant = http_tenant(raw.headers, req.user)
        stream = thread.submit(prompt, t.params, req.priority, tenant=tenant)
        fmt = t.logprob_formatter(ctx.tokenizer, prompt)
    except ValueError as e:
        return _fail(ctx, Status.INVALID_ARGUMENT, str(e))
    except ServingError as e:
        return _fail(ctx, e.status, e.message)
    meta = response_meta(t.chat, ctx.model_name)
    try:
        first = await anext(stream)  # errors before the first token keep their HTTP status
    except ServingError as e:
        return _error(e.status, e.message)
    except BaseException:
        stream.abort()
        raise
    if req.stream:
        body = _stream_body(stream, first, meta, t, fmt, req.include_usage)
        return StreamingResponse(body, media_type="text/event-stream")
    return await _collect(stream, first, meta, t, fmt, raw)


async def _stream_body(
    stream: RequestStream,
    first: Delta,
    meta: dict,
    t: Translated,
    fmt: LogprobFormatter,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    chat = t.chat
    kind: Literal["chat.completion.chunk", "text_completion"] = (
        "chat.completion.chunk" if chat else "text_completion"
    )
    delta, tokens = first, {}  # tokens: each choice's completion tokens so far
    tool_streams: dict[int, ToolStream] = {}  # per choice (n > 1)
    try:
        while True:
            is_first = delta.index not in tokens  # n > 1: each choice opens its own message
            tokens[delta.index] = delta.completion_tokens
            message, shown = None, delta
            if t.tools is not None:  # text outside calls as content, calls as tool_calls
                if is_first:
                    tool_streams[delta.index] = t.tools.stream()
                message, shown = tool_streams[delta.index].feed(delta)
            parts = [choice(shown, chat, True, is_first, message, fmt)]
            chunk = {**meta, "object": kind, "choices": parts}
            yield _sse(chunk)
            if delta.ends_stream:
                if include_usage:
                    body = usage(delta.prompt_tokens, tokens)
                    yield _sse({**meta, "object": kind, "choices": [], "usage": body})
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
    while not deltas[-1].ends_stream:
        deltas.append(await anext(stream))
    return deltas


async def _collect(
    stream: RequestStream,
    first: Delta,
    meta: dict,
    t: Translated,
    fmt: LogprobFormatter,
    raw: Request,
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
    return JSONResponse(response_body(meta, joined(deltas), t.chat, t.tools, fmt))
