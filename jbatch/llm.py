"""LLM: the offline batch API (vLLM's names), over an :class:`LLMEngine`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from pathlib import Path

from tqdm.auto import tqdm

from jbatch import compile_cache
from jbatch.checkpoint import load_generation_config
from jbatch.converted import engine_config, load_weights
from jbatch.engine.config import EngineConfig
from jbatch.engine.interface import StepFailed
from jbatch.engine.llm_engine import LLMEngine
from jbatch.engine.sizing import resolve
from jbatch.models.config import ModelConfig
from jbatch.models.quant import check_checkpoint
from jbatch.outputs import OutputKind, RequestOutput
from jbatch.sampling_params import SamplingParams
from jbatch.tokenizer import Tokenizer
from pallas_kernels.kv_quant import check_backend

Prompt = str | Seq[int]
log = logging.getLogger(__name__)


class LLM:
    """Load a local Hugging Face checkpoint folder (or one written by ``jbatch convert``) and
    generate with continuous batching.

    ``LLM(model_dir, max_slots=8, page_size=16, num_pages=512, max_num_batched_tokens=256,
    dtype="float32")``; any :class:`EngineConfig` field is a keyword. ``max_seq_len`` defaults
    to the model's ``max_position_embeddings`` (capped by the pool); ``kv_cache_memory="2GiB"``
    sizes the pool by memory instead of ``num_pages``.
    ``tp``/``dp`` > 1 shard the model over ``tp`` devices per replica and run ``dp`` replicas
    (``self.engine`` is then a :class:`jbatch.parallel.ReplicaRouter` when ``dp > 1``).
    """

    def __init__(self, model: str | Path, *, warmup: bool = True, **engine_kwargs):
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_kwargs) - fields)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; valid: {sorted(fields)}")
        self.config = EngineConfig(**engine_kwargs)
        compile_cache.from_env()  # opt-in for the library (JBATCH_COMPILATION_CACHE)
        check_backend(self.config.kv_cache_dtype)  # before any weights load
        if not Path(model).is_dir():
            raise FileNotFoundError(f"{model}: model directory not found")
        model_cfg = ModelConfig.from_file(Path(model) / "config.json")
        self.config = engine_config(model, self.config)  # a converted checkpoint's quantization
        check_checkpoint(
            Path(model) / "config.json", self.config.weight_quant, model_cfg.num_experts
        )
        self.config = resolve(self.config, model_cfg)  # sizes left open: from the model
        gen = load_generation_config(model)
        tokenizer = Tokenizer.from_dir(model)
        eos = set(gen.eos_token_ids) | set(model_cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        if self.config.tp * self.config.dp > 1:
            from jbatch.parallel.engines import build_engine

            self.engine = build_engine(
                model_cfg, self.config, model_dir=model, tokenizer=tokenizer,
                eos_token_ids=sorted(eos), warmup=warmup,
            )  # fmt: skip
            return
        params = load_weights(model, model_cfg, self.config)  # HF folder or `jbatch convert`
        self.engine = LLMEngine(model_cfg, params, self.config, tokenizer, sorted(eos), warmup)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results in input order. With ``n > 1`` a prompt's
        ``outputs`` holds n completions, run by the engine as n sequences sharing the prompt's
        pages (completion ``i`` samples with seed ``seed + i`` when a seed is given).

        If an engine step fails, the engine rebuilds its device state and carries on: the
        requests that were on the device finish with ``finish_reason == "error"`` (and
        ``RequestOutput.error`` says why), the others are unaffected."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        # Validate everything before scheduling anything.
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p, output_kind=OutputKind.FINAL))
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
                self.engine.forget(rid)
            self._run_until_done(lambda out: None)
            raise
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req")
        finals: dict[str, RequestOutput] = {}

        def on_output(out: RequestOutput):
            if out.finished:
                finals[out.request_id] = out
                self.engine.forget(out.request_id)
                bar.update(1)

        self._run_until_done(on_output)
        bar.close()
        return [finals[rid] for rid in ids]

    def generate_stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield a RequestOutput each step the request gets tokens: ``outputs[0]`` (also
        ``delta_text`` / ``delta_token_ids``) holds what that step added."""
        rid = self.engine.add_request(prompt, sampling_params)
        try:
            while True:
                for out in self._step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)
            self.engine.forget(rid)

    def _step(self) -> list[RequestOutput]:
        """One engine step; after a failed one (the engine has recovered) the outputs of the
        other replicas and an "error" output for each request that failed."""
        try:
            return self.engine.step()
        except StepFailed as e:
            log.error("%s; %d request(s) failed with it", e, len(e.failed))
            return e.outputs

    def _run_until_done(self, on_output) -> None:
        while self.engine.has_unfinished_requests():
            for out in self._step():
                on_output(out)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # a single prompt of token ids
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
