"""Results returned to callers (vLLM-compatible names).

``LLMEngine.step()`` returns one :class:`RequestOutput` per request that got tokens. Its
content depends on the request's :class:`OutputKind`:

* ``DELTA`` (streaming, the servers): ``outputs[0]`` holds only what this step added — the new
  ``token_ids``, ``text`` and ``logprobs`` — plus running totals (``num_tokens``,
  ``cumulative_logprob``); callers build whole texts from the deltas. Host work per token is
  O(1) whatever the length of the generation.
* ``FINAL`` (``LLM.generate``): nothing until the request finishes, then one output with the
  whole completion.

Requests with ``SamplingParams.logprobs = k`` get ``CompletionOutput.top_logprobs``: per token a
dict ``{token_id: Logprob}`` whose first k entries are the k most likely tokens (highest first,
ties by lower id) followed by the sampled token when it is not among them. With
``prompt_logprobs = k``, ``RequestOutput.prompt_logprobs`` (on the first output) has one entry
per prompt token: None for the first, then the token itself and the top k given its prefix.
"""

from __future__ import annotations

import dataclasses
import enum


class OutputKind(enum.Enum):
    DELTA = "delta"
    FINAL = "final"


@dataclasses.dataclass(slots=True)
class Logprob:
    """One token's log-probability under the raw model, its rank (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


TopLogprobs = dict[int, Logprob]  # token id -> Logprob (see the module doc for the order)


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # DELTA: text added by this update; FINAL: the whole completion
    token_ids: list[int]  # likewise
    cumulative_logprob: float | None  # sum over every generated token so far
    logprobs: list[float] | None  # the sampled tokens' logprobs, aligned with ``token_ids``
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    num_tokens: int = 0  # tokens generated so far (all of them, not only this update's)
    top_logprobs: list[TopLogprobs] | None = None  # per token (``logprobs`` set), like token_ids

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # the engine's own list: do not modify
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str | None = None  # set when the request failed (``finish_reason == "error"``)
    # With ``error``: the serving status it maps to ("unavailable": a decode peer failed; see
    # serving/disagg_prefill.py), None: an engine error (internal).
    error_kind: str | None = None
    # Per prompt token (``prompt_logprobs`` set; first output only): None, then top logprobs.
    prompt_logprobs: list[TopLogprobs | None] | None = None

    @property
    def delta_token_ids(self) -> list[int]:
        """Token ids this update added (for a DELTA output: ``outputs[0].token_ids``)."""
        return self.outputs[0].token_ids

    @property
    def delta_text(self) -> str:
        """Text this update added (for a DELTA output: ``outputs[0].text``)."""
        return self.outputs[0].text
