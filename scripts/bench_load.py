"""Weight loading time: Hugging Face safetensors (``load_params``) vs a ``jbatch convert``
orbax checkpoint (``jbatch.converted.restore``), on one device.

    PYTHONPATH=. python scripts/bench_load.py --reps 5 --out docs/bench_load.json

Models: the built-in demo model and a 30-layer random model of SmolLM2-135M's shape
(``scripts/bench_shapes.py``). Rows: float weights in the checkpoint's stored dtype, and int8
weights (the HF path quantizes on the host while reading; the converted one stores int8).
``--tp N`` (with N devices; on CPU ``XLA_FLAGS=--xla_force_host_platform_device_count=N``)
compares ``load_params_sharded`` with a restore into the mesh's shardings.
``--rss safetensors|orbax``: peak host RSS of one load instead (one loader per process).
Each time is the median of ``--reps`` loads in this process after one untimed load (the files
are in the OS page cache: this measures the loaders, not the disk).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shapes import checkpoint_for

from jbatch.checkpoint import load_params
from jbatch.converted import convert, restore, stored_dtype
from jbatch.demo import demo_model_path
from jbatch.models.config import ModelConfig
from jbatch.models.quant import WeightQuant
from jbatch.parallel.loading import load_params_sharded
from jbatch.parallel.mesh import make_mesh


def _median_s(fn, reps: int) -> float:
    jax.block_until_ready(fn())  # untimed: page cache, first-call costs
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(name: str, hf_dir: Path, reps: int, work: Path, tp: int) -> list[dict]:
    cfg = ModelConfig.from_file(hf_dir / "config.json")
    dtype = stored_dtype(hf_dir)
    mesh = None if tp == 1 else make_mesh(tp, 1)
    rows = []
    for quant in (None, "int8"):
        wq = None if quant is None else WeightQuant(quant)
        t0 = time.perf_counter()
        out = convert(hf_dir, work / f"{name}-{quant}", dtype=dtype, quantization=quant, tp=tp)
        convert_s = time.perf_counter() - t0
        if mesh is None:
            from_hf = lambda wq=wq: load_params(hf_dir, cfg, dtype, wq)
        else:
            from_hf = lambda wq=wq: load_params_sharded(hf_dir, cfg, mesh, dtype, wq)
        from_orbax = lambda out=out: restore(out, cfg, dtype, mesh)
        mb = sum(a.nbytes for a in jax.tree.leaves(from_orbax())) / 1e6
        rows.append(
            dict(
                model=name, layers=cfg.num_layers, tp=tp, weights=quant or dtype, mb=round(mb, 1),
                safetensors_s=round(_median_s(from_hf, reps), 3),
                orbax_s=round(_median_s(from_orbax, reps), 3),
                convert_s=round(convert_s, 2),
            )
        )  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def peak_rss(loader: str, tp: int) -> dict:
    """Peak host RSS (above the process's start) of one load of the 30-layer model by
    ``loader`` ("safetensors" or "orbax"), in a process of its own. On CPU the devices' memory
    is host memory, so it includes the params themselves."""
    hf_dir = Path(checkpoint_for("smollm2-135m"))
    cfg = ModelConfig.from_file(hf_dir / "config.json")
    mesh = None if tp == 1 else make_mesh(tp, 1)
    out = Path(tempfile.mkdtemp()) / "conv"
    if loader == "orbax":  # in a child: this process's high-water mark stays the restore's
        cmd = [
            sys.executable,
            "-m",
            "jbatch.cli",
            "convert",
            str(hf_dir),
            str(out),
            "--tp",
            str(tp),
        ]
        subprocess.run(cmd, check=True, capture_output=True)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if loader == "orbax":
        params = restore(out, cfg, "float32", mesh)
    elif mesh is None:
        params = load_params(hf_dir, cfg, "float32")
    else:
        params = load_params_sharded(hf_dir, cfg, mesh, "float32")
    jax.block_until_ready(params)
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024  # KiB -> MiB
    mb = sum(a.nbytes for a in jax.tree.leaves(params)) / 2**20
    return dict(loader=loader, tp=tp, peak_rss_mib=round(peak), params_mib=round(mb))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument(
        "--tp", type=int, default=1, help="load sharded over this many devices (tp > 1: the "
        "30-layer model only; SmolLM2's 9 query / 3 KV heads split over tp=3)"
    )  # fmt: skip
    ap.add_argument(
        "--rss",
        choices=("safetensors", "orbax"),
        default=None,
        help="only measure one loader's peak host RSS (run each in its own process)",
    )
    args = ap.parse_args()
    if args.rss:
        print(peak_rss(args.rss, args.tp))
        return 0
    models = {"demo": demo_model_path(), "smollm2-135m shape": checkpoint_for("smollm2-135m")}
    models = {k: v for k, v in models.items() if args.tp == 1 or k != "demo"}  # demo: 6 heads
    with tempfile.TemporaryDirectory() as work:
        rows = [
            r
            for name, d in models.items()
            for r in bench(name, Path(d), args.reps, Path(work), args.tp)
        ]
    cols = ["model", "layers", "tp", "weights", "mb", "safetensors_s", "orbax_s", "convert_s"]
    print("| " + " | ".join(cols) + " | speedup |")
    print("|---" * (len(cols) + 1) + "|")
    for r in rows:
        speedup = r["safetensors_s"] / r["orbax_s"]
        print("| " + " | ".join(str(r[c]) for c in cols) + f" | {speedup:.2f}x |")
    if args.out:
        meta = dict(machine=platform.processor() or platform.machine(), jax=jax.__version__,
                    backend=jax.default_backend(), reps=args.reps)  # fmt: skip
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
