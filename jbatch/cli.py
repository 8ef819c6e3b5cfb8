"""The ``jbatch`` command line: ``jbatch generate``, ``jbatch make-tiny-model``.

Engine flags map one to one onto :class:`EngineConfig` fields (``--max-slots`` -> max_slots),
sampling flags onto :class:`SamplingParams` fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from jbatch.engine.config import EngineConfig

_SAMPLING_FLAGS = {
    "max_tokens": (int, 64, "tokens to generate per prompt"),
    "temperature": (float, 0.0, "0 = greedy"),
    "top_p": (float, 1.0, "nucleus sampling mass"),
    "top_k": (int, 0, "0 = off"),
    "min_p": (float, 0.0, "drop tokens below min_p x the top probability"),
    "repetition_penalty": (float, 1.0, "1 = off"),
    "presence_penalty": (float, 0.0, "OpenAI-style presence penalty"),
    "frequency_penalty": (float, 0.0, "OpenAI-style frequency penalty"),
    "seed": (int, None, "per-request seed (reproducible sampling)"),
}


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (EngineConfig fields)")
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.type in ("bool", bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            kind = int if isinstance(field.default, int) else str
            group.add_argument(
                flag, type=kind, default=field.default, help=f"default: {field.default}"
            )


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
    gen.add_argument("--model", required=True, help="local Hugging Face checkpoint folder")
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    for name, (kind, default, text) in _SAMPLING_FLAGS.items():
        gen.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=text)
    _add_engine_flags(gen)

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
    return parser


def _generate(args: argparse.Namespace) -> int:
    from jbatch import LLM, SamplingParams

    params = SamplingParams(
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        **{name: getattr(args, name) for name in _SAMPLING_FLAGS},
    )
    t0 = time.perf_counter()
    llm = LLM(args.model, **_engine_kwargs(args))
    print(f"[jbatch] engine ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
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


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
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
