"""MockCore: a hand-checkable stand-in for :class:`EngineCore`, in numpy.

It keeps the real engine's contract — slots, page tables, a paged pool written by scatter and
read back through page tables, the same decode rule and counters — but its "model" is a formula:
the next token is a hash of every token the sequence's page table leads to. So a scheduler or
allocator bug (a page shared by mistake, recycled too early, a wrong table entry, a lost
position) changes the output, while a correct engine reproduces :func:`expected_tokens` exactly.
Scheduler and server tests use it to run thousands of steps in seconds, without a model.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np

from jbatch.engine import buckets
from jbatch.engine.config import EngineConfig
from jbatch.engine.engine_core import StepResult
from jbatch.engine.state import decodes
from jbatch.engine.step_input import SpareInputs, StepInput, all_layouts
from jbatch.sampling_params import is_greedy


def next_token(tokens, seed: int, step: int, sampled: bool, vocab: int) -> int:
    """The mock model: deterministic in the sequence; seeded "sampling" mixes in (seed, step)."""
    h = 7
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % (2**61 - 1)
    if sampled:
        h = (h * 31 + int(seed) * 7919 + int(step) * 104_729) % (2**61 - 1)
    return int(3 + h % (vocab - 3))  # never 0..2 (pad, bos, eos)


def expected_tokens(prompt, max_tokens: int, seed: int, sampled: bool, vocab: int) -> list[int]:
    """What a request alone must produce: feed each token back, ``max_tokens`` times."""
    seq, out = list(prompt), []
    for step in range(max_tokens):
        out.append(next_token(seq, seed, step, sampled, vocab))
        seq.append(out[-1])
    return out


def _next_allowed(words: np.ndarray, token: int, vocab: int) -> int:
    """The first token at or after ``token`` (wrapping) whose bit is set in ``words``."""
    bits = ((words[:, None].astype(np.int64) >> np.arange(32)) & 1).reshape(-1)[:vocab]
    allowed = np.flatnonzero(np.roll(bits, -token))
    return int((token + allowed[0]) % vocab) if allowed.size else token


@dataclasses.dataclass
class MockState:
    pool: np.ndarray  # [P, S] token id written at each (page, offset); -1 = never written
    page_tables: np.ndarray  # [slots, max_pages]
    tokens: np.ndarray
    seq_lens: np.ndarray
    prefill_lens: np.ndarray
    active: np.ndarray
    num_generated: np.ndarray
    max_tokens: np.ndarray
    temperature: np.ndarray
    seed: np.ndarray


class MockCore:
    """Same methods as EngineCore (init_state / warmup / new_input / step / fetch / swaps); the
    step applies the packed input in the same order: release, insert, then the step."""

    def __init__(self, cfg: EngineConfig, vocab: int):
        self.cfg, self.vocab = cfg, vocab
        self.layouts = all_layouts(cfg)
        self._spare = SpareInputs()  # inputs of fetched steps

    def new_input(self, rows: int, decode_rows: int) -> StepInput:
        # Recycled like EngineCore's: an input goes back once its step's result is fetched.
        return self._spare.take(self.layouts[(rows, decode_rows)])

    def step(self, params, st: MockState, inp: StepInput, bitmask=None):
        release, ins, batch = inp.structured()
        packed = inp.layout.packed_rows  # a packed region computes only this many prompt rows
        if packed is not None and int((batch.prefill_positions >= 0).sum()) > packed:
            raise AssertionError(f"prompt tokens exceed the packed region's {packed} rows")
        st = self.insert(self.release(st, release), ins)
        if buckets.runs_blocks(self.cfg, *inp.layout.key):  # as decode_block.py
            st, out = self._block(st, batch, bitmask)
        else:
            st, out = self._step(st, batch, bitmask)
        out.input = inp
        return st, out

    def _block(self, st: MockState, batch, bitmask):
        """``decode_block.engine_block`` after the insert: the first step with the batch's
        prompt rows (an admission block), the rest decode-only, ending early on stop tokens."""
        n = int(np.clip(batch.decode_steps[0], 1, self.cfg.decode_steps))
        decode_only = types.SimpleNamespace(**vars(batch))
        decode_only.prefill_positions = np.full(0, -1)  # the later steps: no prompt rows
        steps, stopped, idle = [], np.zeros(self.cfg.max_slots, bool), 0
        while len(steps) < n and idle <= batch.block_idle_budget[0]:
            st, one = self._step(st, decode_only if steps else batch, bitmask)
            steps.append((one.tokens, one.sampled, one.logprobs))
            hit = (one.tokens[:, None] == batch.block_stop_tokens).any(axis=1)
            stopped |= hit & one.sampled & self._decodes(st)
            idle += int(stopped.sum())
        steps += [tuple(np.zeros_like(f) for f in steps[0])] * (n - len(steps))
        out = types.SimpleNamespace(**dict(zip(("tokens", "sampled", "logprobs"), steps[0])))
        out.block = tuple(np.stack(field) for field in zip(*steps)) if n > 1 else None
        return st, out

    def fetch(self, out) -> StepResult:
        inp = getattr(out, "input", None)
        if inp is not None:
            self._spare.put(inp)
            out.input = None
        return StepResult(out.tokens, out.sampled, out.logprobs, block=getattr(out, "block", None))

    def init_state(self) -> MockState:
        s, c = self.cfg.max_slots, self.cfg
        z = lambda: np.zeros(s, np.int64)
        return MockState(
            pool=np.full((c.num_pages, c.page_size), -1, np.int64),
            page_tables=np.full((s, c.max_pages_per_seq), c.num_pages, np.int64),
            tokens=z(),
            seq_lens=z(),
            prefill_lens=z(),
            active=np.zeros(s, bool),
            num_generated=z(),
            max_tokens=z(),
            temperature=np.zeros(s),
            seed=z(),
        )

    def warmup(self, params, state: MockState) -> MockState:
        return state

    def insert(self, st: MockState, ins) -> MockState:
        m = np.asarray(ins.mask)
        st.page_tables[m] = np.asarray(ins.page_tables)[m]
        st.seq_lens[m] = np.asarray(ins.seq_lens)[m]
        st.prefill_lens[m] = np.asarray(ins.prefill_lens)[m]
        st.num_generated[m] = np.asarray(ins.num_generated)[m]
        st.max_tokens[m] = np.asarray(ins.max_tokens)[m]
        st.temperature[m] = np.asarray(ins.sampling.temperature)[m]
        st.seed[m] = np.asarray(ins.sampling.seed)[m]
        st.tokens[m] = 0
        st.active |= m
        return st

    def release(self, st: MockState, mask) -> MockState:
        st.active &= ~np.asarray(mask)
        return st

    def _write(self, st: MockState, slot: int, pos: int, token: int) -> None:
        page = st.page_tables[slot, pos // self.cfg.page_size]
        assert page < self.cfg.num_pages, f"slot {slot} writes position {pos} without a page"
        st.pool[page, pos % self.cfg.page_size] = token

    def _read(self, st: MockState, slot: int, length: int) -> list[int]:
        pos = np.arange(length)
        pages = st.page_tables[slot, pos // self.cfg.page_size]
        assert (pages < self.cfg.num_pages).all(), f"slot {slot} reads an unassigned page"
        tokens = st.pool[pages, pos % self.cfg.page_size]
        assert (tokens >= 0).all(), f"slot {slot} reads a position never written"
        return tokens.tolist()

    def _decodes(self, st: MockState) -> np.ndarray:
        """The decode rule (``state.decodes``) on the mock's arrays: slots that may decode."""
        max_len = st.page_tables.shape[1] * self.cfg.page_size
        return decodes(
            st.active, st.seq_lens, st.prefill_lens, st.num_generated, st.max_tokens, max_len
        )

    def _step(self, st: MockState, b, bitmask=None):
        s = self.cfg.max_slots
        for slot, idx, page in zip(b.write_slots, b.write_index, b.write_pages):
            if slot < s:
                st.page_tables[slot, idx] = page
        decode = self._decodes(st)
        listed = np.zeros(s + 1, bool)
        listed[np.asarray(b.decode_slots)] = True  # padding entries hit index s
        decode &= listed[:s]
        for slot in np.flatnonzero(decode):
            self._write(st, slot, st.seq_lens[slot], st.tokens[slot])
        sampled = decode.copy()
        for tok, slot, pos in zip(b.prefill_tokens, b.prefill_slots, b.prefill_positions):
            if pos >= 0:
                self._write(st, slot, pos, tok)
                st.seq_lens[slot] = max(st.seq_lens[slot], pos + 1)
                sampled[slot] |= pos == st.prefill_lens[slot] - 1
        st.seq_lens[decode] += 1
        new = np.zeros(s, np.int64)
        for slot in np.flatnonzero(sampled):
            seq = self._read(st, slot, st.seq_lens[slot])
            sampled_token = not is_greedy(st.temperature[slot])
            new[slot] = next_token(
                seq, st.seed[slot], st.num_generated[slot], sampled_token, self.vocab
            )
            if bitmask is not None:  # structured output: the next allowed token, cyclically
                new[slot] = _next_allowed(bitmask[slot], new[slot], self.vocab)
        st.tokens = np.where(sampled, new, st.tokens)
        st.num_generated += sampled
        out = types.SimpleNamespace(tokens=new, sampled=sampled, logprobs=np.zeros(s))
        return st, out

    def unused_pages(self) -> np.ndarray:
        return np.full(self.cfg.max_pages_per_seq, self.cfg.num_pages, np.int64)

    def to_host(self, saved):
        return saved  # numpy: already in host memory

    to_device = to_host

    def swap_out(self, st: MockState, slot, pages, n=None):
        idx = np.clip(pages if n is None else pages[:n], 0, self.cfg.num_pages - 1)
        fields = (
            "tokens",
            "seq_lens",
            "prefill_lens",
            "num_generated",
            "max_tokens",
            "temperature",
            "seed",
        )
        saved = {"pool": st.pool[idx].copy(), **{f: getattr(st, f)[slot].copy() for f in fields}}
        st.active[slot] = False
        return st, saved

    def swap_in(self, st: MockState, slot, pages, saved, shared: int = 0):
        cut = pages[: len(saved["pool"])]  # a handover's copy holds fewer pages
        real = cut < self.cfg.num_pages
        real[:shared] = False  # prefix-cache hits: shared, not written
        st.pool[cut[real]] = saved["pool"][real]
        st.page_tables[slot] = pages
        for f, v in saved.items():
            if f != "pool":
                getattr(st, f)[slot] = v
        st.active[slot] = True
        return st
