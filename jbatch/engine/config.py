"""EngineConfig: every static size of the engine, validated once, never traced."""

from __future__ import annotations

import dataclasses

import jax

from jbatch.engine.sizing import parse_memory
from jbatch.engine.tenants import check_weights
from jbatch.models.quant import WeightQuant
from pallas_kernels import IMPLEMENTATIONS, resolve_impl
from pallas_kernels.kv_quant import KV_STORAGE_DTYPES, storage_dtype

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", *KV_STORAGE_DTYPES)  # "auto": the model dtype
PREEMPTION_MODES = ("recompute", "swap", "auto")
SCHEDULING_POLICIES = ("priority", "fcfs", "fair")
ROLES = ("mixed", "prefill", "decode")
SPECULATIVE_METHODS = (None, "ngram", "draft")
# Speculative steps per dispatch unless ``decode_steps`` is given (``spec_block.py``).
SPECULATIVE_DECODE_STEPS = 4


def default_dtype() -> str:
    """The model dtype when none is given: bfloat16 on accelerators, float32 on CPU."""
    return "bfloat16" if jax.default_backend() in ("gpu", "tpu") else "float32"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine sizes. Each field maps onto a CLI flag of the same name (``--max-slots``...).

    max_slots: sequences decoded together (rows of every slot array).
    page_size / num_pages: the paged KV pool (tokens per page, pages in the pool; None: from
        ``kv_cache_memory``, else 512).
    max_num_batched_tokens: token budget of one step (decode tokens + prompt-chunk tokens).
    max_seq_len: longest sequence (prompt + output) a slot may hold (None: the model's
        ``max_position_embeddings``, capped by the pool).
    dtype: weights and activations (None: "bfloat16" on GPU/TPU, "float32" on CPU, where tests
        compare with HF); logits and sampling math are float32 either way.
    block_q: prompt chunks are laid out in blocks of this many query rows (one sequence a block).
    attn_impl: paged attention implementation: "auto" (the Pallas kernel on GPU, JAX's TPU
        ragged kernel on TPU for float pools, the native kernel on CPU when it builds, XLA
        elsewhere), "xla", "reference", "pallas", "pallas_interpret" (the kernel in Pallas
        interpret mode: CPU tests), "tpu" (JAX's TPU kernel; the pool is stored in its layout,
        see ``pallas_kernels.tpu_layout``) or "cpu" (``pallas_kernels.cpu_attention``: a C++
        kernel built on first use; decode and speculative rows, and prompt blocks whose rows
        see at most ``cpu_attention.MAX_PROMPT_KEYS`` keys; longer prompt contexts use XLA).
    kv_cache_dtype: what the KV pool stores: "auto" (the model dtype), "int8" or "fp8_e4m3"
        (8-bit entries plus one bfloat16 scale per token and KV head: ~1.9x the tokens of a
        bfloat16 pool in the same bytes; see ``pallas_kernels.kv_quant``).
    kv_cache_memory: the pool's size as memory instead of ``num_pages``, per device: an amount
        ("2GiB", "512MB", bytes) or a fraction of the device's free memory ("0.8"; accelerators).
    enable_prefix_caching: reuse full KV pages of identical prompt prefixes across requests.
    aging_steps: a waiting request's priority improves by one every this many steps (0 = no
        aging: strict priority, FCFS within a priority).
    preemption_mode: what happens to a sequence evicted when pages run out: "recompute" (free
        its pages, prefill again later, mostly from the prefix cache), "swap" (copy its pages
        to host RAM and back), or "auto" (swap when recomputing would take more than one full
        step's token budget).
    scheduling_policy: who is admitted and who is evicted (``jbatch/engine/policies.py``):
        "priority" (priority with aging, FCFS within a priority), "fcfs" (arrival order only) or
        "fair" (fair share between tenants: virtual token counters, priority bands first).
    tenant_weights: (tenant, weight) pairs (a dict is accepted): a tenant's share under
        "fair" is proportional to its weight (default 1). CLI: ``--tenant-weights FILE`` (JSON).
    prefill_pacing: pace the chunks of a long prompt (past its first ``max_num_batched_tokens``
        tokens) while other requests decode, so they keep their step time: the paced chunks
        take at most this share of the decoders' own time, measured (``prefill_pacer.py``;
        e.g. 0.8: decoders' time per output token within ~1.8x). None: off (a running prompt's
        chunk takes whatever budget the decodes leave).
    debug_checks: verify the scheduler's page and slot invariants after every step (slow).
    structured_overlap: also compile each step as a forward program and a sampling program, so
        a step with structured-output requests is dispatched before its token bitmask is ready
        and the device runs the forward while the host fills the mask (one device program per
        bucket pair more to compile; one device: not with tp/dp).
    quantization: weight-only quantization of every linear layer, done at load time: None (the
        checkpoint's weights in ``dtype``) or "int8" (per-output-channel symmetric scales).
    quantize_lm_head: with ``quantization``, also quantize the LM head (the embedding too when
        the two are tied).
    speculative: speculative decoding (``engine/spec_step.py``): None (off) or "ngram" (prompt
        lookup: propose the tokens that followed the latest earlier occurrence of the
        context's last ``ngram_max``..``ngram_min`` tokens; ``engine/ngram_device.py``).
        Verification is exact: greedy output is unchanged, sampled output keeps its
        distribution. One device (tp = dp = 1). "draft": a small draft model
        (``speculative_model``) proposes on the device (``engine/draft_proposer.py``).
    speculative_model: the draft model's checkpoint folder (same tokenizer and vocabulary as
        the target); giving it alone sets ``speculative="draft"``.
    num_speculative_tokens: proposals verified per slot and step (K: K + 1 rows per slot).
    speculative_max_batch: speculate only while at most this many requests decode (above it
        a step costs more rows than speculation saves); also the largest group bucket.
    ngram_min / ngram_max: the n-gram lengths the proposer tries, longest first. ``ngram_min``
        1 (vLLM's prompt-lookup default too): a lone matching token still proposes — the K + 1
        rows run whether or not a group proposes, so a guess costs nothing when it is wrong.
    decode_steps: decode steps one dispatch may run (``decode_block.py``; vLLM V0's
        ``num_scheduler_steps``): when every running request is past its prompt and none needs
        the host between tokens (a grammar, top logprobs), and no waiting request could take a
        free slot, the scheduler plans a block of up to this many decode steps, run in one
        program (``lax.while_loop``) — the launch and the planning are paid once per block.
        While requests queue, a block runs on past a request's end only while the slot rows
        left idle stay within ``multi_step_planning.BLOCK_IDLE_STEPS`` steps' worth (the
        device ends it early when requests that sampled a stop token would idle past that);
        without a queue, until the requests still decoding fit a smaller decode bucket. The
        cost: a request that stops early (EOS, stop string) idles its slot until its block
        ends (while requests queue, such a block lands before the next is planned), and text
        streams a block at a time. With speculative decoding: up to
        this many speculative steps per dispatch (``spec_block.py``; the n-gram stream
        grows on the device between them).
        1: off (one step per dispatch). None (the default): ``SPECULATIVE_DECODE_STEPS`` with
        speculative decoding (at batch 1 a speculative step's host work is about half its
        device work on a CPU: ``docs/benchmarks.md``), else 1.
    tp: tensor parallelism — devices one engine replica's model and KV pool are split over.
    dp: data parallelism — engine replicas (each on its own ``tp`` devices) behind one router.
    role: what the engine runs (``docs/scaling.md``, disaggregation): "mixed" (prompts and
        decodes), "prefill" (prompt chunks only: no decode rows are compiled; a request whose
        prompt is done is handed over to a decode engine) or "decode" (decode-only programs;
        takes handed-over requests only and preempts by swapping).
    """

    max_slots: int = 8
    page_size: int = 16
    num_pages: int | None = None
    max_num_batched_tokens: int = 256
    max_seq_len: int | None = None
    dtype: str | None = None
    block_q: int = 16
    attn_impl: str = "auto"
    kv_cache_dtype: str = "auto"
    kv_cache_memory: str | None = None
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    aging_steps: int = 64
    preemption_mode: str = "recompute"
    scheduling_policy: str = "priority"
    tenant_weights: tuple[tuple[str, float], ...] = ()
    prefill_pacing: float | None = None
    debug_checks: bool = False
    structured_overlap: bool = False
    quantization: str | None = None
    quantize_lm_head: bool = False
    speculative: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int = 4
    speculative_max_batch: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    decode_steps: int | None = None
    tp: int = 1
    dp: int = 1
    role: str = "mixed"

    def __post_init__(self):
        if self.decode_steps is None:
            speculates = self.speculative is not None or self.speculative_model is not None
            object.__setattr__(self, "decode_steps", SPECULATIVE_DECODE_STEPS if speculates else 1)
        for name in (
            "max_slots",
            "page_size",
            "num_pages",
            "max_num_batched_tokens",
            "max_seq_len",
            "block_q",
            "num_speculative_tokens",
            "speculative_max_batch",
            "ngram_min",
            "ngram_max",
            "decode_steps",
            "tp",
            "dp",
        ):
            value = getattr(self, name)
            if value is None and name in ("num_pages", "max_seq_len"):
                continue  # resolved from the model / the memory budget (engine/sizing.py)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.aging_steps, int) or self.aging_steps < 0:
            raise ValueError(f"aging_steps must be an int >= 0, got {self.aging_steps!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.role == "prefill" and self.decode_steps > 1:
            raise ValueError(
                f"decode_steps={self.decode_steps} with role='prefill': a prefill engine never "
                f"decodes (set it on the decode engine)"
            )
        if self.role == "prefill" and self.speculative is not None:
            raise ValueError(
                f"speculative={self.speculative!r} with role='prefill': a prefill engine never "
                f"decodes (speculate on the decode engine)"
            )
        object.__setattr__(self, "tenant_weights", check_weights(self.tenant_weights))
        pacing = self.prefill_pacing
        if pacing is not None and (
            isinstance(pacing, bool) or not isinstance(pacing, int | float) or not pacing > 0
        ):
            raise ValueError(f"prefill_pacing must be a number > 0 or None, got {pacing!r}")
        self._check_speculative()
        if self.dtype is None:
            object.__setattr__(self, "dtype", default_dtype())
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        self.weight_quant  # noqa: B018 (validates quantization and quantize_lm_head)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.attn_impl not in IMPLEMENTATIONS:
            raise ValueError(f"attn_impl must be one of {IMPLEMENTATIONS}, got {self.attn_impl!r}")
        if self.attn_impl == "tpu" and (self.kv_cache_dtype != "auto" or self.tp > 1):
            raise ValueError(
                f"attn_impl='tpu' needs kv_cache_dtype='auto' and tp=1 (got "
                f"{self.kv_cache_dtype!r}, tp={self.tp}): JAX's TPU kernel takes only static "
                f"KV scales, and its pool layout is not sharded; use attn_impl='auto'"
            )
        if self.role != "prefill" and self.max_num_batched_tokens < self.max_slots:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_slots={self.max_slots}: each decoding slot takes a token of a step's "
                f"budget, and a step with no budget left admits nobody, so slots would stay idle"
            )
        if self.max_num_batched_tokens < self.block_q:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"block_q={self.block_q} so a prompt chunk fits in a step"
            )
        if self.kv_cache_memory is not None:
            if self.num_pages is not None:
                raise ValueError(
                    f"give num_pages={self.num_pages} or kv_cache_memory="
                    f"{self.kv_cache_memory!r}, not both"
                )
            parse_memory(self.kv_cache_memory)
        if self.is_resolved and self.num_pages * self.page_size < self.max_seq_len:
            raise ValueError(
                f"the KV pool (num_pages={self.num_pages} x page_size={self.page_size} tokens) "
                f"cannot hold one sequence of max_seq_len={self.max_seq_len}"
            )

    def _check_speculative(self) -> None:
        if self.speculative_model is not None and self.speculative is None:
            object.__setattr__(self, "speculative", "draft")
        if (self.speculative == "draft") != (self.speculative_model is not None):
            raise ValueError(
                f"speculative='draft' needs speculative_model and speculative_model needs it "
                f"(got speculative={self.speculative!r}, "
                f"speculative_model={self.speculative_model!r})"
            )
        if self.speculative == "draft" and self.role != "mixed":
            raise ValueError(
                f"speculative='draft' with role={self.role!r}: the draft's pool needs the draft "
                f"run over every prompt, which disaggregated prefill does not do (use "
                f"speculative='ngram' on the decode engine)"
            )
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}"
            )
        if self.speculative is None:
            return
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min={self.ngram_min} exceeds ngram_max={self.ngram_max}")
        if self.speculative_max_batch > self.max_slots:
            raise ValueError(
                f"speculative_max_batch={self.speculative_max_batch} exceeds "
                f"max_slots={self.max_slots}"
            )
        if self.speculative is not None and (self.tp > 1 or self.dp > 1):
            raise ValueError(
                f"speculative={self.speculative!r} runs on one device (got tp={self.tp}, "
                f"dp={self.dp})"
            )

    def __hash__(self) -> int:
        # Computed once: the bucket functions' caches (``buckets.py``) hash the config several
        # times a step, ~1 us each over its ~40 fields. Equal configs hash equal (the fields
        # ``__eq__`` compares); a pickled copy recomputes it (``__getstate__``).
        cached = self.__dict__.get("_hash")
        if cached is None:
            fields = dataclasses.fields(self)
            cached = hash(tuple(getattr(self, f.name) for f in fields if f.compare))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def weight_quant(self) -> WeightQuant | None:
        """How weights are quantized at load time (None: not at all)."""
        if self.quantization is None:
            if self.quantize_lm_head:
                raise ValueError("quantize_lm_head=True needs quantization (e.g. 'int8')")
            return None
        return WeightQuant(self.quantization, self.quantize_lm_head)

    @property
    def swaps(self) -> bool:
        """Whether the swap programs are compiled: swap preemption, or a handover (any role but
        "mixed": a prefill engine swaps a finished prompt out, a decode engine swaps it in)."""
        return self.preemption_mode != "recompute" or self.role != "mixed"

    @property
    def kv_storage_dtype(self):
        """The KV pool's dtype (int8 / float8_e4m3fn for an 8-bit pool)."""
        return storage_dtype(self.kv_cache_dtype, self.dtype)

    @property
    def tpu_kv_layout(self) -> bool:
        """Whether the KV pool is stored in the TPU kernel's layout (attention resolves to it)."""
        if self.tp > 1 or self.kv_cache_dtype != "auto":
            return False
        return resolve_impl(self.attn_impl) == "tpu"

    @property
    def is_resolved(self) -> bool:
        """Whether every size is concrete (see :func:`jbatch.engine.sizing.resolve`)."""
        return self.num_pages is not None and self.max_seq_len is not None

    @property
    def max_pages_per_seq(self) -> int:
        if self.max_seq_len is None:
            raise ValueError("max_seq_len is not resolved yet (jbatch.engine.sizing.resolve)")
        return -(-self.max_seq_len // self.page_size)
