"""``jbatch batch``: its flags and the command (the job itself is ``jbatch/batch_job.py``)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from jbatch import cli, compile_cache


def add_batch_parser(sub) -> None:
    bat = sub.add_parser(
        "batch",
        help="run an OpenAI Batch API JSONL file through an in-process engine",
        description="Run every line of an OpenAI Batch API input file (custom_id, method, url "
        "= /v1/chat/completions or /v1/completions, body) and append one result line each to "
        "--output as it finishes. Rerun the same command after a kill or Ctrl-C to resume: "
        "lines already in the output are skipped. Ctrl-C (or SIGTERM) stops admitting and "
        "writes what is running; a second Ctrl-C aborts that too (a resume redoes it).",
    )
    bat.add_argument("--input", required=True, help="requests JSONL")
    bat.add_argument("--output", required=True, help="results JSONL (appended to; resumed)")
    bat.add_argument(
        "--model", help="local Hugging Face checkpoint folder (default: the built-in demo model)"
    )
    bat.add_argument("--served-model-name", default=None, help="'model' of each response "
                     "body (default: the folder name)")  # fmt: skip
    bat.add_argument("--chat-template", default=None, help="FILE: a Jinja chat template used "
                     "instead of the checkpoint's (for /v1/chat/completions)")  # fmt: skip
    bat.add_argument("--window", type=int, default=None, help="requests in the engine at once "
                     "(default: 2 x --max-slots)")  # fmt: skip
    bat.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    compile_cache.add_flag(bat)
    cli._add_engine_flags(bat)
    cli._add_distributed_flags(bat)


def run_batch_command(args: argparse.Namespace) -> int:
    from jbatch import LLM
    from jbatch.batch_job import BatchJob, Stop

    model = cli._model_dir(args.model)
    for flag, path in (("--input", args.input), ("--chat-template", args.chat_template)):
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"{flag} {path}: no such file")
    if not Path(args.output).resolve().parent.is_dir():
        raise FileNotFoundError(f"--output {args.output}: its folder does not exist")
    cache = compile_cache.for_cli(args.compilation_cache)  # a resumed job starts in seconds
    t0 = time.perf_counter()
    engine = LLM(model, **cli._engine_kwargs(args)).engine
    if args.chat_template is not None:
        if engine.tokenizer is None:
            raise ValueError(f"--chat-template: the model at {model} has no tokenizer")
        engine.tokenizer.chat_template = Path(args.chat_template).read_text()
    ready = f"[jbatch] engine ready in {time.perf_counter() - t0:.1f}s"
    print(f"{ready}{cli.warmup_summary(engine, cache)}", file=sys.stderr)
    job = BatchJob(
        engine, args.input, args.output, window=args.window, progress=not args.no_progress,
        model_name=args.served_model_name or Path(model).resolve().name,
    )  # fmt: skip
    stop = Stop()

    def on_signal(signum, frame) -> None:
        level = stop.request()
        what = "finishing the requests in the engine" if level == 1 else "aborting them"
        print(f"\n[jbatch] {signal.Signals(signum).name}: {what}", file=sys.stderr)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        summary = job.run(stop)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print(f"[jbatch] batch: {summary.line()}", file=sys.stderr)
    return 0
