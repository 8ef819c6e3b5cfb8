"""The OpenAI request models, their translation into what the engine runs, and the response
bodies: shared by the HTTP server (``serving/http_server.py``: routes and streaming only) and
the batch job (``jbatch/batch_job.py``), so one body means the same thing in both.

- Request models: :class:`CompletionRequest`, :class:`ChatCompletionRequest` (OpenAI's fields
  plus one per SamplingParams field the ``http`` surface of ``jbatch.sampling_surfaces``
  exposes, and ``priority``). A new OpenAI field is a declared field on the model that uses it
  (or on :class:`_RequestFields` for both) plus its use in :func:`translate_completion` /
  :func:`translate_chat`.
- Translation: ``translate_*(request) -> Translated`` (the prompt, still text or already token
  ids, and the SamplingParams); raises ValueError naming the field.
- Responses: :func:`response_body` (a whole, non-streamed completion) and :func:`choice` (one
  choice, also of a streamed chunk) from a :class:`serving.request_stream.Delta`.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, create_model, model_validator

from jbatch.sampling_params import SamplingParams
from jbatch.sampling_surfaces import SurfaceField, surface_fields
from jbatch.tokenizer import Tokenizer
from serving.chat_template import render_chat
from serving.request_stream import Delta


class _RequestFields(BaseModel):
    """What both endpoints take besides the sampling fields (:func:`sampling_request_model`)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1  # OpenAI's choices per request: one here
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    priority: int = 0
    user: str | None = None  # OpenAI's end-user id: the tenant (the X-Tenant-Id header wins)

    sampling_fields: ClassVar[tuple[SurfaceField, ...]] = ()
    params_cls: ClassVar[type[SamplingParams]] = SamplingParams

    def sampling_params(self) -> SamplingParams:
        """Absent or null fields take the Python default; raises ValueError naming a field."""
        if self.n != 1:
            raise ValueError(f"n must be 1 (one completion per request), got {self.n}")
        kwargs = {}
        for field in self.sampling_fields:
            value = getattr(self, field.surface_name)
            kwargs[field.name] = field.default if value is None else value
        return self.params_cls(**kwargs)

    @property
    def include_usage(self) -> bool:
        """A streamed response ends with a chunk carrying ``usage``."""
        return bool((self.stream_options or {}).get("include_usage"))


def _json_type(field: SurfaceField) -> Any:
    """The request type of a field, always nullable (null means the default)."""
    kind = field.shape.kind
    if not field.shape.repeated:
        return kind | None
    if field.shape.accepts_single:
        return kind | list[kind] | None
    return list[kind] | None


def sampling_request_model(params_cls: type[SamplingParams] = SamplingParams) -> type:
    """:class:`_RequestFields` plus one field per SamplingParams field the ``http`` surface
    exposes (``jbatch.sampling_surfaces``), under its surface name."""
    fields = tuple(surface_fields("http", params_cls))
    definitions: dict[str, Any] = {f.surface_name: (_json_type(f), None) for f in fields}
    clash = sorted(set(definitions) & set(_RequestFields.model_fields))
    if clash:
        raise TypeError(f"http: SamplingParams fields {clash} clash with request fields")
    model = create_model("SamplingFields", __base__=_RequestFields, **definitions)
    model.sampling_fields = fields
    model.params_cls = params_cls
    return model


_SamplingFields = sampling_request_model()


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins

    @model_validator(mode="after")
    def _newer_name_wins(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


OpenAIRequest = CompletionRequest | ChatCompletionRequest


@dataclasses.dataclass(frozen=True)
class Translated:
    """One request body as the engine runs it."""

    prompt: str | list[int]  # text still to tokenize (see add_special_tokens), or token ids
    add_special_tokens: bool  # when ``prompt`` is text: add BOS and the like while encoding
    params: SamplingParams
    chat: bool

    def prompt_ids(self, tokenizer: Tokenizer | None) -> list[int]:
        """The prompt's token ids, encoded here (ValueError naming ``prompt`` without a
        tokenizer); the servers encode long prompts off their event loop instead."""
        if not isinstance(self.prompt, str):
            return self.prompt
        if tokenizer is None:
            raise ValueError(
                "prompt: a text prompt needs a tokenizer and this model has none; send token ids"
            )
        return tokenizer.encode(self.prompt, self.add_special_tokens)


def translate_completion(req: CompletionRequest) -> Translated:
    """A ``/v1/completions`` body; ValueError naming the field."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise ValueError(f"prompt: one prompt per request, got a list of {len(prompt)}")
        prompt = prompt[0]
    if req.echo or req.logprobs:
        raise ValueError("echo / logprobs are not supported")
    return Translated(prompt, True, req.sampling_params(), chat=False)


def translate_chat(req: ChatCompletionRequest, tokenizer: Tokenizer | None) -> Translated:
    """A ``/v1/chat/completions`` body, rendered with the model's chat template (which writes
    special tokens such as BOS itself); ValueError naming the problem."""
    messages = [_flatten_content(m) for m in req.messages]
    text = render_chat(tokenizer, messages, req.add_generation_prompt)
    return Translated(text, False, req.sampling_params(), chat=True)


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content parts ``[{"type": "text", "text": ...}]`` -> one string."""
    content = message.get("content")
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and "text" in p]
        message = {**message, "content": "".join(parts)}
    return message


# ---- responses ---------------------------------------------------------------------------------
def response_meta(chat: bool, model_name: str) -> dict[str, Any]:
    """The fields every body and chunk of one response share."""
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12),
        "created": int(time.time()),
        "model": model_name,
    }


def choice(delta: Delta, chat: bool, streaming: bool, first: bool) -> dict[str, Any]:
    """Choice 0 of a body (``streaming`` False: ``delta`` is the whole completion) or of a
    streamed chunk (``first``: the chunk that opens the assistant message)."""
    out: dict[str, Any] = {"index": 0}
    if chat:
        if streaming:
            out["delta"] = (
                {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
            )
        else:
            out["message"] = {"role": "assistant", "content": delta.text}
    else:
        out["text"] = delta.text
        out["logprobs"] = None
    out["token_ids"] = delta.token_ids
    out["finish_reason"] = delta.finish_reason
    if delta.finished:
        out["stop_reason"] = delta.stop_reason
    return out


def usage(delta: Delta) -> dict[str, int]:
    return {
        "prompt_tokens": delta.prompt_tokens,
        "completion_tokens": delta.completion_tokens,
        "total_tokens": delta.prompt_tokens + delta.completion_tokens,
    }


def joined(deltas: list[Delta]) -> Delta:
    """The deltas of one request as one whole completion."""
    last = deltas[-1]
    return Delta(
        token_ids=[t for d in deltas for t in d.token_ids],
        text="".join(d.text for d in deltas),
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
    )


def response_body(meta: dict[str, Any], whole: Delta, chat: bool) -> dict[str, Any]:
    """The body of a non-streamed response: ``chat.completion`` or ``text_completion``."""
    return {
        **meta,
        "object": "chat.completion" if chat else "text_completion",
        "choices": [choice(whole, chat, False, True)],
        "usage": usage(whole),
    }
