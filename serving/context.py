"""ServingContext: what the gRPC and HTTP front ends share (engine thread, metrics, health)."""

from __future__ import annotations

import asyncio
from typing import Any

from grpc_health.v1 import health

from jbatch.engine.interface import EngineClient
from jbatch.sampling_params import SamplingParams
from jbatch.tokenizer import Tokenizer
from serving.auth import ApiKeys
from serving.engine_thread import EngineThread
from serving.errors import ServingError, Status
from serving.limits import RequestLimits
from serving.metrics import ServingMetrics

# Text prompts at least this long are encoded on a worker thread, so that a long prompt does
# not stall the event loop (and every other stream on it); shorter ones are not worth the hop.
ENCODE_OFF_LOOP_CHARS = 4096


class ServingContext:
    """Shared state of one server. ``engine_thread`` is None until the model is loaded."""

    def __init__(
        self,
        model_name: str,
        metrics: ServingMetrics | None = None,
        *,
        limits: RequestLimits | None = None,
        api_keys: ApiKeys | None = None,
        tool_call_parser: str = "auto",
    ):
        self.model_name = model_name
        self.tool_call_parser = tool_call_parser  # serving/tool_parsers.py: PARSER_CHOICES
        self.metrics = metrics or ServingMetrics()
        self.limits = limits or RequestLimits()
        self.api_keys = api_keys or ApiKeys()
        self.health = health.aio.HealthServicer()
        self.engine_thread: EngineThread | None = None

    @property
    def engine(self) -> EngineClient | None:
        return None if self.engine_thread is None else self.engine_thread.engine

    @property
    def tokenizer(self) -> Tokenizer | None:
        engine = self.engine
        return None if engine is None else engine.tokenizer

    @property
    def ready(self) -> bool:
        """Loaded, warm and admitting requests."""
        return self.engine_thread is not None and self.engine_thread.accepting

    def engine_thread_or_raise(self) -> EngineThread:
        """The engine thread, or ServingError UNAVAILABLE while loading / after shutdown."""
        thread = self.engine_thread
        if thread is None:
            raise ServingError(Status.UNAVAILABLE, "the model is still loading")
        return thread

    async def encode_prompt(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt, encoded here so that the engine thread gets ids only
        (``add_special_tokens`` as ``LLMEngine`` encodes a text prompt: BOS and the like).

        Raises ServingError UNAVAILABLE while loading, ValueError naming ``prompt`` when the
        model has no tokenizer.
        """
        self.engine_thread_or_raise()
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError(
                "prompt: a text prompt needs a tokenizer and this model has none; send token ids"
            )
        if len(text) < ENCODE_OFF_LOOP_CHARS:
            return tokenizer.encode(text, add_special_tokens)
        return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)

    def check_limits(self, prompt: list[int], params: SamplingParams) -> None:
        """ValueError naming the first of :attr:`limits` the request exceeds."""
        self.limits.check(prompt, params)

    def model_info(self) -> dict[str, Any] | None:
        """Static facts about the model and engine (None while loading)."""
        engine = self.engine
        if engine is None:
            return None
        tok = engine.tokenizer
        return dict(
            model=self.model_name,
            vocab_size=engine.model_cfg.vocab_size,
            max_seq_len=engine.cfg.max_seq_len,
            max_slots=engine.cfg.max_slots,
            eos_token_ids=sorted(engine.eos_ids),
            has_chat_template=bool(tok is not None and tok.chat_template),
            dtype=engine.cfg.dtype,
            limits=self.limits.resolved(engine.cfg.max_seq_len),
        )
