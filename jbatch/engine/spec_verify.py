"""Verification of speculated tokens on the device: exact for greedy and for sampled requests.

A speculating slot's step has K + 1 rows: its last token, then the proposals ``d_1..d_n``
(``n <= K``; rows past ``n`` are padding). Row ``j``'s logits give the target distribution
``p_j`` of the token after ``d_j`` (``d_0``: the last token), under the request's own sampling
settings (temperature, top-k, top-p, min-p: ``sampler.filtered_logits``; row 0 also gets the
penalties and the structured-output mask, which requests that speculate never have).

1. **Greedy** rows accept ``d_{j+1}`` while it equals ``argmax p_j``; the token after the
   accepted run is the target's argmax there. The output is exactly the target's greedy output.
2. **Sampled** rows: rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Draft
   ``d_{j+1}`` with draft probability ``q_j(d_{j+1})`` is accepted when ``u_j * q_j < p_j``;
   at the first rejection the token is drawn from ``max(0, p_j - q_j)`` renormalised; if all
   ``n`` are accepted, a bonus token is drawn from ``p_n``. Every emitted token is then
   distributed exactly as under ``p``. The n-gram proposer's ``q`` is a point mass, for which
   the rule is *coupled*: each row draws the target's own token ``x_j`` with the uniform a
   non-speculative step would use at that position, ``d_{j+1}`` is accepted iff it equals
   ``x_j``, and the token after the run is that ``x_j`` — acceptance with probability
   ``p_j(d)``, after a rejection a draw from ``p_j`` without ``d``, as rejection sampling
   asks; and a seeded request's output is token for token its output without speculation,
   whatever was proposed (so it does not depend on how steps fell into dispatches).
3. Randomness is per request, as in ``sampler.py``: the uniform of output position ``i`` is
   ``uniforms(seed, num_generated + i)`` — used either by the accept test of row ``i`` or by
   the final draw at row ``i`` (n-gram: row ``i``'s own draw) — and a rejection's residual
   draw uses stream ``RESIDUAL_STREAM`` of the same position. A seeded request is
   deterministic, and a row with no proposals samples exactly as a non-speculative step
   would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int32

from jbatch.engine.sampler import (
    SlotSampling,
    argmax,
    filtered_logits,
    inverse_cdf,
    log_normalizer,
    uniforms,
)
from jbatch.sampling_params import is_greedy

RESIDUAL_STREAM = 1  # a rejected position's residual draw
DRAFT_STREAM = 2  # a draft model's own draws (its proposals)


def _rows(sp: SlotSampling, k1: int) -> SlotSampling:
    """Each group's sampling row repeated for its ``k1`` rows (flattened group-major)."""
    return jax.tree.map(lambda a: jnp.repeat(a, k1, axis=0), sp)


def verify(
    x: Float[Array, "groups k1 vocab"],
    drafts: Int32[Array, "groups k"],
    num_drafts: Int32[Array, " groups"],
    sp: SlotSampling,
    step_index: Int32[Array, " groups"],
    draft_probs: Float[Array, "groups k vocab"] | None = None,
    accept_bias: float = 0.0,
) -> tuple[Int32[Array, "groups k1"], Int32[Array, " groups"]]:
    """The tokens each group emits (``[G, K + 1]``, valid up to its count) and their count
    (accepted proposals + 1). ``x``: the processed logits of each group's rows; ``sp``,
    ``step_index``: the group's sampling row and RNG counter (``num_generated``);
    ``draft_probs``: the proposer's distributions (None: point masses at ``drafts``).
    ``accept_bias`` (tests only) adds to every acceptance probability: a deliberately wrong
    verifier that the distribution test must catch."""
    g, k1, vocab = x.shape
    greedy = is_greedy(sp.temperature)  # [G]
    target = argmax(x.reshape(g * k1, vocab)).reshape(g, k1)  # [G, K1]
    greedy_ok = drafts == target[:, :-1]  # [G, K]
    args = (x, drafts, num_drafts, sp, step_index, draft_probs, accept_bias)
    accepted, final = _choose(greedy, greedy_ok, target, args)
    return _emit(drafts, num_drafts, accepted, final)


def _choose(greedy, greedy_ok, target, args):
    """(accepted proposals [G], the token after them [G]). Greedy rows need only the argmax;
    the sampling path runs only when some row samples (a ``lax.cond``, as in ``sampler``)."""
    g = greedy.shape[0]

    def greedy_only():
        accepted = _accepted(greedy_ok, args[2])
        return accepted, target[jnp.arange(g), accepted]

    def mixed():
        sampled_ok, draw = _sampled(*args)
        ok = jnp.where(greedy[:, None], greedy_ok, sampled_ok)
        accepted = _accepted(ok, args[2])
        final = jnp.where(greedy, target[jnp.arange(g), accepted], draw(accepted))
        return accepted, final

    return jax.lax.cond(jnp.all(greedy), greedy_only, mixed)


def _accepted(ok: Bool[Array, "groups k"], num_drafts: Int32[Array, " groups"]):
    """Leading accepted proposals per group (only the ``num_drafts`` offered count)."""
    k = ok.shape[1]
    offered = jnp.arange(k, dtype=jnp.int32)[None, :] < num_drafts[:, None]  # [G, K]
    return jnp.sum(jnp.cumprod(ok & offered, axis=1), axis=1).astype(jnp.int32)  # [G]


def _sampled(x, drafts, num_drafts, sp, step_index, draft_probs, accept_bias):
    """Rejection sampling (module doc, 2-3): per proposal whether it is accepted, and a
    function of the accepted count giving the token drawn after the run."""
    g, k1, vocab = x.shape
    k = k1 - 1
    flat = x.reshape(g * k1, vocab)
    greedy = is_greedy(sp.temperature)
    masked = filtered_logits(flat, _rows(sp, k1), jnp.repeat(greedy, k1)).reshape(g, k1, vocab)
    log_p = masked - log_normalizer(masked.reshape(g * k1, vocab)).reshape(g, k1, 1)
    steps = step_index[:, None] + jnp.arange(k1, dtype=jnp.int32)  # [G, K1] output positions
    seeds = jnp.broadcast_to(sp.seed[:, None], steps.shape)
    u = uniforms(seeds.ravel(), steps.ravel()).reshape(g, k1)  # [G, K1]
    if draft_probs is None:  # point masses: the coupled rule (module doc, 2)
        own = inverse_cdf(masked.reshape(g * k1, vocab), u.ravel()).reshape(g, k1)  # [G, K1]
        sampled_ok = drafts == own[:, :k]  # [G, K]
        if accept_bias:  # tests only: accept a rejected proposal with this probability too
            u_bias = uniforms(seeds.ravel(), steps.ravel(), RESIDUAL_STREAM).reshape(g, k1)
            sampled_ok = sampled_ok | (u_bias[:, :k] < accept_bias)
        return sampled_ok, lambda accepted: own[jnp.arange(g), accepted]
    p = jnp.exp(log_p)  # [G, K1, V]
    p_draft = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]  # [G, K]
    q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    sampled_ok = u[:, :k] * q_draft < p_draft + accept_bias * q_draft  # [G, K]

    def draw(accepted: Int32[Array, " groups"]) -> Int32[Array, " groups"]:
        # The target's own draw at position ``accepted``, or, after a rejection, a draw from
        # the residual max(0, p - q) (q: the rejected proposal's law).
        gi = jnp.arange(g)
        rejected = accepted < num_drafts  # [G]
        at = lambda a: a[gi, accepted]  # row ``accepted`` of each group
        q_row = _draft_row(drafts, draft_probs, accepted, vocab)  # [G, V]
        residual = jnp.maximum(at(p) - q_row, 0.0)  # [G, V]
        log_w = jnp.where(rejected[:, None], jnp.log(residual), at(masked))  # [G, V]
        u_res = uniforms(sp.seed, step_index + accepted, RESIDUAL_STREAM)  # [G]
        return inverse_cdf(log_w, jnp.where(rejected, u_res, at(u)))  # [G]

    return sampled_ok, draw


def _emit(drafts, num_drafts, accepted, final):
    """Emitted tokens [G, K + 1] (the accepted proposals, then ``final``) and their count."""
    k1 = drafts.shape[1] + 1
    pos = jnp.arange(k1, dtype=jnp.int32)[None, :]  # [1, K1]
    padded = jnp.pad(drafts, ((0, 0), (0, 1)))  # [G, K1]
    emitted = jnp.where(pos < accepted[:, None], padded, 0)
    emitted = jnp.where(pos == accepted[:, None], final[:, None], emitted)
    return emitted.astype(jnp.int32), accepted + 1


def _draft_row(
    drafts: Int32[Array, "groups k"],
    draft_probs: Float[Array, "groups k vocab"] | None,
    accepted: Int32[Array, " groups"],
    vocab: int,
) -> Float[Array, "groups vocab"]:
    """Each group's proposal law at position ``accepted`` (zeros past its last proposal)."""
    g, k = drafts.shape
    i = jnp.minimum(accepted, k - 1)
    inside = (accepted < k)[:, None]
    if draft_probs is None:
        row = jax.nn.one_hot(drafts[jnp.arange(g), i], vocab, dtype=jnp.float32)
    else:
        row = draft_probs[jnp.arange(g), i]
    return jnp.where(inside, row, 0.0)


def emitted_logprobs(
    logits: Float[Array, "groups k1 vocab"], emitted: Int32[Array, "groups k1"]
) -> Float[Array, "groups k1"]:
    """Raw-model log-probability of each emitted token under its row (as ``sampler.sample``)."""
    g, k1, vocab = logits.shape
    lse = log_normalizer(logits.reshape(g * k1, vocab)).reshape(g, k1)
    chosen = jnp.take_along_axis(logits, emitted[..., None], axis=-1)[..., 0] - lse
    return jnp.where(jnp.isnan(chosen), -jnp.inf, chosen)
