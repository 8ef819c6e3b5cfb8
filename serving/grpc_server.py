"""The gRPC front end: ``jbatch.v1.Generation`` plus grpc.health.v1 and server reflection."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jbatch.outputs import TopLogprobs
from jbatch.sampling_params import SamplingParams
from serving.context import ServingContext
from serving.disagg_decode import DisaggregationService
from serving.engine_thread import Delta
from serving.errors import ServingError, Status
from serving.grpc_guard import GrpcGuard
from serving.openai_logprobs import top_k
from serving.proto.jbatch.v1 import disaggregation_pb2_grpc as disagg_grpc
from serving.proto.jbatch.v1 import generation_pb2 as pb
from serving.proto.jbatch.v1 import generation_pb2_grpc as pb_grpc
from serving.sampling_proto import sampling_params_from_proto
from serving.tenant import grpc_tenant

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "jbatch.v1.Generation"

_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


def _position(token: int | None, entries: TopLogprobs | None, k: int | None) -> pb.PositionLogprobs:
    """One position's logprobs: the token there (when known) and the first ``k`` entries."""
    msg = pb.PositionLogprobs()
    if entries is None:
        return msg  # the first prompt token: nothing precedes it
    one = lambda t, lp: pb.TokenLogprob(
        token_id=t, logprob=lp.logprob, rank=lp.rank or 0, token=lp.decoded_token or ""
    )
    if token in entries:
        msg.token.CopyFrom(one(token, entries[token]))
    msg.top.extend(one(t, lp) for t, lp in top_k(entries, k))
    return msg


def response_from_delta(
    request_id: str, delta: Delta, params: SamplingParams | None = None, prompt=()
) -> pb.GenerateResponse:
    """``params`` / ``prompt``: the request's, for its logprobs (none without them)."""
    resp = pb.GenerateResponse(
        request_id=request_id, token_ids=delta.token_ids, text=delta.text, index=delta.index
    )
    if params is not None and delta.top_logprobs is not None:
        k = params.logprobs
        resp.logprobs.extend(
            _position(t, e, k) for t, e in zip(delta.token_ids, delta.top_logprobs)
        )
    if params is not None and delta.prompt_logprobs is not None:
        k = params.prompt_logprobs
        resp.prompt_logprobs.extend(
            _position(t, e, k) for t, e in zip(prompt, delta.prompt_logprobs)
        )
    if delta.finished:
        resp.finish_reason = _FINISH.get(delta.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
        if isinstance(delta.stop_reason, str):
            resp.stop_string = delta.stop_reason
        elif isinstance(delta.stop_reason, int):
            resp.stop_token_id = delta.stop_reason
        resp.usage.prompt_tokens = delta.prompt_tokens
        resp.usage.completion_tokens = delta.completion_tokens
    return resp


class GenerationService(pb_grpc.GenerationServicer):
    """``jbatch.v1.Generation`` over the shared engine thread."""

    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        ctx = self.ctx
        try:
            asked = (None, [])  # (params, prompt) for logprobs; a resumed stream carries none
            if request.resume:
                stream = self._resume(request)
            else:
                stream, asked = await self._submit(request, context)
        except ValueError as e:
            ctx.metrics.outcome(Status.INVALID_ARGUMENT.label)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ServingError as e:
            ctx.metrics.outcome(e.status.label)
            await context.abort(e.status.grpc_code, e.message)
        async for response in self._stream(request, context, stream, *asked):
            yield response

    def _resume(self, request: pb.GenerateRequest):
        """The stream of a request restored after a restart (serving/resumable.py)."""
        if not request.request_id:
            raise ValueError("resume needs the request_id the stream was started with")
        if request.resume_from_token < 0:
            raise ValueError(f"resume_from_token must be >= 0, got {request.resume_from_token}")
        thread = self.ctx.engine_thread_or_raise()
        return thread.resume(request.request_id, request.resume_from_token)

    async def _submit(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        """A new request's stream, and its (params, prompt ids) for the responses' logprobs
        (ValueError / ServingError: the call fails)."""
        ctx = self.ctx
        params = sampling_params_from_proto(request.sampling_params)
        params = params.replace(n=request.n or 1)  # 0 (unset): one completion
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise ValueError("prompt is required: set text or token_ids")
        thread = ctx.engine_thread_or_raise()
        if kind == "text":
            prompt = await ctx.encode_prompt(request.text)
        else:
            prompt = list(request.token_ids.ids)
        ctx.check_limits(prompt, params)
        tenant = grpc_tenant(context.invocation_metadata(), request.tenant)
        client_id = request.request_id or None
        stream = thread.submit(prompt, params, request.priority, tenant, client_id=client_id)
        return stream, (params, prompt)

    async def _stream(
        self, request, context, stream, params=None, prompt=()
    ) -> AsyncIterator[pb.GenerateResponse]:
        loop = asyncio.get_running_loop()
        remaining = context.time_remaining()
        deadline = None if remaining is None else loop.time() + remaining
        tokens = 0
        try:
            while True:
                timeout = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    delta = await asyncio.wait_for(anext(stream), timeout)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    stream.abort(Status.DEADLINE_EXCEEDED.label)
                    msg = f"deadline exceeded after {tokens} generated tokens"
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, msg)
                except ServingError as e:
                    await context.abort(e.status.grpc_code, e.message)
                tokens += len(delta.token_ids)
                yield response_from_delta(request.request_id, delta, params, prompt)
        finally:
            stream.abort()  # client cancelled / went away: free the slot (no-op when finished)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        info = self.ctx.model_info()
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return pb.ModelInfo(**info)


def build_grpc_server(
    ctx: ServingContext, host: str, port: int, tls: tuple[bytes, bytes] | None = None
) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with Generation, health and reflection, bound (not started); with
    ``tls`` (PEM private key, PEM certificate chain) it listens with TLS only.

    Every call goes through :class:`serving.grpc_guard.GrpcGuard` (API keys, undecodable
    requests); messages are bounded by ``max_body_bytes`` and streams per connection by
    ``max_concurrent_streams``. Returns the server and the port it bound (``port=0``: any).
    """
    limits = ctx.limits
    options = [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", limits.max_body_bytes),
        ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
    ]
    guard = GrpcGuard(ctx.api_keys, ctx.metrics, f"/{SERVICE_NAME}/")
    server = grpc.aio.server(options=options, interceptors=[guard])
    pb_grpc.add_GenerationServicer_to_server(GenerationService(ctx), server)
    # Disaggregated serving: a decode server's side of a handover (serving/disagg_decode.py).
    disagg_grpc.add_DisaggregationServicer_to_server(DisaggregationService(ctx, host), server)
    health_pb2_grpc.add_HealthServicer_to_server(ctx.health, server)
    names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    address = f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, grpc.ssl_server_credentials([tls]))
    if bound == 0:
        raise OSError(f"could not bind the gRPC server to {host}:{port}")
    return server, bound


async def set_health(ctx: ServingContext, serving: bool) -> None:
    """Overall ("") and per-service health: SERVING only while the engine is warm and admitting."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", SERVICE_NAME):
        await ctx.health.set(name, status)
