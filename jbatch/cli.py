"""The ``jbatch`` command line: ``generate``, ``make-tiny-model``, ``serve``, ``client``,
``convert``, ``batch`` (``jbatch/batch_cli.py``).

Engine flags map one to one onto :class:`EngineConfig` fields (``--max-slots`` -> max_slots),
sampling flags onto :class:`SamplingParams` fields (those ``jbatch.sampling_surfaces`` exposes
on the ``cli`` surface, with its defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from jbatch import compile_cache
from jbatch.engine.config import SPECULATIVE_DECODE_STEPS, EngineConfig
from jbatch.engine.tenants import load_tenant_weights
from jbatch.sampling_params import SamplingParams
from jbatch.sampling_surfaces import surface_fields
from serving.flags import add_hardening_flags, hardening_config
from serving.tool_parsers import PARSER_CHOICES


def _tenant_weights_file(path: str):
    try:
        return load_tenant_weights(path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# Engine fields whose None default is resolved by EngineConfig otherwise than from the model.
AUTO_DEFAULTS = {"decode_steps": f"{SPECULATIVE_DECODE_STEPS} with speculative decoding, else 1"}


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (EngineConfig fields)")
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.name == "tenant_weights":
            help_ = "FILE: a JSON object tenant -> weight (fair share; default: all 1)"
            group.add_argument(flag, type=_tenant_weights_file, default=(), help=help_)
        elif field.type in ("bool", bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            kinds = {"int": int, "float": float}
            kind = next((k for n, k in kinds.items() if str(field.type).startswith(n)), str)
            shown = field.default
            if shown is None:
                shown = AUTO_DEFAULTS.get(field.name, "from the model / the machine")
            group.add_argument(flag, type=kind, default=field.default, help=f"default: {shown}")


def _add_sampling_flags(
    parser: argparse.ArgumentParser, params_cls: type[SamplingParams] = SamplingParams
) -> None:
    """One flag per CLI-exposed SamplingParams field: ``--max-tokens``; a bool is
    ``--ignore-eos/--no-ignore-eos``; a list field is a repeatable flag."""
    group = parser.add_argument_group("sampling (SamplingParams fields)")
    for field in surface_fields("cli", params_cls):
        flag = "--" + field.surface_name.replace("_", "-")
        kind = field.shape.kind
        if field.shape.repeated:
            group.add_argument(
                flag, dest=field.name, action="append", type=kind, help=field.help + " (repeatable)"
            )
        elif kind is bool:
            action = argparse.BooleanOptionalAction
            group.add_argument(
                flag, dest=field.name, action=action, default=field.default, help=field.help
            )
        else:
            text = field.help if field.default is None else f"{field.help} (default: %(default)s)"
            group.add_argument(flag, dest=field.name, type=kind, default=field.default, help=text)


def _sampling_params(
    args: argparse.Namespace, params_cls: type[SamplingParams] = SamplingParams
) -> SamplingParams:
    """SamplingParams from the flags of :func:`_add_sampling_flags` (ValueError naming a field)."""
    kwargs = {}
    for field in surface_fields("cli", params_cls):
        value = getattr(args, field.name)
        if not (field.shape.repeated and value is None):  # a list flag never given: the default
            kwargs[field.name] = value
    return params_cls(**kwargs)


def _add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "multi-host (jax.distributed; run the same command on every host)"
    )
    group.add_argument(
        "--multihost", action="store_true", help="join a multi-process run; with no other "
        "flag JAX auto-detects it (Cloud TPU pod slices, SLURM, Open MPI)"
    )  # fmt: skip
    group.add_argument("--coordinator-address", default=None, help="host:port of process 0")
    group.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    group.add_argument("--process-id", type=int, default=None, help="this process's index")


def _maybe_initialize_distributed(args: argparse.Namespace) -> None:
    flags = ("multihost", "coordinator_address", "num_processes")
    if any(getattr(args, f, None) for f in flags):
        from jbatch.parallel.distributed import initialize

        initialize(args.coordinator_address, args.num_processes, args.process_id)


def _model_dir(model: str | None) -> str:
    """``--model``, or the built-in demo model when it is not given."""
    if model is not None:
        return model
    from jbatch.demo import demo_model_path

    return str(demo_model_path())


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jbatch", description="JAX continuous-batching LLM inference engine"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="generate completions for prompts",
        description="Generate completions with continuous batching.",
    )
    gen.add_argument("prompts", nargs="+", help="prompt strings")
    gen.add_argument(
        "--model", help="local Hugging Face checkpoint folder (default: the built-in demo model)"
    )
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    compile_cache.add_flag(gen)
    _add_sampling_flags(gen)
    _add_engine_flags(gen)
    _add_distributed_flags(gen)

    tiny = sub.add_parser(
        "make-tiny-model",
        help="write a small random-weight Llama checkpoint",
        description="Write a random-weight Llama in HF format (for trying "
        "jbatch without downloads; its text is gibberish).",
    )
    tiny.add_argument("directory")
    tiny.add_argument("--vocab-size", type=int, default=2048)
    tiny.add_argument("--hidden-size", type=int, default=256)
    tiny.add_argument("--num-layers", type=int, default=4)
    tiny.add_argument("--seed", type=int, default=0)

    srv = sub.add_parser(
        "serve",
        help="serve a model over gRPC and OpenAI-compatible HTTP",
        description="Serve a model: gRPC jbatch.v1.Generation (with health and reflection) and "
        "an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
        "/health, /metrics) over one engine. SIGTERM drains and exits 0.",
    )
    srv.add_argument(
        "--model", help="local Hugging Face checkpoint folder (default: the built-in demo model)"
    )
    srv.add_argument("--served-model-name", default=None, help="default: the folder name")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    srv.add_argument("--grpc-port", type=int, default=50051, help="0 = any free port")
    srv.add_argument("--http-port", type=int, default=8000, help="0 = any free port")
    srv.add_argument(
        "--metrics-port", type=int, default=None, help="extra Prometheus port (/metrics is "
        "always on the HTTP port)"
    )  # fmt: skip
    srv.add_argument(
        "--max-queue", type=int, default=1024, help="requests waiting for a slot before "
        "RESOURCE_EXHAUSTED / 429"
    )  # fmt: skip
    srv.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get "
        "on SIGTERM before they are aborted"
    )  # fmt: skip
    srv.add_argument(
        "--snapshot-dir", default=None, help="on SIGTERM snapshot every in-flight request here "
        "instead of finishing them; on start, restore a snapshot found here (gRPC clients "
        "resume their streams: serving/resumable.py)"
    )  # fmt: skip
    srv.add_argument(
        "--tool-call-parser", choices=PARSER_CHOICES, default="auto", help="the format of tool "
        "calls in chat output: hermes (<tool_call>...</tool_call>), llama3_json, none (never "
        "parse); auto (default): from the chat template, else hermes"
    )  # fmt: skip
    compile_cache.add_flag(srv)
    srv.add_argument(
        "--decode-peers", default=None, metavar="HOST:PORT,...", help="with --role prefill: "
        "the gRPC addresses of the --role decode servers requests are handed over to"
    )  # fmt: skip
    add_hardening_flags(srv)
    _add_engine_flags(srv)
    _add_distributed_flags(srv)

    _add_convert_parser(sub)
    from jbatch.batch_cli import add_batch_parser

    add_batch_parser(sub)

    cli = sub.add_parser(
        "client",
        help="stream a completion from a jbatch gRPC server",
        description="Send prompts to `jbatch serve` over gRPC and print text as it arrives.",
    )
    cli.add_argument("prompts", nargs="+", help="prompt strings")
    cli.add_argument("--target", default="127.0.0.1:50051", help="gRPC host:port")
    cli.add_argument("--timeout", type=float, default=None, help="deadline per request (s)")
    cli.add_argument("--tls-ca", default=None, help="PEM CA / certificate to trust: use TLS")
    cli.add_argument(
        "--api-key", default=None, help="sent as 'authorization: Bearer KEY' (default: the "
        "JBATCH_API_KEY environment variable)"
    )  # fmt: skip
    _add_sampling_flags(cli)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from jbatch import LLM
    from serving.server import ServeConfig, serve

    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    args.model = _model_dir(args.model)
    config = ServeConfig(
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        max_queue=args.max_queue,
        shutdown_timeout=args.shutdown_timeout,
        snapshot_dir=args.snapshot_dir,
        model_name=args.served_model_name or Path(args.model).resolve().name,
        tool_call_parser=args.tool_call_parser,
        **hardening_config(args),
    )
    if not Path(args.model).is_dir():
        raise FileNotFoundError(f"--model {args.model}: no such folder")
    compile_cache.for_cli(args.compilation_cache)
    peers = [p for p in (args.decode_peers or "").split(",") if p]
    if peers and args.role != "prefill":
        raise ValueError(f"--decode-peers needs --role prefill, got --role {args.role}")

    def load():
        engine = LLM(args.model, **_engine_kwargs(args)).engine
        if args.role != "prefill":
            return engine
        from serving.disagg_prefill import RemoteDecodeEngine

        key = os.environ.get("JBATCH_PEER_API_KEY")  # the decode servers' --api-key, if any
        return RemoteDecodeEngine(engine, peers, args.host, key)  # decodes on the peers

    return serve(load, config)


def _add_convert_parser(sub) -> None:
    from jbatch.engine.config import DTYPES
    from jbatch.models.quant import QUANT_MODES

    conv = sub.add_parser(
        "convert",
        help="write an orbax checkpoint that loads faster (and sharded) than the HF folder",
        description="Convert a Hugging Face folder into a jbatch checkpoint: orbax params in "
        "the engine's layout and dtype, with the tokenizer and config beside them. Then "
        "`--model OUT_DIR` (or LLM(OUT_DIR)) restores it straight into the engine's shardings.",
    )
    conv.add_argument("hf_dir", metavar="HF_DIR")
    conv.add_argument("out_dir", metavar="OUT_DIR")
    conv.add_argument("--dtype", choices=DTYPES, default=None, help="default: as stored")
    conv.add_argument("--quantization", choices=QUANT_MODES, default=None)
    conv.add_argument("--quantize-lm-head", action="store_true")
    conv.add_argument(
        "--tp", type=int, default=1, help="read and write sharded over this many devices "
        "(and replicate KV heads as this tp needs)"
    )  # fmt: skip


def _convert(args: argparse.Namespace) -> int:
    import logging

    from jbatch.converted import convert

    log = logging.getLogger("jbatch")  # its own stderr handler: imports may own the root one
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[jbatch] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    kw = dict(dtype=args.dtype, quantization=args.quantization, tp=args.tp)
    print(convert(args.hf_dir, args.out_dir, quantize_lm_head=args.quantize_lm_head, **kw))
    return 0


def _client(args: argparse.Namespace) -> int:
    import asyncio
    import os

    import grpc

    from serving.client import GenerationClient, finish_reason_name

    params = _sampling_params(args)

    async def run() -> int:
        api_key = args.api_key or os.environ.get("JBATCH_API_KEY") or None
        async with GenerationClient(args.target, tls_ca=args.tls_ca, api_key=api_key) as client:
            for prompt in args.prompts:
                print(prompt, end="", flush=True)
                try:
                    async for resp in client.generate(prompt, params, timeout=args.timeout):
                        print(resp.text, end="", flush=True)
                        if resp.finish_reason:
                            usage = resp.usage
                            print(
                                f"\n[jbatch] {finish_reason_name(resp)}: "
                                f"{usage.prompt_tokens} prompt + {usage.completion_tokens} "
                                "generated tokens",
                                file=sys.stderr,
                            )
                except grpc.aio.AioRpcError as e:
                    print(f"\njbatch: error: {e.code().name}: {e.details()}", file=sys.stderr)
                    return 1
        return 0

    return asyncio.run(run())


def _generate(args: argparse.Namespace) -> int:
    from jbatch import LLM

    params = _sampling_params(args)
    cache = compile_cache.for_cli(args.compilation_cache)
    t0 = time.perf_counter()
    llm = LLM(_model_dir(args.model), **_engine_kwargs(args))
    ready = f"[jbatch] engine ready in {time.perf_counter() - t0:.1f}s"
    print(f"{ready}{warmup_summary(llm.engine, cache)}", file=sys.stderr)
    t0 = time.perf_counter()
    if args.stream:
        tokens = 0
        for prompt in args.prompts:
            print(prompt, end="", flush=True)
            for out in llm.generate_stream(prompt, params):
                print(out.delta_text, end="", flush=True)
                tokens += len(out.delta_token_ids)
            print()
    else:
        outs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 8)
        for out in outs:
            c = out.outputs[0]
            print(f"--- {out.prompt!r} ({len(c.token_ids)} tokens, {c.finish_reason})")
            print(out.prompt + c.text)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    dt = time.perf_counter() - t0
    print(f"[jbatch] {tokens} tokens in {dt:.2f}s ({tokens / dt:.0f} tok/s)", file=sys.stderr)
    return 0


def warmup_summary(engine, cache: Path | None) -> str:
    """What warm-up did with the step programs, e.g. `` (step programs: 0 compiled, 17 loaded;
    cache DIR)``; empty for an engine without one core (the data-parallel router)."""
    programs = getattr(getattr(engine, "core", None), "warmup_programs", None)
    if not programs:
        return ""
    done = f"{programs['compiled']} compiled, {programs['loaded']} loaded"
    return f" (step programs: {done}; {'cache ' + str(cache) if cache else 'no cache'})"


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        _maybe_initialize_distributed(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "client":
            return _client(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "batch":
            from jbatch.batch_cli import run_batch_command

            return run_batch_command(args)
        from jbatch.tiny_model import write_random_llama

        path = write_random_llama(
            args.directory,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            seed=args.seed,
        )
        print(path)
        return 0
    except (ValueError, FileNotFoundError) as e:
        print(f"jbatch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
