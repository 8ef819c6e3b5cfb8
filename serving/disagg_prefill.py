"""The prefill side of disaggregated serving: the engine of ``jbatch serve --role prefill
--decode-peers HOST:PORT,...`` (``docs/scaling.md``).

:class:`RemoteDecodeEngine` implements :class:`jbatch.engine.interface.EngineClient` over a
``role="prefill"`` :class:`LLMEngine`, so the server's engine thread and both front ends are
those of a mixed server: clients talk to the prefill server only and get the same gRPC/HTTP
streams. Per request:

1. The prefill engine runs the prompt and samples the first token (streamed to the client as
   usual), then hands the request over (``jbatch/engine/handover.py``).
2. Its KV pages and slot rows are offered on this process's JAX transfer server
   (``serving/kv_transfer.py``), and a ``Handover`` call (``disaggregation.proto``: the record
   as JSON, the transfer id, shapes, page count) goes to the decode peer with the most free pages
   (polled with ``PoolStatus``). The prefill pool's pages are free as soon as the slot is
   copied out: a decode peer that fails can never leak them.
3. The call's stream — the decode server's deltas — is relayed: each message becomes a
   ``RequestOutput`` of the original request, returned by the next ``step()``. The prefill
   server proxies the stream (simplest correct design: one client connection, one API).

Faults: a peer that refuses or fails a handover before sending anything (UNAVAILABLE: down,
draining; RESOURCE_EXHAUSTED: queue full) is skipped and the next peer tried with a fresh offer
of the same copy. A peer that fails after its first output (dies mid-stream) fails the request
with UNAVAILABLE (``RequestOutput.error_kind``; not re-run: the client already has tokens); no
peer reachable: UNAVAILABLE at once, never a hang. gRPC calls run on a private event loop
thread; the engine thread never waits on the network.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import threading
from collections.abc import Sequence

import grpc

from jbatch.engine import handover
from jbatch.engine.handover_wire import record_to_json, top_from_list
from jbatch.engine.interface import EngineStats, StepFailed
from jbatch.engine.llm_engine import LLMEngine
from jbatch.outputs import CompletionOutput, RequestOutput
from serving.kv_transfer import KvTransfer
from serving.proto.jbatch.v1 import disaggregation_pb2 as pb
from serving.proto.jbatch.v1 import disaggregation_pb2_grpc as pb_grpc

POLL_SECONDS = 0.5  # how often each peer's PoolStatus is read
_IDLE_WAIT_S = 0.005  # step() with only relays in flight waits this long for their outputs
_RETRY_ON_ANOTHER_PEER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclasses.dataclass(eq=False)
class _Peer:
    address: str
    stub: pb_grpc.DisaggregationStub
    free_pages: int | None = None  # None: not reachable at the last poll


@dataclasses.dataclass
class _Relay:
    record: handover.HandoverRecord
    future: object  # concurrent.futures.Future of the relay coroutine
    done: bool = False


class RemoteDecodeEngine:
    """A prefill engine whose requests decode on remote peers (see the module docstring)."""

    def __init__(
        self,
        engine: LLMEngine,
        peers: Sequence[str],
        host: str = "127.0.0.1",
        api_key: str | None = None,
    ):
        """``peers``: the decode servers' gRPC addresses; ``host``: where this process's transfer
        server listens; ``api_key``: sent to the peers (their ``--api-key``), if any."""
        if engine.cfg.role != "prefill":
            role = engine.cfg.role
            raise ValueError(f"RemoteDecodeEngine needs a role='prefill' engine, got {role!r}")
        if not peers:
            raise ValueError("--decode-peers is empty: give at least one HOST:PORT")
        self.engine = engine
        self.model_cfg, self.cfg, self.tokenizer = engine.model_cfg, engine.cfg, engine.tokenizer
        self.eos_ids = engine.eos_ids
        self.transfer = KvTransfer(host)
        self._outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._relays: dict[str, _Relay] = {}  # engine thread only
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="jbatch-peers", daemon=True).start()
        self._peers = self._on_loop(self._connect(list(peers)))
        self._poller = asyncio.run_coroutine_threadsafe(self._poll_forever(), self._loop)
        self.handovers = 0
        self.retries = 0  # handovers a peer refused before its first output, tried elsewhere
        self.withdrawn = 0  # offers taken back from peers that failed without pulling them

    def _on_loop(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _connect(self, addresses: list[str]) -> list[_Peer]:
        peers = []
        for address in addresses:
            channel = grpc.aio.insecure_channel(address)
            peers.append(_Peer(address, pb_grpc.DisaggregationStub(channel)))
        await asyncio.gather(*(self._poll(p) for p in peers))
        return peers

    async def _poll(self, peer: _Peer) -> None:
        try:
            request, meta = pb.PoolStatusRequest(), self._metadata
            status = await peer.stub.PoolStatus(request, timeout=2.0, metadata=meta)
            peer.free_pages = status.free_pages
        except grpc.aio.AioRpcError:
            peer.free_pages = None

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(POLL_SECONDS)
            await asyncio.gather(*(self._poll(p) for p in self._peers))

    def pick_peer(self, exclude: Sequence[_Peer] = ()) -> _Peer | None:
        """The peer (not in ``exclude``) with the most free pages; when none answered the last
        poll, one that did not (the poll may be stale: a refused connection fails fast);
        None when every peer is excluded."""
        left = [p for p in self._peers if p not in exclude]
        alive = [p for p in left if p.free_pages is not None]
        if alive:
            return max(alive, key=lambda p: p.free_pages)
        return left[0] if left else None

    # ---- EngineClient --------------------------------------------------------------------------
    def add_request(self, prompt, params=None, request_id=None, *args, **kwargs) -> str:
        if params is not None and params.n > 1:
            raise ValueError(f"n={params.n}: disaggregated serving runs n == 1 requests only")
        if request_id is not None and str(request_id) in self._relays:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self.engine.add_request(prompt, params, request_id, *args, **kwargs)

    def abort_request(self, request_id: str) -> None:
        relay = self._relays.get(request_id)
        if relay is None:
            self.engine.abort_request(request_id)
        elif not relay.done:
            relay.done = True
            relay.future.cancel()  # cancels the call: the peer aborts and frees its pages

    def forget(self, request_id: str) -> bool:
        relay = self._relays.get(request_id)
        if relay is None:
            return self.engine.forget(request_id)
        if not relay.done:
            return False
        del self._relays[request_id]
        return True

    def has_unfinished_requests(self) -> bool:
        return (
            self.engine.has_unfinished_requests()
            or bool(self.engine.handed_over)
            or any(not r.done for r in self._relays.values())
            or not self._outputs.empty()
        )

    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        try:
            if self.engine.has_unfinished_requests():
                outputs += self.engine.step()
        except StepFailed as e:
            e.outputs.extend(self._relayed(wait=False))
            raise
        for record, saved in handover.take_ready(self.engine):
            self._hand_over(record, saved)
        return outputs + self._relayed(wait=not outputs)

    def _relayed(self, wait: bool) -> list[RequestOutput]:
        """Outputs the relays have received (``wait``: block briefly for the first one)."""
        outputs = []
        if wait and not self.engine.has_unfinished_requests():
            try:
                outputs.append(self._outputs.get(timeout=_IDLE_WAIT_S))
            except queue.Empty:
                return []
        while not self._outputs.empty():
            outputs.append(self._outputs.get())
        for out in outputs:
            relay = self._relays.get(out.request_id)
            if out.finished and relay is not None:
                relay.done = True
        return outputs

    def stats(self) -> EngineStats:
        """The prefill engine's; requests decoding on a peer count as running."""
        stats = self.engine.stats()
        relayed = sum(not r.done for r in self._relays.values())
        return dataclasses.replace(stats, running=stats.running + relayed)

    def reset(self, requeue_waiting: bool = True) -> list[str]:
        return self.engine.reset(requeue_waiting)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._poller.cancel)

    # ---- handing over --------------------------------------------------------------------------
    def _hand_over(self, record: handover.HandoverRecord, saved) -> None:
        future = asyncio.run_coroutine_threadsafe(self._relay(record, saved), self._loop)
        self._relays[record.request_id] = _Relay(record, future)
        self.handovers += 1

    async def _relay(self, record: handover.HandoverRecord, saved) -> None:
        """Hand ``record`` over and relay the peer's stream into outputs of the request (on the
        peers' loop). A peer that refuses or fails before its first output (UNAVAILABLE, or
        RESOURCE_EXHAUSTED: a full queue) is skipped and the next one tried with a fresh offer
        of the same copy; after the first output a failure ends the request."""
        tried: list[_Peer] = []
        while (peer := self.pick_peer(exclude=tried)) is not None:
            tried.append(peer)
            uuid, specs = self.transfer.offer(saved)
            msg = pb.HandoverRequest(
                request_id=record.request_id, transfer_address=self.transfer.address,
                transfer_uuid=uuid, num_pages=record.num_pages,
                record_json=record_to_json(record),
                arrays=[pb.ArraySpec(shape=s, dtype=d) for s, d in specs],
            )  # fmt: skip
            if peer.free_pages is not None:
                peer.free_pages -= record.num_pages  # until the next poll
            started = False
            try:
                async for out in peer.stub.Handover(msg, metadata=self._metadata):
                    started, saved = True, None  # the peer has the request: drop the copy
                    self._outputs.put(_output(record, out))
                    if out.finish_reason:
                        return
                self._outputs.put(_failed(record, f"decode peer {peer.address} ended the stream"))
                return
            except grpc.aio.AioRpcError as e:
                if not started and not _pulled(e):
                    self._withdraw(uuid, saved)
                if not started and e.code() in _RETRY_ON_ANOTHER_PEER:
                    self.retries += 1
                    continue
                kind = "unavailable" if e.code() == grpc.StatusCode.UNAVAILABLE else e.code().name
                detail = f"decode peer {peer.address}: {e.code().name}: {e.details()}"
                self._outputs.put(_failed(record, detail, kind.lower()))
                return
        self._outputs.put(_failed(record, "no decode peer is reachable"))

    def _withdraw(self, uuid: int, saved) -> None:
        """Take back the offer a failed peer did not pull (a thread of its own: if the peer did
        pull it before failing, the self-pull never returns)."""
        withdraw = self.transfer.withdraw
        threading.Thread(target=withdraw, args=(uuid, saved), daemon=True).start()
        self.withdrawn += 1


def _pulled(error: grpc.aio.AioRpcError) -> bool:
    """Whether the failed call's peer had pulled the KV (``disagg_decode.PULLED``)."""
    return dict(error.trailing_metadata() or ()).get("jbatch-kv-pulled") == "1"


def _output(record: handover.HandoverRecord, out: pb.HandoverOutput) -> RequestOutput:
    stop = out.WhichOneof("stop")
    top = None
    if out.top_logprobs_json:
        top = [top_from_list(t) for t in json.loads(out.top_logprobs_json)]
    completion = CompletionOutput(
        0, out.text, list(out.token_ids), None, None, out.finish_reason or None,
        getattr(out, stop) if stop else None, out.completion_tokens, top,
    )  # fmt: skip
    finished = bool(out.finish_reason)
    prompt_ids = list(record.prompt_ids)
    return RequestOutput(record.request_id, record.prompt, prompt_ids, [completion], finished)


def _failed(record: handover.HandoverRecord, error: str, kind="unavailable") -> RequestOutput:
    completion = CompletionOutput(0, "", [], None, None, "error", None, len(record.output_ids))
    return RequestOutput(
        record.request_id, record.prompt, list(record.prompt_ids), [completion], True,
        error=error, error_kind=kind,
    )  # fmt: skip
