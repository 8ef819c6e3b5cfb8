"""The compiled shapes of the step program, defined in one place.

A step's token buffer is ``decode_rows`` decode rows (the decoding slots, compacted, padding at
the end) followed by a prompt-chunk region of ``rows`` rows; ``rows`` comes from
:func:`prefill_buckets` and ``decode_rows`` from :func:`decode_buckets` (so a step with 2 busy
slots of 32 does not pay for 32). :func:`bucket_pairs` lists every (rows, decode_rows) pair: one
compiled program each; warm-up compiles them all, so nothing compiles while serving. The
context length is not a bucket: attention walks the page tables with a traced trip count.

Prompt rows cost what their bucket holds, padding included (~1.3 ms a row on the 30-layer
SmolLM2-135M shape, CPU), and a running batch admits about one short prompt per step as slots
free up. So the small prefill buckets are every whole number of ``block_q`` blocks up to
LINEAR_PREFILL_BLOCKS (16/32/48/64 rows: a 40-token prompt pays 48 rows, not 64), and the
larger ones are 4x apart up to the token budget (256, 512: long prompts are chunked anyway).
The buckets between the 4x ladder's rungs (32, 48) serve a busy batch admitting a prompt, so
they compile with the full decode bucket only. A step runs the compiled pair that holds it with
the fewest rows (:func:`pick_pair`), and the scheduler plans prompt rows for the pairs a step of
its decode count would run (:func:`fit_prompt_rows`): a step with few decodes and a 40-token
prompt runs (64, 8), not (48, max_slots) — with 256 slots (64, 16): 80 rows instead of 304.

Decode-only steps (``rows == 0``: the steady state, and the tail end of a long tail with a few
long requests left) get power-of-two decode buckets down to one row: on the 30-layer shape a
decode step of 1/2/4/8/16/32 rows took 20/27/30/37/49/74 ms (CPU, context 200), so a step pays
for about the rows it uses. Between the two largest, where a row costs the most, they also get
3/4 ``max_slots`` (24 of 32: the forward and LM head of 24 rows took 79 ms against 92 at 32;
the 30-layer long tail runs 30 of its 224 decode-only steps with 17-24 decodes). Steps with
prompt rows, whose cost the prompt rows dominate, get only ``max_slots`` and its quarters (at
least 8 rows), which bounds the program count: 32 slots and a 512-token budget (prefill
buckets 16/32/48/64/320/640, the last two packed: below) compile 7 + 4 x 2 + 2 = 17 step
programs.

Packed prompt regions: each prompt chunk starts a new ``block_q`` block, because prompt
attention takes blocks of one sequence, so a region of many short chunks is ~16-20% padding.
Above LINEAR_PREFILL_BLOCKS blocks (the 4x rungs: 256, 512) a bucket is a *packed* region: its
chunks are laid out in ``region_rows`` block rows (5/4 of its dense rows: 320, 640), and the
model gathers their tokens into the dense rows (``llama.Packing``) for everything but
attention. The scheduler caps such a step's tokens at the dense rows and its block rows at
the region, so a step of 512 prompt tokens costs 512 rows, not ~600. A bucket is named by its
block rows (what the scheduler's row cap counts); :func:`dense_rows` gives what it computes.

Roles (``EngineConfig.role``, disaggregation): a "prefill" engine never decodes, so it compiles
one program per non-zero prefill bucket, each with zero decode rows; a "decode" engine compiles
only the decode-only programs (``rows == 0``).
"""

from __future__ import annotations

import functools

from jbatch.engine.config import EngineConfig


def block_rows(cfg: EngineConfig, tokens: int) -> int:
    """Rows ``tokens`` prompt tokens take in a step's prompt region: whole ``block_q`` blocks."""
    return -(-tokens // cfg.block_q) * cfg.block_q


LINEAR_PREFILL_BLOCKS = 4  # prompt buckets of 1, 2, ... this many blocks, then 4x apart


def _ladder(cfg: EngineConfig) -> list[int]:
    """``block_q`` x powers of 4 below the token budget's rows, then the budget's rows."""
    top = block_rows(cfg, cfg.max_num_batched_tokens)
    rows = [cfg.block_q]
    while rows[-1] * 4 < top:
        rows.append(rows[-1] * 4)
    return [r for r in rows if r < top] + [top]


def _between(cfg: EngineConfig, ladder: list[int]) -> set[int]:
    """The prefill buckets off the 4x ``ladder``: whole blocks up to LINEAR_PREFILL_BLOCKS."""
    linear = {cfg.block_q * k for k in range(2, LINEAR_PREFILL_BLOCKS + 1)}
    return {r for r in linear if r < ladder[-1]} - set(ladder)


# A packed prompt region (module doc) holds its dense rows plus this fraction of them again
# for the chunks' block padding (1/4: 512 dense rows in 640 block rows).
PACKED_SLACK = 4


def region_rows(cfg: EngineConfig, dense: int) -> int:
    """The block rows of a prompt region whose dense layers compute ``dense`` rows: ``dense``
    up to LINEAR_PREFILL_BLOCKS blocks (one prompt or so: nothing to pack), else ``dense``
    plus PACKED_SLACK's share of it, in whole blocks."""
    if dense <= LINEAR_PREFILL_BLOCKS * cfg.block_q:
        return dense
    return dense + block_rows(cfg, dense // PACKED_SLACK)


@functools.cache
def prefill_buckets(cfg: EngineConfig) -> tuple[int, ...]:
    """Prompt regions, in block rows: 0 (decode only), then 1 to LINEAR_PREFILL_BLOCKS whole
    ``block_q`` blocks, then 4x apart up to the budget, those packed (:func:`region_rows`;
    module doc)."""
    ladder = _ladder(cfg)
    rows = sorted({*map(functools.partial(region_rows, cfg), ladder), *_between(cfg, ladder)})
    return tuple(rows) if cfg.role == "prefill" else (0, *rows)


@functools.cache
def _dense_of(cfg: EngineConfig) -> dict[int, int]:
    return {region_rows(cfg, d): d for d in _ladder(cfg)}  # only the 4x rungs are packed


def dense_rows(cfg: EngineConfig, rows: int) -> int:
    """The prompt rows the dense layers compute in the prompt region of ``rows`` block rows
    (a bucket): fewer than ``rows`` in a packed region, else ``rows``."""
    return _dense_of(cfg).get(rows, rows)


def _holds(cfg: EngineConfig, region: int, rows: int, tokens: int) -> bool:
    """Whether the prompt region of ``region`` block rows holds chunks of ``rows`` block rows
    and ``tokens`` tokens."""
    return region >= rows and dense_rows(cfg, region) >= tokens


def pick_bucket(cfg: EngineConfig, rows: int, tokens: int = 0) -> int:
    """Smallest prompt region holding ``rows`` block rows of chunks of ``tokens`` tokens."""
    for b in prefill_buckets(cfg):
        if _holds(cfg, b, rows, tokens):
            return b
    top = prefill_buckets(cfg)[-1]
    raise ValueError(
        f"{rows} prompt rows of {tokens} tokens exceed the largest bucket {top} "
        f"({dense_rows(cfg, top)} tokens)"
    )


def fit_prompt_rows(cfg: EngineConfig, wanted: int, decodes: int = 0) -> int:
    """The prompt rows a step with ``decodes`` decode rows plans for when ``wanted`` rows of
    prompt chunks could go: the nearest prompt size such a step runs (:func:`pick_pair`) — the
    one below when fewer rows are left over for a later step's chunk than the smallest size
    holding them would pad — but never down to the smallest, which holds a single prompt block
    (small prompts are not admitted one per step). So a prompt just past a bucket no longer
    takes one up to 4x its size."""
    sizes = _prompt_sizes(cfg, decodes)
    upper = next((b for b in sizes if b >= wanted), sizes[-1])
    lower = max((b for b in sizes if b < upper), default=upper)
    nearer_below = wanted - lower < upper - wanted
    return lower if nearer_below and lower > sizes[0] else upper


MIN_DECODE_ROWS = 1  # the smallest decode-only bucket (mixed steps: at least 8 rows)


MIN_MIXED_DECODE_ROWS = 8

# Decode-only steps also get a bucket of 3/4 ``max_slots`` rows (24 of 32) when that is at least
# this many rows (module doc).
MIN_THREE_QUARTER_ROWS = 16


@functools.cache
def decode_buckets(cfg: EngineConfig, rows: int = 0) -> tuple[int, ...]:
    """Decode row counts compiled with ``rows`` prompt-chunk rows: ``max_slots``, then halves
    down to MIN_DECODE_ROWS and 3/4 ``max_slots`` (decode-only steps; the latter from
    MIN_THREE_QUARTER_ROWS rows) or quarters down to MIN_MIXED_DECODE_ROWS (steps with prompt
    rows on the 4x ladder); ``max_slots`` only with the prefill buckets between the ladder's
    rungs (module doc). A prefill engine: zero decode rows only."""
    if cfg.role == "prefill":
        return (0,)
    if rows in _between(cfg, _ladder(cfg)):
        return (cfg.max_slots,)
    shrink, least = (2, MIN_DECODE_ROWS) if rows == 0 else (4, MIN_MIXED_DECODE_ROWS)
    sizes, d = [cfg.max_slots], cfg.max_slots // shrink
    while d >= least:
        sizes.append(d)
        d //= shrink
    three_quarters = 3 * cfg.max_slots // 4  # above every halving: never a duplicate
    if rows == 0 and three_quarters >= MIN_THREE_QUARTER_ROWS:
        sizes.append(three_quarters)
    return tuple(sorted(sizes))


def bucket_pairs(cfg: EngineConfig) -> tuple[tuple[int, int], ...]:
    """Every (prompt rows, decode rows) pair the engine compiles."""
    rows = (0,) if cfg.role == "decode" else prefill_buckets(cfg)
    return tuple((r, d) for r in rows for d in decode_buckets(cfg, r))


@functools.cache
def _prompt_sizes(cfg: EngineConfig, decodes: int) -> list[int]:
    """The prompt rows of the pairs steps with ``decodes`` decode rows run (:func:`pick_pair`)."""
    sizes = {b for b in prefill_buckets(cfg) if b > 0}
    if cfg.role != "decode":  # a decode engine runs no prompt rows: its cap only gates admission
        sizes = {pick_pair(cfg, b, decodes)[0] for b in sizes}
    return sorted(sizes)


@functools.cache
def _pairs_by_rows(cfg: EngineConfig) -> tuple[tuple[int, int], ...]:
    cost = lambda pair: (dense_rows(cfg, pair[0]) + pair[1], pair)  # the dense rows it computes
    return tuple(sorted(bucket_pairs(cfg), key=cost))


def pick_pair(cfg: EngineConfig, rows: int, decodes: int, tokens: int = 0) -> tuple[int, int]:
    """The compiled (prompt rows, decode rows) pair of a step with ``rows`` prompt-chunk block
    rows holding ``tokens`` tokens and ``decodes`` decode rows: of the pairs holding them, the
    one whose layers compute the fewest rows (:func:`dense_rows` plus decode rows; then the
    fewest prompt rows)."""
    for pair in _pairs_by_rows(cfg):
        if pair[1] >= decodes and _holds(cfg, pair[0], rows, tokens):
            return pair
    raise ValueError(
        f"no step program holds {rows} prompt rows of {tokens} tokens and {decodes} decode rows "
        f"(largest: {max(bucket_pairs(cfg))})"
    )


def handover_page_buckets(cfg: EngineConfig) -> tuple[int, ...]:
    """Page counts a handover's copy is padded to (``engine/handover.py``): powers of two, then
    ``max_pages_per_seq``; a handover moves less than twice the pages its request holds."""
    top, sizes, n = cfg.max_pages_per_seq, [], 1
    while n < top:
        sizes.append(n)
        n *= 2
    return (*sizes, top)


def pick_handover_bucket(cfg: EngineConfig, pages: int) -> int:
    """The smallest handover page bucket holding ``pages`` pages."""
    for b in handover_page_buckets(cfg):
        if b >= pages:
            return b
    raise ValueError(f"{pages} pages exceed max_pages_per_seq={cfg.max_pages_per_seq}")


def max_page_writes(cfg: EngineConfig) -> int:
    """Upper bound on page-table entries one step assigns: each prompt chunk's pages (a chunk
    may straddle one extra page boundary) plus, per slot, the pages its decode positions span:
    one for a step, and for a block of ``decode_steps`` steps (``decode_block.py``; an
    admission block's new requests included) all of the block's at once."""
    top = prefill_buckets(cfg)[-1]
    per_slot = -(-(cfg.decode_steps - 1) // cfg.page_size) + 1
    return cfg.max_slots * per_slot + top // cfg.page_size + top // cfg.block_q + 1


# A block of decode steps checks each slot's sampled tokens against this many stop token ids
# (EOS, ``stop_token_ids``) on the device, to end early (``decode_block.py``); a request with
# more is checked for its first ones (the host finds the rest, as for stop strings).
BLOCK_STOP_TOKENS = 4
# A block's idle budget (``StepBatch.block_idle_budget``) that never ends it early.
NO_EARLY_END = 2**30


def admission_blocks(cfg: EngineConfig) -> bool:
    """Whether a step that prefills prompts may run on as a block of decode steps (an
    *admission block*, ``decode_block.py``): with ``decode_steps`` > 1 on an engine that
    admits prompts and does not speculate (a speculating engine's next dispatch after an
    admission is a speculative one)."""
    return cfg.decode_steps > 1 and cfg.role == "mixed" and cfg.speculative is None


def runs_blocks(cfg: EngineConfig, rows: int, decode_rows: int) -> bool:
    """Whether the program of (``rows`` prompt rows, ``decode_rows`` decode rows) runs a block
    of up to ``decode_steps`` steps (``decode_block.py``): every decode-only program when
    ``decode_steps`` > 1, and with :func:`admission_blocks` the programs with prompt rows whose
    decode rows list every slot (an admission block's later steps decode its new requests
    too)."""
    if cfg.decode_steps == 1:
        return False
    return rows == 0 or (admission_blocks(cfg) and decode_rows == cfg.max_slots)


def spec_buckets(cfg: EngineConfig) -> tuple[int, ...]:
    """Group counts of the speculative step program (``spec_step.py``; decode-only steps with
    ``K + 1`` rows per slot): powers of two up to ``speculative_max_batch``, which itself is
    one. None when the engine does not speculate."""
    if cfg.speculative is None:
        return ()
    top, sizes, g = cfg.speculative_max_batch, [], 1
    while g < top:
        sizes.append(g)
        g *= 2
    return (*sizes, top)


def spec_extra(cfg: EngineConfig) -> int:
    """Tokens one speculative dispatch may emit for a request past its first: K in a step, and
    K + 1 in each further step of a block (``spec_block.py``; ``decode_steps`` steps)."""
    return cfg.decode_steps * (cfg.num_speculative_tokens + 1) - 1


def max_spec_page_writes(cfg: EngineConfig) -> int:
    """Upper bound on page-table entries one speculative dispatch assigns: each group's
    ``E + 1`` positions (``E = spec_extra``), after up to ``E`` the dispatch in flight may
    have emitted, straddle at most ``ceil((2E + 1) / page_size) + 1`` new pages."""
    rows = 2 * spec_extra(cfg) + 1
    return cfg.speculative_max_batch * (-(-rows // cfg.page_size) + 1)


def ngram_window(cfg: EngineConfig) -> int:
    """Stream tokens a speculative step's n-gram lookup searches (``spec_step.SpecBatch``):
    the whole context up to ``NGRAM_WINDOW`` tokens, the latest ones beyond (1 when the
    engine proposes no n-grams)."""
    if cfg.speculative != "ngram":
        return 1
    return min(cfg.max_seq_len, NGRAM_WINDOW)


NGRAM_WINDOW = 4096


def pick_spec_bucket(cfg: EngineConfig, groups: int) -> int:
    """Smallest speculative bucket holding ``groups`` groups."""
    return next(b for b in spec_buckets(cfg) if b >= groups)
