"""The compiled shapes of ``step``, defined in one place.

A step's token buffer is ``decode_rows`` decode rows (the decoding slots, compacted, padding at
the end) followed by a prompt-chunk region of ``rows`` rows; ``decode_rows`` comes from
:func:`decode_buckets` (so a step with 2 busy slots of 32 does not pay for 32) and ``rows`` from
:func:`prefill_buckets`. Each (decode bucket, prefill bucket) pair is one compiled program;
warm-up compiles them all, so nothing compiles while serving. The context length is not a
bucket: attention walks the page tables with a traced trip count.
"""

from __future__ import annotations

from jbatch.engine.config import EngineConfig


def prefill_buckets(cfg: EngineConfig) -> tuple[int, ...]:
    """Prompt-chunk row counts: 0 (decode only), then block_q x powers of 4 up to the budget."""
    top = -(-cfg.max_num_batched_tokens // cfg.block_q) * cfg.block_q
    rows, r = [0], cfg.block_q
    while r < top:
        rows.append(r)
        r *= 4
    rows.append(top)
    return tuple(rows)


def pick_bucket(cfg: EngineConfig, rows: int) -> int:
    """Smallest bucket holding ``rows`` prompt-chunk rows."""
    for b in prefill_buckets(cfg):
        if b >= rows:
            return b
    raise ValueError(f"{rows} prompt rows exceed the largest bucket {prefill_buckets(cfg)[-1]}")


def decode_buckets(cfg: EngineConfig) -> tuple[int, ...]:
    """Decode row counts: ``max_slots``, then quarters of it while at least 8 rows."""
    sizes, d = [cfg.max_slots], cfg.max_slots // 4
    while d >= 8:
        sizes.append(d)
        d //= 4
    return tuple(sorted(sizes))


def pick_decode_bucket(cfg: EngineConfig, decodes: int) -> int:
    """Smallest decode bucket holding ``decodes`` rows."""
    return next(b for b in decode_buckets(cfg) if b >= decodes)


def max_page_writes(cfg: EngineConfig) -> int:
    """Upper bound on page-table entries one step assigns: a new page per decoding slot, plus
    each prompt chunk's pages (a chunk may straddle one extra page boundary)."""
    top = prefill_buckets(cfg)[-1]
    return cfg.max_slots + top // cfg.page_size + top // cfg.block_q + 1
