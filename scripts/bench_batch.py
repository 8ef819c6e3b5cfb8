"""``jbatch batch`` on the demo model: a job killed with SIGKILL half way and restarted ends with
every custom_id exactly once and the outputs of an uninterrupted run; throughput, slot
utilization while requests queue, and the job's RSS over a long input.

    PYTHONPATH=. python scripts/bench_batch.py --lines 10000 [--memory-lines 100000]
        [--json docs/bench_batch.json] [engine flags for jbatch batch ...]

Phase 1 (``--lines``): an uninterrupted run (the reference), then a run killed with SIGKILL
once half the lines are written, then the same command again (resume). Requests are greedy or
seeded (every third): greedy outputs must equal the reference exactly (the exit status); seeded
ones that differ are listed (a sampled token whose uniform draw falls within rounding of a CDF
boundary flips when the logits move by an ulp, i.e. when the run's batches differ).
Phase 2 (``--memory-lines``, optional): one run over that many short requests, the job's RSS
sampled every 0.5 s: flat memory means the RSS late in the job is what it was early on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_FLAGS = ["--max-slots", "32", "--max-num-batched-tokens", "256"]


def write_input(path: Path, lines: int, max_tokens: int) -> None:
    with path.open("w") as f:
        for i in range(lines):
            body = {"prompt": f"def f{i}(x):", "max_tokens": max_tokens, "temperature": 0}
            if i % 3 == 0:
                body.update(temperature=0.8, seed=i)
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST",
                                "url": "/v1/completions", "body": body}) + "\n")  # fmt: skip


def start(inp: Path, out: Path, flags: list[str], cache: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # fmt: skip
    cmd = [sys.executable, "-m", "jbatch.cli", "batch", "--input", str(inp), "--output",
           str(out), "--no-progress", *flags]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def rss_mib(pid: int) -> float:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            return int(row.split()[1]) / 1024
    return float("nan")


def finish(proc: subprocess.Popen) -> dict:
    """Wait; the figures of the summary line."""
    err = proc.communicate()[1]
    if proc.returncode != 0:
        raise SystemExit(f"jbatch batch failed ({proc.returncode}):\n{err}")
    summary = next(line for line in err.splitlines() if line.startswith("[jbatch] batch:"))
    numbers = re.search(r"(\d+) tokens in ([\d.]+)s \((\d+) tok/s\)", summary)
    util = re.search(r"slots busy while queued ([\d.]+)%", summary)
    return {
        "summary": summary,
        "tokens": int(numbers[1]),
        "seconds": float(numbers[2]),
        "tok_s": int(numbers[3]),
        "slot_utilization_while_queued": float(util[1]) / 100 if util else None,
    }


def results(path: Path) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for raw in path.read_text().splitlines():
        entry = json.loads(raw)
        if entry["custom_id"] in out:
            raise SystemExit(f"custom_id {entry['custom_id']} appears twice in {path}")
        out[entry["custom_id"]] = entry["response"]["body"]["choices"][0]["token_ids"]
    return out


def kill_resume(tmp: Path, lines: int, max_tokens: int, flags: list[str]) -> dict:
    inp, cache = tmp / "requests.jsonl", tmp / "jax_cache"
    write_input(inp, lines, max_tokens)
    whole, resumed = tmp / "whole.jsonl", tmp / "resumed.jsonl"
    reference = finish(start(inp, whole, flags, cache))
    proc = start(inp, resumed, flags, cache)
    while lines_in(resumed) < lines // 2:
        if proc.poll() is not None:
            raise SystemExit("the job ended before it could be killed")
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = lines_in(resumed)
    torn = resumed.stat().st_size - len(b"".join(resumed.read_bytes().splitlines(True)[:killed_at]))
    resume = finish(start(inp, resumed, flags, cache))
    ref, got = results(whole), results(resumed)
    return {
        "lines": lines,
        "max_tokens": max_tokens,
        "uninterrupted": reference,
        "killed_after_lines": killed_at,
        "torn_bytes_at_kill": torn,
        "resume": resume,
        "each_custom_id_once": sorted(got) == sorted(ref) and len(got) == lines,
        "greedy_outputs_equal_uninterrupted": all(
            got.get(k) == v for k, v in ref.items() if not seeded(k)
        ),
        "seeded_outputs_differing": sorted(
            k for k, v in ref.items() if seeded(k) and got.get(k) != v
        ),
    }


def seeded(custom_id: str) -> bool:
    """Whether write_input made this request sampled (seeded) rather than greedy."""
    return int(custom_id.rsplit("-", 1)[1]) % 3 == 0


def memory(tmp: Path, lines: int, flags: list[str]) -> dict:
    inp, out, cache = tmp / "long.jsonl", tmp / "long_out.jsonl", tmp / "jax_cache"
    write_input(inp, lines, max_tokens=2)
    proc = start(inp, out, flags, cache)
    samples = []  # (lines written, RSS MiB)
    while proc.poll() is None:
        try:
            samples.append((lines_in(out), rss_mib(proc.pid)))
        except FileNotFoundError:
            break
        time.sleep(0.5)
    figures = finish(proc)
    running = [(n, r) for n, r in samples if 0 < n < lines]
    at = lambda share: next((r for n, r in running if n >= share * lines), float("nan"))
    return {
        "lines": lines,
        "rss_mib_at_10pct": at(0.1),
        "rss_mib_at_50pct": at(0.5),
        "rss_mib_at_90pct": at(0.9),
        "rss_mib_max": max(r for _, r in samples),
        "job": figures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--memory-lines", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the figures here")
    args, engine_flags = parser.parse_known_args()
    flags = engine_flags or ENGINE_FLAGS
    report: dict = {"engine_flags": flags}
    with tempfile.TemporaryDirectory() as d:
        report["kill_resume"] = kill_resume(Path(d), args.lines, args.max_tokens, flags)
        print(json.dumps(report["kill_resume"], indent=1), flush=True)
        if args.memory_lines:
            report["memory"] = memory(Path(d), args.memory_lines, flags)
            print(json.dumps(report["memory"], indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    kr = report["kill_resume"]
    sys.exit(0 if kr["each_custom_id_once"] and kr["greedy_outputs_equal_uninterrupted"] else 1)


if __name__ == "__main__":
    main()
