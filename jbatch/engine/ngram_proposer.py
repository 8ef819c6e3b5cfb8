"""N-gram (prompt lookup) proposals for speculative decoding: the rule, in host numpy, and the
host's copy of each request's stream.

For a request whose stream (prompt + outputs) ends in tokens ``t[-n:]``, find the latest
earlier place where the same ``n`` tokens occur (the latest with ``k`` tokens after it, if
any) and propose the (up to) ``k`` tokens that followed them there, trying ``n = ngram_max``
down to ``ngram_min``. Outputs that copy spans of their prompt (edits, code refactors,
quoting, extraction) are proposed correctly, run after run.

The engine looks proposals up on the device (``ngram_device.py``, which must equal
:func:`propose`: tested), from the stream the host sends — a :class:`TokenStream`, kept in a
growing numpy buffer (amortised O(1) per new token) rather than rebuilt from lists.
:func:`propose` costs one vectorized comparison of the stream against its tail per tried
``n``: O(context).
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Int32


class TokenStream:
    """A request's prompt + outputs as a numpy buffer that grows by doubling."""

    def __init__(self, prompt_ids: list[int]):
        self._buf = np.zeros(max(16, 2 * len(prompt_ids)), np.int32)
        self._buf[: len(prompt_ids)] = prompt_ids
        self.size = len(prompt_ids)

    def sync(self, output_ids: list[int], prompt_len: int) -> Int32[np.ndarray, " n"]:
        """Append the outputs not copied yet; the stream as a view."""
        new = output_ids[self.size - prompt_len :]
        if new:
            need = self.size + len(new)
            if need > len(self._buf):
                grown = np.zeros(2 * need, np.int32)
                grown[: self.size] = self._buf[: self.size]
                self._buf = grown
            self._buf[self.size : need] = new
            self.size = need
        return self._buf[: self.size]


def propose(stream: Int32[np.ndarray, " n"], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to ``k`` proposed next tokens for ``stream`` (module doc); [] when no n-gram recurs.

    One pass finds every earlier position holding the stream's last token (a candidate end of
    a match); each longer ``n`` keeps the candidates whose preceding tokens match too."""
    size = len(stream)
    if k <= 0 or size < 2:
        return []
    ends = np.flatnonzero(stream[: size - 1] == stream[size - 1])  # matches of length 1
    found = ends if ngram_min <= 1 else None
    for n in range(2, min(ngram_max, size - 1) + 1):
        ends = ends[ends >= n - 1]
        ends = ends[stream[ends - (n - 1)] == stream[size - n]]
        if not ends.size:
            break
        if n >= ngram_min:
            found = ends  # the longest n so far
    if found is None or not found.size:
        return []
    # The latest match followed by k whole tokens, else the latest match.
    full = found[found + k < size]
    start = int(full[-1] if full.size else found[-1]) + 1
    return stream[start : start + k].tolist()
