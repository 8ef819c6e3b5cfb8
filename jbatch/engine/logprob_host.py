"""Host side of top-k logprobs: which slots and prompt rows ask (step input), and what comes back.

- :func:`fill_step` sets the step input's ``want_top_logprobs`` flag of every sampling slot whose
  request has ``logprobs``, and ``prefill_targets`` (the next prompt token) on the prompt rows
  of requests with ``prompt_logprobs`` — each prompt position once per request, even when a
  preempted request prefills its prompt again. The rows asked for are listed on the
  ``SchedulerOutput`` (``prompt_logprob_rows``) for :func:`read_prompt`.
- :func:`read_token` / :func:`read_prompt` turn a step's result rows into ``{token_id:
  Logprob}`` dicts (O(k) per token, only for requests that asked): the first k entries are the
  top k, highest first, then the token itself when it is not among them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from jbatch.engine.logprobs import HostTopLogprobs
from jbatch.engine.request import Request
from jbatch.engine.scheduler_output import Chunk, SchedulerOutput
from jbatch.outputs import Logprob, TopLogprobs
from jbatch.tokenizer import Tokenizer

TokenText = Callable[[int], str | None]


class TokenTexts:
    """``decoded_token`` of a token id (cached: the vocabulary is bounded); None without a
    tokenizer."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer, self._cache = tokenizer, {}

    def __call__(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text


def fill_step(batch, sched: SchedulerOutput, chunk_rows: Iterable[tuple[Chunk, int]]) -> None:
    """Logprob flags of one step's input (see the module doc); ``chunk_rows``: each chunk of
    ``sched`` with its first prompt row."""
    for seq, slot in sched.samplers:
        if seq.params.logprobs is not None:
            batch.want_top_logprobs[slot] = True
    for chunk, row in chunk_rows:
        seq = chunk.seq
        if seq.prompt_logprobs is None:
            continue
        # Row at position p predicts prompt token p + 1; ask each prompt position once.
        first = max(chunk.start, seq.prompt_logprobs_asked - 1)
        end = min(chunk.start + len(chunk.token_ids), len(seq.prompt_ids) - 1)
        if first >= end:
            continue
        at = row + first - chunk.start
        batch.prefill_targets[at : at + end - first] = seq.prompt_ids[first + 1 : end + 1]
        sched.prompt_logprob_rows.append((seq, at, first + 1, end - first))
        seq.prompt_logprobs_asked = end + 1


def _entries(
    k: int, own: int, logprob: float, rank: int, ids: list[int], values: list[float], text
) -> TopLogprobs:
    top = {t: Logprob(v, i + 1, text(t)) for i, (t, v) in enumerate(zip(ids[:k], values[:k]))}
    if own not in top:
        top[own] = Logprob(logprob, rank, text(own))
    return top


def read_token(
    seq: Request, slot: int, token: int, logprob: float, top: HostTopLogprobs | None, text
) -> None:
    """Append the top logprobs of ``seq``'s new ``token`` (sampled in ``slot``)."""
    if top is None:  # a stand-in core computes no top-k
        seq.top_logprobs.append({token: Logprob(logprob, None, text(token))})
        return
    rank, ids, values = top.row(slot)
    seq.top_logprobs.append(_entries(seq.params.logprobs, token, logprob, rank, ids, values, text))


def read_prompt(rows: list[tuple[Request, int, int, int]], top: HostTopLogprobs | None, text):
    """Append the prompt logprobs of the rows a step asked for (``fill_step``)."""
    for seq, at, index, count in rows:
        k = seq.params.prompt_logprobs
        for j in range(count):
            own = seq.prompt_ids[index + j]
            if top is None:
                seq.prompt_logprobs.append({own: Logprob(0.0, None, text(own))})
                continue
            rank, ids, values = top.row(at + j)
            logprob = float(top.logprob[at + j])
            seq.prompt_logprobs.append(_entries(k, own, logprob, rank, ids, values, text))


def prompt_logprobs_to_send(seq: Request) -> list[TopLogprobs | None] | None:
    """The prompt logprobs, once (with the first output that has tokens)."""
    if seq.prompt_logprobs is None or seq.prompt_logprobs_sent or not seq.output_ids:
        return None
    seq.prompt_logprobs_sent = True
    return seq.prompt_logprobs
