"""The files of a batch job (``jbatch batch``): the JSONL input read line by line, and the JSONL
output that is appended to, one whole line per result, and scanned on a restart.

Output lines are OpenAI Batch API ``BatchRequestOutput`` objects: ``id``, ``custom_id``,
``response`` (``status_code``, ``request_id``, ``body``) or null, ``error`` (``code``,
``message``) or null. A line is *keyed* by its ``custom_id``, or, when it carries ``"line"``
(an input line without a usable ``custom_id``, or a duplicate one), by that 1-based line number
of the input. A restarted job skips every key already in the output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class Done:
    """The keys already in an output file."""

    custom_ids: set[str] = dataclasses.field(default_factory=set)
    lines: set[int] = dataclasses.field(default_factory=set)
    repaired_bytes: int = 0  # a torn last line cut off (a job killed while writing it)

    def __len__(self) -> int:
        return len(self.custom_ids) + len(self.lines)

    def add(self, entry: dict[str, Any]) -> None:
        if "line" in entry:
            self.lines.add(int(entry["line"]))
        else:
            self.custom_ids.add(entry["custom_id"])


def scan_output(path: Path) -> Done:
    """The keys in ``path`` (nothing if it does not exist), after cutting off a torn last line
    (one without its newline). ValueError naming the line if a whole line is not one of ours:
    the job will not append to a file it does not understand."""
    done = Done()
    if not path.exists():
        return done
    good = 0  # bytes of whole lines
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                done.repaired_bytes = len(raw)
                break
            good += len(raw)
            if not raw.strip():
                continue
            try:
                entry = json.loads(raw)
                ok = isinstance(entry, dict) and (
                    isinstance(entry.get("line"), int) or isinstance(entry.get("custom_id"), str)
                )
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(
                    f"--output {path}: line {number} is not a batch result line; not resuming "
                    f"into a file this job did not write"
                )
            done.add(entry)
    if done.repaired_bytes:
        os.truncate(path, good)
    return done


def read_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes) of every non-blank line, streamed."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                yield number, raw


def count_lines(path: Path) -> int:
    """Non-blank lines (the progress bar's total); one streamed pass."""
    return sum(1 for _ in read_lines(path))


class ResultWriter:
    """Appends one whole line per call: one ``write`` of the encoded line, so lines never
    interleave and a kill leaves at most a torn last line (repaired by :func:`scan_output`)."""

    def __init__(self, path: Path):
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, entry: dict[str, Any]) -> None:
        data = (json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def result_line(custom_id: Any, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """A line holding the HTTP answer the server would give (200 or an error status)."""
    response = {"status_code": status, "request_id": "req_" + secrets.token_hex(12), "body": body}
    return {"id": _line_id(), "custom_id": custom_id, "response": response, "error": None}


def error_line(custom_id: Any, code: str, message: str, line: int | None = None) -> dict[str, Any]:
    """A line for an input line that is not a request at all (``line``: keyed by number)."""
    entry = {"id": _line_id(), "custom_id": custom_id, "response": None}
    entry["error"] = {"code": code, "message": message}
    if line is not None:
        entry["line"] = line
    return entry


def _line_id() -> str:
    return "batch_req_" + secrets.token_hex(12)
