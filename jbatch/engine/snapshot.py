"""Engine snapshot: an :class:`LLMEngine`'s in-flight work to a folder, and back into a new one.

1. :func:`save` first drains the step in flight (its outputs are returned: the caller delivers
   them as it would any step's), so nothing is half done; then it writes
   - ``state/``: the device state (``EngineState``: the KV pool, page tables, per-slot lengths,
     sampling rows and seeds, RNG step counters, penalty statistics, 8-bit KV scales) with
     orbax, each array as it is placed (a sharded pool is written shard by shard);
   - ``host.pkl``: the scheduler (running set, waiting queue order, page allocator and prefix
     cache, tenant counters, its clock), every request record (prompt, outputs so far, params,
     resolved seed, counters, swapped-out copies in host RAM) and the engine's counters. A
     request's grammar matcher and detokenizer are not pickled: they are rebuilt;
   - ``meta.json``: the format version and the engine and model configs.
2. :func:`load` into an engine built with the same model and configs (anything else is a
   ValueError naming the difference): the state is restored straight into the engine's own
   placement, the records unpickled, detokenizers re-attached to the engine's tokenizer, and
   each structured request's matcher rebuilt by replaying its outputs so far. The next
   ``step()`` continues every request where it stopped: greedy and seeded outputs are those
   of an uninterrupted run (tested).

The whole pool is written, used pages or not (simple, and one orbax item); an engine that
swapped requests out keeps their copies in ``host.pkl``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

import jax

if TYPE_CHECKING:
    from jbatch.engine.llm_engine import LLMEngine
    from jbatch.outputs import RequestOutput

FORMAT = 1


def save(engine: LLMEngine, directory: str | Path) -> list[RequestOutput]:
    """Write ``engine``'s in-flight work to ``directory`` (must not exist yet); returns the
    outputs of the step that was in flight."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if directory.exists():
        raise ValueError(f"snapshot directory {directory} already exists")
    outputs = engine.drain()
    directory.mkdir(parents=True)
    on_device = _on_device(engine)
    if on_device:
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(directory / "state", engine.state)
    records = {
        "scheduler": engine.scheduler,
        "requests": engine.requests,
        "parents": engine.parents,  # n > 1: their children are request records too
        "counters": engine.counters,
        "next_id": _peek(engine),
        "state": None if on_device else engine.state,
    }
    with _detached(engine):
        (directory / "host.pkl").write_bytes(pickle.dumps(records))
    (directory / "meta.json").write_text(json.dumps(_meta(engine), indent=1))
    return outputs


def load(engine: LLMEngine, directory: str | Path) -> None:
    """Replace ``engine``'s work (it must be idle) with the snapshot in ``directory``."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if not (directory / "meta.json").is_file():
        raise ValueError(f"{directory} holds no engine snapshot (no meta.json)")
    if engine.has_unfinished_requests():
        raise ValueError("restore needs an idle engine (requests are in flight)")
    meta, want = json.loads((directory / "meta.json").read_text()), _meta(engine)
    diff = sorted(k for k in set(meta) | set(want) if meta.get(k) != want.get(k))
    if diff:
        raise ValueError(f"the snapshot in {directory} was taken with a different {diff}")
    records = pickle.loads((directory / "host.pkl").read_bytes())
    if _on_device(engine):
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), engine.state
        )
        with ocp.StandardCheckpointer() as ckpt:
            engine.state = ckpt.restore(directory / "state", target)
    else:
        engine.state = records["state"]
    engine.scheduler, engine.requests = records["scheduler"], records["requests"]
    engine.parents = records["parents"]
    engine.counters = records["counters"]
    engine._ids = itertools.count(records["next_id"])
    for seq in _records(engine):
        if seq.detokenizer is not None:
            seq.detokenizer.tokenizer = engine.tokenizer
        if seq.params.structured is not None and not seq.finished:
            seq.matcher = engine.intake.matcher(seq.params)
            if seq.output_ids and not seq.matcher.consume_tokens(seq.output_ids):
                raise ValueError(f"request {seq.request_id}: its outputs do not replay")


def _records(engine: LLMEngine) -> list:
    """Every request record: the requests, and the children of n > 1 requests (a finished
    child may be forgotten from ``requests`` while its siblings run)."""
    children = (c for parent in engine.parents.values() for c in parent.children)
    return list({id(s): s for s in [*engine.requests.values(), *children]}.values())


def _on_device(engine: LLMEngine) -> bool:
    return all(isinstance(a, jax.Array) for a in jax.tree.leaves(engine.state))


def _peek(engine: LLMEngine) -> int:
    """The next automatic request id (the counter itself does not pickle)."""
    n = next(engine._ids)
    engine._ids = itertools.count(n)
    return n


def _meta(engine: LLMEngine) -> dict:
    as_dict = lambda c: dataclasses.asdict(c) if dataclasses.is_dataclass(c) else vars(c)
    return json.loads(
        json.dumps(
            {"format": FORMAT, "engine": as_dict(engine.cfg), "model": as_dict(engine.model_cfg)},
            default=str,
        )
    )


class _detached:
    """Matchers and detokenizers' tokenizers off the request records while they are pickled."""

    def __init__(self, engine: LLMEngine):
        self.seqs = _records(engine)

    def __enter__(self):
        self.saved = [(s.matcher, s.detokenizer and s.detokenizer.tokenizer) for s in self.seqs]
        for seq in self.seqs:
            seq.matcher = None
            if seq.detokenizer is not None:
                seq.detokenizer.tokenizer = None

    def __exit__(self, *exc):
        for seq, (matcher, tokenizer) in zip(self.seqs, self.saved):
            seq.matcher = matcher
            if seq.detokenizer is not None:
                seq.detokenizer.tokenizer = tokenizer
