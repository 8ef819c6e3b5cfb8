"""Train jbatch's built-in demo model: a small Llama on text every Python install carries.

    python scripts/train_demo_model.py --steps 750 --out jbatch/demo_model

``--steps`` fixes the work (reproducible: same seed, same data order, same weights on the same
versions); without it training runs for ``--minutes``. The shipped model's exact command and
step count are in ``jbatch/demo_model/training.json`` and ``docs/demo_model.md``.

Corpus: the standard library's own ``.py`` sources plus ``pydoc_data`` topic texts, files sorted
by path and split 98/2 into train/validation by a seeded shuffle. Tokenizer: a byte-level BPE
trained by HF ``tokenizers``. Model: a Llama (RMSNorm, RoPE, GQA, SwiGLU) trained with optax
AdamW on next-token prediction, with the same params layout jbatch serves. Output: an HF
checkpoint folder (config.json, model.safetensors in bfloat16, generation_config.json,
tokenizer.json, tokenizer_config.json) that transformers also loads, plus ``training.json``
(losses, settings, samples). Seeded: the same machine and versions give the same weights.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from safetensors.numpy import save_file

from jbatch.models.config import ModelConfig
from jbatch.models.llama import apply_rope, rms_norm, rope_tables
from jbatch.tiny_model import write_tokenizer
from jbatch.tokenizer import Tokenizer


def corpus_files(max_mb: float) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    # Includes pydoc_data/topics.py: the language reference's topics as text.
    files = sorted(p for p in stdlib.rglob("*.py") if "test" not in p.parts and p.is_file())
    files = [p for p in files if "site-packages" not in p.parts]
    random.Random(0).shuffle(files)
    out, total = [], 0
    for f in files:
        size = f.stat().st_size
        if total + size > max_mb * 2**20:
            continue
        out.append(f)
        total += size
    return out


def hf_config(args) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.mlp,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def init_params(cfg: ModelConfig, key) -> dict:
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    h, kvh, n = cfg.num_heads, cfg.num_kv_heads, cfg.num_layers
    keys = iter(jax.random.split(key, 16))
    w = lambda *shape: jax.random.normal(next(keys), shape) * (shape[-2] ** -0.5)
    return {
        "embed": jax.random.normal(next(keys), (cfg.vocab_size, e)) * 0.02,
        "final_norm": jnp.ones(e),
        "layers": {
            "attn_norm": jnp.ones((n, e)),
            "mlp_norm": jnp.ones((n, e)),
            "wq": w(n, e, h * d),
            "wk": w(n, e, kvh * d),
            "wv": w(n, e, kvh * d),
            "wo": w(n, h * d, e) / np.sqrt(2 * n),
            "w_gate": w(n, e, f),
            "w_up": w(n, e, f),
            "w_down": w(n, f, e) / np.sqrt(2 * n),
        },
    }


def dense_forward(params, cfg: ModelConfig, tokens):  # tokens [B, T] -> logits [B, T, V]
    b, t = tokens.shape
    h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = rope_tables(cfg.ropes[0], cfg.head_dim, jnp.arange(t))
    causal = jnp.tril(jnp.ones((t, t), bool))
    x = params["embed"][tokens]  # [B, T, E]
    lp = params["layers"]
    for i in range(cfg.num_layers):
        xn = rms_norm(x, lp["attn_norm"][i], cfg.rms_norm_eps)
        q = jax.vmap(apply_rope, (0, None, None))((xn @ lp["wq"][i]).reshape(b, t, h, d), cos, sin)
        k = jax.vmap(apply_rope, (0, None, None))(
            (xn @ lp["wk"][i]).reshape(b, t, kvh, d), cos, sin
        )
        v = (xn @ lp["wv"][i]).reshape(b, t, kvh, d)
        k, v = jnp.repeat(k, h // kvh, axis=2), jnp.repeat(v, h // kvh, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5
        p = jax.nn.softmax(jnp.where(causal, s, -1e30), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, h * d)
        x = x + o @ lp["wo"][i]
        xn = rms_norm(x, lp["mlp_norm"][i], cfg.rms_norm_eps)
        x = x + (jax.nn.silu(xn @ lp["w_gate"][i]) * (xn @ lp["w_up"][i])) @ lp["w_down"][i]
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps) @ params["embed"].T


def loss_fn(params, cfg, batch):
    logits = dense_forward(params, cfg, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def save_hf(params, cfg_dict: dict, out: Path) -> None:
    # C-contiguous: safetensors writes the raw buffer, so a transposed view would be saved
    # with its rows and columns swapped.
    bf16 = lambda a: np.ascontiguousarray(np.asarray(a, np.float32).astype(ml_dtypes.bfloat16))
    lp = params["layers"]
    tensors = {
        "model.embed_tokens.weight": bf16(params["embed"]),
        "model.norm.weight": bf16(params["final_norm"]),
    }
    names = {
        "wq": "self_attn.q_proj",
        "wk": "self_attn.k_proj",
        "wv": "self_attn.v_proj",
        "wo": "self_attn.o_proj",
        "w_gate": "mlp.gate_proj",
        "w_up": "mlp.up_proj",
        "w_down": "mlp.down_proj",
    }
    for i in range(cfg_dict["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = bf16(lp["attn_norm"][i])
        tensors[p + "post_attention_layernorm.weight"] = bf16(lp["mlp_norm"][i])
        for ours, hf in names.items():
            tensors[p + hf + ".weight"] = bf16(np.asarray(lp[ours][i]).T)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="jbatch/demo_model")
    ap.add_argument("--steps", type=int, default=0, help="train exactly this many steps")
    ap.add_argument("--minutes", type=float, default=17.0, help="time budget if --steps is 0")
    ap.add_argument("--corpus-mb", type=float, default=30.0)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--mlp", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    files = corpus_files(args.corpus_mb)
    n_val = max(1, len(files) // 50)
    texts = [f.read_text(errors="replace") for f in files]
    write_tokenizer(out, args.vocab, texts[n_val:])
    tok = Tokenizer.from_dir(out)
    ids = lambda ts: np.concatenate(
        [np.asarray(tok.encode(t, add_special_tokens=False) + [2], np.int32) for t in ts]
    )
    train, val = ids(texts[n_val:]), ids(texts[:n_val])
    print(
        f"corpus {len(files)} files, {len(train):,} train / {len(val):,} val tokens "
        f"({time.time() - t_start:.0f}s)",
        flush=True,
    )

    cfg_dict = hf_config(args)
    cfg = ModelConfig.from_hf_dict(cfg_dict)
    params = init_params(cfg, jax.random.key(args.seed))
    total_steps = 10_000  # the schedule's horizon; training stops on the time budget
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, 100, total_steps, args.lr / 20)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.05))
    opt_state = opt.init(params)

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, cfg, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_loss = jax.jit(lambda p, b: loss_fn(p, cfg, b))
    rng = np.random.default_rng(args.seed)
    n = args.seq + 1
    val_batches = [val[i : i + n] for i in range(0, len(val) - n, n)][:64]
    val_arr = np.stack(val_batches)

    def validate(params) -> float:
        return float(
            np.mean([eval_loss(params, val_arr[i : i + 16]) for i in range(0, len(val_arr), 16)])
        )

    log, step, deadline = [], 0, t_start + args.minutes * 60
    while step < (args.steps or total_steps) and (args.steps or time.time() < deadline):
        starts = rng.integers(0, len(train) - n, args.batch)
        batch = np.stack([train[s : s + n] for s in starts])
        params, opt_state, loss = train_step(params, opt_state, batch)
        step += 1
        if step % 50 == 0:
            entry = {
                "step": step,
                "train_loss": float(loss),
                "minutes": (time.time() - t_start) / 60,
            }
            if step % 200 == 0:
                entry["val_loss"] = validate(params)
            log.append(entry)
            print(json.dumps(entry), flush=True)
    final_val = validate(params)
    print(f"done: {step} steps, val loss {final_val:.3f}", flush=True)
    save_hf(params, cfg_dict, out)
    (out / "training.json").write_text(
        json.dumps(
            {
                "args": vars(args),
                "steps": step,
                "val_loss": final_val,
                "train_tokens": int(step * args.batch * args.seq),
                "log": log,
                "minutes": (time.time() - t_start) / 60,
                "python": sys.version.split()[0],
                "jax": jax.__version__,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
