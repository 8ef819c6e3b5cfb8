"""Tokenizer wrapper over Hugging Face ``tokenizers`` plus a streaming detokenizer.

``Tokenizer`` loads ``tokenizer.json`` (and, optionally, ``tokenizer_config.json`` for the
bos/eos tokens and the chat template) from a model directory. ``IncrementalDetokenizer`` turns
a growing list of generated token ids into text deltas that are safe to stream: it never emits a
partial multi-byte UTF-8 character and keeps SentencePiece-style leading spaces right.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

try:  # tokenizers >= 0.22: the streaming decoder with a prefilled context
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: the Python reference path only
    _DecodeStream = None

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

REPLACEMENT_CHAR = "\ufffd"
# Tokens held back before the held text is taken for invalid bytes, not one unfinished
# character (at most 4 bytes, so at most 4 tokens): then all but the last 3 go out.
_MAX_HELD = 8
_KEEP_HELD = 3


def _token_content(value: Any) -> str | None:
    """Return the token string of a config entry: a plain string or an AddedToken-style dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template_of(config: dict[str, Any], model_dir: Path) -> str | None:
    """Extract the chat template from ``tokenizer_config.json`` or ``chat_template.jinja``."""
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if isinstance(template, str):
        return template
    jinja = model_dir / "chat_template.jinja"
    return jinja.read_text(encoding="utf-8") if jinja.is_file() else None


class Tokenizer:
    """A thin, typed wrapper around :class:`tokenizers.Tokenizer`.

    Truncation and padding stored in ``tokenizer.json`` are disabled: the engine decides lengths.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self._tok.no_truncation()
        self._tok.no_padding()
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id: int | None = self.token_to_id(bos_token) if bos_token else None
        self.eos_token_id: int | None = self.token_to_id(eos_token) if eos_token else None
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        """Load from a model directory; ``None`` if it has no ``tokenizer.json``."""
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            return None
        config: dict[str, Any] = {}
        cfg_file = model_dir / "tokenizer_config.json"
        if cfg_file.is_file():
            loaded = json.loads(cfg_file.read_text(encoding="utf-8"))
            if isinstance(loaded, dict):
                config = loaded
        return cls(
            tokenizers.Tokenizer.from_file(str(tok_file)),
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            chat_template=_chat_template_of(config, model_dir),
        )

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added tokens (the model's embedding may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Encode ``text`` to ids; ``add_special_tokens`` applies the post-processor (e.g. BOS)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode ids to text, dropping special tokens unless ``skip_special_tokens`` is False."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, tok: str) -> int | None:
        """Id of the token string ``tok``, or ``None`` if it is not in the vocabulary."""
        return self._tok.token_to_id(tok)

    def id_to_token(self, idx: int) -> str | None:
        """Token string of ``idx``, or ``None`` if out of range."""
        return self._tok.id_to_token(idx)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    A byte-level BPE (or byte-fallback ``<0xNN>`` tokens) can split one character over several
    tokens; while the decoded tail ends in U+FFFD the delta is held back, so a partial character
    is never emitted. Decoding a token alone can lose context (SentencePiece ``▁`` leading spaces
    are stripped at the start of a decode), so each step decodes a small window of previous
    tokens plus the new ones and emits the difference against the window alone.

    ``prefix_offset``..``read_offset`` is the window of already-emitted tokens used as context;
    ``read_offset``..end are tokens whose text is not emitted yet. With an empty prompt the
    concatenated deltas plus :meth:`flush` equal ``tokenizer.decode(generated_ids)``. The last
    ``context_tokens`` prompt ids only seed the window so the first generated token keeps its
    leading space (the deltas then continue the prompt text, as a streamed reply should).

    Tokens are taken one at a time. The work is done by ``tokenizers``' own ``DecodeStream``
    (the same window rule, in Rust: one call per token, ~10x cheaper than two ``decode`` calls
    from Python); :meth:`_step` is the same rule in Python, used for the final flush and
    whenever the stream cannot follow (a decoder that rewrote earlier text, an old
    ``tokenizers``). The offsets are kept here either way, so the stream is rebuilt from them
    after a handover or unpickling (it holds no state of its own that the offsets do not).

    Caveat: for *invalid* UTF-8 a one-shot decode may rewrite earlier characters (the
    ``tokenizers`` ByteFallback decoder turns every byte of an invalid ``<0xNN>`` run into U+FFFD,
    e.g. ``<0x0A>`` then a stray ``<0x80>``); text already streamed is never taken back, so only
    then can the stream differ from ``decode``. Byte-level BPE decoding is exact in all cases.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        *,
        context_tokens: int = 6,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = self._context_of(list(prompt_ids), context_tokens)
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self._num_context = len(self._ids)
        self._chunks: list[str] = []
        self._stream = None  # opened on first use (_open_stream)

    def _context_of(self, prompt_ids: list[int], context_tokens: int) -> list[int]:
        """The last ``context_tokens`` prompt ids, trimmed so they start on a character boundary.

        A window starting mid-character decodes to U+FFFD there (and ByteFallback turns the whole
        byte run into U+FFFD, which would swallow the next generated bytes too).
        """
        for start in range(max(len(prompt_ids) - context_tokens, 0), len(prompt_ids)):
            window = prompt_ids[start:]
            if not self.tokenizer.decode(window, self.skip_special_tokens).startswith(
                REPLACEMENT_CHAR
            ):
                return window
        return []

    def get_state(self) -> dict:
        """Everything but the tokenizer and the stream, as plain values (a handover:
        ``engine/handover.py``)."""
        return {k: v for k, v in vars(self).items() if k not in ("tokenizer", "_stream")}

    @classmethod
    def from_state(cls, tokenizer: Tokenizer, state: dict) -> IncrementalDetokenizer:
        """A detokenizer continuing where the one ``get_state`` was read from stopped."""
        detok = cls.__new__(cls)
        detok.tokenizer, detok._stream = tokenizer, None
        for key, value in state.items():
            setattr(detok, key, list(value) if isinstance(value, list) else value)
        return detok

    def __getstate__(self) -> dict:  # pickling (engine snapshots): the stream is rebuilt
        return {**self.get_state(), "tokenizer": self.tokenizer}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state, _stream=None)

    @property
    def text(self) -> str:
        """All text emitted so far (concatenation of the returned deltas)."""
        return "".join(self._chunks)

    @property
    def generated_ids(self) -> list[int]:
        """The ids passed to :meth:`add_tokens` so far."""
        return self._ids[self._num_context :]

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end], self.skip_special_tokens)

    def _step(self, final: bool) -> str:
        """Decode the pending window; emit its new text unless it ends in a partial character."""
        if self.read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        full_text = self._decode(self.prefix_offset, len(self._ids))
        if not final and (
            full_text.endswith(REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text)
        ):
            # An incomplete character, or no new text (a skipped special token: moving the
            # window past it would lose the space a SentencePiece decoder strips at the start
            # of a decode), or a decoder that shrank the text: wait for more.
            return self._release_held(prefix_text, full_text)
        return self._emit(full_text[len(prefix_text) :], len(self._ids))

    def _emit(self, delta: str, upto: int) -> str:
        """Text up to token ``upto`` is out: the window moves on."""
        self.prefix_offset, self.read_offset = self.read_offset, upto
        if delta:
            self._chunks.append(delta)
        return delta

    def _release_held(self, prefix_text: str | None = None, full_text: str | None = None) -> str:
        """Keep held-back text bounded: past ``_MAX_HELD`` tokens the held text cannot be one
        unfinished character (invalid bytes, e.g. a model emitting stray byte tokens), and
        holding it would make every later token decode an ever longer window. Emit it but for
        the last ``_KEEP_HELD`` tokens, if their text is a prefix of the whole window's (so a
        character that those tokens complete is never split); else keep waiting."""
        held = len(self._ids) - self.read_offset
        if held <= _MAX_HELD:
            return ""
        if prefix_text is None:
            prefix_text = self._decode(self.prefix_offset, self.read_offset)
            full_text = self._decode(self.prefix_offset, len(self._ids))
        upto = len(self._ids) - _KEEP_HELD
        cut_text = self._decode(self.prefix_offset, upto)
        if len(cut_text) <= len(prefix_text) or not full_text.startswith(cut_text):
            return ""
        self._stream = None  # rebuilt from the new offsets
        return self._emit(cut_text[len(prefix_text) :], upto)

    def add_tokens(self, ids: Sequence[int]) -> str:
        """Append generated ``ids``; return the newly completed text (possibly ``""``)."""
        deltas = []
        for token in ids:
            self._ids.append(int(token))
            delta = self._step_streamed()
            if delta:
                deltas.append(delta)
        return "".join(deltas)

    def decode_rest(self, ids: Sequence[int], final: bool = True) -> str:
        """Append ``ids`` and return their text at once, for text nobody reads before the end:
        what :meth:`add_tokens` then :meth:`flush` would return (``final``), or
        :meth:`add_tokens` alone (not ``final``: an incomplete character at the end stays
        held back) — one decode of the window instead of a step per token, except when the
        text ends in an incomplete character without ``final`` (then token by token: what is
        held back then depends on the path)."""
        if not final:
            window = self._ids[self.prefix_offset :] + [int(t) for t in ids]
            prefix_text = self._decode(self.prefix_offset, self.read_offset)
            full_text = self.tokenizer.decode(window, self.skip_special_tokens)
            if full_text.endswith(REPLACEMENT_CHAR) or not full_text.startswith(prefix_text):
                return self.add_tokens(ids)
            self._ids.extend(int(t) for t in ids)
            return self._emit(full_text[len(prefix_text) :], len(self._ids))
        self._ids.extend(int(t) for t in ids)
        return self.flush()

    def flush(self) -> str:
        """At end of generation: emit whatever is held back, even if it ends in U+FFFD."""
        self._stream = None  # the offsets move without it
        return self._step(final=True)

    def _step_streamed(self) -> str:
        """:meth:`_step` for the newest token, through the ``DecodeStream`` when it can."""
        stream = self._stream if self._stream is not None else self._open_stream()
        if stream is None:
            return self._step(final=False)
        try:
            delta = stream.step(self.tokenizer.backend, self._ids[-1])
        except Exception:  # tokenizers' InvalidPrefix: the decoder rewrote earlier text
            self._stream = None  # rebuilt from the offsets the reference step leaves
            return self._step(final=False)
        if delta is None:
            return self._release_held()
        return self._emit(delta, len(self._ids))

    def _open_stream(self):
        """A ``DecodeStream`` in this detokenizer's state, the newest token not yet stepped:
        the emitted window as context, then the held-back tokens replayed (each must stay held
        back, as it did here; if one does not, None: the reference path takes this token).
        None too while the emitted window ends in U+FFFD (after :meth:`_release_held`)."""
        if _DecodeStream is None:
            return None
        window = self._ids[self.prefix_offset : self.read_offset]
        if window and self._decode(self.prefix_offset, self.read_offset).endswith(REPLACEMENT_CHAR):
            return None  # DecodeStream takes such a context as no text at all
        backend = self.tokenizer.backend
        try:  # (a DecodeStream without a context argument: tokenizers < 0.22)
            stream = _DecodeStream(window, self.skip_special_tokens)
            for token in self._ids[self.read_offset : -1]:
                if stream.step(backend, token) is not None:
                    return None
        except Exception:
            return None
        self._stream = stream
        return stream
