"""Sizes taken from the model and a memory budget (engine/sizing.py)."""

from __future__ import annotations

import logging

import pytest

from jbatch import LLM
from jbatch.engine.config import EngineConfig
from jbatch.engine.sizing import page_bytes, parse_memory, resolve
from jbatch.models.config import ModelConfig

MODEL = ModelConfig.from_hf_dict(
    dict(
        architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024,
    )
)  # fmt: skip


def test_max_seq_len_defaults_to_the_model_capped_by_the_pool():
    assert resolve(EngineConfig(), MODEL).max_seq_len == 1024  # 512 pages x 16 tokens hold it
    small = resolve(EngineConfig(num_pages=10, page_size=16), MODEL)
    assert (small.num_pages, small.max_seq_len) == (10, 160)
    assert resolve(small, MODEL) is small  # resolving a concrete config changes nothing
    with pytest.raises(ValueError, match="max_seq_len=2048 exceeds the model's .*=1024"):
        resolve(EngineConfig(max_seq_len=2048), MODEL)
    with pytest.raises(ValueError, match="cannot hold one sequence of max_seq_len=512"):
        EngineConfig(num_pages=4, page_size=16, max_seq_len=512)


@pytest.mark.parametrize(
    "text,expected",
    [("2GiB", (2 * 2**30, None)), ("512MB", (512 * 10**6, None)), ("4096", (4096, None)),
     ("0.8", (None, 0.8)), (" 1.5 kib", (1536, None))],
)  # fmt: skip
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["lots", "2 parsecs", "1.5", "0", "-1GiB", ""])
def test_bad_memory_is_named(text):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory=text)


def test_budget_sizes_the_pool_by_what_a_page_really_costs():
    per_page = page_bytes(MODEL, 16, "float32")
    assert per_page == 2 * 2 * 16 * 2 * 16 * 4  # K+V x layers x tokens x KV heads x dim x 4 B
    cfg = resolve(EngineConfig(kv_cache_memory="1MiB"), MODEL)
    assert cfg.num_pages == 2**20 // per_page and cfg.max_seq_len == min(1024, cfg.num_pages * 16)
    int8 = resolve(EngineConfig(kv_cache_memory="1MiB", kv_cache_dtype="int8"), MODEL)
    bf16 = resolve(EngineConfig(kv_cache_memory="1MiB", dtype="bfloat16"), MODEL)
    assert int8.num_pages > 1.75 * bf16.num_pages  # the 8-bit pool's scales are counted
    tp2 = resolve(EngineConfig(kv_cache_memory="1MiB", tp=2), MODEL)
    assert tp2.num_pages == 2 * cfg.num_pages  # per device: each holds half of every page
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(num_pages=64, kv_cache_memory="1MiB")
    with pytest.raises(ValueError, match="holds no page"):
        resolve(EngineConfig(kv_cache_memory="100B"), MODEL)
    with pytest.raises(ValueError, match="memory statistics"):
        resolve(EngineConfig(kv_cache_memory="0.5"), MODEL)  # the CPU reports none


def test_llm_with_no_options_takes_its_sizes_from_the_model(hf_checkpoint, caplog):
    path, _ = hf_checkpoint("llama")
    logger = logging.getLogger("jbatch.engine.sizing")
    logger.addHandler(caplog.handler)  # direct: the CLI may have stopped jbatch's propagation
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            llm = LLM(path, warmup=False)
    finally:
        logger.removeHandler(caplog.handler)
    assert (llm.config.num_pages, llm.config.max_seq_len) == (512, 512)  # max_position_embeddings
    assert llm.engine.cfg == llm.config
    assert "max_seq_len=512 (from the model)" in caplog.text
