"""A request's ``RequestOutput`` for one step: what the engine hands its caller.

DELTA requests get the tokens and text of this step only (O(1) per token); FINAL ones one
output at the end, assembled once. Text comes from ``stop_checker.text_to_emit`` (held back
while it could still grow into a stop string).
"""

from __future__ import annotations

from jbatch.engine import logprob_host, stop_checker
from jbatch.engine.request import Request
from jbatch.outputs import CompletionOutput, OutputKind, RequestOutput


def step_output(seq: Request, new: int = 1) -> RequestOutput | None:
    """This step's output for ``seq``, which got ``new`` tokens (None: a FINAL request still
    running)."""
    finished = seq.finished
    delta_text = stop_checker.text_to_emit(seq, finished)
    if seq.output_kind is OutputKind.FINAL:
        if not finished:
            return None
        text, ids, logprobs = "".join(seq.text_chunks), list(seq.output_ids), list(seq.logprobs)
    else:
        text, ids, logprobs = delta_text, seq.output_ids[-new:], seq.logprobs[-new:]
    completion = CompletionOutput(
        seq.index, text, ids, seq.cumulative_logprob, logprobs, seq.finish_reason,
        seq.stop_reason, len(seq.output_ids), _top_logprobs(seq, len(ids)),
    )  # fmt: skip
    return RequestOutput(
        seq.request_id, seq.prompt, seq.prompt_ids, [completion], finished, metrics(seq),
        error=seq.error,
        prompt_logprobs=logprob_host.prompt_logprobs_to_send(seq),
    )  # fmt: skip


def error_output(seq: Request, error: str) -> RequestOutput:
    """The final output of a request that failed with a step: what it had, then "error"."""
    final = seq.output_kind is OutputKind.FINAL
    if seq.text_at_end:
        stop_checker.text_to_emit(seq, True)  # its tokens' text, decoded now
    text = "".join(seq.text_chunks) if final else ""
    ids = list(seq.output_ids) if final else []
    logprobs = list(seq.logprobs) if final else []
    completion = CompletionOutput(
        seq.index, text, ids, seq.cumulative_logprob, logprobs, "error", None,
        len(seq.output_ids),
    )  # fmt: skip
    return RequestOutput(
        seq.request_id, seq.prompt, seq.prompt_ids, [completion], True, metrics(seq),
        error=error,
    )  # fmt: skip


def metrics(seq: Request) -> dict[str, float]:
    out = {"arrival_time": seq.arrival_time, "num_preemptions": seq.num_preemptions}
    if seq.first_token_time is not None:
        out["first_token_time"] = seq.first_token_time
    return out


def _top_logprobs(seq: Request, n: int) -> list | None:
    """The top logprobs of ``seq``'s last ``n`` tokens (None: the request has none)."""
    if seq.params.logprobs is None:
        return None
    return seq.top_logprobs[len(seq.top_logprobs) - n :]
