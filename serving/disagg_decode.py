"""The decode side of disaggregated serving: ``jbatch.v1.Disaggregation`` on a ``--role decode``
server (``docs/scaling.md``).

``Handover``: parse the host record (``jbatch/engine/handover_wire.py``), pull the request's KV
pages and slot rows from the prefill server's JAX transfer server (``serving/kv_transfer.py``)
onto this engine's placement, queue the request on the engine thread
(:meth:`EngineThread.adopt`: it waits like a swapped-out request and is swapped into this pool's
pages), then stream its outputs back, one ``HandoverOutput`` per engine step. Cancelling the
call aborts the request. ``PoolStatus``: this pool's free pages, for the prefill server's
choice of peer. Servers of another role answer FAILED_PRECONDITION.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator

import grpc
import jax
import jax.numpy as jnp

from jbatch.engine import buckets, handover, swap
from jbatch.engine.handover_wire import record_from_json, top_to_list
from serving.context import ServingContext
from serving.errors import ServingError, Status
from serving.kv_transfer import KvTransfer
from serving.proto.jbatch.v1 import disaggregation_pb2 as pb
from serving.proto.jbatch.v1 import disaggregation_pb2_grpc as pb_grpc

PULL_TIMEOUT_S = 30.0  # a handover whose KV pages take longer fails with UNAVAILABLE
PULLED = (("jbatch-kv-pulled", "1"),)  # trailing metadata of a call whose KV was pulled


def output_of(delta) -> pb.HandoverOutput:
    """One stream delta of the decode server as the message the prefill server relays."""
    out = pb.HandoverOutput(
        token_ids=delta.token_ids, text=delta.text, finish_reason=delta.finish_reason or "",
        completion_tokens=delta.completion_tokens,
    )  # fmt: skip
    if isinstance(delta.stop_reason, str):
        out.stop_string = delta.stop_reason
    elif isinstance(delta.stop_reason, int):
        out.stop_token_id = delta.stop_reason
    if delta.top_logprobs is not None:
        out.top_logprobs_json = json.dumps([top_to_list(t) for t in delta.top_logprobs]).encode()
    return out


class DisaggregationService(pb_grpc.DisaggregationServicer):
    def __init__(self, ctx: ServingContext, host: str = "127.0.0.1"):
        self.ctx, self.host = ctx, host  # the transfer server binds ``host``
        self._transfer: KvTransfer | None = None
        self._layout = None  # (template SwappedSlot, its shardings), read once

    async def _decode_thread(self, context):
        thread = self.ctx.engine_thread_or_raise()
        if thread.engine.cfg.role != "decode":
            role = thread.engine.cfg.role
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this server is {role!r}")
        if self._layout is None:
            self._layout = await asyncio.wrap_future(thread.call(_slot_layout))
            self._transfer = self._transfer or KvTransfer(self.host)
        return thread

    async def Handover(
        self, request: pb.HandoverRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.HandoverOutput]:
        try:
            thread = await self._decode_thread(context)
            record = record_from_json(request.record_json)
            specs = [(tuple(a.shape), a.dtype) for a in request.arrays]
            saved = await self._pull(request, specs)
            context.set_trailing_metadata(PULLED)  # the prefill server need not withdraw it
            admit = lambda engine, rid: handover.admit(
                engine, dataclasses.replace(record, request_id=rid), saved
            )
            stream = thread.adopt(admit)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e), _trailing(context))
        except ServingError as e:
            await context.abort(e.status.grpc_code, e.message, _trailing(context))
        try:
            async for delta in stream:
                yield output_of(delta)
        except ServingError as e:
            await context.abort(e.status.grpc_code, e.message, _trailing(context))
        finally:
            stream.abort()  # the prefill server cancelled or went away: free the pages

    async def _pull(self, request: pb.HandoverRequest, specs):
        """The handed-over arrays, all bytes arrived: a failed or stalled pull fails this call
        (UNAVAILABLE), never the engine's next step. jax 0.10.2's pull has no working timeout:
        a pull that never completes leaves one worker thread waiting."""
        pull, layout = self._transfer.pull, self._layout
        template = layout.template(request.num_pages)  # ValueError: too many pages
        args = (request.transfer_address, request.transfer_uuid, specs, template, layout.sharding)
        pulled = lambda: jax.block_until_ready(pull(*args))  # pull blocks if no such offer
        try:
            return await asyncio.wait_for(asyncio.to_thread(pulled), PULL_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as e:  # JaxRuntimeError: the peer went away
            msg = f"pulling the KV pages from {request.transfer_address} failed: {e!r}"
            raise ServingError(Status.UNAVAILABLE, msg) from None

    async def PoolStatus(
        self, request: pb.PoolStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.PoolStatusResponse:
        try:
            thread = await self._decode_thread(context)
        except ServingError as e:
            await context.abort(e.status.grpc_code, e.message, _trailing(context))
        return await asyncio.wrap_future(thread.call(_pool_status))


@dataclasses.dataclass
class _SlotLayout:
    """What a handed-over slot must look like here: the engine state's shapes, the config, the
    placement of a swapped slot."""

    state: object  # EngineState of ShapeDtypeStructs
    cfg: object
    sharding: object
    _templates: dict = dataclasses.field(default_factory=dict)

    def template(self, num_pages: int):
        """A SwappedSlot of ShapeDtypeStructs for a handover of ``num_pages`` pages."""
        n = buckets.pick_handover_bucket(self.cfg, num_pages)
        if n not in self._templates:
            pages = jax.ShapeDtypeStruct((n,), jnp.int32)
            self._templates[n] = jax.eval_shape(swap.swap_out, self.state, 0, pages)[1]
        return self._templates[n]


def _trailing(context) -> tuple:
    """The trailing metadata set so far (an abort would otherwise drop it)."""
    return tuple(context.trailing_metadata() or ())


def _slot_layout(engine) -> _SlotLayout:
    state = jax.eval_shape(lambda s: s, engine.state)
    return _SlotLayout(state, engine.cfg, engine.core.swapped_sharding)


def _pool_status(engine) -> pb.PoolStatusResponse:
    stats, free = engine.stats(), handover.free_pages(engine.scheduler)
    return pb.PoolStatusResponse(
        free_pages=free, total_pages=stats.pages_total, running=stats.running,
        waiting=stats.waiting,
    )  # fmt: skip
