"""N-gram (prompt lookup) proposals on the device, inside the speculative step program.

The rule is :func:`jbatch.engine.ngram_proposer.propose`'s (its host reference, tested equal):
the latest earlier occurrence of the stream's last ``n`` tokens, for the longest ``n`` in
``ngram_min..ngram_max`` that occurs (the latest with ``cap`` tokens after it, if any), proposes
the tokens that followed it.

Why on the device: the step is planned while the previous one runs, so the host does not know
how the stream ends — after a rejection, a continuation guessed on the host is wrong from the
rejected token on. The device knows: each group's stream is assembled here from

1. the host's window — the last ``window_len`` tokens of the stream the host has read, up to
   stream index ``anchor`` (its last token);
2. the proposals the step in flight accepted, which the device kept (``EngineState.spec_drafts``):
   the ``o - 1`` tokens after ``anchor``, where ``o = seq_lens - anchor``;
3. the slot's last sampled token (``EngineState.tokens``) at index ``seq_lens``.

Cost: one ``[groups, ngram_max, window + K + 1]`` comparison per step.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Int32


def assemble(
    window: Int32[Array, "groups w"],
    window_len: Int32[Array, " groups"],
    accepted: Int32[Array, "groups k"],
    num_accepted: Int32[Array, " groups"],
    last: Int32[Array, " groups"],
) -> tuple[Int32[Array, "groups t"], Int32[Array, " groups"]]:
    """Each group's stream (module doc: window, accepted proposals, last token), left-aligned
    in ``t = w + k + 1`` entries, and its length. ``num_accepted`` -1: nothing ran since the
    window, whose last token is the slot's last."""
    w, k = window.shape[1], accepted.shape[1]
    idx = jnp.arange(w + k + 1, dtype=jnp.int32)[None, :]  # [1, T]
    wl, na = window_len[:, None], jnp.clip(num_accepted, -1, k)[:, None]
    from_window = jnp.take_along_axis(window, jnp.clip(idx, 0, w - 1), axis=1)
    from_accepted = jnp.take_along_axis(accepted, jnp.clip(idx - wl, 0, k - 1), axis=1)
    stream = jnp.where(idx < wl, from_window, from_accepted)
    stream = jnp.where(idx == wl + na, last[:, None], stream)
    return stream, (wl + na + 1)[:, 0]


def propose(
    stream: Int32[Array, "groups t"],
    length: Int32[Array, " groups"],
    cap: Int32[Array, " groups"],
    k: int,
    ngram_min: int,
    ngram_max: int,
) -> tuple[Int32[Array, "groups k"], Int32[Array, " groups"]]:
    """Up to ``cap`` (<= ``k``) proposals per group for ``stream[:length]`` (module doc) and
    how many there are (0: no n-gram recurs)."""
    g, t = stream.shape
    pos = jnp.arange(t, dtype=jnp.int32)[None, :]  # [1, T] candidate match ends e
    tail = lambda i: jnp.take_along_axis(stream, jnp.clip(length - 1 - i, 0, t - 1)[:, None], 1)
    # run[e]: how many tokens ending at e equal the stream's last ones (capped at ngram_max).
    run = jnp.zeros((g, t), jnp.int32)
    still = jnp.ones((g, t), bool)
    for i in range(ngram_max):
        back = jnp.take_along_axis(stream, jnp.clip(pos - i, 0, t - 1), axis=1)
        still = still & (pos - i >= 0) & (back == tail(i))
        run = run + still
    candidate = pos < (length - 1)[:, None]  # earlier than the last token
    longest = jnp.minimum(ngram_max, length - 1)  # n <= size - 1
    # The longest n >= ngram_min with a match, as ``ngram_proposer.propose`` finds it.
    best = jnp.max(jnp.where(candidate, run, 0), axis=1)  # [G]
    n = jnp.minimum(best, longest)
    found = (n >= max(ngram_min, 1)) & (length >= 2)
    hits = candidate & (run >= n[:, None])
    full = hits & (pos + cap[:, None] < length[:, None])  # followed by cap whole tokens
    latest = lambda m: jnp.max(jnp.where(m, pos, -1), axis=1)
    end = jnp.where(jnp.any(full, axis=1), latest(full), latest(hits))  # [G]
    start = end + 1
    take = jnp.clip(start[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :], 0, t - 1)
    drafts = jnp.take_along_axis(stream, take, axis=1)
    count = jnp.where(found, jnp.clip(jnp.minimum(cap, length - start), 0, k), 0)
    return drafts, count
