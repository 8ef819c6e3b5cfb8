"""Engine snapshot / restore: 16 in-flight requests (greedy, seeded, structured, a shared
prefix) snapshotted mid-generation with requests swapped out and queued; a new engine restores
them and finishes with the outputs of an uninterrupted run, pages and slots consistent."""

from __future__ import annotations

import re

import pytest

from jbatch import LLM, LLMEngine, SamplingParams
from jbatch.demo import demo_model_path
from jbatch.outputs import OutputKind
from jbatch.structured_output import StructuredOutput

DEMO = demo_model_path()
# A pool too small for 8 slots of these requests: swap preemption happens mid-run.
ENGINE = dict(max_slots=8, max_num_batched_tokens=64, max_seq_len=256, num_pages=26,
              preemption_mode="swap", debug_checks=True)  # fmt: skip
SYSTEM = "# Utilities for parsing configuration files.\nimport os\nimport re\n\n"
REGEX = r"[a-z_]{4,12}\([a-z, ]{0,20}\)"


def workload() -> list[tuple[str, SamplingParams]]:
    work = []
    for i in range(16):
        prompt = SYSTEM + f"def helper_{i}(path):\n    " if i % 3 else f"class Thing{i}:\n"
        if i % 4 == 0:
            sp = SamplingParams(temperature=0.0, max_tokens=40 + i, ignore_eos=True)
        elif i % 4 == 1:
            sp = SamplingParams(temperature=0.9, seed=i, max_tokens=48, ignore_eos=True)
        elif i % 4 == 2:
            sp = SamplingParams(temperature=0.7, seed=100 + i, max_tokens=60,
                                structured=StructuredOutput(regex=REGEX))  # fmt: skip
        else:
            sp = SamplingParams(temperature=0.0, max_tokens=36, top_k=5)
        work.append((prompt, sp))
    return work


def collect(outs, into: dict[str, list[int]]) -> None:
    for out in outs:
        into.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)


def run(engine, into: dict[str, list[int]], steps: int | None = None) -> None:
    n = 0
    while engine.has_unfinished_requests() and (steps is None or n < steps):
        collect(engine.step(), into)
        n += 1


@pytest.fixture(scope="module")
def engines():
    """The engine, and a second one over the same compiled programs (a restart without the
    compile; the programs are pure functions of the state)."""
    first = LLM(DEMO, **ENGINE).engine
    second = LLMEngine(first.model_cfg, first.params, first.cfg, first.tokenizer, first.eos_ids,
                       warmup=False, core=first.core)  # fmt: skip
    return first, second


def test_restored_engine_finishes_like_an_uninterrupted_run(engines, tmp_path):
    first, second = engines
    expected: dict[str, list[int]] = {}
    for i, (prompt, sp) in enumerate(workload()):
        first.add_request(prompt, sp, request_id=f"r{i}", output_kind=OutputKind.DELTA)
    run(first, expected)
    assert first.stats().swap_outs > 0  # the pool is tight enough to swap

    first.forget_finished()
    got: dict[str, list[int]] = {}
    for i, (prompt, sp) in enumerate(workload()):
        first.add_request(prompt, sp, request_id=f"r{i}b", output_kind=OutputKind.DELTA)
    swapped = lambda: [r for r in first.requests.values() if r.swapped is not None]
    for _ in range(200):  # run until a request sits swapped out in host RAM
        collect(first.step(), got)
        if swapped() and first.scheduler.running:
            break
    assert swapped() and first.scheduler.running and first.scheduler.waiting
    collect(first.snapshot(tmp_path / "snap"), got)
    first.reset()  # the old engine is gone (an upgrade, a node drain)

    second.restore(tmp_path / "snap")
    second.scheduler.check_invariants()
    assert set(second.requests) == {f"r{i}b" for i in range(16)}
    run(second, got)
    for i in range(16):
        assert got[f"r{i}b"] == expected[f"r{i}"], i
    texts = {rid: second.requests[rid] for rid in second.requests}
    for i, (_, sp) in enumerate(workload()):
        if sp.structured is not None:
            text = "".join(texts[f"r{i}b"].text_chunks) or second.tokenizer.decode(got[f"r{i}b"])
            assert re.fullmatch(REGEX, text), text
    stats = second.stats()
    assert stats.pages_used == 0 and stats.running == 0 and stats.waiting == 0


def test_restore_refuses_a_different_engine(engines, tmp_path):
    first, _ = engines
    first.snapshot(tmp_path / "s")
    other = LLM(DEMO, **{**ENGINE, "max_slots": 4}, warmup=False).engine
    with pytest.raises(ValueError, match="different"):
        other.restore(tmp_path / "s")
    with pytest.raises(ValueError, match="already exists"):
        first.snapshot(tmp_path / "s")
    with pytest.raises(ValueError, match="no engine snapshot"):
        first.restore(tmp_path)
