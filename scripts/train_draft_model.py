"""Distill a small draft model for speculative decoding from the demo model.

    python scripts/train_draft_model.py --steps 400 --out jbatch/demo_model/draft

The draft is a Llama with the teacher's tokenizer and vocabulary (so its proposals are the
teacher's token ids) and fewer layers. It starts from the teacher: embedding (tied LM head),
final norm and evenly spaced teacher layers are copied in, then every weight is trained to
minimise KL(teacher || draft) of the next-token distributions on the teacher's own corpus and
train split (``train_demo_model.corpus_files``, same seeded 98/2 file split). Seeded: the same
machine and versions give the same weights.

At the end it measures what speculative decoding gets from the pair on held-out text: from
``--eval-contexts`` validation prefixes, both models continue greedily for ``--k`` tokens and the
accepted length is the longest common prefix (what greedy verification accepts), plus the
teacher-forced top-1 agreement. Both are measured on the weights as saved (bfloat16).
Output: an HF checkpoint folder (with the teacher's tokenizer files) and ``training.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_model import corpus_files, dense_forward, hf_config, save_hf

from jbatch.checkpoint import load_model
from jbatch.models.config import ModelConfig
from jbatch.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def draft_args(args, teacher: ModelConfig) -> argparse.Namespace:
    """The teacher's shape with the draft's layer count (what ``hf_config`` reads)."""
    return argparse.Namespace(
        vocab=teacher.vocab_size,
        hidden=teacher.hidden_size,
        mlp=teacher.intermediate_size,
        layers=args.layers,
        heads=teacher.num_heads,
        kv_heads=teacher.num_kv_heads,
    )


def init_from_teacher(teacher: dict, n_teacher: int, n_draft: int) -> dict:
    """Embedding and final norm of the teacher, and its layers at evenly spaced depths."""
    picks = np.round(np.linspace(0, n_teacher - 1, n_draft)).astype(int)
    layers = {k: jnp.asarray(v[picks]) for k, v in teacher["layers"].items()}
    return {"embed": teacher["embed"], "final_norm": teacher["final_norm"], "layers": layers}


def kl_loss(params, cfg, teacher_logits, tokens):
    """Mean KL(teacher || draft) over the positions of ``tokens`` [B, T]."""
    logq = jax.nn.log_softmax(dense_forward(params, cfg, tokens), axis=-1)
    logp = jax.nn.log_softmax(teacher_logits, axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1))


def greedy_continuation(params, cfg, prefixes, k: int):
    """[B, P] prefixes -> [B, k] greedy next tokens (one fixed-shape buffer, causal)."""
    b, p = prefixes.shape
    buf = jnp.concatenate([prefixes, jnp.zeros((b, k), prefixes.dtype)], axis=1)
    for i in range(k):
        nxt = jnp.argmax(dense_forward(params, cfg, buf)[:, p - 1 + i], axis=-1)
        buf = buf.at[:, p + i].set(nxt.astype(buf.dtype))
    return buf[:, p:]


def acceptance(teacher, t_cfg, draft, d_cfg, val, args) -> dict:
    """Greedy acceptance of ``args.k`` draft tokens and top-1 agreement on held-out text."""
    rng = np.random.default_rng(args.seed + 1)
    p = args.eval_prefix
    starts = rng.integers(0, len(val) - p - args.k, args.eval_contexts)
    prefixes = np.stack([val[s : s + p] for s in starts])
    accepted, agree = [], []
    for i in range(0, len(prefixes), 64):
        x = jnp.asarray(prefixes[i : i + 64])
        g = greedy_continuation(teacher, t_cfg, x, args.k)
        d = greedy_continuation(draft, d_cfg, x, args.k)
        accepted.append(np.asarray(jnp.sum(jnp.cumprod(g == d, axis=1), axis=1)))
        top_t = jnp.argmax(dense_forward(teacher, t_cfg, x), axis=-1)
        top_d = jnp.argmax(dense_forward(draft, d_cfg, x), axis=-1)
        agree.append(np.asarray(top_t == top_d).ravel())
    accepted = np.concatenate(accepted)
    return {
        "k": args.k,
        "contexts": len(accepted),
        "prefix_tokens": p,
        "mean_accepted": float(accepted.mean()),
        "acceptance_rate": float(accepted.mean() / args.k),
        "accepted_histogram": np.bincount(accepted, minlength=args.k + 1).tolist(),
        "top1_agreement": float(np.concatenate(agree).mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default="jbatch/demo_model")
    ap.add_argument("--out", default="jbatch/demo_model/draft")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--corpus-mb", type=float, default=30.0, help="as the teacher's training")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step (evaluation)")
    ap.add_argument("--eval-contexts", type=int, default=512)
    ap.add_argument("--eval-prefix", type=int, default=64)
    args = ap.parse_args()
    out, teacher_dir = Path(args.out), Path(args.teacher)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    t_cfg, teacher = load_model(teacher_dir, "float32")
    tok = Tokenizer.from_dir(teacher_dir)
    files = corpus_files(args.corpus_mb)
    n_val = max(1, len(files) // 50)
    texts = [f.read_text(errors="replace") for f in files]
    ids = lambda ts: np.concatenate(
        [np.asarray(tok.encode(t, add_special_tokens=False) + [2], np.int32) for t in ts]
    )
    train, val = ids(texts[n_val:]), ids(texts[:n_val])
    print(f"{len(train):,} train / {len(val):,} val tokens ({time.time() - t_start:.0f}s)")

    cfg_dict = hf_config(draft_args(args, t_cfg))
    d_cfg = ModelConfig.from_hf_dict(cfg_dict)
    params = init_from_teacher(teacher, t_cfg.num_layers, args.layers)
    sched = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(50, args.steps // 4), max(args.steps, 2), args.lr / 20
    )
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    opt_state = opt.init(params)
    teacher_logits = jax.jit(lambda b: dense_forward(teacher, t_cfg, b))

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(kl_loss)(params, d_cfg, teacher_logits(batch), batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    n = args.seq
    val_arr = np.stack([val[i : i + n] for i in range(0, len(val) - n, n)][:32])
    eval_kl = jax.jit(lambda p, b: kl_loss(p, d_cfg, teacher_logits(b), b))
    validate = lambda p: float(np.mean([eval_kl(p, val_arr[i : i + 16]) for i in (0, 16)]))
    rng = np.random.default_rng(args.seed)
    log = [{"step": 0, "val_kl": validate(params)}]
    print(json.dumps(log[0]), flush=True)
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, len(train) - n, args.batch)
        batch = np.stack([train[s : s + n] for s in starts])
        params, opt_state, loss = train_step(params, opt_state, batch)
        if step % 25 == 0:
            entry = {"step": step, "train_kl": float(loss), "minutes": (time.time() - t_start) / 60}
            if step % 100 == 0 or step == args.steps:
                entry["val_kl"] = validate(params)
            log.append(entry)
            print(json.dumps(entry), flush=True)
    train_minutes = (time.time() - t_start) / 60

    save_hf(params, cfg_dict, out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(teacher_dir / name, out / name)
    _, saved_teacher = load_model(teacher_dir, "float32")  # bf16 values, as served
    _, saved_draft = load_model(out, "float32")
    stats = acceptance(saved_teacher, t_cfg, saved_draft, d_cfg, val, args)
    print(json.dumps(stats), flush=True)
    (out / "training.json").write_text(
        json.dumps(
            {
                "command": "python " + " ".join(sys.argv),
                "args": vars(args),
                "teacher": str(teacher_dir),
                "train_tokens": int(args.steps * args.batch * args.seq),
                "train_minutes": train_minutes,
                "final_val_kl": log[-1].get("val_kl"),
                "acceptance": stats,
                "log": log,
                "python": sys.version.split()[0],
                "jax": jax.__version__,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
