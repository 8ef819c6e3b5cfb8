"""The engine's programs, jitted: one step program per bucket, the swaps and the state's init,
on one device or a ``(1, tp)`` mesh (``EngineCore`` dispatches them).

- A step program is ``core.engine_step`` (or ``spec_block.engine_spec_block``) over a packed
  input: ``(params, state, ints, floats, bitmask) -> (state, packed result)``, the state
  donated.
- One device: everything lives committed on the first device (a placement change would be a
  new cache key: a recompile); swapped-out sequences wait in host RAM.
- A mesh: explicit in/out shardings — the KV pool split over KV heads, every other state field
  and every host input replicated; params keep the shardings they were placed with
  (:func:`jbatch.parallel.sharding.param_specs`). XLA's SPMD partitioner splits the matmuls;
  attention and experts run per shard under ``shard_map``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jbatch.engine import buckets, swap
from jbatch.engine.config import EngineConfig
from jbatch.engine.core import engine_step
from jbatch.engine.decode_block import engine_block
from jbatch.engine.spec_block import engine_spec_block
from jbatch.engine.split_step import SplitPrograms
from jbatch.engine.state import init_state
from jbatch.engine.step_input import StepInputLayout
from jbatch.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class StepPrograms:
    steps: dict[tuple, Callable]  # bucket key -> jitted step program
    swap_out: Callable
    swap_in: Callable
    init: Callable  # () -> a fresh EngineState, placed
    device: Any  # where host inputs go: a device, or the mesh's replicated sharding
    swapped_sharding: Any  # placement of a swapped-out slot brought back to the device
    split: SplitPrograms | None = None  # structured_overlap's forward / sample halves


def packed_step(layout: StepInputLayout, cfg: EngineConfig, **step_kwargs) -> Callable:
    """The step program of ``layout``'s bucket pair; with ``decode_steps`` > 1 the decode-only
    ones, and the ones of admission blocks, run a block of steps (``buckets.runs_blocks``,
    ``decode_block.py``), their result the block's rows, flattened."""
    if buckets.runs_blocks(cfg, *layout.key):

        def run(params, state, ints, floats, bitmask):
            return engine_block(
                params, state, *layout.unpack(ints, floats), bitmask,
                max_steps=cfg.decode_steps, first_kwargs=layout.step_kwargs(), **step_kwargs,
            )  # fmt: skip

        return run

    step_kwargs = {**step_kwargs, **layout.step_kwargs()}

    def run(params, state, ints, floats, bitmask):
        state, out = engine_step(
            params, state, *layout.unpack(ints, floats), bitmask, **step_kwargs
        )
        return state, out.packed()

    return run


def packed_spec_step(layout: StepInputLayout, **block_kwargs) -> Callable:
    """The speculative program of ``layout``'s group bucket: up to ``max_steps`` speculative
    steps, its result their rows, flattened (``spec_block.py``)."""

    def run(params, state, ints, floats, bitmask):
        state, rows = engine_spec_block(
            params, state, *layout.unpack(ints, floats), bitmask, **block_kwargs
        )
        return state, rows.ravel()

    return run


def single_device(
    model_cfg: ModelConfig,
    cfg: EngineConfig,
    draft_cfg: ModelConfig | None,
    layouts: dict[tuple, StepInputLayout],
    spec_layouts: dict[tuple, StepInputLayout],
    step_kwargs: dict,
) -> StepPrograms:
    jit = lambda layout: jax.jit(packed_step(layout, cfg, **step_kwargs), donate_argnums=1)
    steps = {key: jit(layout) for key, layout in layouts.items()}
    spec_kwargs = dict(
        step_kwargs,
        num_speculative_tokens=cfg.num_speculative_tokens,
        ngram=(cfg.ngram_min, cfg.ngram_max),
        max_steps=cfg.decode_steps,
    )
    spec = lambda layout: jax.jit(packed_spec_step(layout, **spec_kwargs), donate_argnums=1)
    steps.update({key: spec(layout) for key, layout in spec_layouts.items()})
    device = jax.devices()[0]
    return StepPrograms(
        steps=steps,
        swap_out=jax.jit(swap.swap_out, donate_argnums=0),
        swap_in=jax.jit(swap.swap_in, donate_argnums=0),
        init=lambda: jax.device_put(init_state(model_cfg, cfg, draft_cfg), device),
        device=device,
        swapped_sharding=device,
        split=SplitPrograms(layouts, step_kwargs) if cfg.structured_overlap else None,
    )


def sharded(
    mesh: Mesh,
    model_cfg: ModelConfig,
    cfg: EngineConfig,
    layouts: dict[tuple, StepInputLayout],
    step_kwargs: dict,
    unused_pages,
) -> StepPrograms:
    if cfg.structured_overlap:
        raise ValueError("structured_overlap runs on one device (tp = dp = 1)")
    from jbatch.parallel.attention import sharded_attention
    from jbatch.parallel.experts import sharded_experts
    from jbatch.parallel.sharding import param_shardings, replicated, state_shardings
    from jbatch.param_layout import expected_param_shapes

    rep = replicated(mesh)
    init = functools.partial(init_state, model_cfg, cfg)
    st = state_shardings(mesh, jax.eval_shape(init))
    saved_shape = jax.eval_shape(lambda: swap.swap_out(init(), 0, unused_pages)[1])
    saved = state_shardings(mesh, saved_shape)
    params = param_shardings(mesh, expected_param_shapes(model_cfg))
    head = params.get("lm_head", params["embed"])
    vocab_split = NamedSharding(mesh, P(None, *head.spec[:1]))  # the logits' [S, V] split
    step_kwargs = dict(
        step_kwargs,
        logits_shardings=(vocab_split, rep),
        attention=sharded_attention(mesh),
        experts=sharded_experts(mesh),
    )
    # Params keep the shardings they were placed with; the state and every host input are
    # pinned.
    jit = lambda layout: jax.jit(
        packed_step(layout, cfg, **step_kwargs),
        in_shardings=(None, st, rep, rep, rep),
        out_shardings=(st, rep),
        donate_argnums=1,
    )
    return StepPrograms(
        steps={key: jit(layout) for key, layout in layouts.items()},
        swap_out=jax.jit(
            swap.swap_out, in_shardings=(st, rep, rep), out_shardings=(st, saved), donate_argnums=0
        ),
        swap_in=jax.jit(
            swap.swap_in,
            in_shardings=(st, rep, rep, saved, rep),
            out_shardings=st,
            donate_argnums=0,
        ),
        init=jax.jit(init, out_shardings=st),
        device=rep,
        swapped_sharding=saved,
    )
