"""PrefillPacer: a long prompt's chunks are paced so that requests decoding beside it keep
their step time (``EngineConfig.prefill_pacing``; off by default).

A chunk deep into a long prompt costs attention over its whole context: on the 2-core CPU a
248-token chunk at 16k tokens of context takes ~80 ms, a decode step of 8 chats ~1.5 ms, so
every chat decoding beside the prefill would see ~50x its time per output token. The pacer
keeps the decoders' share of the device time instead, from measured step times:

1. The engine reports every finished step (:meth:`observe`): its duration (from the previous
   step's result, or its own dispatch if later, to its own result) and the query-key pairs of
   its *paced* chunks — chunks of a prompt longer than ``max_num_batched_tokens``, scheduled
   while other requests decode. The prompt's first ``max_num_batched_tokens`` tokens are
   scheduled at once (a long prompt starts without waiting), but measured and owed like the
   rest: they give the first ``per_pair`` and their time goes into the debt, never into
   ``base``.
2. Steps without paced chunks set ``base``, a moving average of an ordinary step's time; steps
   with them set ``per_pair``, a moving average of ``(duration - base) / pairs``.
3. ``debt``: a paced step adds the time it took beyond ``base``; every step with decodes pays
   ``share * base`` back. While ``debt > 0``, or a paced step is still running (the engine
   plans step N + 1 before step N's time is known), no paced chunk is scheduled. So, averaged over a
   few steps, the paced chunks take at most ``share`` times the decoders' own time: a
   decoding request's time per output token stays within ``1 + share`` of what it would be
   without the long prompt, and the long prompt still gets ``share / (1 + share)`` of the
   device while others decode (all of it when nobody does: then nothing is paced).
4. The chunk size shrinks as the context grows (:meth:`chunk_tokens`): ``n`` tokens at context
   ``start`` cost ``per_pair * n * (start + n)``, kept within ``share * base`` — but never
   below ``block_q`` tokens (a smaller chunk would cost a whole query block anyway), so each
   paced step makes progress and the debt spreads the rest. Should no paced step have been
   measured yet, the chunk is a ``block_q`` probe, not a whole budget of unknown cost.

Host-only, O(1) per step; the step's shapes are unchanged (a chunk size is a row count inside
the same prompt buckets), so pacing never compiles anything.
"""

from __future__ import annotations

import dataclasses

_EMA = 0.2  # weight of the newest observation in the moving averages


@dataclasses.dataclass
class PrefillPacer:
    share: float  # paced chunks' time / the decoders' own time, averaged
    min_tokens: int  # the smallest paced chunk (block_q)
    base: float | None = None  # seconds, an ordinary step
    per_pair: float | None = None  # seconds per query-key pair of a paced chunk
    debt: float = 0.0  # seconds the paced chunks are ahead of their share
    in_flight: int = 0  # paced steps dispatched, not yet observed

    @staticmethod
    def pairs(start: int, n: int) -> int:
        """Query-key pairs of a chunk of ``n`` tokens at context ``start`` (causal)."""
        return n * start + n * (n + 1) // 2

    @property
    def blocked(self) -> bool:
        """Whether paced chunks wait this step: they are ahead of their share, or a paced step
        is still running (its cost is not known yet: one at a time)."""
        return self.debt > 0.0 or self.in_flight > 0

    def scheduled(self) -> None:
        """A step with paced chunks was planned (it is observed when it finishes)."""
        self.in_flight += 1

    def chunk_tokens(self, start: int) -> int | None:
        """The most tokens a paced chunk at context ``start`` may take (None: no limit; paced
        chunks have cost nothing measurable)."""
        if self.base is None or self.per_pair is None:
            return self.min_tokens  # nothing measured yet: a probe
        if self.per_pair <= 0.0:
            return None
        allowed = self.share * self.base / self.per_pair  # pairs within the share of one step
        # the largest n with pairs(start, n) <= allowed: n^2 / 2 + n * (start + 1/2) = allowed
        b = start + 0.5
        return max(self.min_tokens, int(-b + (b * b + 2.0 * allowed) ** 0.5))

    def observe(self, duration: float, paced_pairs: int, decodes: int) -> None:
        """A finished step: its ``duration`` (seconds), the query-key pairs of its paced chunks
        and how many requests it decoded."""
        if decodes == 0:
            self.debt = 0.0  # nobody to protect: the next paced chunk is free to go
        if paced_pairs == 0:
            self.base = duration if self.base is None else _ema(self.base, duration)
            if decodes:
                self.debt = max(0.0, self.debt - self.share * self.base)
            return
        self.in_flight = max(0, self.in_flight - 1)
        base = self.base if self.base is not None else 0.0
        extra = max(0.0, duration - base)
        rate = extra / paced_pairs
        self.per_pair = rate if self.per_pair is None else _ema(self.per_pair, rate)
        if decodes:
            self.debt = max(0.0, self.debt + extra - self.share * base)


def _ema(old: float, new: float) -> float:
    return (1.0 - _EMA) * old + _EMA * new
