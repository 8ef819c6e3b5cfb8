"""Structured output: specs, the device bitmask, and constrained generation mixed with free
generation on the demo model (every constrained output valid, neighbours unchanged, no
recompiles), plus the host loop under preemption on the MockCore."""

from __future__ import annotations

import json
import re
import types

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jbatch import LLM, EngineConfig, LLMEngine, SamplingParams
from jbatch.demo import demo_model_path
from jbatch.engine import grammar
from jbatch.engine.mock_core import MockCore
from jbatch.engine.sampler import SlotSampling, apply_bitmask, sample
from jbatch.structured_output import StructuredOutput
from jbatch.tokenizer import Tokenizer
from tests.compile_counter import count_compiles

DEMO = demo_model_path()

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "pet", "tags", "home"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe later"]
GRAMMAR = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'  # Lark: a sum in parentheses
GRAMMAR_RE = r"\([0-9]{1,3}(\+[0-9]{1,3})*\)"


# ---- specs -------------------------------------------------------------------------------------
def test_spec_needs_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutput()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutput(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="structured.choice"):
        StructuredOutput(choice="yes")
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput(json="{not json")
    with pytest.raises(ValueError, match="structured must be"):
        SamplingParams(structured={"regex": "a"})
    with pytest.raises(ValueError, match="unknown key"):
        StructuredOutput.from_dict({"regx": "a"})
    # One canonical key per schema, whatever its key order or form.
    a = StructuredOutput(json={"type": "object", "required": []})
    assert a == StructuredOutput(json='{"required": [], "type": "object"}')
    assert hash(a) == hash(StructuredOutput(json={"required": [], "type": "object"}))


@pytest.fixture(scope="module")
def compiler():
    return grammar.GrammarCompiler(Tokenizer.from_dir(DEMO), 2048, [2])


@pytest.mark.parametrize(
    "spec, problem",
    [
        (StructuredOutput(regex="[0-9"), "structured.regex"),
        (StructuredOutput(grammar="start: undefined_rule"), "structured.grammar"),
        (StructuredOutput(json={"properties": {"a": {"$ref": "#/nope"}}}), "structured.json"),
    ],
)
def test_rejected_specs_name_the_problem(compiler, spec, problem):
    with pytest.raises(ValueError, match=problem):
        compiler.matcher(spec)


def test_json_object_accepts_objects_only(compiler):
    """``json_object`` (any object: a tiny model may never close one, so it is checked here on
    the matcher rather than end to end)."""
    tok = Tokenizer.from_dir(DEMO)
    ok = compiler.matcher(StructuredOutput(json_object=True))
    assert ok.consume_tokens(tok.encode('{"x":[1,{"y":null}]}', add_special_tokens=False))
    assert ok.is_accepting()
    for text in ("[1]", '"a"', '{"x" :1}'):  # not an object; loose whitespace (compact)
        m = compiler.matcher(StructuredOutput(json_object=True))
        assert not m.consume_tokens(tok.encode(text, add_special_tokens=False)), text


def test_bitmask_rows_follow_their_matchers(compiler):
    m = compiler.matcher(StructuredOutput(choice=["yes", "no"]))
    mask = compiler.bitmask([(m, 2)], slots=4)
    assert mask.shape == (4, grammar.bitmask_words(2048))
    assert (mask[[0, 1, 3]] == -1).all()  # unconstrained rows allow everything
    bits = ((mask[2][:, None].astype(np.int64) >> np.arange(32)) & 1).reshape(-1)
    allowed = np.flatnonzero(bits)
    assert 0 < len(allowed) < 50  # a handful of prefixes of "yes" / "no"
    tok = Tokenizer.from_dir(DEMO)
    texts = [tok.decode([int(i)]) for i in allowed]
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts), texts


# ---- the device side -------------------------------------------------------------------------
def test_apply_bitmask_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 70)).astype(np.float32)
    words = rng.integers(-(2**31), 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    got = np.asarray(apply_bitmask(jnp.asarray(x), jnp.asarray(words)))
    bits = ((words[:, :, None].astype(np.int64) >> np.arange(32)) & 1).reshape(3, -1)[:, :70]
    np.testing.assert_array_equal(got, np.where(bits == 1, x, -np.inf))


def test_sampler_only_draws_allowed_tokens():
    """Greedy and random rows (with top-p / top-k on) never leave the allowed set; a row
    whose mask is all ones is unchanged by its neighbours' masks."""
    slots, vocab = 4, 300
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(slots, vocab)).astype(np.float32))
    allowed_ids = [[5, 17, 299], [0, 64, 65, 128], [7], None]
    mask = grammar.all_allowed(slots, vocab)
    for row, ids in enumerate(allowed_ids):
        if ids is not None:
            mask[row] = 0
            for t in ids:
                mask[row, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    sp = SlotSampling.neutral(slots)
    sp = sp.replace(temperature=jnp.array([0.0, 1.0, 0.7, 1.0]), top_p=jnp.array([1, 0.9, 1, 1.0]))
    zeros = (jnp.zeros((slots, vocab), bool), jnp.zeros((slots, vocab), jnp.int32))
    free, _ = sample(logits, sp, jnp.zeros(slots, jnp.int32), *zeros)
    run = jax.jit(sample)
    for step in range(20):
        toks, _ = run(logits, sp, jnp.full(slots, step, jnp.int32), *zeros, jnp.asarray(mask))
        for row, ids in enumerate(allowed_ids[:3]):
            assert int(toks[row]) in ids
        assert int(toks[3]) == int(free[3]) or step > 0
    assert int(toks[0]) == max(allowed_ids[0], key=lambda t: float(logits[0, t]))


# ---- end to end on the demo model --------------------------------------------------------------
def _valid(spec: StructuredOutput, text: str) -> bool:
    if spec.kind in ("json", "json_object"):
        try:
            jsonschema.validate(json.loads(text), spec.schema)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    pattern = {"regex": REGEX, "grammar": GRAMMAR_RE}.get(spec.kind)
    if pattern is not None:
        return re.fullmatch(pattern, text) is not None
    return text in spec.choice


ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"enum": ["a1", "b2", "c3"]},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "paid": {"type": "boolean"},
    },
    "required": ["id", "items", "paid"],
    "additionalProperties": False,
}
SPECS = [
    StructuredOutput(json=PERSON),
    StructuredOutput(json=ORDER),
    StructuredOutput(regex=REGEX),
    StructuredOutput(choice=CHOICES),
    StructuredOutput(grammar=GRAMMAR),
]
PROMPTS = ["def fibonacci(n):\n    ", "import os\n", "The answer is ", "class Stack:\n", "# "]


ENGINE = dict(max_slots=4, max_num_batched_tokens=64, max_seq_len=512, num_pages=96)


@pytest.fixture(scope="module")
def llm():
    return LLM(DEMO, **ENGINE)


@pytest.fixture(scope="module")
def mixed_run(llm):
    """Constrained requests (greedy and seeded) interleaved with free ones, 4 slots."""
    requests = []
    for i in range(12):
        spec = SPECS[i % len(SPECS)]
        seeded = dict(temperature=0.9, seed=i) if i % 2 else dict(temperature=0.0)
        requests.append((PROMPTS[i % 5], SamplingParams(max_tokens=200, structured=spec, **seeded)))
        requests.append((PROMPTS[(i + 2) % 5], SamplingParams(max_tokens=12, temperature=0.0)))
    with count_compiles() as compiled:
        outs = llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
    return requests, outs, compiled


def test_constrained_outputs_are_valid(mixed_run):
    requests, outs, _ = mixed_run
    for (_, sp), out in zip(requests, outs):
        if sp.structured is not None:
            c = out.outputs[0]
            assert c.finish_reason == "stop", (sp.structured.kind, c.text)
            assert _valid(sp.structured, c.text), (sp.structured.kind, c.text)


def test_json_is_compact(mixed_run):
    requests, outs, _ = mixed_run
    texts = [o.outputs[0].text for (_, sp), o in zip(requests, outs) if sp.structured == SPECS[0]]
    assert texts and all(t == json.dumps(json.loads(t), separators=(",", ":")) for t in texts)


def test_free_neighbours_are_unchanged(llm, mixed_run):
    requests, outs, _ = mixed_run
    free = [(p, sp) for p, sp in requests if sp.structured is None]
    alone = llm.generate([p for p, _ in free], [sp for _, sp in free], use_tqdm=False)
    mixed = [o for (_, sp), o in zip(requests, outs) if sp.structured is None]
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]


def test_no_recompiles_and_lockstep_only_when_needed(llm, mixed_run):
    _, _, compiled = mixed_run
    assert compiled == []
    before = llm.engine.stats().constrained_steps
    llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert llm.engine.stats().constrained_steps == before  # free batches keep the overlap


def test_overlapped_steps_give_the_same_tokens(mixed_run):
    """``structured_overlap``: a constrained step's forward is dispatched before its bitmask
    is filled and sampled by a second program; same tokens as the one-program step, no
    compiles after warm-up, and the lockstep steps did take that path."""
    requests, outs, _ = mixed_run
    llm = LLM(DEMO, structured_overlap=True, **ENGINE)
    core, calls = llm.engine.core, []
    sample = core.sample
    core.sample = lambda *a: calls.append(1) or sample(*a)
    with count_compiles() as compiled:
        got = llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
    assert compiled == []
    assert calls and len(calls) == llm.engine.stats().constrained_steps
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in outs]


def test_seeded_constrained_output_is_deterministic(llm):
    sp = SamplingParams(max_tokens=120, temperature=1.0, seed=7, structured=SPECS[0])
    a, b = (llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0].outputs[0].text for _ in range(2))
    assert a == b and _valid(SPECS[0], a)


def test_engine_rejects_bad_specs_at_add_request(llm):
    bad = SamplingParams(structured=StructuredOutput(regex="(unclosed"))
    with pytest.raises(ValueError, match="structured.regex"):
        llm.engine.add_request("hi", bad)
    assert not llm.engine.has_unfinished_requests()


# ---- the host loop under preemption (MockCore) ----------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_requests_survive_preemption(mode):
    """A pool too small for every slot: constrained requests are preempted and resumed; the
    grammar state carries over, every output is valid, no page leaks."""
    vocab = 2048
    cfg = EngineConfig(block_q=4, page_size=4, num_pages=26, max_seq_len=96, max_slots=4,
                       preemption_mode=mode, debug_checks=True)  # fmt: skip
    model_cfg = types.SimpleNamespace(vocab_size=vocab, max_position_embeddings=1 << 20)
    tok = Tokenizer.from_dir(DEMO)
    engine = LLMEngine(model_cfg, None, cfg, tokenizer=tok, eos_token_ids=[2],
                       core=MockCore(cfg, vocab))  # fmt: skip
    specs = [StructuredOutput(regex=r"[a-z]{20,30}"), StructuredOutput(choice=CHOICES)]
    for i in range(10):
        sp = SamplingParams(max_tokens=60, temperature=0.0, structured=specs[i % 2])
        engine.add_request(list(range(3 + i, 3 + 30 + 2 * i)), sp, request_id=str(i))
    texts: dict[str, str] = {}
    reasons = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.outputs[0].text
            reasons[out.request_id] = out.outputs[0].finish_reason
    assert engine.stats().preemptions > 0
    for i in range(10):
        text = texts[str(i)]
        ok = re.fullmatch(r"[a-z]{20,30}", text) if i % 2 == 0 else text in CHOICES
        assert ok and reasons[str(i)] == "stop", (i, text)
    assert engine.stats().pages_used == 0
