"""StepInput: everything the host sends one engine step, packed into two flat buffers.

A step's host inputs — the slots to retire, the sequences to start (a ``SlotInsert``) and the
token rows and page writes of the step (a ``StepBatch``) — are about twenty small arrays. Each
jit argument costs a few microseconds of dispatch, so the engine's one step program takes them
packed: one int32 buffer (int32 fields, bools as 0/1, uint32 seeds bit for bit) and one float32
buffer, with a layout that is static per (decode bucket, prefill bucket) pair.

1. :class:`StepInputLayout` is built once per bucket pair from a template pytree of numpy
   arrays (the defaults: nothing released, nothing inserted, only padding rows).
2. The host takes a :class:`StepInput` from :meth:`StepInputLayout.new` (fresh buffers) or
   :meth:`StepInputLayout.reuse` (an input whose step has finished, reset to the defaults: a
   device buffer may alias host memory, so a buffer is never rewritten while a step can still
   read it). Its fields are numpy *views* into the two buffers, which the batch builder fills.
3. Inside the jitted program :meth:`StepInputLayout.unpack` slices the buffers back into the
   pytree (static slices, reshapes and bitcasts: no copies worth counting).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int32

from jbatch.engine import buckets
from jbatch.engine.config import EngineConfig

_INT_KINDS = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(bool))


@dataclasses.dataclass(frozen=True)
class _Field:
    buffer: int  # 0: the int32 buffer, 1: the float32 buffer
    offset: int
    size: int
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclasses.dataclass
class StepInput:
    """One step's host inputs: ``release`` mask, ``insert`` (a ``SlotInsert``), ``batch`` (a
    ``StepBatch``), as numpy views into the packed ``ints`` / ``floats`` buffers."""

    release: np.ndarray  # [slots] (0/1)
    insert: Any  # SlotInsert of numpy views
    batch: Any  # StepBatch of numpy views
    ints: np.ndarray
    floats: np.ndarray
    layout: StepInputLayout

    def structured(self) -> tuple[np.ndarray, Any, Any]:
        """(release, insert, batch) with their real dtypes (bool masks, uint32 seeds)."""
        return self.layout.unpack_numpy(self.ints, self.floats)


class StepInputLayout:
    """Static packing of a ``(release, SlotInsert, StepBatch)`` pytree (see module doc)."""

    def __init__(
        self, template: tuple[np.ndarray, Any, Any], key: tuple = (), packed_rows: int | None = None
    ):
        self.key = key  # the program it feeds: (rows, decode_rows), or ("spec", groups)
        # A packed prompt region (``buckets.py``): the prompt rows its dense layers compute.
        self.packed_rows = packed_rows
        leaves, self.treedef = jax.tree.flatten(template)
        self.fields: list[_Field] = []
        sizes = [0, 0]
        for leaf in leaves:
            leaf = np.asarray(leaf)
            buffer = 0 if leaf.dtype in _INT_KINDS else 1
            if buffer == 1 and leaf.dtype != np.float32:
                raise TypeError(f"cannot pack a {leaf.dtype} step input")
            self.fields.append(_Field(buffer, sizes[buffer], leaf.size, leaf.shape, leaf.dtype))
            sizes[buffer] += leaf.size
        ints, floats = np.zeros(max(sizes[0], 1), np.int32), np.zeros(max(sizes[1], 1), np.float32)
        self.defaults = (ints, floats)
        for leaf, view in zip(leaves, self._views(self.defaults)):
            view[...] = leaf

    @classmethod
    def for_bucket(cls, cfg: EngineConfig, rows: int, decode_rows: int) -> StepInputLayout:
        """The layout of steps with ``rows`` prompt-chunk rows and ``decode_rows`` decode rows."""
        from jbatch.engine.core import StepBatch, build_empty_insert

        release = np.zeros(cfg.max_slots, bool)
        batch = StepBatch.empty(cfg, rows, decode_rows)
        batch.decode_slots[:] = cfg.max_slots  # padding: the host lists the decoding slots
        dense = buckets.dense_rows(cfg, rows)
        template = (release, build_empty_insert(cfg), batch)
        return cls(template, (rows, decode_rows), dense if dense < rows else None)

    def step_kwargs(self) -> dict:
        """Keywords of ``core.step`` particular to this layout's program."""
        return {} if self.packed_rows is None else {"packed_rows": self.packed_rows}

    @classmethod
    def for_spec_bucket(cls, cfg: EngineConfig, groups: int) -> StepInputLayout:
        """The layout of speculative steps with ``groups`` groups (``spec_step.SpecBatch``)."""
        from jbatch.engine.core import build_empty_insert
        from jbatch.engine.spec_step import SpecBatch

        release = np.zeros(cfg.max_slots, bool)
        template = (release, build_empty_insert(cfg), SpecBatch.empty(cfg, groups))
        return cls(template, ("spec", groups))

    def _views(self, buffers: tuple[np.ndarray, np.ndarray]) -> list[np.ndarray]:
        views = []
        for f in self.fields:
            flat = buffers[f.buffer][f.offset : f.offset + f.size]
            if f.dtype == np.uint32:
                flat = flat.view(np.uint32)
            views.append(flat.reshape(f.shape))
        return views

    def new(self) -> StepInput:
        """Fresh buffers holding the defaults, and views to fill them."""
        ints, floats = self.defaults[0].copy(), self.defaults[1].copy()
        release, insert, batch = jax.tree.unflatten(self.treedef, self._views((ints, floats)))
        return StepInput(release, insert, batch, ints, floats, self)

    def reuse(self, inp: StepInput) -> StepInput:
        """``inp`` (of this layout, its step finished) reset to the defaults, views and all."""
        np.copyto(inp.ints, self.defaults[0])
        np.copyto(inp.floats, self.defaults[1])
        return inp

    def unpack(
        self, ints: Int32[Array, " n_int"], floats: Float[Array, " n_float"]
    ) -> tuple[Bool[Array, " slots"], Any, Any]:
        """Traced: the packed buffers back into ``(release, SlotInsert, StepBatch)``."""
        leaves = []
        for f in self.fields:
            flat = (ints, floats)[f.buffer][f.offset : f.offset + f.size]
            if f.dtype == np.bool_:
                flat = flat != 0
            elif f.dtype == np.uint32:
                flat = jax.lax.bitcast_convert_type(flat, jnp.uint32)
            leaves.append(flat.reshape(f.shape))
        return jax.tree.unflatten(self.treedef, leaves)

    def unpack_numpy(self, ints: np.ndarray, floats: np.ndarray) -> tuple[np.ndarray, Any, Any]:
        """The same on the host (numpy), for stand-in cores."""
        leaves = [
            v.astype(bool) if f.dtype == np.bool_ else v
            for f, v in zip(self.fields, self._views((ints, floats)))
        ]
        return jax.tree.unflatten(self.treedef, leaves)


class SpareInputs:
    """Step inputs whose step has finished, per layout, handed out again (reset to the
    defaults) instead of fresh ones. Only an input no step can still read may be put here."""

    def __init__(self):
        self._spare: dict[tuple, list[StepInput]] = {}

    def put(self, inp: StepInput) -> None:
        self._spare.setdefault(inp.layout.key, []).append(inp)

    def take(self, layout: StepInputLayout) -> StepInput:
        """A spare input of ``layout``, reset, else a fresh one."""
        free = self._spare.get(layout.key)
        return layout.reuse(free.pop()) if free else layout.new()

    def __len__(self) -> int:
        return sum(map(len, self._spare.values()))


def all_layouts(cfg: EngineConfig) -> dict[tuple[int, int], StepInputLayout]:
    """A layout for every (prefill rows, decode rows) bucket pair the engine compiles."""
    return {
        (rows, decode_rows): StepInputLayout.for_bucket(cfg, rows, decode_rows)
        for rows, decode_rows in buckets.bucket_pairs(cfg)
    }


def spec_layouts(cfg: EngineConfig) -> dict[tuple[str, int], StepInputLayout]:
    """A layout for every speculative group bucket (none when the engine does not speculate)."""
    return {("spec", g): StepInputLayout.for_spec_bucket(cfg, g) for g in buckets.spec_buckets(cfg)}
