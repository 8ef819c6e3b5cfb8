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
2. the tokens the dispatch in flight emitted, which the device kept
   (``EngineState.spec_emitted``): the ``o - 1`` tokens after ``anchor``, where
   ``o = seq_lens - anchor``;
3. the slot's last sampled token (``EngineState.tokens``) at index ``seq_lens``.

Cost: ``ngram_max`` shifted comparisons of ``[groups, window + K + 1]`` per step, and no gather
over it (on XLA:CPU, one group and a 2 048-token window: 70 µs a call with gathers, 25 µs
without; four groups 108 -> 25-30 µs).
"""

from __future__ import annotations

import jax
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
    window, whose last token is the slot's last. Entries past the length are unspecified."""
    g, k = accepted.shape
    rows = jnp.arange(g, dtype=jnp.int32)[:, None]
    wl, na = window_len[:, None], jnp.clip(num_accepted, -1, k)[:, None]
    # k + 1 writes per group, not a gather over the whole stream (the lookup's main cost).
    stream = jnp.pad(window, ((0, 0), (0, k + 1)))
    stream = stream.at[rows, wl + jnp.arange(k, dtype=jnp.int32)].set(accepted, mode="drop")
    stream = stream.at[rows, wl + na].set(last[:, None], mode="drop")
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
    # run[e]: how many tokens ending at e equal the stream's last ones (capped at ngram_max).
    run = jnp.zeros((g, t), jnp.int32)
    still = jnp.ones((g, t), bool)
    # back_i[e] = stream[e - i] compared with the stream's i-th last token: static slices of
    # one left-padded copy against [G, ngram_max] tails, both materialized first. A pad, or a
    # gather's out-of-range fill, fused into the comparisons is redone per element on XLA:CPU
    # (3x slower); a clipped gather is not fused into them.
    lead = ngram_max - 1
    back_at = length[:, None] - 1 - jnp.arange(ngram_max, dtype=jnp.int32)  # [G, N]
    tails = jnp.take_along_axis(stream, back_at, axis=1, mode="clip")
    padded = jax.lax.optimization_barrier(jnp.pad(stream, ((0, 0), (lead, 0))))
    for i in range(ngram_max):
        back = padded[:, lead - i : lead - i + t]
        still = still & (pos - i >= 0) & (back == tails[:, i : i + 1])
        run = run + still
    # The longest n >= ngram_min with a match, as ``ngram_proposer.propose`` finds it, at its
    # latest end followed by ``cap`` whole tokens, else its latest end: one max over the key
    # (run, followed by cap tokens, end), lexicographic. Every candidate's run is <= size - 1.
    candidate = pos < (length - 1)[:, None]  # earlier than the last token
    full = pos + cap[:, None] < length[:, None]
    key = jnp.where(candidate, run * (2 * t) + full * t + pos, 0)
    top = jnp.max(key, axis=1)  # [G]
    found = (top // (2 * t) >= max(ngram_min, 1)) & (length >= 2)
    end = top % t
    start = end + 1
    take = jnp.clip(start[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :], 0, t - 1)
    drafts = jnp.take_along_axis(stream, take, axis=1)
    count = jnp.where(found, jnp.clip(jnp.minimum(cap, length - start), 0, k), 0)
    return drafts, count
