"""Tests for jbatch.tokenizer: loading, special tokens and the incremental detokenizer."""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from jbatch.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = [
    "héllo wörld 你好世界 🙂🚀 the quick brown fox jumps over the lazy dog",
    "Hello world! The engine streams tokens; déjà vu, naïve café, straße.",
    "你好，世界。我们在测试分词器。 😀😃😄 🚀🚀 emoji and CJK text",
    "numbers 12345 67890 and punctuation ... !? -- () [] {}",
    "the the the hello hello world world wörld wörld",
] * 20

SPECIALS = ["<s>", "</s>", "<unk>"]
# Characters for random text: ASCII, multi-byte Latin/CJK/emoji seen in training, and unseen ones
# (which byte-level BPE covers via its byte alphabet and the SentencePiece-like one via <0xNN>).
ALPHABET = (
    list("abcdefghijklmnop xyz  .!?,\n") + list("éöß你好世界") + ["🙂", "🚀", "Ω", "𝔘", "😀", "ç"]
)


def _write_dir(path: Path, tok: HFTokenizer, config: dict | None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def _byte_level_bpe() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def _sentencepiece_like() -> HFTokenizer:
    """A Llama-2-style BPE: '▁' spaces, <0xNN> byte fallback, decoder strips one leading space."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    # Train without 4-byte characters (emoji, 𝔘) so those only exist as <0xNN> byte tokens.
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(
        ["".join(c for c in line if ord(c) < 0x10000) for line in CORPUS], trainer=trainer
    )
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = HFTokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return tok


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    config["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    return _write_dir(tmp_path_factory.mktemp("bytebpe"), _byte_level_bpe(), config)


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    return _write_dir(tmp_path_factory.mktemp("sp"), _sentencepiece_like(), config)


@pytest.fixture(scope="module")
def byte_tok(byte_dir: Path) -> Tokenizer:
    tok = Tokenizer.from_dir(byte_dir)
    assert tok is not None
    return tok


@pytest.fixture(scope="module")
def sp_tok(sp_dir: Path) -> Tokenizer:
    tok = Tokenizer.from_dir(sp_dir)
    assert tok is not None
    return tok


@pytest.fixture(params=["byte", "sp"])
def any_tok(request: pytest.FixtureRequest, byte_tok: Tokenizer, sp_tok: Tokenizer) -> Tokenizer:
    return byte_tok if request.param == "byte" else sp_tok


def _stream(
    tok: Tokenizer, ids: list[int], sizes: list[int], prompt: Sequence[int] = ()
) -> list[str]:
    """Feed ``ids`` in groups of ``sizes`` (cycled); return all deltas including the flush."""
    detok = IncrementalDetokenizer(tok, prompt)
    deltas, pos, k = [], 0, 0
    while pos < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        deltas.append(detok.add_tokens(ids[pos : pos + n]))
        pos, k = pos + n, k + 1
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


# --------------------------------------------------------------------------- loading


def test_from_dir_missing_returns_none(tmp_path: Path) -> None:
    assert Tokenizer.from_dir(tmp_path) is None
    assert Tokenizer.from_dir(tmp_path / "does-not-exist") is None


def test_special_ids_and_config(byte_tok: Tokenizer, sp_tok: Tokenizer, tmp_path: Path) -> None:
    for tok in (byte_tok, sp_tok):
        assert tok.bos_token_id == tok.token_to_id("<s>") == 0
        assert tok.eos_token_id == tok.token_to_id("</s>") == 1
        assert {0, 1, 2} <= tok.special_token_ids
        assert tok.token_to_id("definitely-not-a-token") is None
    assert byte_tok.chat_template is not None and "messages" in byte_tok.chat_template
    assert sp_tok.chat_template is None
    assert sp_tok.vocab_size >= 256 + len(SPECIALS)
    assert sp_tok.token_to_id("<0xF0>") is not None
    # Without tokenizer_config.json: loads, but no bos/eos.
    bare = Tokenizer.from_dir(_write_dir(tmp_path / "bare", _byte_level_bpe(), None))
    assert bare is not None and bare.eos_token_id is None and bare.bos_token_id is None


def test_skip_special_tokens(any_tok: Tokenizer) -> None:
    ids = [any_tok.bos_token_id, *any_tok.encode("hello world", False), any_tok.eos_token_id]
    assert "<s>" not in any_tok.decode(ids) and "</s>" not in any_tok.decode(ids)
    assert "hello" in any_tok.decode(ids)
    kept = any_tok.decode(ids, skip_special_tokens=False)
    assert "<s>" in kept and "</s>" in kept
    streamed = "".join(_stream_special(any_tok, ids, skip=False))
    assert streamed == kept
    assert "".join(_stream_special(any_tok, ids, skip=True)) == any_tok.decode(ids)


def _stream_special(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    return [detok.add_tokens([i]) for i in ids] + [detok.flush()]


def test_sp_emoji_uses_byte_fallback(sp_tok: Tokenizer) -> None:
    ids = sp_tok.encode("hi 🚀", add_special_tokens=False)
    pieces = [sp_tok.id_to_token(i) for i in ids]
    assert pieces[-4:] == ["<0xF0>", "<0x9F>", "<0x9A>", "<0x80>"]
    assert sp_tok.decode(ids) == "hi 🚀"
    deltas = _stream(sp_tok, ids, [1])
    assert "".join(deltas) == "hi 🚀"
    assert all("\ufffd" not in d for d in deltas)
    # '▁' alone is stripped at the start of the text; the emoji is held back until its 4th byte.
    assert deltas == ["", "h", "i", " ", "", "", "", "🚀", ""]


def test_byte_level_splits_multibyte(byte_tok: Tokenizer) -> None:
    text = "𝔘Ω"  # unseen in training: each becomes several byte tokens
    ids = byte_tok.encode(text, add_special_tokens=False)
    assert len(ids) > 2
    deltas = _stream(byte_tok, ids, [1])
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


# --------------------------------------------------------------------------- streaming

_FIXTURE_OK = [HealthCheck.function_scoped_fixture]  # fixtures are read-only here


@settings(max_examples=150, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(
    text=st.text(alphabet=st.sampled_from(ALPHABET), max_size=40),
    sizes=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=8),
)
def test_stream_matches_decode(any_tok: Tokenizer, text: str, sizes: list[int]) -> None:
    ids = any_tok.encode(text, add_special_tokens=False)
    full = any_tok.decode(ids)
    deltas = _stream(any_tok, ids, sizes)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=60, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(
    raw=st.lists(st.integers(min_value=0, max_value=10**6), max_size=30),
    sizes=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=8),
)
def test_stream_random_ids(any_tok: Tokenizer, raw: list[int], sizes: list[int]) -> None:
    """Arbitrary ids (specials, stray bytes): the stream equals the one-shot decode.

    Exception: tokenizers' ByteFallback decoder turns *every* byte of an invalid <0xNN> run into
    U+FFFD, so a byte emitted while its run was still valid (e.g. <0x00>) is rewritten by a later
    stray continuation byte (<0x00><0x80> decodes to two U+FFFD). Only the byte-level decoder
    is exact for invalid UTF-8; valid text is exact for both (see test_stream_matches_decode).
    """
    ids = [r % any_tok.vocab_size for r in raw]
    full = any_tok.decode(ids)
    streamed = "".join(_stream(any_tok, ids, sizes))
    if any_tok.token_to_id("<0x00>") is None or "\ufffd" not in full:
        assert streamed == full


@settings(max_examples=80, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(
    text=st.text(alphabet=st.sampled_from(ALPHABET), min_size=2, max_size=40),
    split=st.floats(min_value=0.0, max_value=1.0),
    sizes=st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=6),
)
def test_prompt_context_continues_text(
    any_tok: Tokenizer, text: str, split: float, sizes: list[int]
) -> None:
    """With prompt ids, the deltas are exactly what decoding prompt+generation adds."""
    ids = any_tok.encode(text, add_special_tokens=False)
    k = int(split * len(ids))
    prompt_text, full = any_tok.decode(ids[:k]), any_tok.decode(ids)
    if "\ufffd" in prompt_text or not full.startswith(prompt_text):
        return  # prompt ends mid-character: no well-defined continuation
    assert "".join(_stream(any_tok, ids[k:], sizes, ids[:k])) == full[len(prompt_text) :]


@settings(max_examples=40, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(
    text=st.text(alphabet=st.sampled_from(ALPHABET), min_size=1, max_size=30),
    cut=st.floats(min_value=0.0, max_value=1.0),
    how=st.sampled_from(["state", "pickle"]),
)
def test_handover_mid_stream_continues(any_tok: Tokenizer, text: str, cut: float, how: str) -> None:
    """A detokenizer read with get_state (or pickled) anywhere, held-back bytes included, and
    rebuilt continues with the same deltas as one that never stopped."""
    ids = any_tok.encode(text, add_special_tokens=False)
    k = int(cut * len(ids))
    whole = IncrementalDetokenizer(any_tok)
    expected = [whole.add_tokens([i]) for i in ids] + [whole.flush()]
    first = IncrementalDetokenizer(any_tok)
    got = [first.add_tokens([i]) for i in ids[:k]]
    if how == "state":
        second = IncrementalDetokenizer.from_state(
            any_tok, json.loads(json.dumps(first.get_state()))
        )
    else:
        second = pickle.loads(pickle.dumps(first))
    got += [second.add_tokens([i]) for i in ids[k:]] + [second.flush()]
    assert got == expected
    assert second.text == "".join(expected)


def test_stream_decodes_in_rust(byte_tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past opening the stream, a token costs one ``DecodeStream.step`` (no Python decode)."""
    ids = byte_tok.encode(CORPUS[0] + CORPUS[2], add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_tok, ids[:8])
    calls = []
    monkeypatch.setattr(byte_tok, "decode", lambda *a, **k: calls.append(a) or "")
    streamed = "".join(detok.add_tokens([i]) for i in ids[8:])
    assert len(calls) <= 1 and streamed  # one decode of the context to open the stream
    monkeypatch.undo()
    assert streamed + detok.flush() == byte_tok.decode(ids)[len(byte_tok.decode(ids[:8])) :]


def test_invalid_bytes_held_back_boundedly(byte_tok: Tokenizer) -> None:
    """A run of stray bytes always ends in U+FFFD; it goes out a few tokens behind instead of
    growing the decoded window (and the host time per token) without end. Still exact."""
    stray = byte_tok.token_to_id("Ã")  # byte 0xC3: a lead byte, never completed here
    ids = [stray] * 300 + byte_tok.encode(" ok é", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_tok)
    widest = 0
    for i in ids:
        detok.add_tokens([i])
        widest = max(widest, len(detok._ids) - detok.prefix_offset)
    assert widest <= 24
    assert detok.text + detok.flush() == byte_tok.decode(ids)


def test_sp_leading_space_kept_with_prompt(sp_tok: Tokenizer) -> None:
    prompt = sp_tok.encode("hello", add_special_tokens=False)
    gen = sp_tok.encode("hello world", add_special_tokens=False)[len(prompt) :]
    assert sp_tok.id_to_token(gen[0]).startswith("▁")
    assert sp_tok.decode(gen) == "world"  # decoding alone strips the space...
    assert "".join(_stream(sp_tok, gen, [1], prompt)) == " world"  # ...streaming keeps it


@pytest.mark.parametrize("tail", ["🚀😀", "🚀😀🙂🚀", "ok\n🙂"])
def test_prompt_window_starts_on_char_boundary(sp_tok: Tokenizer, tail: str) -> None:
    """The last prompt tokens are byte tokens of several emoji: a fixed-size context window would
    start mid-character and ByteFallback would turn the next generated bytes into U+FFFD."""
    prompt = sp_tok.encode(f"go {tail}", add_special_tokens=False)
    ids = sp_tok.encode(f"go {tail}𝔘😀ö", add_special_tokens=False)
    assert ids[: len(prompt)] == prompt and len(prompt) > 6
    gen = ids[len(prompt) :]
    for sizes in ([1], [2], [3, 1]):
        assert "".join(_stream(sp_tok, gen, sizes, prompt)) == "𝔘😀ö"


def test_empty_inputs(any_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(any_tok, any_tok.encode("hello"))
    assert detok.add_tokens([]) == "" and detok.flush() == "" and detok.text == ""


def test_flush_emits_incomplete_tail(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("a𝔘", add_special_tokens=False)  # 𝔘 is unseen: several byte tokens
    partial = ids[:-1]
    assert byte_tok.decode(partial).endswith("\ufffd")
    detok = IncrementalDetokenizer(byte_tok)
    held = detok.add_tokens(partial)
    assert "\ufffd" not in held
    assert held + detok.flush() == byte_tok.decode(partial)


# --------------------------------------------------------------------------- cross-check


@pytest.mark.parametrize("which", ["byte", "sp"])
def test_matches_transformers(which: str, byte_dir: Path, sp_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model_dir = byte_dir if which == "byte" else sp_dir
    ours = Tokenizer.from_dir(model_dir)
    assert ours is not None
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    for text in ["héllo wörld 你好世界 🙂🚀", "  two  spaces", "Ω𝔘 naïve café", ""]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip)
        streamed = "".join(_stream(ours, ids, [2, 1, 3]))
        assert streamed == theirs.decode(ids, skip_special_tokens=True)


@settings(max_examples=40, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(
    prompt=st.lists(st.integers(min_value=3, max_value=10**6), min_size=1, max_size=12),
    max_tokens=st.integers(min_value=1, max_value=40),
    stop_at=st.one_of(st.none(), st.integers(min_value=0, max_value=39)),
    eos=st.booleans(),
    decode_steps=st.sampled_from([1, 4]),
)
def test_final_text_decoded_at_the_end_is_the_streamed_text(
    any_tok: Tokenizer, prompt: list[int], max_tokens: int, stop_at, eos: bool, decode_steps: int
) -> None:
    """A FINAL request without stop strings is detokenized once when it ends
    (``Request.text_at_end``): its text equals the DELTA stream's of the same tokens, whatever
    ends it (length, a stop token, EOS) — random ids, stray bytes and specials included
    (ByteFallback's invalid runs excepted, as in ``test_stream_random_ids``)."""
    import types

    from jbatch import EngineConfig, LLMEngine, SamplingParams
    from jbatch.engine.mock_core import MockCore, expected_tokens
    from jbatch.outputs import OutputKind

    vocab = any_tok.vocab_size
    prompt = [3 + t % (vocab - 3) for t in prompt]
    tokens = expected_tokens(prompt, 40, 0, False, vocab)
    stops = [] if stop_at is None or eos else [tokens[stop_at]]
    eos_ids = (tokens[stop_at],) if eos and stop_at is not None else ()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stops)
    texts = {}
    for kind in (OutputKind.DELTA, OutputKind.FINAL):
        cfg = EngineConfig(max_slots=2, page_size=4, num_pages=32, max_seq_len=64, block_q=4,
                           decode_steps=decode_steps)  # fmt: skip
        model_cfg = types.SimpleNamespace(vocab_size=vocab, max_position_embeddings=64)
        eng = LLMEngine(model_cfg, None, cfg, any_tok, eos_ids, core=MockCore(cfg, vocab))
        eng.add_request(prompt, params, output_kind=kind)
        text, ids = "", []
        while eng.has_unfinished_requests():
            for out in eng.step():
                text += out.outputs[0].text
                ids += out.outputs[0].token_ids
                reason = out.outputs[0].finish_reason
        texts[kind] = (text, ids, reason)
    final, delta = texts[OutputKind.FINAL], texts[OutputKind.DELTA]
    assert final[1:] == delta[1:]
    if any_tok.token_to_id("<0x00>") is None or "\ufffd" not in final[0] + delta[0]:
        assert final[0] == delta[0]


@settings(max_examples=60, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(
    run=st.lists(st.integers(min_value=3, max_value=60), min_size=1, max_size=12),
    before=st.integers(min_value=0, max_value=3),
    max_tokens=st.integers(min_value=1, max_value=16),
    stop_ids=st.lists(st.integers(min_value=3, max_value=60), max_size=2),
    eos=st.booleans(),
    stop_strings=st.booleans(),
    final=st.booleans(),
)
def test_a_run_of_tokens_is_recorded_as_token_by_token(
    any_tok: Tokenizer, run, before, max_tokens, stop_ids, eos, stop_strings, final
) -> None:
    """``stop_checker.append_run`` (a block's or speculative dispatch's tokens at once) records
    what ``append_token`` one by one records and ends where it ends: ids, logprobs and their
    sum, pending text, finish — stop ids, EOS, stop strings, the length, streamed or FINAL."""
    from jbatch import EngineConfig, SamplingParams
    from jbatch.engine import stop_checker
    from jbatch.engine.request_intake import RequestIntake
    from jbatch.outputs import OutputKind

    cfg = EngineConfig(max_slots=2, page_size=4, num_pages=32, max_seq_len=64, block_q=4)
    stop = tuple(s for s in map(any_tok.decode, ([t] for t in run[1:3])) if s)
    stop = stop if stop_strings else ()
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens + before, stop_token_ids=stop_ids, stop=stop,
        ignore_eos=not eos,
    )  # fmt: skip
    intake = RequestIntake(cfg, any_tok.vocab_size, any_tok, frozenset({run[-1]}))
    kind = OutputKind.FINAL if final else OutputKind.DELTA
    one, two = (intake.request(str(i), [5, 6, 7], params, output_kind=kind)[0] for i in (1, 2))
    logprobs = [-0.1 * (i + 1) / 3 for i in range(len(run))]
    for seq in (one, two):  # tokens already there: the run starts mid-generation
        for t in range(before):
            stop_checker.append_token(seq, 40 + t, -0.5)
    want, n = None, 0
    for token, logprob in zip(run, logprobs):
        want, n = stop_checker.append_token(one, token, logprob), n + 1
        if want is not None:
            break
    got = stop_checker.append_run(two, run, logprobs)
    assert got == (want, n)
    assert two.output_ids == one.output_ids and two.logprobs == one.logprobs
    assert two.cumulative_logprob == one.cumulative_logprob
    assert two.pending_text == one.pending_text
