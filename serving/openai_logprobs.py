"""Logprobs in OpenAI's response shapes, built from the engine's ``{token_id: Logprob}`` dicts.

- ``/v1/completions`` (legacy ``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs"
  (dicts keyed by token text), "text_offset"}``; with ``echo`` the prompt's tokens come first
  (the first one's logprob and top logprobs are null).
- ``/v1/chat/completions`` (``logprobs: true, top_logprobs: k``): ``{"content": [{"token",
  "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.
- ``prompt_logprobs: k`` (a jbatch extra on both): per prompt token null or ``{token_id:
  {"logprob", "rank", "decoded_token"}}``.

Each engine dict holds the top k first (highest first), then the token itself when it is not
among them (``jbatch.outputs``), so the top k are its first k entries.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from jbatch.outputs import Logprob, TopLogprobs
from jbatch.tokenizer import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character of each byte -> the byte: printable
    Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer: Tokenizer | None, token: int, text: str) -> list[int]:
    """The token's raw bytes: from its byte-level or ``<0xNN>`` spelling when it has one (a
    token may hold part of a character), else the UTF-8 of its text."""
    piece = tokenizer.id_to_token(token) if tokenizer is not None else None
    if piece is not None:
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return [int(m.group(1), 16)]
        alphabet = _byte_level_alphabet()
        if piece and all(c in alphabet for c in piece) and tokenizer.decode([token]) != piece:
            return [alphabet[c] for c in piece]
    return list(text.encode("utf-8"))


def top_k(entries: TopLogprobs, k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of one position, highest first."""
    return list(entries.items())[:k]


class LogprobFormatter:
    """One request's logprobs in its endpoint's shape (``k`` None: it asked for none)."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        chat: bool,
        k: int | None,
        echo: tuple[str, list[int]] | None = None,
        prompt_k: int | None = None,
    ):
        self.tokenizer, self.chat, self.k, self.prompt_k = tokenizer, chat, k, prompt_k
        self.echo = echo  # (prompt text, prompt ids) that lead the completion (``echo``)
        self.offset = 0  # text offset of the next token (completions)

    def text(self, delta_text: str, first: bool) -> str:
        """A choice's text: the echoed prompt's first."""
        return self.echo[0] + delta_text if first and self.echo else delta_text

    def _text(self, token: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return "" if self.tokenizer is None else self.tokenizer.decode([token], False)

    def _chat_entry(self, token: int, lp: Logprob) -> dict[str, Any]:
        text = self._text(token, lp)
        return {
            "token": text,
            "logprob": _finite(lp.logprob),
            "bytes": token_bytes(self.tokenizer, token, text),
        }

    def choice_logprobs(
        self, token_ids: list[int], tops: list[TopLogprobs] | None, prompt=None
    ) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice (or stream chunk) with these tokens; ``prompt``: the
        prompt logprobs to put first (the first chunk of a completion with ``echo``)."""
        if self.k is None:
            return None
        tops = tops or [{} for _ in token_ids]
        if self.chat:
            content = []
            for token, entries in zip(token_ids, tops):
                own = entries.get(token, Logprob(0.0))
                entry = self._chat_entry(token, own)
                entry["top_logprobs"] = [
                    self._chat_entry(t, lp) for t, lp in top_k(entries, self.k)
                ]
                content.append(entry)
            return {"content": content}
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        if prompt is not None and self.echo is not None:
            self._add_completion_rows(out, self.echo[1], prompt)
            self.offset = len(self.echo[0])
        self._add_completion_rows(out, token_ids, tops)
        return out

    def _add_completion_rows(self, out: dict, token_ids, tops) -> None:
        for token, entries in zip(token_ids, tops):
            own = None if entries is None else entries.get(token)
            text = self._text(token, own)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if own is None else _finite(own.logprob))
            top = None
            if entries is not None:
                top = {self._text(t, lp): _finite(lp.logprob) for t, lp in top_k(entries, self.k)}
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)

    def prompt_logprobs(self, prompt: list[TopLogprobs | None] | None) -> list | None:
        """vLLM's ``prompt_logprobs`` shape (a jbatch extra; None when not asked for)."""
        if self.prompt_k is None or prompt is None:
            return None
        return [
            None
            if entries is None
            else {
                str(t): {
                    "logprob": _finite(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }
                for t, lp in entries.items()
            }
            for entries in prompt
        ]


def _finite(logprob: float) -> float:
    """JSON has no -inf: OpenAI writes -9999.0 for a token of (about) zero probability."""
    return logprob if logprob > -9999.0 else -9999.0
