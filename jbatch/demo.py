"""The built-in demo model: a small Llama trained by ``scripts/train_demo_model.py`` on the
standard library's sources, shipped inside the package so the first command needs no download.
See ``docs/demo_model.md`` for its model card."""

from __future__ import annotations

import os
from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


def demo_model_path() -> Path:
    """Folder of the demo checkpoint (``$JBATCH_DEMO_MODEL`` overrides it)."""
    path = Path(os.environ.get("JBATCH_DEMO_MODEL", DEMO_MODEL_DIR))
    missing = [f for f in _REQUIRED if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"demo model at {path} is incomplete (missing {', '.join(missing)}); "
            f"run scripts/train_demo_model.py or pass --model"
        )
    return path


def demo_draft_path() -> Path:
    """Folder of the demo model's draft for speculative decoding (1 layer, distilled from it by
    ``scripts/train_draft_model.py``; ``docs/demo_model.md``): ``--speculative-model``."""
    path = demo_model_path() / "draft"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"no draft model at {path}; run scripts/train_draft_model.py")
    return path
