"""RequestLimits: the bounds a server puts on one request, checked before it reaches the engine.

Each limit is a ``jbatch serve`` flag (``--max-body-bytes`` -> ``max_body_bytes``) and appears
in ``GetModelInfo`` (``limits``) and ``/v1/models`` (``limits``). A request over a limit fails
with INVALID_ARGUMENT / 400 and a message naming the limit and the request's value; an HTTP body
over ``max_body_bytes`` gets 413, a gRPC message over it RESOURCE_EXHAUSTED (gRPC's own check).
``None`` for ``max_prompt_tokens`` / ``max_tokens`` means "the engine's ``max_seq_len``".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jbatch.sampling_params import MAX_LOGPROBS, SamplingParams

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds (see the module docstring)."""

    max_body_bytes: int = 4 * MIB  # HTTP request body (413) and gRPC message size
    max_prompt_tokens: int | None = None  # None: the engine's max_seq_len
    max_tokens: int | None = None  # upper bound on a request's max_tokens (None: max_seq_len)
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_top_logprobs: int = MAX_LOGPROBS
    max_n: int = 16  # completions per request (each one a sequence in its own slot)
    max_concurrent_streams: int = 256  # gRPC streams per connection (HTTP/2 setting)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            optional = field.name in ("max_prompt_tokens", "max_tokens")
            if value is None and optional:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field.name} must be an int >= 1, got {value!r}")
        if self.max_top_logprobs > MAX_LOGPROBS:
            raise ValueError(
                f"max_top_logprobs must be <= {MAX_LOGPROBS} (the engine's most), "
                f"got {self.max_top_logprobs}"
            )

    def resolved(self, max_seq_len: int) -> dict[str, int]:
        """Every limit as a number (``None`` ones replaced by ``max_seq_len``)."""
        values = dataclasses.asdict(self)
        for name in ("max_prompt_tokens", "max_tokens"):
            if values[name] is None:
                values[name] = max_seq_len
        return values

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError naming the first limit the request exceeds, and its value. (A
        ``None`` limit is the engine's own ``max_seq_len`` check, with its own message.)"""
        limits = dataclasses.asdict(self)
        _at_most("prompt tokens", len(prompt), "max_prompt_tokens", limits)
        if params.max_tokens is not None:
            _at_most("max_tokens", params.max_tokens, "max_tokens", limits)
        _at_most("n", params.n, "max_n", limits)
        _at_most("stop strings", len(params.stop), "max_stop_strings", limits)
        for s in params.stop:
            _at_most("a stop string's characters", len(s), "max_stop_string_chars", limits)
        _at_most("stop_token_ids", len(params.stop_token_ids), "max_stop_token_ids", limits)
        if params.logprobs is not None:
            _at_most("top_logprobs", params.logprobs, "max_top_logprobs", limits)
        if params.prompt_logprobs is not None:
            _at_most("prompt_logprobs", params.prompt_logprobs, "max_top_logprobs", limits)


def _at_most(what: str, value: int, limit: str, limits: dict[str, Any]) -> None:
    if limits[limit] is not None and value > limits[limit]:
        raise ValueError(f"{what}: {value} is over this server's limit {limit}={limits[limit]}")
