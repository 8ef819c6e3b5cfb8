"""GenerationClient: a small asyncio gRPC client for ``jbatch.v1.Generation``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

import grpc

from jbatch.sampling_params import SamplingParams
from serving.proto.jbatch.v1 import generation_pb2 as pb
from serving.proto.jbatch.v1 import generation_pb2_grpc as pb_grpc
from serving.sampling_proto import sampling_params_to_proto

_FINISH_NAMES = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


# A call the server refused before reading it (HTTP/2 RST_STREAM REFUSED_STREAM when a
# connection is over the server's max_concurrent_streams, as it can briefly be while the
# server retires a finished stream) surfaces as UNAVAILABLE. gRPC retries a call only until
# its first response arrives, so no generated token is ever asked for twice.
RETRY_SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{"service": "jbatch.v1.Generation"}],
        "retryPolicy": {
            "maxAttempts": 4, "initialBackoff": "0.05s", "maxBackoff": "1s",
            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }]
})  # fmt: skip


@dataclasses.dataclass
class Completion:
    """A whole streamed completion, put together."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


def finish_reason_name(resp: pb.GenerateResponse) -> str | None:
    """ "stop" / "length" / "abort", or None while unfinished."""
    return _FINISH_NAMES.get(resp.finish_reason)


def build_request(
    prompt: str | Sequence[int],
    params: SamplingParams | None = None,
    request_id: str = "",
    priority: int = 0,
    tenant: str = "",
) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id, priority=priority, tenant=tenant)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    if params is not None:  # n travels in GenerateRequest (SamplingParams reserves the name)
        req.sampling_params.CopyFrom(sampling_params_to_proto(params.replace(n=1)))
        req.n = params.n
    return req


class GenerationClient:
    """``async with GenerationClient("127.0.0.1:50051") as c: async for r in c.generate(...)``.

    ``tls_ca``: a PEM file of the CA (or the self-signed certificate) to trust; the channel
    then uses TLS. ``api_key``: sent as ``authorization: Bearer KEY`` metadata on every call.
    """

    def __init__(self, target: str, *, tls_ca: str | None = None, api_key: str | None = None):
        options = [("grpc.enable_retries", 1), ("grpc.service_config", RETRY_SERVICE_CONFIG)]
        if tls_ca is None:
            self.channel = grpc.aio.insecure_channel(target, options=options)
        else:
            with open(tls_ca, "rb") as f:
                credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
            self.channel = grpc.aio.secure_channel(target, credentials, options=options)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self._metadata = () if not api_key else (("authorization", f"Bearer {api_key}"),)

    async def __aenter__(self) -> GenerationClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str = "",
        priority: int = 0,
        tenant: str = "",
        timeout: float | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream responses; raises grpc.aio.AioRpcError on a non-OK status. Leaving the loop
        early cancels the call (the server aborts the request)."""
        request = build_request(prompt, params, request_id, priority, tenant)
        call = self.stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            async for resp in call:
                yield resp
        finally:
            call.cancel()

    async def complete(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, **kw
    ) -> Completion:
        """Generate to the end and return the pieces put together."""
        text, ids, last = [], [], pb.GenerateResponse()
        async with contextlib.aclosing(self.generate(prompt, params, **kw)) as stream:
            async for resp in stream:
                text.append(resp.text)
                ids.extend(resp.token_ids)
                last = resp
        return Completion(
            "".join(text),
            ids,
            finish_reason_name(last),
            last.usage.prompt_tokens,
            last.usage.completion_tokens,
        )

    async def model_info(self, timeout: float | None = 10.0) -> pb.ModelInfo:
        request = pb.GetModelInfoRequest()
        return await self.stub.GetModelInfo(request, timeout=timeout, metadata=self._metadata)
