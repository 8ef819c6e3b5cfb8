"""SamplingParams: the per-request sampling options (vLLM-compatible names and defaults).

Host-side and plain Python: validated once when a request arrives, then the engine copies the
numeric fields into its fixed-shape per-slot device arrays (see ``jbatch.engine.sampler``).
Every invalid value raises ``ValueError`` naming the field and the offending value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

from jbatch.structured_output import StructuredOutput

MAX_LOGPROBS = 20
SEED_LIMIT = 2**32  # seeds are stored as uint32 on the device
GREEDY_EPS = 1e-5  # temperature below this means greedy (same constant as the device sampler)


def _field(default: Any, help: str) -> Any:
    """A dataclass field with its one-line ``help`` (the CLI shows it; jbatch.sampling_surfaces)."""
    return dataclasses.field(default=default, metadata={"help": help})


def is_greedy(temperature):
    """Greedy (argmax) decoding: the one rule, for a float here or a ``[slots]`` array on the
    device (``jbatch.engine.sampler``)."""
    return temperature < GREEDY_EPS


def uses_penalties(repetition_penalty, presence_penalty, frequency_penalty):
    """Whether any penalty applies: for floats here, for ``[slots]`` arrays in the sampler."""
    return (repetition_penalty != 1) | (presence_penalty != 0) | (frequency_penalty != 0)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling options of one request.

    ``temperature == 0`` means greedy decoding. ``top_k`` 0 (or -1, normalised to 0) disables
    top-k. ``max_tokens=None`` means "until the model's maximum length". ``seed=None`` lets the
    engine choose a random seed. ``stop`` becomes a tuple of strings and ``stop_token_ids`` a
    tuple of ints after construction.
    """

    n: int = _field(1, "completions per prompt")
    temperature: float = _field(1.0, "0 = greedy")
    top_p: float = _field(1.0, "nucleus sampling mass")
    top_k: int = _field(0, "0 = off")
    min_p: float = _field(0.0, "drop tokens below min_p x the top probability")
    repetition_penalty: float = _field(1.0, "1 = off")
    presence_penalty: float = _field(0.0, "OpenAI-style presence penalty")
    frequency_penalty: float = _field(0.0, "OpenAI-style frequency penalty")
    seed: int | None = _field(None, "per-request seed (reproducible sampling)")
    max_tokens: int | None = _field(16, "tokens to generate per prompt")
    min_tokens: int = _field(0, "tokens to generate before EOS / stop may end the output")
    stop: str | Sequence[str] | None = _field(None, "stop string")
    stop_token_ids: Sequence[int] | None = _field(None, "token id that ends the output")
    ignore_eos: bool = _field(False, "keep going past EOS")
    include_stop_str_in_output: bool = _field(False, "keep the matched stop string in the text")
    skip_special_tokens: bool = _field(True, "leave special tokens out of the text")
    logprobs: int | None = _field(None, "log-probabilities of this many top tokens per step")
    prompt_logprobs: int | None = _field(
        None, "log-probabilities of each prompt token and this many top tokens"
    )
    structured: StructuredOutput | None = _field(  # noqa: RUF009 (a frozen value)
        None, "constrain the output: a JSON Schema, regex, choice or grammar"
    )
    speculative: bool = _field(
        True, "speculative decoding where the engine has it on (false: decode one token a step)"
    )

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)

        # --- integers ---------------------------------------------------------------------
        def need_int(name: str, *, optional: bool = False) -> int | None:
            v = getattr(self, name)
            if v is None and optional:
                return None
            if not _is_int(v):
                raise ValueError(f"{name} must be an int, got {v!r}")
            return v

        n = need_int("n")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        top_k = need_int("top_k")
        if top_k == -1:
            set_("top_k", 0)
        elif top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {top_k}")
        seed = need_int("seed", optional=True)
        if seed is not None and not 0 <= seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**32), got {seed}")
        max_tokens = need_int("max_tokens", optional=True)
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
        min_tokens = need_int("min_tokens")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        if max_tokens is not None and min_tokens > max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({max_tokens}), got {min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            k = need_int(name, optional=True)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be None or in [0, {MAX_LOGPROBS}], got {k}")

        # --- floats (ints accepted and converted) --------------------------------------------
        def need_real(name: str, ok: Callable[[float], bool], rule: str) -> None:
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            set_(name, float(v))
            if not ok(float(v)):
                raise ValueError(f"{name} must be {rule}, got {v!r}")

        need_real("temperature", lambda t: t >= 0.0, ">= 0")
        need_real("top_p", lambda p: 0.0 < p <= 1.0, "in (0, 1]")
        need_real("min_p", lambda p: 0.0 <= p <= 1.0, "in [0, 1]")
        need_real("repetition_penalty", lambda r: r > 0.0, "> 0")
        need_real("presence_penalty", lambda p: -2.0 <= p <= 2.0, "in [-2, 2]")
        need_real("frequency_penalty", lambda p: -2.0 <= p <= 2.0, "in [-2, 2]")

        # --- booleans ---------------------------------------------------------------------
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "speculative",
        ):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be a bool, got {v!r}")

        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(
                f"structured must be a StructuredOutput or None, got {self.structured!r}"
            )

        # --- stop strings / ids -------------------------------------------------------------
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, list | tuple):
            stop = tuple(stop)
        else:
            raise ValueError(f"stop must be a str, a list of str or None, got {stop!r}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {self.stop!r}")
        set_("stop", stop)

        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif isinstance(ids, list | tuple):
            ids = tuple(ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of int or None, got {ids!r}")
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(
                    f"stop_token_ids must contain only ints >= 0, got {self.stop_token_ids!r}"
                )
        set_("stop_token_ids", ids)

    @property
    def is_greedy(self) -> bool:
        """True when decoding is argmax (temperature 0); top-k/top-p/min-p are then irrelevant."""
        return bool(is_greedy(self.temperature))

    @property
    def uses_penalties(self) -> bool:
        return bool(
            uses_penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        )

    @functools.cached_property
    def stop_hold(self) -> int:
        """Characters of streamed text held back while running: a tail that could still grow
        into a stop string (the longest one, less one character)."""
        return max((len(s) - 1 for s in self.stop), default=0)

    def replace(self, **kw: Any) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **kw)
