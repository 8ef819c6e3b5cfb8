"""The hardening flags of ``jbatch serve``: API keys, TLS, request limits, slow consumers.

Light on imports (no gRPC, no FastAPI) so that ``jbatch --help`` stays fast. Each
:class:`RequestLimits` field is a flag of its own name (``max_body_bytes`` ->
``--max-body-bytes``), except ``max_tokens``: ``--max-tokens-limit``, so that it is not taken
for a request's own ``--max-tokens``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from serving.auth import ENV_VAR, ApiKeys
from serving.limits import RequestLimits

_LIMIT_FLAG_NAMES = {"max_tokens": "max_tokens_limit"}
_LIMIT_HELP = {
    "max_body_bytes": "largest HTTP request body (413 above) and gRPC message",
    "max_prompt_tokens": "most prompt tokens per request (default: the engine's max_seq_len)",
    "max_tokens": "largest max_tokens a request may ask for (default: max_seq_len)",
    "max_stop_strings": "most stop strings per request",
    "max_stop_string_chars": "longest stop string (characters)",
    "max_stop_token_ids": "most stop token ids per request",
    "max_top_logprobs": "largest logprobs / top_logprobs",
    "max_n": "most completions (n) per request",
    "max_concurrent_streams": "gRPC streams per connection (HTTP/2 SETTINGS)",
}


def _dest(field: dataclasses.Field) -> str:
    return "limit_" + field.name


def add_hardening_flags(parser: argparse.ArgumentParser) -> None:
    auth = parser.add_argument_group("authentication and TLS")
    auth.add_argument(
        "--api-key", action="append", default=None, help="accept 'Authorization: Bearer KEY' "
        f"(repeatable; default: the {ENV_VAR} environment variable); without any, no auth"
    )  # fmt: skip
    auth.add_argument(
        "--protect-metrics", action="store_true", help="/metrics needs a key too (/health "
        "and grpc.health.v1 always stay open)"
    )  # fmt: skip
    auth.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS only")
    auth.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    limits = parser.add_argument_group("request limits (shown in GetModelInfo and /v1/models)")
    for field in dataclasses.fields(RequestLimits):
        flag = "--" + _LIMIT_FLAG_NAMES.get(field.name, field.name).replace("_", "-")
        default = field.default
        limits.add_argument(
            flag, dest=_dest(field), type=int, default=default,
            help=f"{_LIMIT_HELP[field.name]} (default: %(default)s)",
        )  # fmt: skip
    slow = parser.add_argument_group("slow consumers")
    slow.add_argument(
        "--stream-buffer", type=int, default=256, help="outputs buffered per stream for a "
        "client that is not reading (default: %(default)s)"
    )  # fmt: skip
    slow.add_argument(
        "--stream-stall-timeout", type=float, default=30.0, help="seconds a full buffer may "
        "go unread before the request is aborted (default: %(default)s)"
    )  # fmt: skip


def hardening_config(args: argparse.Namespace) -> dict[str, Any]:
    """``ServeConfig`` keyword arguments from the flags (ValueError naming a bad one)."""
    from serving.request_stream import StreamBuffers

    values = {f.name: getattr(args, _dest(f)) for f in dataclasses.fields(RequestLimits)}
    StreamBuffers(args.stream_buffer, args.stream_stall_timeout)  # checked before loading
    return dict(
        api_keys=ApiKeys.from_flags(args.api_key, args.protect_metrics),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        limits=RequestLimits(**values),
        stream_buffer=args.stream_buffer,
        stream_stall_timeout=args.stream_stall_timeout,
    )
