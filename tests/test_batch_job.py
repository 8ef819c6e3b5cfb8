"""``jbatch batch``: OpenAI Batch API lines in, one result line per request out, resumable.

In-process tests run ``BatchJob`` on the serving harness's engine (the real ``LLMEngine`` over
``MockCore``: exact expected tokens, seconds to build); one end-to-end test runs the command on
the demo model in subprocesses: uninterrupted, SIGKILLed, resumed and SIGINTed, resumed again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai.types
import openai.types.chat
import pytest

from jbatch.batch_files import scan_output
from jbatch.batch_job import BatchJob, Stop
from serving.chat_template import render_chat
from tests.serving_harness import hardened_llm  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def _line(custom_id, body, url="/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _greedy(prompt, max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _read(path: Path) -> list[dict]:
    return [json.loads(raw) for raw in path.read_text().splitlines()]


def _key(entry: dict):
    return ("line", entry["line"]) if "line" in entry else entry["custom_id"]


def _tokens(entry: dict) -> list[int]:
    return entry["response"]["body"]["choices"][0]["token_ids"]


def _run(engine, inp: Path, out: Path, stop: Stop | None = None, window: int = 4):
    return BatchJob(engine, inp, out, window=window, progress=False).run(stop)


def _work_lines(h, n: int) -> list[str]:
    return [_line(f"w{i}", _greedy(p, params.max_tokens)) for i, (p, params, _) in
            enumerate(h.work[:n])]  # fmt: skip


def test_results_errors_and_duplicates(hardened_llm, tmp_path):  # noqa: F811
    h = hardened_llm
    chat = {"messages": [{"role": "user", "content": "the fox"}], "max_tokens": 3}
    lines = [
        *_work_lines(h, 6),
        "{not json",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        "",  # blank: not a request
        _line("badurl", {"prompt": "x"}, url="/v1/embeddings"),
        _line("w2", {"prompt": "again"}),  # a duplicate custom_id
        _line("unknown", {"prompt": "x", "frobnicate": 1}),  # a 400 answer
        _line("tools", {"prompt": "x", "tools": [{"type": "function"}]}),
        _line("chat", chat, url="/v1/chat/completions"),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    summary = _run(h.engine, inp, out)
    got = {_key(e): e for e in _read(out)}
    assert len(got) == len(_read(out)) == 13 and (summary.results, summary.failed) == (7, 6)
    for i, (_, _, ref) in enumerate(h.work[:6]):
        entry = got[f"w{i}"]
        assert entry["error"] is None and entry["response"]["status_code"] == 200
        assert _tokens(entry) == ref
        openai.types.Completion.model_validate(entry["response"]["body"])
    bad_json = got[("line", 7)]
    assert bad_json["error"]["code"] == "invalid_json" and bad_json["response"] is None
    assert got[("line", 8)]["error"]["code"] == "invalid_request"
    assert "url" in got["badurl"]["error"]["message"] and "line" not in got["badurl"]
    assert got[("line", 11)]["error"]["code"] == "duplicate_custom_id"
    for cid, field in (("unknown", "frobnicate"), ("tools", "tools")):
        response = got[cid]["response"]
        assert response["status_code"] == 400 and got[cid]["error"] is None
        assert response["body"]["error"]["message"].startswith(field), response
    reply = openai.types.chat.ChatCompletion.model_validate(got["chat"]["response"]["body"])
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens == 3
    assert not h.engine.has_unfinished_requests() and not h.engine.requests


def test_an_openai_batch_file_gives_openai_shaped_lines(hardened_llm, tmp_path):  # noqa: F811
    """The input file of ``client.files.create(purpose="batch")`` + ``client.batches.create``
    (OpenAI's batch guide), and output lines that the ``openai`` package's types parse."""
    h = hardened_llm
    tok = h.engine.tokenizer
    chats = [
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": f"Hello world {i}!"}]
        for i in range(5)
    ]  # fmt: skip
    inp, out = tmp_path / "batchinput.jsonl", tmp_path / "out.jsonl"
    with inp.open("w") as f:
        for i, messages in enumerate(chats):
            body = {"model": "tiny", "messages": messages, "max_completion_tokens": 4 + i,
                    "temperature": 0, "ignore_eos": True, "metadata": {"run": "t"}}  # fmt: skip
            f.write(_line(f"request-{i + 1}", body, url="/v1/chat/completions") + "\n")
    _run(h.engine, inp, out)
    entries = {e["custom_id"]: e for e in _read(out)}
    assert sorted(entries) == [f"request-{i + 1}" for i in range(5)]
    for i, messages in enumerate(chats):
        entry = entries[f"request-{i + 1}"]
        assert set(entry) == {"id", "custom_id", "response", "error"} and entry["error"] is None
        assert entry["id"].startswith("batch_req_") and entry["response"]["status_code"] == 200
        reply = openai.types.chat.ChatCompletion.model_validate(entry["response"]["body"])
        assert reply.object == "chat.completion" and reply.choices[0].finish_reason == "length"
        ids = tok.encode(render_chat(tok, messages), False)
        assert reply.choices[0].model_extra["token_ids"] == h.expected(ids, 4 + i)


def test_resume_repairs_a_torn_line_and_skips_what_is_done(hardened_llm, tmp_path):  # noqa: F811
    h = hardened_llm
    lines = [*_work_lines(h, 20), "{bad", _line("w3", {"prompt": "dup"})]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    whole = tmp_path / "whole.jsonl"
    _run(h.engine, inp, whole)
    reference = {_key(e): e for e in _read(whole)}
    raw = whole.read_bytes().splitlines(keepends=True)
    part = tmp_path / "part.jsonl"
    part.write_bytes(b"".join(raw[:7]) + raw[7][: len(raw[7]) // 2])  # killed mid-line
    assert scan_output(part).repaired_bytes == len(raw[7]) // 2
    part.write_bytes(b"".join(raw[:7]) + raw[7][: len(raw[7]) // 2])
    summary = _run(h.engine, inp, part)
    assert summary.skipped == 7 and summary.repaired_bytes == len(raw[7]) // 2
    entries = _read(part)
    keys = [_key(e) for e in entries]
    assert sorted(keys, key=str) == sorted(reference, key=str)  # each key exactly once
    for e in entries:
        if e["error"] is None:
            assert _tokens(e) == _tokens(reference[_key(e)])
    assert _run(h.engine, inp, part).skipped == len(reference)  # done: nothing more to do
    assert len(_read(part)) == len(reference)


def test_an_output_that_is_not_ours_is_refused(hardened_llm, tmp_path):  # noqa: F811
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(_work_lines(hardened_llm, 1)[0] + "\n")
    out.write_text("hello\n")
    with pytest.raises(ValueError, match="line 1 is not a batch result line"):
        _run(hardened_llm.engine, inp, out)


class _StopAfter:
    """The engine, with ``stop`` raised to ``level`` at its ``after``-th step."""

    def __init__(self, engine, stop: Stop, level: int, after: int):
        self._engine, self._stop, self._level, self._left = engine, stop, level, after

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        self._left -= 1
        if self._left == 0:
            while self._stop.level < self._level:
                self._stop.request()
        return self._engine.step()


@pytest.mark.parametrize("level", [1, 2])
def test_stop_writes_whole_lines_and_a_resume_finishes(hardened_llm, tmp_path, level):  # noqa: F811
    h = hardened_llm
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(_work_lines(h, 40)) + "\n")
    stop = Stop()
    summary = _run(_StopAfter(h.engine, stop, level, after=6), inp, out, stop, window=8)
    written = _read(out)
    assert summary.stopped and 0 < len(written) < 40
    # level 1 writes everything it had admitted; level 2 aborts it, unwritten
    assert (summary.aborted > 0) == (level == 2)
    assert not h.engine.has_unfinished_requests() and not h.engine.requests
    _run(h.engine, inp, out)
    entries = _read(out)
    assert sorted(e["custom_id"] for e in entries) == sorted(f"w{i}" for i in range(40))
    for e in entries:
        assert _tokens(e) == h.work[int(e["custom_id"][1:])][2]


# ---- the command, end to end, on the demo model ---------------------------------------------
N_LINES = 300
ENGINE_FLAGS = ["--max-slots", "4", "--num-pages", "64", "--max-seq-len", "128",
                "--max-num-batched-tokens", "16"]  # fmt: skip


def _start(inp: Path, out: Path, tmp: Path) -> subprocess.Popen:
    """The command in a subprocess; its stderr goes to ``tmp / "stderr"`` (a pipe nobody reads
    while the test polls could fill up and stall it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "JAX_COMPILATION_CACHE_DIR": str(tmp / "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}  # fmt: skip
    cmd = [sys.executable, "-m", "jbatch.cli", "batch", "--input", str(inp), "--output",
           str(out), *ENGINE_FLAGS]  # fmt: skip
    with (tmp / "stderr").open("wb") as err:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)


def _finished(proc: subprocess.Popen, tmp: Path, timeout: float) -> str:
    """Wait for the command; its stderr (asserting exit 0)."""
    proc.wait(timeout=timeout)
    err = (tmp / "stderr").read_text()
    assert proc.returncode == 0, err
    return err


def _lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _interrupt_at(proc: subprocess.Popen, out: Path, lines: int, sig: int) -> None:
    """Send ``sig`` once ``out`` holds ``lines`` lines (the job is still running)."""
    deadline = time.monotonic() + 240
    while _lines_in(out) < lines:
        assert proc.poll() is None, "the job ended before the signal"
        assert time.monotonic() < deadline, "the job wrote too little"
        time.sleep(0.005)
    proc.send_signal(sig)


@pytest.mark.slow
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path):
    inp = tmp_path / "requests.jsonl"
    with inp.open("w") as f:
        for i in range(N_LINES):
            # greedy: a seeded sampled token can flip at a CDF boundary when batches differ
            body = {"prompt": f"def f{i}(x):", "max_tokens": 12 + i % 9, "temperature": 0}
            f.write(_line(f"req-{i}", body) + "\n")
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    err = _finished(_start(inp, whole, tmp_path), tmp_path, timeout=300)
    assert "req/s" in err and "tok/s" in err  # the progress bar

    proc = _start(inp, resumed, tmp_path)
    _interrupt_at(proc, resumed, N_LINES // 4, signal.SIGKILL)
    proc.wait(timeout=60)
    with resumed.open("ab") as f:
        f.write(b'{"id": "batch_req_torn", "custom_')  # what a kill mid-write leaves
    killed_at = _lines_in(resumed)
    assert killed_at < N_LINES

    proc = _start(inp, resumed, tmp_path)  # resume, then Ctrl-C
    _interrupt_at(proc, resumed, killed_at + N_LINES // 4, signal.SIGINT)
    err = _finished(proc, tmp_path, timeout=120)
    assert "SIGINT: finishing" in err and "cut a torn last line" in err, err
    assert _lines_in(resumed) < N_LINES, "the SIGINT came too late to test anything"
    assert all(json.loads(raw) for raw in resumed.read_bytes().splitlines())  # whole lines

    _finished(_start(inp, resumed, tmp_path), tmp_path, timeout=300)
    reference = {e["custom_id"]: _tokens(e) for e in _read(whole)}
    entries = _read(resumed)
    assert len(entries) == N_LINES and len(reference) == N_LINES
    assert {e["custom_id"]: _tokens(e) for e in entries} == reference
