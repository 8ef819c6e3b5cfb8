"""Results returned to callers (vLLM-compatible names)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[float] | None  # per generated token, the sampled token's logprob
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # What this update added (streaming): new token ids and text since the previous update.
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    delta_text: str = ""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
