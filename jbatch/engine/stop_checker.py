"""Host-side stop conditions and text streaming for one request's new token.

Text is handled in O(1) per token: only ``Request.pending_text`` (not yet streamed) is searched
for stop strings. Streamed text can never hold the start of a match: while running, the last
``len(longest stop) - 1`` characters are always held back.
"""

from __future__ import annotations

from jbatch.engine.request import Request
from jbatch.outputs import OutputKind


def append_token(seq: Request, token: int, logprob: float) -> tuple[str, int | str] | None:
    """Record ``token`` for ``seq``; return ``(finish_reason, stop_reason)`` if it finishes.

    Order of checks: stop token ids and EOS (the id is kept, its text is not), then stop strings
    (the text is cut before the match unless ``include_stop_str_in_output``), then the length.
    """
    p = seq.params
    seq.output_ids.append(token)
    seq.logprobs.append(logprob)
    seq.cumulative_logprob += logprob
    if token in p.stop_token_ids:
        return "stop", token
    if not p.ignore_eos and token in seq.eos_ids:
        return "stop", token
    if seq.detokenizer is not None and not seq.text_at_end:
        seq.pending_text += seq.detokenizer.add_tokens([token])
        if p.stop:
            hit = _find_stop(seq.pending_text, p.stop)
            if hit is not None:
                at, stop = hit
                end = at + len(stop) if p.include_stop_str_in_output else at
                seq.pending_text = seq.pending_text[:end]
                return "stop", stop
    if len(seq.output_ids) >= seq.max_tokens:
        return "length", None
    return None


def append_run(
    seq: Request, tokens: list[int], logprobs: list[float]
) -> tuple[tuple[str, int | str] | None, int]:
    """Record a run of tokens (one step's, or a block's or speculative dispatch's) as
    :func:`append_token` one by one would: ``(finish, tokens recorded)``. Without stop strings
    only a stop id or the length can end the run, so it is found by a scan and recorded in
    bulk (list extends, one detokenizer call); with them, token by token."""
    if seq.params.stop:  # the text must be searched after every token
        for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
            done = append_token(seq, token, logprob)
            if done is not None:
                return done, i + 1
        return None, len(tokens)
    n, done = min(len(tokens), seq.max_tokens - len(seq.output_ids)), None
    stops = stop_token_ids(seq)
    if stops:
        for i in range(n):
            if tokens[i] in stops:
                n, done = i + 1, ("stop", tokens[i])
                break
    run, lps = tokens[:n], logprobs[:n]
    seq.output_ids += run
    seq.logprobs += lps
    for logprob in lps:  # in order: the same sum as token by token
        seq.cumulative_logprob += logprob
    if seq.detokenizer is not None and not seq.text_at_end:
        seq.pending_text += seq.detokenizer.add_tokens(run[:-1] if done else run)
    if done is None and len(seq.output_ids) >= seq.max_tokens:
        done = ("length", None)
    return done, n


def may_stop_early(seq: Request) -> bool:
    """Whether ``seq`` can end before its token budget — by one of :func:`append_token`'s
    checks before the length: the host learns that only from its tokens."""
    return bool(seq.params.stop or stop_token_ids(seq))


def stop_token_ids(seq: Request) -> tuple[int, ...]:
    """The token ids that end ``seq`` (:func:`append_token`'s first two checks), EOS first."""
    p = seq.params
    return (() if p.ignore_eos else tuple(sorted(seq.eos_ids))) + tuple(p.stop_token_ids)


def _find_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Earliest stop string in ``text``."""
    best = None
    for stop in stops:
        at = text.find(stop)
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    return best


def text_to_emit(seq: Request, finished: bool) -> str:
    """New text safe to stream: while running, hold back a tail that could still grow into a
    stop string (so a stop string is never streamed and then retracted)."""
    if seq.detokenizer is None:
        return ""
    if finished and seq.text_at_end:
        seq.pending_text += _decode_at_end(seq)
        end = len(seq.pending_text)
    elif finished:
        if seq.finish_reason == "length" or seq.stop_reason is None:
            seq.pending_text += seq.detokenizer.flush()
        end = len(seq.pending_text)
    else:
        end = max(0, len(seq.pending_text) - seq.params.stop_hold)
    delta, seq.pending_text = seq.pending_text[:end], seq.pending_text[end:]
    if seq.output_kind is OutputKind.FINAL and delta:
        seq.text_chunks.append(delta)
    return delta


def _decode_at_end(seq: Request) -> str:
    """The whole text of a request whose tokens were not detokenized one by one
    (``Request.text_at_end``), decoded at once: what streaming them would have given — a stop
    token's text is not kept, and a stop token ends the text without a flush (as above)."""
    stop_token = isinstance(seq.stop_reason, int) and not isinstance(seq.stop_reason, bool)
    ids = seq.output_ids[:-1] if stop_token else seq.output_ids
    return seq.detokenizer.decode_rest(ids, final=not stop_token)
