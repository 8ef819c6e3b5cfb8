"""A batch job: OpenAI Batch API JSONL in, one result line per request out, on an in-process
engine (``jbatch batch --input requests.jsonl --output results.jsonl``; no HTTP).

Each input line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body"}``; a body means what it means to ``jbatch serve`` (the same
``serving/openai_protocol.py`` models and translation). The input is streamed: at most
``window`` requests are in the engine at once (a few times its slots, so a finishing request's
slot is refilled at once), and each result is appended when its request finishes
(``jbatch/batch_files.py``), so memory does not grow with the input, apart from the set of
custom_ids (duplicates are refused) and keys already done.

Restart with the same command after a kill: a torn last line is cut off and every key already
in the output is skipped; greedy or seeded requests give the same results as an uninterrupted
run (each request's tokens do not depend on what shares its batch).

What becomes which line: a body the server would refuse gets the server's answer (``response``
with ``status_code`` 400 and its ``{"error": ...}`` body), a request whose engine step failed
status 500; an input line that is no request at all (not JSON, no ``custom_id``, a bad
``method`` / ``url`` / ``body``) or a duplicate ``custom_id`` gets ``response: null`` and an
``error`` ``{code, message}``, and when it has no usable custom_id (or a duplicate one) also
``"line"``, its 1-based line number, by which it is keyed.

Stopping (:class:`Stop`): level 1 (the first SIGINT / SIGTERM) admits nothing more and lets the
requests in the engine finish and be written; level 2 (a second SIGINT) aborts them, unwritten,
so a restart runs them again. Either way the job returns normally.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from jbatch.batch_files import (
    Done,
    ResultWriter,
    count_lines,
    error_line,
    read_lines,
    result_line,
    scan_output,
)
from jbatch.engine.interface import EngineClient, StepFailed
from jbatch.engine.tenants import check_tenant
from jbatch.outputs import OutputKind, RequestOutput
from serving.openai_protocol import (
    ENDPOINTS,
    ChatCompletionRequest,
    parse_body,
    response_body,
    response_meta,
    translate_chat,
    translate_completion,
)
from serving.request_stream import Delta
from serving.tool_output import ToolCalling

WINDOW_PER_SLOT = 2  # default requests in the engine per slot


class Stop:
    """How hard the job has been asked to stop (0: not at all); a signal handler raises it."""

    def __init__(self) -> None:
        self.level = 0

    def request(self) -> int:
        self.level = min(self.level + 1, 2)
        return self.level


@dataclasses.dataclass
class Summary:
    results: int = 0  # lines written with a 200 response
    failed: int = 0  # lines written with an error status or an error object
    skipped: int = 0  # lines already in the output
    aborted: int = 0  # requests aborted by a second stop (not written)
    tokens: int = 0  # tokens generated
    seconds: float = 0.0
    repaired_bytes: int = 0
    stopped: bool = False  # stopped before the end of the input
    slot_utilization: float | None = None  # busy slots / slots, over steps with a queue

    def line(self) -> str:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        text = (
            f"{self.results} results, {self.failed} errors, {self.skipped} already done; "
            f"{self.tokens} tokens in {self.seconds:.1f}s ({rate:.0f} tok/s)"
        )
        if self.slot_utilization is not None:
            text += f"; slots busy while queued {self.slot_utilization:.1%}"
        if self.repaired_bytes:
            text += f"; cut a torn last line of {self.repaired_bytes} bytes"
        if self.stopped:
            text += f"; stopped early ({self.aborted} aborted): rerun the command to resume"
        return text


@dataclasses.dataclass
class _Pending:
    custom_id: str
    chat: bool
    meta: dict[str, Any]
    tools: ToolCalling | None = None  # chat with tools: how the output becomes tool_calls
    fmt: Any = None  # the request's logprobs and echo (Translated.logprob_formatter)


class _BadLine(Exception):
    """An input line that is no request: becomes an error line (``custom_id`` when it has a
    usable one)."""

    def __init__(self, code: str, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.code, self.message, self.custom_id = code, message, custom_id


class BatchJob:
    """One run over ``input_path``, appending to ``output_path``."""

    def __init__(
        self,
        engine: EngineClient,
        input_path: str | Path,
        output_path: str | Path,
        *,
        model_name: str = "jbatch",
        window: int | None = None,
        progress: bool = True,
    ):
        self.engine, self.model_name = engine, model_name
        self.input_path, self.output_path = Path(input_path), Path(output_path)
        self.window = window or WINDOW_PER_SLOT * engine.cfg.max_slots
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not self.input_path.is_file():
            raise FileNotFoundError(f"--input {self.input_path}: no such file")
        self.progress = progress
        self.pending: dict[str, _Pending] = {}  # engine request id -> what its line needs
        self.seen: set[str] = set()  # custom_ids of this input so far
        self.summary = Summary()
        self._ids = 0

    def run(self, stop: Stop | None = None) -> Summary:
        stop = stop or Stop()
        done = scan_output(self.output_path)
        self.summary.repaired_bytes = done.repaired_bytes
        total = count_lines(self.input_path) if self.progress else None
        bar = tqdm(
            total=total, initial=min(len(done), total or 0), unit="req", desc="batch",
            disable=not self.progress, dynamic_ncols=True,
        )  # fmt: skip
        t0 = time.perf_counter()
        lines = read_lines(self.input_path)
        exhausted = False
        with ResultWriter(self.output_path) as writer:
            self._writer, self._bar, self._t0 = writer, bar, t0
            while True:
                if stop.level >= 2:
                    self._abort_all()
                    break
                while not exhausted and not stop.level and len(self.pending) < self.window:
                    item = next(lines, None)
                    if item is None:
                        exhausted = True
                    else:
                        self._admit(*item, done)
                if not self.pending:
                    break
                for out in self._step():
                    if out.finished:
                        self._finish(out)
        bar.close()
        self.summary.seconds = time.perf_counter() - t0
        self.summary.stopped = not exhausted
        stats = self.engine.stats()
        if stats.steps_while_queued:
            busy = stats.busy_slots_while_queued
            self.summary.slot_utilization = busy / (stats.steps_while_queued * stats.total_slots)
        return self.summary

    # ---- input ---------------------------------------------------------------------------
    def _admit(self, number: int, raw: bytes, done: Done) -> None:
        """Queue one input line, write its error line, or skip it (already done)."""
        try:
            entry, bad = _envelope(raw), None
        except _BadLine as e:
            entry, bad = None, e
        custom_id = bad.custom_id if bad else entry["custom_id"]
        if custom_id is None:  # keyed by its line number
            if number in done.lines:
                self.summary.skipped += 1
            else:
                self._write(error_line(None, bad.code, bad.message, number))
            return
        if not self._claim(custom_id, number, done):
            return
        if bad:
            self._write(error_line(custom_id, bad.code, bad.message))
        else:
            self._submit(custom_id, entry["url"], entry["body"])

    def _claim(self, custom_id: str, number: int, done: Done) -> bool:
        """Whether this line runs: not a duplicate (that gets an error line keyed by its
        number) and not already done."""
        if custom_id in self.seen:
            if number in done.lines:
                self.summary.skipped += 1
            else:
                msg = f"custom_id {custom_id!r} appears more than once; only its first line runs"
                self._write(error_line(custom_id, "duplicate_custom_id", msg, number))
            return False
        self.seen.add(custom_id)
        if custom_id in done.custom_ids:
            self.summary.skipped += 1
            return False
        return True

    def _submit(self, custom_id: str, url: str, body: Any) -> None:
        try:
            req = parse_body(url, body)
            if req.stream:
                raise ValueError("stream: a batch job returns whole responses; set it false")
            chat = isinstance(req, ChatCompletionRequest)
            translated = (
                translate_chat(req, self.engine.tokenizer) if chat else translate_completion(req)
            )
            rid = f"batch-{self._ids}"
            ids = translated.prompt_ids(self.engine.tokenizer)
            self.engine.add_request(
                ids, translated.params,
                request_id=rid, priority=req.priority, output_kind=OutputKind.FINAL,
                tenant=check_tenant(req.user, "user"),
            )  # fmt: skip
        except ValueError as e:
            self._write(result_line(custom_id, 400, _error_body(400, "invalid_argument", e)))
            return
        self._ids += 1
        meta = response_meta(chat, self.model_name)
        fmt = translated.logprob_formatter(self.engine.tokenizer, ids)
        self.pending[rid] = _Pending(custom_id, chat, meta, translated.tools, fmt)

    # ---- engine --------------------------------------------------------------------------
    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except StepFailed as e:  # the engine has recovered; the failed requests come as errors
            return e.outputs

    def _finish(self, out: RequestOutput) -> None:
        pending = self.pending.pop(out.request_id, None)
        self.engine.forget(out.request_id)
        if pending is None:
            return
        if out.error or any(c.finish_reason == "error" for c in out.outputs):
            body = _error_body(500, "internal", out.error or "the engine step failed")
            self._write(result_line(pending.custom_id, 500, body))
            return
        wholes = [  # one per choice (n > 1: several)
            Delta(
                c.token_ids,
                c.text,
                c.finish_reason,
                c.stop_reason,
                len(out.prompt_token_ids),
                len(c.token_ids),
                c.top_logprobs,
                out.prompt_logprobs,
                index=c.index,
            )
            for c in out.outputs
        ]
        body = response_body(pending.meta, wholes, pending.chat, pending.tools, pending.fmt)
        self.summary.tokens += sum(len(c.token_ids) for c in out.outputs)
        self._write(result_line(pending.custom_id, 200, body))

    def _abort_all(self) -> None:
        for rid in list(self.pending):
            self.engine.abort_request(rid)
        while self.engine.has_unfinished_requests():  # let the aborts land; write nothing
            self._step()
        for rid in self.pending:
            self.engine.forget(rid)
        self.summary.aborted += len(self.pending)
        self.pending.clear()

    # ---- output --------------------------------------------------------------------------
    def _write(self, entry: dict[str, Any]) -> None:
        self._writer.write(entry)
        ok = entry["error"] is None and entry["response"]["status_code"] == 200
        if ok:
            self.summary.results += 1
        else:
            self.summary.failed += 1
        self._bar.update(1)
        if ok and self._bar.n % 8 == 0:
            rate = self.summary.tokens / max(time.perf_counter() - self._t0, 1e-9)
            self._bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)


def _envelope(raw: bytes) -> dict[str, Any]:
    """The checked request envelope of an input line; _BadLine otherwise."""
    try:
        entry = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _BadLine("invalid_json", f"not a JSON line: {e}") from None
    if not isinstance(entry, dict):
        raise _BadLine("invalid_request", "a line must be a JSON object")
    custom_id = entry.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        msg = f"custom_id must be a non-empty string, got {custom_id!r}"
        raise _BadLine("invalid_request", msg)
    if entry.get("method") != "POST":
        msg = f"method must be POST, got {entry.get('method')!r}"
        raise _BadLine("invalid_request", msg, custom_id)
    if entry.get("url") not in ENDPOINTS:
        msg = f"url must be one of {sorted(ENDPOINTS)}, got {entry.get('url')!r}"
        raise _BadLine("invalid_request", msg, custom_id)
    if not isinstance(entry.get("body"), dict):
        raise _BadLine("invalid_request", "body must be a JSON object", custom_id)
    return entry


def _error_body(status: int, kind: str, error: object) -> dict[str, Any]:
    return {"error": {"message": str(error), "type": kind, "code": status}}
