"""Render a checkpoint's Hugging Face chat template (Jinja) in a sandbox."""

from __future__ import annotations

import functools
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jbatch.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    """The request cannot be rendered (no template, bad messages, template raised)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def render_chat(
    tokenizer: Tokenizer | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for ``messages``; raises ChatTemplateError (a ValueError) on any problem."""
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
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from None
