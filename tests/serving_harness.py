"""What the hardening tests share: one engine for the session (the real ``LLMEngine`` over the
hand-checkable ``MockCore``, with a real tokenizer: seconds to build, exact expected tokens),
servers over it one at a time, reference outputs, and the drain check.

Import the fixture into a test module with ``from tests.serving_harness import hardened_llm``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import types
from collections.abc import Iterator

import numpy as np
import pytest

from jbatch import SamplingParams
from jbatch.engine.config import EngineConfig
from jbatch.engine.llm_engine import LLMEngine
from jbatch.engine.mock_core import MockCore, expected_tokens
from jbatch.tiny_model import write_tokenizer
from jbatch.tokenizer import Tokenizer
from serving.server import BackgroundServer, ServeConfig

VOCAB = 512
ENGINE = dict(
    max_slots=8, page_size=8, num_pages=160, max_num_batched_tokens=64, max_seq_len=256, block_q=4
)
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
CORPUS = "the quick brown fox jumps over the lazy dog; pages of keys and values " * 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
N_WORK = 48


@dataclasses.dataclass
class Hardened:
    engine: LLMEngine
    work: list[tuple[list[int], SamplingParams, list[int]]]  # prompt, params, reference ids

    def expected(self, prompt: list[int], max_tokens: int) -> list[int]:
        """What a greedy request alone produces (``MockCore``'s formula)."""
        return expected_tokens(prompt, max_tokens, 0, False, VOCAB)


@pytest.fixture(scope="session")
def hardened_llm(tmp_path_factory) -> Hardened:
    path = tmp_path_factory.mktemp("hardened_tokenizer")
    write_tokenizer(path, VOCAB, [CORPUS])
    tokenizer = Tokenizer.from_dir(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    cfg = EngineConfig(**ENGINE)
    model_cfg = types.SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=4096)
    engine = LLMEngine(model_cfg, None, cfg, tokenizer=tokenizer, core=MockCore(cfg, VOCAB))
    rng = np.random.RandomState(1)
    h = Hardened(engine, [])
    for _ in range(N_WORK):
        prompt = rng.randint(3, VOCAB, size=int(rng.randint(2, 12))).tolist()
        params = GREEDY.replace(max_tokens=int(rng.randint(3, 9)))
        h.work.append((prompt, params, h.expected(prompt, params.max_tokens)))
    return h


@dataclasses.dataclass
class Running:
    server: object
    grpc_target: str
    http: str

    @property
    def thread(self):
        return self.server.engine_thread

    @property
    def metrics(self):
        return self.server.ctx.metrics


@contextlib.contextmanager
def running_server(h: Hardened, **config) -> Iterator[Running]:
    """A server over the session engine (only one at a time: the engine has one owner)."""
    tls = config.get("tls_cert") is not None
    cfg = ServeConfig(grpc_port=0, http_port=0, model_name="tiny", **config)
    bg = BackgroundServer(h.engine, cfg).start()
    server = bg.server
    scheme = "https" if tls else "http"
    try:
        yield Running(
            server, f"127.0.0.1:{server.grpc_port}", f"{scheme}://127.0.0.1:{server.http_port}"
        )
    finally:
        bg.stop()


def assert_drained(running: Running, timeout: float = 10.0) -> None:
    """No request left, every page and slot back (checked on the engine thread)."""
    thread = running.thread
    deadline = time.monotonic() + timeout
    while thread.num_outstanding and time.monotonic() < deadline:
        time.sleep(0.02)
    assert thread.num_outstanding == 0, "requests still outstanding"

    def snapshot(engine):
        sched = engine.scheduler
        sched.check_invariants()
        return dict(
            free_pages=sched.allocator.num_free,
            free_slots=len(sched.free_slots),
            requests=len(engine.requests),
            unfinished=engine.has_unfinished_requests(),
        )

    snap = thread.call(snapshot).result(10)
    expected = dict(
        free_pages=ENGINE["num_pages"], free_slots=ENGINE["max_slots"], requests=0, unfinished=False
    )
    assert snap == expected, snap


@contextlib.contextmanager
def slow_steps(thread, seconds: float = 0.01) -> Iterator[None]:
    """Each engine step takes at least ``seconds``."""

    def slow(engine):
        core = engine.core

        def step(*args):
            time.sleep(seconds)
            return type(core).step(core, *args)

        core.step = step

    thread.call(slow).result(10)
    try:
        yield
    finally:
        thread.call(lambda engine: vars(engine.core).pop("step", None)).result(10)
