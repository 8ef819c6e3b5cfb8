"""Host-side stop conditions and text streaming for one sequence's new token."""

from __future__ import annotations

from jbatch.engine.request import Request


def append_token(seq: Request, token: int, logprob: float) -> tuple[str, int | str] | None:
    """Record ``token`` for ``seq``; return ``(finish_reason, stop_reason)`` if it finishes.

    Order of checks: stop token ids and EOS (the id is kept, its text is not), then stop strings
    (the text is cut before the match unless ``include_stop_str_in_output``), then the length.
    """
    p = seq.params
    seq.output_ids.append(token)
    seq.logprobs.append(logprob)
    if token in p.stop_token_ids:
        return "stop", token
    if not p.ignore_eos and token in seq.eos_ids:
        return "stop", token
    if seq.detokenizer is not None:
        seq.text += seq.detokenizer.add_tokens([token])
        if p.stop:
            hit = _find_stop(seq.text, p.stop, window=len(seq.text) - seq.emitted_text_len)
            if hit is not None:
                at, stop = hit
                seq.text = (
                    seq.text[: at + len(stop)] if p.include_stop_str_in_output else (seq.text[:at])
                )
                return "stop", stop
    if len(seq.output_ids) >= seq.max_tokens:
        return "length", None
    return None


def _find_stop(text: str, stops: tuple[str, ...], window: int) -> tuple[int, str] | None:
    """Earliest stop string that ends in the last ``window`` characters of ``text``."""
    best = None
    for stop in stops:
        start = max(0, len(text) - window - len(stop) + 1)
        at = text.find(stop, start)
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    return best


def text_to_emit(seq: Request, finished: bool) -> str:
    """New text safe to stream: while running, hold back a tail that could still grow into a
    stop string (so a stop string is never streamed and then retracted)."""
    if seq.detokenizer is None:
        return ""
    if finished:
        if seq.finish_reason == "length" or seq.stop_reason is None:
            seq.text += seq.detokenizer.flush()
        end = len(seq.text)
    else:
        hold = max((len(s) - 1 for s in seq.params.stop), default=0)
        end = max(seq.emitted_text_len, len(seq.text) - hold)
    delta = seq.text[seq.emitted_text_len : end]
    seq.emitted_text_len = end
    return delta
