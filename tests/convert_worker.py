"""``jbatch convert`` and restore on several (simulated) devices, run by tests/test_convert.py:
``python -m tests.convert_worker HF_DIR OUT_BASE`` with 4 host devices; prints ``RESULT {json}``.

Converts HF_DIR at tp=1, at tp=4 (KV heads replicated: the model has 2) and int8 at tp=2, then
restores each onto a mesh and compares every param, value and sharding, with
``load_params_sharded`` of the HF folder; last, the params
``LLM(converted, tp=2)`` runs against those of ``LLM(HF_DIR, tp=2)``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# A small engine, not warmed up: only the programs these prompts run are compiled.
SMALL = dict(
    max_slots=2, num_pages=16, page_size=8, max_num_batched_tokens=16, max_seq_len=64, block_q=8,
    warmup=False,
)  # fmt: skip


def same(a, b) -> list[str]:
    """Paths of the params whose values, dtypes or shardings differ (``[]``: identical)."""
    import jax
    import numpy as np

    (fa, ta), (fb, tb) = (
        jax.tree_util.tree_flatten_with_path(a),
        jax.tree_util.tree_flatten_with_path(b),
    )
    if ta != tb:
        return [f"different trees: {ta} vs {tb}"]
    shards = lambda t: sorted((str(s.device), str(s.index)) for s in t.addressable_shards)
    return [
        jax.tree_util.keystr(path)
        for (path, x), (_, y) in zip(fa, fb)
        if x.dtype != y.dtype
        or not np.array_equal(np.asarray(x), np.asarray(y))
        or x.sharding.spec != y.sharding.spec
        or shards(x) != shards(y)
    ]


def main(hf_dir: str, out_base: str) -> dict:
    import jax

    from jbatch import LLM
    from jbatch.converted import convert, restore
    from jbatch.models.config import ModelConfig
    from jbatch.models.quant import WeightQuant
    from jbatch.parallel.loading import load_params_sharded
    from jbatch.parallel.mesh import make_mesh

    cfg = ModelConfig.from_file(f"{hf_dir}/config.json")
    out1 = convert(hf_dir, f"{out_base}/tp1")
    out4 = convert(hf_dir, f"{out_base}/tp4", tp=4)
    out2q = convert(hf_dir, f"{out_base}/tp2q", quantization="int8", tp=2)
    mesh2, mesh4 = make_mesh(2, 1, jax.devices()[:2]), make_mesh(4, 1)
    result = {
        "tp1_on_2": same(restore(out1, cfg, mesh=mesh2), load_params_sharded(hf_dir, cfg, mesh2)),
        "tp4_on_4": same(restore(out4, cfg, mesh=mesh4), load_params_sharded(hf_dir, cfg, mesh4)),
        "int8_on_2": same(
            restore(out2q, cfg, mesh=mesh2),
            load_params_sharded(hf_dir, cfg, mesh2, quant=WeightQuant("int8")),
        ),
    }
    for name, path, mesh in (("tp4_on_2", out4, mesh2), ("tp1_on_4", out1, mesh4)):
        try:
            restore(path, cfg, mesh=mesh)
            result[name] = "restored"
        except ValueError as e:
            result[name] = str(e)
    # LLM(converted, tp=2): the engine's params (after its own restructuring) as from HF_DIR
    engines = [
        LLM(d, tp=2, quantization=q, **SMALL).engine for d, q in ((out2q, None), (hf_dir, "int8"))
    ]
    result["llm_tp2"] = same(engines[0].params, engines[1].params)
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(*sys.argv[1:3])))
