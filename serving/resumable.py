"""Resumable streams: what the server keeps so gRPC clients can resume after a restart.

With ``jbatch serve --snapshot-dir D`` (:class:`ResumeRegistry` in the engine thread):

1. While serving, every stream's sent deltas are kept (token ids and text, per delta).
2. On shutdown the engine is snapshotted into ``D`` (``LLMEngine.snapshot``), and
   ``D/streams.json`` records, per engine request, the client's ``request_id`` (gRPC) and the
   deltas sent so far. Open streams end with UNAVAILABLE naming how to resume.
3. On start with a snapshot in ``D``, the engine restores it and every restored request keeps
   generating at once. The deltas it produces wait in the registry for their client; requests
   that came over HTTP (which cannot resume a stream) are aborted. The snapshot is consumed:
   ``D`` is removed.
4. The client calls ``Generate`` again with the same ``request_id``, ``resume = true`` and
   ``resume_from_token`` = the number of generated tokens it already received; the stream
   continues from there: the deltas it missed first, then new ones as they come. A resume that
   names no waiting request is NOT_FOUND. A restored request whose client has not come back
   ``ttl`` seconds after the restart is aborted and dropped.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from serving.request_stream import Delta

STREAMS_FILE = "streams.json"


@dataclasses.dataclass
class Parked:
    """A restored request waiting for its client: its deltas so far (sent before the restart,
    then produced since)."""

    client_id: str
    deltas: list[Delta]
    deadline: float
    finished: bool = False


def replay(deltas: list[Delta], from_token: int) -> list[Delta]:
    """The deltas after the first ``from_token`` generated tokens (a delta split there keeps
    its remaining ids; its text goes with the part the client has not seen)."""
    out, seen = [], 0
    for d in deltas:
        n = len(d.token_ids)
        if seen + n <= from_token and not d.finished:
            seen += n
            continue
        skip = max(0, from_token - seen)
        out.append(dataclasses.replace(d, token_ids=d.token_ids[skip:]) if skip else d)
        seen += n
    return out


def write_streams(directory: Path, streams: dict[str, tuple[str | None, list[Delta]]]) -> None:
    """``engine request id -> (client request id or None, deltas sent)`` into the snapshot."""
    data = {
        rid: {"client_id": cid, "deltas": [_plain(d) for d in deltas]}
        for rid, (cid, deltas) in streams.items()
    }
    (directory / STREAMS_FILE).write_text(json.dumps(data))


def _plain(d: Delta) -> dict:
    """A delta as JSON; logprobs are not carried across a restart (a resumed stream has none)."""
    return dataclasses.asdict(dataclasses.replace(d, top_logprobs=None, prompt_logprobs=None))


def read_streams(directory: Path) -> dict[str, tuple[str | None, list[Delta]]]:
    path = directory / STREAMS_FILE
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {rid: (v["client_id"], [Delta(**d) for d in v["deltas"]]) for rid, v in data.items()}


class ResumeRegistry:
    """Engine-thread state of resumable streams (see the module doc)."""

    def __init__(self, directory: str | Path, ttl: float = 300.0):
        self.directory = Path(directory)
        self.ttl = ttl
        self.history: dict[str, tuple[str | None, list[Delta]]] = {}  # live streams
        self.parked: dict[str, Parked] = {}  # engine request id -> restored, no client yet
        self._by_client: dict[str, str] = {}

    @property
    def has_snapshot(self) -> bool:
        return (self.directory / "meta.json").is_file()

    def track(self, rid: str, client_id: str | None) -> None:
        self.history[rid] = (client_id, [])

    def sent(self, rid: str, delta: Delta) -> None:
        entry = self.history.get(rid)
        if entry is not None:
            entry[1].append(delta)

    def forget(self, rid: str) -> None:
        self.history.pop(rid, None)

    def park(self, restored: dict[str, tuple[str | None, list[Delta]]]) -> list[str]:
        """Register restored streams; returns the engine ids that cannot resume (no client id)."""
        deadline = time.monotonic() + self.ttl
        orphans = []
        for rid, (client_id, deltas) in restored.items():
            if client_id:
                self.parked[rid] = Parked(client_id, deltas, deadline)
                self._by_client[client_id] = rid
            else:
                orphans.append(rid)
        return orphans

    def claim(self, client_id: str) -> tuple[str, Parked] | None:
        """The parked request of ``client_id``, removed from the registry (None: unknown)."""
        rid = self._by_client.pop(client_id, None)
        if rid is None:
            return None
        return rid, self.parked.pop(rid)

    def expired(self, now: float) -> list[str]:
        """Parked requests whose client did not come back in time (removed)."""
        gone = [rid for rid, p in self.parked.items() if p.deadline <= now]
        for rid in gone:
            self._by_client.pop(self.parked.pop(rid).client_id, None)
        return gone
