"""Render a checkpoint's Hugging Face chat template (Jinja) in a sandbox, with what HF's
``apply_chat_template`` gives a template: ``messages``, ``tools`` (None or OpenAI-style tool
dicts), ``add_generation_prompt``, ``bos_token`` / ``eos_token``, ``raise_exception``, a
``tojson`` that neither sorts keys nor escapes HTML (as HF's), and loop controls."""

from __future__ import annotations

import functools
import json
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jbatch.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    """The request cannot be rendered (no template, bad messages, template raised)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs) -> str:
    """HF's ``tojson``: keys in their order, no HTML escaping (Jinja's own does both)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def render_chat(
    tokenizer: Tokenizer | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text for ``messages`` (and ``tools``, for a template that renders them);
    raises ChatTemplateError (a ValueError) on any problem."""
    template = None if tokenizer is None else tokenizer.chat_template
    if not template:
        raise ChatTemplateError(
            "this model has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja); use /v1/completions with a plain prompt"
        )
    if not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{i}].role must be a string")
    try:
        return _compile(template).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from None
