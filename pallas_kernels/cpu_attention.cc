// Paged attention of small query blocks (decode rows, speculative groups) on the CPU, as an XLA
// FFI custom call: keys and values are read in place from the pool through the page tables, so
// no page is gathered, no chunk is transposed and nothing is masked that is never read.
//
// Contract: that of pallas_kernels/paged_attention_reference.py (see its docstring), for one
// layer's pool [P, S, KVH, D] (float32, bfloat16, or int8 / float8_e4m3fn with bfloat16 scales
// [P, S, KVH]) and query blocks q [N, Bq, H, D] (float32 or bfloat16) with their positions
// [N, Bq] (-1: padding row, zeros out) and page tables [N, MP]. A row at position p reads keys
// max(0, p - window + 1) .. p; nothing else of the pool is touched, so free pages (NaN) never
// reach a result. Page ids and positions are clamped into the arrays: a bad table reads a wrong
// page, never out of bounds.
//
// Work: one item per (block, KV head), spread over XLA's intra-op thread pool when the call has
// at least `min_parallel_work` (keys read x query heads x head dim, summed over rows; below it
// the calling thread does every item: waking a pool thread costs more than it saves); an item
// scores its block's valid rows x the G query heads of the KV head against each key (one pass
// over the keys), takes a two-pass softmax per query vector and accumulates the value rows.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// e^x, vectorizable (no libm call): n = round(x / ln 2), r = x - n ln 2 in two parts (|r| <=
// ln 2 / 2), e^r by its Taylor series to r^7 (relative error < 1e-8 there), times 2^n built in
// the exponent bits. x below -87 (results under float's normal range) returns 0.
inline float exp_approx(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = (clamped - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < -87.0f ? 0.0f : p * two_n;
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits, no infinities, S.1111.111 = NaN.
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
      float v = exp == 0 ? std::ldexp(man / 8.0f, -6) : std::ldexp(1.0f + man / 8.0f, exp - 7);
      if (exp == 15 && man == 7) v = std::nanf("");
      value[b] = sign ? -v : v;
    }
  }
};
const Fp8Table kFp8;

enum class Pool { kF32, kBF16, kS8, kF8 };

// One pool row (D entries of one token and KV head) as float32 into `dst`.
inline void load_row(const void* base, Pool kind, int64_t offset, int64_t d, float scale,
                     float* dst) {
  switch (kind) {
    case Pool::kF32: {
      const float* src = static_cast<const float*>(base) + offset;
      for (int64_t i = 0; i < d; ++i) dst[i] = src[i];
      return;
    }
    case Pool::kBF16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int64_t i = 0; i < d; ++i) dst[i] = bf16_to_float(src[i]);
      return;
    }
    case Pool::kS8: {
      const int8_t* src = static_cast<const int8_t*>(base) + offset;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]) * scale;
      return;
    }
    case Pool::kF8: {
      const uint8_t* src = static_cast<const uint8_t*>(base) + offset;
      for (int64_t i = 0; i < d; ++i) dst[i] = kFp8.value[src[i]] * scale;
      return;
    }
  }
}

// Vectors of 16 floats (GCC/Clang vector extensions: one AVX-512 register, two AVX2 ones, four
// NEON ones). A head dim that is a multiple of 16 runs on them, any other on scalar loops.
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
constexpr int kLanes = 16;

inline v16 load16(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof(x)); }

inline float hsum(v16 x) {  // halving tree: 4 dependent adds, not 16
  v8 lo, hi;
  std::memcpy(&lo, &x, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof(lo), sizeof(hi));
  const v8 s = lo + hi;
  const float a = (s[0] + s[4]) + (s[1] + s[5]), b = (s[2] + s[6]) + (s[3] + s[7]);
  return a + b;
}

struct Problem {
  const void* q;
  bool q_bf16;
  const void* k;
  const void* v;
  Pool pool;
  const uint16_t* k_scales;  // bfloat16 [P, S, KVH]; null for float pools
  const uint16_t* v_scales;
  const int32_t* tables;     // [N, MP]
  const int32_t* positions;  // [N, Bq]
  void* out;
  int64_t n, bq, h, d, num_pages, page_size, kvh, max_pages;
  float scale, soft_cap;
  int64_t window;  // 0: none
};

// Per-thread scratch, grown as needed and reused across calls.
struct Scratch {
  std::vector<float> q, scores, row, acc, out;
};

inline float read_scale(const uint16_t* scales, int64_t entry) {
  return scales == nullptr ? 1.0f : bf16_to_float(scales[entry]);
}

// Calls fn(i, entry) for keys lo + i, i in [0, hi - lo), walking the page table page by page
// (`entry`: the key's (page, slot, head) row index into the pool).
template <typename Fn>
inline void for_each_key(const Problem& pr, const int32_t* table, int64_t head, int64_t lo,
                         int64_t hi, Fn&& fn) {
  const int64_t s_len = pr.page_size;
  for (int64_t pi = lo / s_len; pi * s_len < hi; ++pi) {
    const int64_t page = std::clamp<int64_t>(table[pi], 0, pr.num_pages - 1);
    const int64_t first = pi * s_len;
    const int64_t k0 = std::max(lo, first), k1 = std::min(hi, first + s_len);
    const int64_t base = page * s_len * pr.kvh + head - first * pr.kvh;
    for (int64_t key = k0; key < k1; ++key) fn(key - lo, base + key * pr.kvh);
  }
}

// A pool row as float32: in place for a float32 pool, else converted into `buf`.
inline const float* row_of(const Problem& pr, const void* pool, const uint16_t* scales,
                           int64_t entry, int64_t d, float* buf) {
  if (pr.pool == Pool::kF32) return static_cast<const float*>(pool) + entry * d;
  load_row(pool, pr.pool, entry * d, d, read_scale(scales, entry), buf);
  return buf;
}

// One query vector q (scaled, float32, kD entries; kD = 0: pr.d at run time) attending keys
// [lo, hi) of KV head `head` through `table`: its normalized output into `out` (d floats).
template <int kD>
void attend_vector(const Problem& pr, const int32_t* table, int64_t head, int64_t lo,
                   int64_t hi, const float* q, float* out, Scratch& ws) {
  const int64_t d = kD > 0 ? kD : pr.d;
  const int64_t chunks = d % kLanes == 0 ? d / kLanes : 0;  // 0: scalar loops
  constexpr int kChunks = kD > 0 && kD % kLanes == 0 ? kD / kLanes : 1;
  const int64_t len = hi - lo;
  ws.scores.resize(len);
  float* s = ws.scores.data();
  float* buf = ws.row.data();
  // Pass 1: scores, and their max.
  float m = -3.0e38f;
  v16 qv[kChunks];
  if (kD > 0 && chunks == kChunks) {
    for (int c = 0; c < kChunks; ++c) qv[c] = load16(q + c * kLanes);
  }
  for_each_key(pr, table, head, lo, hi, [&](int64_t i, int64_t entry) {
    const float* k = row_of(pr, pr.k, pr.k_scales, entry, d, buf);
    float score;
    if (kD > 0 && chunks == kChunks) {
      v16 acc = qv[0] * load16(k);
      for (int c = 1; c < kChunks; ++c) acc += qv[c] * load16(k + c * kLanes);
      score = hsum(acc);
    } else if (chunks > 0) {
      v16 acc = load16(q) * load16(k);
      for (int64_t c = 1; c < chunks; ++c) acc += load16(q + c * kLanes) * load16(k + c * kLanes);
      score = hsum(acc);
    } else {
      score = 0.0f;
      for (int64_t j = 0; j < d; ++j) score += q[j] * k[j];
    }
    if (pr.soft_cap > 0.0f) score = pr.soft_cap * std::tanh(score / pr.soft_cap);
    s[i] = score;
    m = std::max(m, score);
  });
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < len; ++i) {
    s[i] = exp_approx(s[i] - m);
    sum += s[i];
  }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  // Pass 2: the weighted value rows.
  if (kD > 0 && chunks == kChunks) {
    v16 acc[kChunks] = {};
    for_each_key(pr, table, head, lo, hi, [&](int64_t i, int64_t entry) {
      const float* v = row_of(pr, pr.v, pr.v_scales, entry, d, buf);
      const float w = s[i];
      for (int c = 0; c < kChunks; ++c) acc[c] += w * load16(v + c * kLanes);
    });
    for (int c = 0; c < kChunks; ++c) store16(out + c * kLanes, acc[c] * inv);
    return;
  }
  ws.acc.assign(d, 0.0f);
  float* acc = ws.acc.data();
  for_each_key(pr, table, head, lo, hi, [&](int64_t i, int64_t entry) {
    const float* v = row_of(pr, pr.v, pr.v_scales, entry, d, buf);
    const float w = s[i];
    for (int64_t j = 0; j < d; ++j) acc[j] += w * v[j];
  });
  for (int64_t j = 0; j < d; ++j) out[j] = acc[j] * inv;
}

// The keys a row at `pos` reads: [lo, hi) (empty for a padding row, pos < 0).
struct KeyRange {
  int64_t lo, hi;
};
inline KeyRange keys_of(const Problem& pr, int64_t pos) {
  const int64_t hi = std::min(pos + 1, pr.max_pages * pr.page_size);
  const int64_t lo = pr.window > 0 ? std::max<int64_t>(0, pos - pr.window + 1) : 0;
  return pos < 0 ? KeyRange{0, 0} : KeyRange{lo, hi};
}

// Item (block, KV head): each valid row's G query heads of that KV head, one vector at a time
// (the head's keys stay in L1/L2 between them). Padding rows get zeros.
template <int kD>
void attend_item(const Problem& pr, int64_t item, Scratch& ws) {
  const int64_t blk = item / pr.kvh, head = item % pr.kvh;
  const int64_t g = pr.h / pr.kvh, d = pr.d;
  const int32_t* table = pr.tables + blk * pr.max_pages;
  ws.q.resize(d);
  ws.row.resize(d);
  ws.out.resize(d);
  float result[kD > 0 ? kD : 1];
  for (int64_t b = 0; b < pr.bq; ++b) {
    const auto [lo, hi] = keys_of(pr, pr.positions[blk * pr.bq + b]);
    for (int64_t j = 0; j < g; ++j) {
      const int64_t at = ((blk * pr.bq + b) * pr.h + head * g + j) * d;
      float* o = kD > 0 ? result : ws.out.data();
      if (lo >= hi) {
        std::fill(o, o + d, 0.0f);
      } else {
        float* qs = ws.q.data();
        if (pr.q_bf16) {
          const uint16_t* src = static_cast<const uint16_t*>(pr.q) + at;
          for (int64_t i = 0; i < d; ++i) qs[i] = bf16_to_float(src[i]) * pr.scale;
        } else {
          const float* src = static_cast<const float*>(pr.q) + at;
          for (int64_t i = 0; i < d; ++i) qs[i] = src[i] * pr.scale;
        }
        attend_vector<kD>(pr, table, head, lo, hi, qs, o, ws);
      }
      if (pr.q_bf16) {
        uint16_t* dst = static_cast<uint16_t*>(pr.out) + at;
        for (int64_t i = 0; i < d; ++i) dst[i] = float_to_bf16(o[i]);
      } else {
        std::memcpy(static_cast<float*>(pr.out) + at, o, d * sizeof(float));
      }
    }
  }
}

// Items handed out by an atomic counter to the calling thread and up to (threads - 1) pool
// tasks; the caller works too, then waits only for items other threads have started. A task
// that starts after the work ran out touches nothing but the shared counters it co-owns.
struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
};

// The call's work in multiply-adds per pass: keys each valid row reads x query heads x head dim.
int64_t call_work(const Problem& pr) {
  int64_t keys = 0;
  for (int64_t r = 0; r < pr.n * pr.bq; ++r) {
    const auto [lo, hi] = keys_of(pr, pr.positions[r]);
    keys += std::max<int64_t>(0, hi - lo);
  }
  return keys * pr.h * pr.d;
}

void run_items(const Problem& pr, int64_t items, Progress& progress) {
  thread_local Scratch scratch;
  for (int64_t i; (i = progress.next.fetch_add(1)) < items;) {
    switch (pr.d) {  // the common head dims unrolled
      case 16: attend_item<16>(pr, i, scratch); break;
      case 32: attend_item<32>(pr, i, scratch); break;
      case 64: attend_item<64>(pr, i, scratch); break;
      case 128: attend_item<128>(pr, i, scratch); break;
      case 256: attend_item<256>(pr, i, scratch); break;
      default: attend_item<0>(pr, i, scratch);
    }
    if (progress.done.fetch_add(1) + 1 == items) {
      std::lock_guard<std::mutex> lock(progress.mu);
      progress.cv.notify_all();
    }
  }
}

ffi::Error pool_kind(ffi::DataType t, Pool* kind) {
  switch (t) {
    case ffi::DataType::F32: *kind = Pool::kF32; return ffi::Error::Success();
    case ffi::DataType::BF16: *kind = Pool::kBF16; return ffi::Error::Success();
    case ffi::DataType::S8: *kind = Pool::kS8; return ffi::Error::Success();
    case ffi::DataType::F8E4M3FN: *kind = Pool::kF8; return ffi::Error::Success();
    default: return ffi::Error::InvalidArgument("pool dtype: float32, bfloat16, int8 or float8_e4m3fn");
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales,
                          ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> positions,
                          ffi::Result<ffi::AnyBuffer> out, float scale, float soft_cap,
                          int64_t window, int64_t min_parallel_work) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || tables.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("want q [N, Bq, H, D], pool [P, S, KVH, D], tables [N, MP]");
  }
  Problem pr{};
  if (q.element_type() != ffi::DataType::F32 && q.element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("q dtype: float32 or bfloat16");
  }
  if (out->element_type() != q.element_type() || v.element_type() != k.element_type()) {
    return ffi::Error::InvalidArgument("out must have q's dtype, v must have k's dtype");
  }
  if (ffi::Error e = pool_kind(k.element_type(), &pr.pool); e.failure()) return e;
  const bool quantized = pr.pool == Pool::kS8 || pr.pool == Pool::kF8;
  if (quantized && (k_scales.element_count() != kd[0] * kd[1] * kd[2] ||
                    v_scales.element_count() != kd[0] * kd[1] * kd[2] ||
                    k_scales.element_type() != ffi::DataType::BF16)) {
    return ffi::Error::InvalidArgument("an 8-bit pool needs bfloat16 scales [P, S, KVH]");
  }
  pr.q = q.untyped_data();
  pr.q_bf16 = q.element_type() == ffi::DataType::BF16;
  pr.k = k.untyped_data();
  pr.v = v.untyped_data();
  pr.k_scales = quantized ? static_cast<const uint16_t*>(k_scales.untyped_data()) : nullptr;
  pr.v_scales = quantized ? static_cast<const uint16_t*>(v_scales.untyped_data()) : nullptr;
  pr.tables = tables.typed_data();
  pr.positions = positions.typed_data();
  pr.out = out->untyped_data();
  pr.n = qd[0], pr.bq = qd[1], pr.h = qd[2], pr.d = qd[3];
  pr.num_pages = kd[0], pr.page_size = kd[1], pr.kvh = kd[2];
  pr.max_pages = tables.dimensions()[1];
  pr.scale = scale, pr.soft_cap = soft_cap, pr.window = window;
  if (kd[3] != pr.d || pr.kvh <= 0 || pr.h % pr.kvh != 0 || tables.dimensions()[0] != pr.n ||
      positions.element_count() != pr.n * pr.bq || pr.num_pages <= 0 || pr.max_pages <= 0) {
    return ffi::Error::InvalidArgument("inconsistent shapes (head dim, heads, blocks)");
  }
  const int64_t items = pr.n * pr.kvh;
  if (items == 0) return ffi::Error::Success();
  auto progress = std::make_shared<Progress>();
  const int64_t helpers = call_work(pr) < min_parallel_work
                              ? 0
                              : std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    // The task holds the counters alive; it reads `pr` only while items are left, and the
    // caller does not return while any item is unfinished.
    pool.Schedule([progress, pr, items] { run_items(pr, items, *progress); });
  }
  run_items(pr, items, *progress);
  std::unique_lock<std::mutex> lock(progress->mu);
  progress->cv.wait(lock, [&] { return progress->done.load() >= items; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbatchCpuPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k pages
                                  .Arg<ffi::AnyBuffer>()  // v pages
                                  .Arg<ffi::AnyBuffer>()  // k scales (empty for a float pool)
                                  .Arg<ffi::AnyBuffer>()  // v scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<int64_t>("min_parallel_work"));
