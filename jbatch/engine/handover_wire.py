"""A :class:`HandoverRecord` as JSON, for handovers between processes (``serving/disagg_*.py``).

Only plain values travel (no pickle: a peer's bytes are never code): sampling parameters field
by field (a structured-output spec as its fields), logprobs as ``[token, logprob, rank, text]``
lists, the detokenizer's window as its ids and offsets.
"""

from __future__ import annotations

import dataclasses
import json

from jbatch.engine.handover import HandoverRecord
from jbatch.outputs import Logprob, OutputKind, TopLogprobs
from jbatch.sampling_params import SamplingParams
from jbatch.structured_output import StructuredOutput


def record_to_json(record: HandoverRecord) -> bytes:
    d = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    d["params"] = _params_to_dict(record.params)
    d["output_kind"] = record.output_kind.value
    d["top_logprobs"] = [top_to_list(t) for t in record.top_logprobs]
    if record.prompt_logprobs is not None:
        d["prompt_logprobs"] = [top_to_list(t) for t in record.prompt_logprobs]
    return json.dumps(d).encode()


def record_from_json(data: bytes) -> HandoverRecord:
    """The record ``record_to_json`` wrote; ValueError if it is not one."""
    try:
        d = json.loads(data)
        d["params"] = _params_from_dict(d["params"])
        d["output_kind"] = OutputKind(d["output_kind"])
        d["top_logprobs"] = tuple(top_from_list(t) for t in d["top_logprobs"])
        if d["prompt_logprobs"] is not None:
            d["prompt_logprobs"] = tuple(top_from_list(t) for t in d["prompt_logprobs"])
        for name in ("prompt_ids", "output_ids", "logprobs", "text_chunks"):
            d[name] = tuple(d[name])
        return HandoverRecord(**d)
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a handover record: {type(e).__name__}: {e}") from None


def top_to_list(top: TopLogprobs | None) -> list | None:
    if top is None:
        return None
    return [[t, lp.logprob, lp.rank, lp.decoded_token] for t, lp in top.items()]


def top_from_list(items: list | None) -> TopLogprobs | None:
    if items is None:
        return None
    return {int(t): Logprob(lp, rank, text) for t, lp, rank, text in items}


def _params_to_dict(params: SamplingParams) -> dict:
    d = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    if params.structured is not None:
        s = params.structured
        d["structured"] = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
    return d


def _params_from_dict(d: dict) -> SamplingParams:
    if d.get("structured") is not None:
        d = {**d, "structured": StructuredOutput(**d["structured"])}
    return SamplingParams(**d)
