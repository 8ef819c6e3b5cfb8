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
