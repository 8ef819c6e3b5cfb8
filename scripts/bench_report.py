"""What a benchmark script writes next to its table: ``OUT.json`` with the command that ran it,
the date and the machine, then the script's own fields."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path


def write_summary(out: str, **fields) -> Path:
    """Write ``out`` (suffix ``.json``) and return its path; the caller's plot goes beside it
    (``path.with_suffix(".png")``)."""
    summary = {
        "command": f"python scripts/{Path(sys.argv[0]).name} " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.platform(),
        **fields,
    }
    path = Path(out).with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))
    return path
