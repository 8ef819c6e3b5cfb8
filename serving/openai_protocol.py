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
- Strictness: a field the models do not declare is a 400 naming it, unless it is one of
  :data:`IGNORED_FIELDS` (accepted and ignored: none of them changes the output) or one of
  :data:`NOT_SUPPORTED_YET` at a value that turns it off. Implementing one of those is:
  declare the field, use it, delete its entry (an entry every model declares fails at import).
- Responses: :func:`response_body` (a whole, non-streamed completion) and :func:`choice` (one
  choice, also of a streamed chunk) from a :class:`serving.request_stream.Delta`.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, create_model, model_validator

from jbatch.sampling_params import MAX_LOGPROBS, SamplingParams
from jbatch.sampling_surfaces import SurfaceField, surface_fields
from jbatch.tokenizer import Tokenizer
from serving.openai_logprobs import LogprobFormatter
from serving.request_stream import Delta
from serving.structured_request import structured_from_request
from serving.tool_output import ToolCalling
from serving.tool_parsers import parser_for
from serving.tool_prompt import render_tool_chat
from serving.tool_request import ToolRequest


class _RequestFields(BaseModel):
    """What both endpoints take besides the sampling fields (:func:`sampling_request_model`)."""

    model_config = ConfigDict(extra="allow")  # undeclared fields: check_fields

    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    priority: int = 0
    user: str | None = None  # OpenAI's end-user id: the tenant (the X-Tenant-Id header wins)
    # The output's shape (serving/structured_request.py): OpenAI's, or jbatch's extra.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    sampling_fields: ClassVar[tuple[SurfaceField, ...]] = ()
    params_cls: ClassVar[type[SamplingParams]] = SamplingParams

    def sampling_params(self) -> SamplingParams:
        """Absent or null fields take the Python default; raises ValueError naming a field."""
        kwargs = {}
        for field in self.sampling_fields:
            value = getattr(self, field.surface_name)
            kwargs[field.name] = field.default if value is None else value
        kwargs["structured"] = structured_from_request(
            self.response_format, self.structured_outputs
        )
        return self.params_cls(**{**kwargs, **self.logprob_params()})

    def logprob_params(self) -> dict[str, Any]:
        """SamplingParams logprob fields the endpoint takes in its own (OpenAI) form."""
        return {}

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
    echo: bool = False  # the prompt's text (and, with logprobs, its tokens' logprobs) first
    logprobs: int | None = None  # top logprobs per token (serving/openai_logprobs.py)

    def logprob_params(self) -> dict[str, Any]:
        if self.logprobs is None:
            return {}
        if self.echo and self.prompt_logprobs is None:
            return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs}
        return {"logprobs": self.logprobs}


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins
    # Tool calling (serving/tool_request.py checks them: a 400 naming the field).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: this many top tokens per token

    def logprob_params(self) -> dict[str, Any]:
        k = self.top_logprobs
        if not self.logprobs:
            if k is not None:
                raise ValueError(f"top_logprobs={k} needs logprobs: true")
            return {}
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {k}")
        return {"logprobs": 0 if k is None else k}

    @model_validator(mode="after")
    def _newer_name_wins(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


OpenAIRequest = CompletionRequest | ChatCompletionRequest
ENDPOINTS: dict[str, type[OpenAIRequest]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}

# ---- strictness ------------------------------------------------------------------------------
# OpenAI fields jbatch accepts and ignores, with the reason: none of them changes the output.
IGNORED_FIELDS: dict[str, str] = {
    "metadata": "tags for OpenAI's stored completions; not an input to generation",
    "store": "whether OpenAI keeps the completion; jbatch keeps nothing",
    "service_tier": "OpenAI's billing and latency class; jbatch has one (`priority` orders)",
    "prompt_cache_key": "a cache routing hint; the prefix cache finds shared prefixes itself",
    "safety_identifier": "an end-user id for abuse monitoring; the output does not depend on it",
    "prediction": "predicted output only makes generation faster; the output is the same",
}

# OpenAI fields jbatch does not implement yet, with the values that mean "off" (accepted: they
# change nothing); any other value is a 400 naming the field.
NOT_SUPPORTED_YET: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
}


def _stale_entries() -> list[str]:
    """Table entries that every request model declares (implemented: delete the entry)."""
    tables = (*IGNORED_FIELDS, *NOT_SUPPORTED_YET)
    return [f for f in tables if all(f in m.model_fields for m in ENDPOINTS.values())]


if _stale_entries():
    raise TypeError(f"openai_protocol: {_stale_entries()} are declared fields now; delete them")


def check_fields(req: OpenAIRequest) -> None:
    """ValueError naming the first undeclared field that is neither ignored nor off."""
    for name, value in (req.model_extra or {}).items():
        if name in IGNORED_FIELDS:
            continue
        if name in NOT_SUPPORTED_YET:
            if value not in NOT_SUPPORTED_YET[name]:
                shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
                raise ValueError(f"{name}: not supported yet by jbatch (got {shown})")
            continue
        raise ValueError(
            f"{name}: unknown field; jbatch does not implement it (accepted and ignored: "
            f"{', '.join(IGNORED_FIELDS)})"
        )


def validation_message(errors: list[dict[str, Any]]) -> str:
    """The first pydantic error as ``field: message`` (the 400 of a body that does not parse)."""
    first = errors[0] if errors else {}
    field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    return f"{field}: {first.get('msg', 'invalid value')}"


def parse_body(url: str, body: Any) -> OpenAIRequest:
    """The request model of ``url`` from a JSON body (the batch job's path to what FastAPI does
    for the server); ValueError with the message the server's 400 carries."""
    if url not in ENDPOINTS:
        raise ValueError(f"url: {url!r} is not one of {sorted(ENDPOINTS)}")
    try:
        return ENDPOINTS[url].model_validate(body)
    except ValidationError as e:
        raise ValueError(validation_message(e.errors())) from None


@dataclasses.dataclass(frozen=True)
class Translated:
    """One request body as the engine runs it."""

    prompt: str | list[int]  # text still to tokenize (see add_special_tokens), or token ids
    add_special_tokens: bool  # when ``prompt`` is text: add BOS and the like while encoding
    params: SamplingParams
    chat: bool
    tools: ToolCalling | None = None  # chat with tools: how the output becomes tool_calls
    echo: bool = False  # completions: the prompt's text first

    def logprob_formatter(self, tokenizer: Tokenizer | None, prompt_ids: list[int]):
        """How this request's responses show logprobs and the echoed prompt."""
        echo = None
        if self.echo:
            text = self.prompt if isinstance(self.prompt, str) else None
            if text is None:
                text = "" if tokenizer is None else tokenizer.decode(prompt_ids)
            echo = (text, prompt_ids)
        p = self.params
        return LogprobFormatter(tokenizer, self.chat, p.logprobs, echo, p.prompt_logprobs)

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
    check_fields(req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise ValueError(f"prompt: one prompt per request, got a list of {len(prompt)}")
        prompt = prompt[0]
    return Translated(prompt, True, req.sampling_params(), chat=False, echo=req.echo)


def translate_chat(
    req: ChatCompletionRequest, tokenizer: Tokenizer | None, tool_call_parser: str = "auto"
) -> Translated:
    """A ``/v1/chat/completions`` body, rendered with the model's chat template (which writes
    special tokens such as BOS itself) and its tools (``tool_call_parser``: the output format,
    ``serving/tool_parsers.py``); ValueError naming the problem."""
    check_fields(req)
    messages = [_flatten_content(i, m) for i, m in enumerate(req.messages)]
    parser = parser_for(tool_call_parser, tokenizer.chat_template if tokenizer else None)
    tools = ToolRequest.from_fields(req.tools, req.tool_choice, req.parallel_tool_calls, parser)
    text = render_tool_chat(tokenizer, messages, req.add_generation_prompt, tools)
    params = req.sampling_params()
    if tools is None:
        return Translated(text, False, params, chat=True)
    params = params.replace(structured=tools.constrain(params.structured))
    return Translated(text, False, params, chat=True, tools=tools.output())


def _flatten_content(i: int, message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content parts ``[{"type": "text", "text": ...}]`` -> one string; any other part
    (an image, audio, a file) is a ValueError naming it: dropping it would change the output."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type", "text") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            where = f"messages[{i}].content[{j}]"
            raise ValueError(f"{where}: only text parts are supported, got {part!r:.60}")
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}


# ---- responses ---------------------------------------------------------------------------------
def response_meta(chat: bool, model_name: str) -> dict[str, Any]:
    """The fields every body and chunk of one response share."""
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12),
        "created": int(time.time()),
        "model": model_name,
    }


def choice(
    delta: Delta,
    chat: bool,
    streaming: bool,
    first: bool,
    message: dict[str, Any] | None = None,
    fmt: LogprobFormatter | None = None,
) -> dict[str, Any]:
    """Choice ``delta.index`` of a body (``streaming`` False: ``delta`` is the whole completion)
    or of a streamed chunk (``first``: the chunk that opens this choice's assistant message);
    ``message``: the chat message's fields when not just ``delta.text`` as content (tool
    calls); ``fmt``: the request's logprobs and echo (``Translated.logprob_formatter``; None:
    neither)."""
    out: dict[str, Any] = {"index": delta.index}
    text = delta.text if fmt is None else fmt.text(delta.text, first)
    if chat:
        fields = {"content": text} if message is None else message
        if streaming:
            out["delta"] = {"role": "assistant", **fields} if first else fields
        else:
            out["message"] = {"role": "assistant", **fields}
    else:
        out["text"] = text
    out["logprobs"] = None
    if fmt is not None:
        prompt = delta.prompt_logprobs if first else None
        out["logprobs"] = fmt.choice_logprobs(delta.token_ids, delta.top_logprobs, prompt)
        if first and fmt.prompt_k is not None:
            out["prompt_logprobs"] = fmt.prompt_logprobs(delta.prompt_logprobs)
    out["token_ids"] = delta.token_ids
    out["finish_reason"] = delta.finish_reason
    if delta.finished:
        out["stop_reason"] = delta.stop_reason
    return out


def usage(prompt_tokens: int, completion_tokens: dict[int, int]) -> dict[str, int]:
    """A request's usage; ``completion_tokens``: each choice's count (n > 1: summed)."""
    completion = sum(completion_tokens.values())
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def joined(deltas: list[Delta]) -> list[Delta]:
    """The deltas of one request as whole completions, one per choice, in index order."""
    choices: dict[int, list[Delta]] = {}
    for d in deltas:
        choices.setdefault(d.index, []).append(d)
    return [
        dataclasses.replace(
            ds[-1],
            token_ids=[t for d in ds for t in d.token_ids],
            text="".join(d.text for d in ds),
            top_logprobs=_joined_top_logprobs(ds),
            prompt_logprobs=ds[0].prompt_logprobs,
        )
        for _, ds in sorted(choices.items())
    ]


def _joined_top_logprobs(deltas: list[Delta]) -> list | None:
    tops = [d.top_logprobs for d in deltas if d.top_logprobs is not None]
    return [t for top in tops for t in top] if tops else None


def response_body(
    meta: dict[str, Any],
    wholes: list[Delta],
    chat: bool,
    tools: ToolCalling | None = None,
    fmt: LogprobFormatter | None = None,
) -> dict[str, Any]:
    """The body of a non-streamed response: ``chat.completion`` or ``text_completion``, with
    one choice per whole completion (:func:`joined`)."""
    choices = []
    for whole in wholes:
        message = None
        if tools is not None:
            message, whole = tools.whole(whole)
        choices.append(choice(whole, chat, False, True, message, fmt))
    return {
        **meta,
        "object": "chat.completion" if chat else "text_completion",
        "choices": choices,
        "usage": usage(wholes[0].prompt_tokens, {w.index: w.completion_tokens for w in wholes}),
    }
