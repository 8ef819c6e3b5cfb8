"""GrpcGuard: the server interceptor in front of every gRPC method — API keys and bad bytes.

* Authentication: with API keys configured, a call needs ``authorization: Bearer KEY``
  metadata, else it ends UNAUTHENTICATED before its handler runs. ``grpc.health.v1.Health``
  stays open (load balancers probe it without credentials).
* Undecodable requests: a message that does not parse (truncated bytes, invalid UTF-8 in a
  ``string`` field...) ends INVALID_ARGUMENT naming the method, where grpcio would answer
  UNKNOWN ("Unexpected DecodeError").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from serving.auth import UNAUTHENTICATED_MESSAGE, ApiKeys
from serving.errors import Status
from serving.metrics import ServingMetrics

OPEN_SERVICE_PREFIX = "/grpc.health.v1.Health/"


class _Undecodable:
    """Stands for a request whose bytes did not parse; the handler answers INVALID_ARGUMENT."""

    def __init__(self, error: Exception):
        self.error = error


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as e:
            return _Undecodable(e)

    return parse


def _replace(handler: grpc.RpcMethodHandler, behavior: Callable, **kw) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` with a new behavior (and serializers)."""
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
        **kw,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(behavior, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(behavior, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(behavior, **kw)
    return grpc.stream_stream_rpc_method_handler(behavior, **kw)


def _refusal(status: Status, message: str) -> Callable:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(status.grpc_code, message)

    return refuse


def _decode_checked(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """Unary-request methods (Generate, GetModelInfo) answer bad bytes with INVALID_ARGUMENT."""
    inner = handler.unary_unary or handler.unary_stream
    if inner is None:
        return handler
    if handler.unary_stream:

        async def behavior(request: Any, context: grpc.aio.ServicerContext):
            if isinstance(request, _Undecodable):
                msg = f"{method}: the request does not parse: {request.error}"
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg)
            async for item in inner(request, context):
                yield item

    else:

        async def behavior(request: Any, context: grpc.aio.ServicerContext):
            if isinstance(request, _Undecodable):
                msg = f"{method}: the request does not parse: {request.error}"
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg)
            return await inner(request, context)

    return _replace(handler, behavior, request_deserializer=_lenient(handler.request_deserializer))


class GrpcGuard(grpc.aio.ServerInterceptor):
    """Authentication and decode checks for every method of one server."""

    def __init__(self, keys: ApiKeys, metrics: ServingMetrics, checked_prefix: str):
        self.keys, self.metrics, self.checked_prefix = keys, metrics, checked_prefix

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method
        if self.keys.enabled and not method.startswith(OPEN_SERVICE_PREFIX):
            metadata = dict(details.invocation_metadata or ())
            if not self.keys.allows(metadata.get("authorization")):
                self.metrics.outcome(Status.UNAUTHENTICATED.label)
                refuse = _refusal(Status.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
                return _replace(handler, refuse, request_deserializer=None)
        if method.startswith(self.checked_prefix):
            return _decode_checked(handler, method)
        return handler
