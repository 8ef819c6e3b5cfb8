"""Request intake: a caller's prompt and ``SamplingParams`` checked and turned into a ``Request``.

Every check raises ``ValueError`` naming the field and its value; the front ends turn that into
a 400 naming the field or gRPC ``INVALID_ARGUMENT``. The engine keeps the request-id registry
and the queue; this module knows only what one request needs to start: its token ids, its
budget, its detokenizer and, for structured output, its grammar matcher (grammars compiled
lazily, once per spec: ``engine/grammar.py``).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

from jbatch.engine import grammar
from jbatch.engine.config import EngineConfig
from jbatch.engine.request import Request
from jbatch.outputs import OutputKind
from jbatch.sampling_params import SamplingParams
from jbatch.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclasses.dataclass
class RequestIntake:
    cfg: EngineConfig
    vocab_size: int
    tokenizer: Tokenizer | None
    eos_ids: frozenset[int]  # what ends a request (and its grammar)
    _grammars: grammar.GrammarCompiler | None = None  # built on first use

    def request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.DELTA,
        tenant: str = "default",
    ) -> tuple[Request, Callable[[], dict]]:
        """The checked request, and a function giving each child of an ``n > 1`` request its
        own detokenizer and matcher (``ParentRequest.fan_out``)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt_text, ids = self.prompt_ids(prompt)
        room = self.cfg.max_seq_len - len(ids)
        if room < 1:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_seq_len={self.cfg.max_seq_len} leaves no room "
                f"to generate"
            )
        if params.min_tokens:
            raise ValueError(f"min_tokens={params.min_tokens} is not supported yet")
        if self.tokenizer is None and params.stop:
            raise ValueError(f"stop={params.stop!r} needs a tokenizer; this model has none")
        new_detok = lambda: (
            None
            if self.tokenizer is None
            else IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        )
        new_matcher = lambda: None if params.structured is None else self.matcher(params)
        seq = Request(
            request_id=request_id,
            prompt_ids=ids,
            params=params,
            max_tokens=min(params.max_tokens or room, room),
            seed=secrets.randbelow(2**32) if params.seed is None else params.seed,
            eos_ids=self.eos_ids,
            prompt=prompt_text,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            tenant=tenant,
            matcher=new_matcher(),
            detokenizer=new_detok(),
            output_kind=OutputKind(output_kind),
        )
        return seq, lambda: {"detokenizer": new_detok(), "matcher": new_matcher()}

    def matcher(self, params: SamplingParams):
        """The grammar matcher of a structured request (ValueError if the spec is rejected)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer; this model has none")
            self._grammars = grammar.GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._grammars.matcher(params.structured)

    @property
    def grammars(self) -> grammar.GrammarCompiler | None:
        """The grammar compiler, once a structured request has needed one."""
        return self._grammars

    def prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids), checked against the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                msg = f"prompt must be a string or a list of token ids, got {prompt!r}"
                raise ValueError(msg) from None
            if any(isinstance(t, bool) or int(t) != t for t in prompt):
                raise ValueError(f"prompt token ids must be ints, got {list(prompt)!r}")
            text = None
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        return text, ids
