"""Structured output on the host: llguidance matchers and the per-step token bitmask.

1. ``add_request``: :meth:`GrammarCompiler.matcher` turns a request's :class:`StructuredOutput`
   into an llguidance grammar (cached per spec; a spec the library rejects is a ValueError
   naming the problem) and a fresh ``LLMatcher`` kept on the ``Request``.
2. Before a step in which constrained requests sample, :meth:`GrammarCompiler.bitmask` fills a
   ``[slots, ceil(vocab / 32)]`` int32 bitmask (bit ``t % 32`` of word ``t // 32`` set: token
   ``t`` allowed) for their slots — in parallel on llguidance's thread pool, GIL released —
   and all-ones rows for every other slot. The jitted sampler sets masked-out logits to -inf.
3. Each token the step samples for such a request is fed to its matcher
   (:func:`advance`); a grammar that cannot continue ends the request (finish reason "stop",
   or "error" if the matcher failed).

Mask ``N+1`` needs token ``N``, which the one-step-in-flight loop reads only after dispatching
the next step; the engine therefore reads step N before dispatching a step in which a
constrained request samples (``LLMEngine._step``), and costs what the mask takes to fill plus
one result round trip. Unconstrained steps keep the overlap.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

import llguidance
import llguidance.numpy as llg_np
import numpy as np
from jaxtyping import Int32

from jbatch.structured_output import StructuredOutput
from jbatch.tokenizer import Tokenizer

CACHE_SIZE = 256  # compiled grammars kept (LRU), keyed by the spec


def bitmask_words(vocab_size: int) -> int:
    """Int32 words per slot of a token bitmask (the device sampler's ``allowed`` width)."""
    return -(-vocab_size // 32)


def all_allowed(slots: int, vocab_size: int) -> Int32[np.ndarray, "slots words"]:
    """A bitmask that allows every token in every slot (unconstrained steps)."""
    return np.full((slots, bitmask_words(vocab_size)), -1, np.int32)


class GrammarCompiler:
    """Compiles StructuredOutput specs for one tokenizer and fills token bitmasks."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Iterable[int]):
        if tokenizer.vocab_size > vocab_size:
            raise ValueError(
                f"tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                f"vocab_size={vocab_size}"
            )
        eos = sorted(eos_ids)
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos or None
        )
        self.executor = llguidance.LLExecutor()
        self._grammars: collections.OrderedDict[StructuredOutput, str] = collections.OrderedDict()

    def grammar(self, spec: StructuredOutput) -> str:
        """The llguidance grammar of ``spec`` (cached); ValueError naming what is wrong."""
        if spec in self._grammars:
            self._grammars.move_to_end(spec)
            return self._grammars[spec]
        grammar = _to_grammar(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if is_error:
            raise ValueError(f"structured.{spec.kind}: {messages[0] if messages else 'invalid'}")
        self._grammars[spec] = grammar
        if len(self._grammars) > CACHE_SIZE:
            self._grammars.popitem(last=False)
        return grammar

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one request."""
        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured.{spec.kind}: {matcher.get_error()}")
        return matcher

    def bitmask(
        self, rows: Sequence[tuple[llguidance.LLMatcher, int]], slots: int
    ) -> Int32[np.ndarray, "slots words"]:
        """A fresh bitmask: each ``(matcher, slot)`` row from its matcher, others all ones. Fresh
        every step: a CPU device buffer may alias it while the step runs."""
        mask = all_allowed(slots, self.vocab_size)
        if rows:
            llg_np.fill_next_token_bitmask_par(self.executor, list(rows), mask)
        return mask


def advance(matcher: llguidance.LLMatcher, token: int) -> tuple[str, str | None] | None:
    """Feed one sampled token; ``(finish_reason, error)`` when the output must end here."""
    if not matcher.consume_token(token) or matcher.is_error():
        return "error", f"structured output: {matcher.get_error() or f'token {token} rejected'}"
    if matcher.is_stopped():
        return "stop", None
    return None


def _to_grammar(spec: StructuredOutput) -> str:
    """The llguidance grammar text of a spec (not yet checked against a tokenizer)."""
    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            options = {"whitespace_flexible": spec.whitespace_flexible}
            return llguidance.LLMatcher.grammar_from_json_schema(spec.schema, defaults=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as e:
        raise ValueError(f"structured.{kind}: {e}") from None
