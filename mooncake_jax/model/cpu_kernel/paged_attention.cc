// Paged attention for XLA:CPU, two XLA FFI custom calls (see cpu_kernel/__init__.py for why they exist). Both read
// K and V in place from the paged cache through a page table, and spread their work items over XLA's intra-op thread
// pool (`ParallelFor`). The cache is float32, or bfloat16 held as its uint16 bits (the CPU's stored 16-bit cache);
// everything is computed in float32.
//
// MooncakePagedDecode: one query token per sequence attends its cached context plus its own new key/value.
//   q [B, H, G, D] (scaled), k_new, v_new [B, H, D], k_pages, v_pages [H, R, bs, D], table [B, P], ctx_len [B]
//   -> [B, H, G, D]. Items are (sequence, kv head): the keys read once for the whole query group, the softmax over
//   scores held in a per-thread buffer, then the values read once.
//
// MooncakePagedPrefill: T new tokens per sequence, already written to their pages, attend causally: token i sees
//   the sequence's ctx_len cached tokens and new tokens 0..i, all read from the pages.
//   q [B, T, H, G, D] (scaled), k_pages, v_pages, table [B, W] covering ctx_len + T tokens, ctx_len [B]
//   -> [B, T, H, G, D]. Items are (query block of kQueryBlock tokens, sequence, kv head), the last blocks (the
//   most keys) first; each is a flash-attention loop over blocks of kKeyBlock keys: scores by register-tiled
//   products against a transposed copy of the key block, an online softmax, and the weighted values.
//
// The vector code uses GCC/Clang vector extensions (8 floats), which compile to AVX2 here and to pairs of NEON
// registers on ARM.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));

inline v8 Splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

inline float Load(const float* p, int64_t i) { return p[i]; }

inline float Load(const uint16_t* p, int64_t i) {  // bfloat16 bits
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline v8 Load8(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

inline v8 Load8(const uint16_t* p) {  // eight bfloat16 values
  v8u16 h;
  std::memcpy(&h, p, sizeof h);
  const v8i w = __builtin_convertvector(h, v8i) << 16;
  v8 r;
  std::memcpy(&r, &w, sizeof r);
  return r;
}

inline void Store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

inline float HMax(v8 v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}

inline float HSum(v8 v) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// The sums of eight vectors' lanes, as one vector (lane j: the sum of p[j]), by a tree of shuffles.
inline v8 Sums8(const v8* p) {
  v8 a[4];
  for (int i = 0; i < 4; ++i) {
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  }
  v8 b[2];
  for (int i = 0; i < 2; ++i) {
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  return __builtin_shufflevector(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

constexpr float kLowest = -87.0f;  // exp below this is taken as 0 (float32's smallest normal is exp(-87.3))
constexpr float kMasked = -1e30f;

// exp(x) for x <= 0 (scores minus their max): 2^n * p(r), r in [-ln2/2, ln2/2], a degree-6 polynomial (relative
// error about 2e-7); 0 below kLowest. Scalar and eight-wide forms.
template <typename T>
inline T ExpPoly(T xc, T n) {
  const T r = xc - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;
  T p = r * (1.0f / 720) + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}

inline float ExpNonPositive(float x) {
  if (x < kLowest) return 0.0f;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return ExpPoly(x, n) * scale;
}

inline v8 Exp8(v8 x) {
  const v8 lo = Splat(kLowest);
  const v8 xc = x < lo ? lo : x;
  const v8 n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &e, sizeof scale);
  return x < lo ? Splat(0.0f) : ExpPoly(xc, n) * scale;
}

// Runs fn(item, scratch) for items 0..n-1 on the calling thread and, when there is enough work to pay for waking
// them (`macs` multiply-adds in all, kMinMacsPerThread per thread), the pool's; returns when all are done. The
// tasks capture by value: one that starts after the call has returned finds no item left and touches nothing freed
// (the callable must own copies of what it reads).
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t items = 0;
};

constexpr int64_t kMinMacsPerThread = 1 << 18;  // ~30-60 us of work: a pool thread's wake-up is a few us

template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t macs, F fn) {
  auto work = std::make_shared<Work>();
  work->items = n;
  auto body = [work, fn]() {
    std::vector<float> scratch;
    for (;;) {
      const int64_t item = work->next.fetch_add(1, std::memory_order_relaxed);
      if (item >= work->items) return;
      fn(item, scratch);
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min({pool.num_threads(), n, macs / kMinMacsPerThread}) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(body)(body));  // a copy: Schedule takes F&&
  body();
  while (work->done.load(std::memory_order_acquire) < work->items) std::this_thread::yield();
}

struct Cache {
  int64_t h, rows, bs, d;
};

// ---- decode ----------------------------------------------------------------------------------------------------

template <typename KV>
void DecodeOne(const Cache& c, int64_t width, int64_t g, int64_t bi, int64_t hi, const float* q,
               const float* k_new, const float* v_new, const KV* k_pages, const KV* v_pages, const int32_t* table,
               int64_t ctx, float* scores, float* out) {
  const int64_t d = c.d, bs = c.bs, n = ctx + 1;
  const float* qg = q + (bi * c.h + hi) * g * d;
  const int32_t* pages = table + bi * width;
  const int64_t page_stride = bs * d;
  const KV* k_head = k_pages + hi * c.rows * page_stride;
  const KV* v_head = v_pages + hi * c.rows * page_stride;

  // Scores: every key read once, against the whole query group.
  for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
    const KV* kp = k_head + static_cast<int64_t>(pages[t0 / bs]) * page_stride;
    const int64_t m = std::min(bs, ctx - t0);
    int64_t t = 0;
    if (d % 8 == 0) {  // eight keys at a time: their eight partial-sum vectors reduced together
      for (; t + 8 <= m; t += 8) {
        const KV* keys = kp + t * d;
        for (int64_t gi = 0; gi < g; ++gi) {
          const float* qq = qg + gi * d;
          v8 p[8] = {};
          for (int64_t i = 0; i < d; i += 8) {
            const v8 qv = Load8(qq + i);
            for (int j = 0; j < 8; ++j) p[j] += qv * Load8(keys + j * d + i);
          }
          Store8(scores + gi * n + t0 + t, Sums8(p));
        }
      }
    }
    for (; t < m; ++t) {
      const KV* key = kp + t * d;
      for (int64_t gi = 0; gi < g; ++gi) {
        const float* qq = qg + gi * d;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < d; ++i) acc += qq[i] * Load(key, i);
        scores[gi * n + t0 + t] = acc;
      }
    }
  }
  const float* kn = k_new + (bi * c.h + hi) * d;
  for (int64_t gi = 0; gi < g; ++gi) {
    const float* qq = qg + gi * d;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < d; ++i) acc += qq[i] * kn[i];
    scores[gi * n + ctx] = acc;
  }

  // Softmax weights, unnormalised; the sums divide at the end.
  float* total = scores + g * n;
  for (int64_t gi = 0; gi < g; ++gi) {
    float* row = scores + gi * n;
    float mx = row[0];
    for (int64_t t = 1; t < n; ++t) mx = std::max(mx, row[t]);
    float sum = 0.0f;
    int64_t t = 0;
    for (const v8 m8 = Splat(mx); t + 8 <= n; t += 8) {
      const v8 e = Exp8(Load8(row + t) - m8);
      Store8(row + t, e);
      sum += HSum(e);
    }
    for (; t < n; ++t) {
      row[t] = ExpNonPositive(row[t] - mx);
      sum += row[t];
    }
    total[gi] = sum;
  }

  // Weighted sum of the values: every value read once, into the whole group's accumulators.
  float* o = out + (bi * c.h + hi) * g * d;
  const float* vn = v_new + (bi * c.h + hi) * d;
  for (int64_t gi = 0; gi < g; ++gi) {
    const float w = scores[gi * n + ctx];
    for (int64_t i = 0; i < d; ++i) o[gi * d + i] = w * vn[i];
  }
  for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
    const KV* vp = v_head + static_cast<int64_t>(pages[t0 / bs]) * page_stride;
    const int64_t m = std::min(bs, ctx - t0);
    int64_t t = 0;
    if (d % 8 == 0) {  // eight values at a time into each accumulator vector, held in a register across them
      for (; t + 8 <= m; t += 8) {
        const KV* values = vp + t * d;
        for (int64_t gi = 0; gi < g; ++gi) {
          const float* w = scores + gi * n + t0 + t;
          float* og = o + gi * d;
          for (int64_t i = 0; i < d; i += 8) {
            v8 acc = Load8(og + i);
            for (int j = 0; j < 8; ++j) acc += Splat(w[j]) * Load8(values + j * d + i);
            Store8(og + i, acc);
          }
        }
      }
    }
    for (; t < m; ++t) {
      const KV* value = vp + t * d;
      for (int64_t gi = 0; gi < g; ++gi) {
        const float w = scores[gi * n + t0 + t];
        float* og = o + gi * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) og[i] += w * Load(value, i);
      }
    }
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    const float inv = 1.0f / total[gi];
    for (int64_t i = 0; i < d; ++i) o[gi * d + i] *= inv;
  }
}

// ---- prefill ---------------------------------------------------------------------------------------------------

constexpr int kKeyBlock = 64;    // keys per block of the flash loop (columns of the score tile)
constexpr int kTileRows = 6;     // query rows per register tile: 6 x 16 accumulators in 12 vector registers
constexpr int kQueryBlock = 64;  // query tokens per work item

// s[i][0..kKeyBlock) = q_i . kt[:, 0..kKeyBlock) for M rows; kt is the key block transposed, [d][kKeyBlock].
template <int M>
inline void ScoreTile(const float* const* q, const float* kt, int64_t d, float* s) {
  for (int c = 0; c < kKeyBlock; c += 16) {
    v8 acc[M][2];
    for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = Splat(0.0f);
    for (int64_t k = 0; k < d; ++k) {
      const v8 b0 = Load8(kt + k * kKeyBlock + c), b1 = Load8(kt + k * kKeyBlock + c + 8);
      for (int i = 0; i < M; ++i) {
        const v8 a = Splat(q[i][k]);
        acc[i][0] += a * b0;
        acc[i][1] += a * b1;
      }
    }
    for (int i = 0; i < M; ++i) {
      Store8(s + i * kKeyBlock + c, acc[i][0]);
      Store8(s + i * kKeyBlock + c + 8, acc[i][1]);
    }
  }
}

// o[i][:] += p[i][0..n) v[0..n)[:] for M rows (o rows d apart, p rows kKeyBlock apart).
template <int M, typename KV>
inline void ValueTile(const float* p, const KV* const* v, int n, float* o, int64_t d) {
  int64_t c = 0;
  for (; c + 16 <= d; c += 16) {
    v8 acc[M][2];
    for (int i = 0; i < M; ++i) {
      acc[i][0] = Load8(o + i * d + c);
      acc[i][1] = Load8(o + i * d + c + 8);
    }
    for (int j = 0; j < n; ++j) {
      const v8 b0 = Load8(v[j] + c), b1 = Load8(v[j] + c + 8);
      for (int i = 0; i < M; ++i) {
        const v8 a = Splat(p[i * kKeyBlock + j]);
        acc[i][0] += a * b0;
        acc[i][1] += a * b1;
      }
    }
    for (int i = 0; i < M; ++i) {
      Store8(o + i * d + c, acc[i][0]);
      Store8(o + i * d + c + 8, acc[i][1]);
    }
  }
  for (; c < d; ++c) {  // head_dim not a multiple of 16
    for (int i = 0; i < M; ++i) {
      float acc = o[i * d + c];
      for (int j = 0; j < n; ++j) acc += p[i * kKeyBlock + j] * Load(v[j], c);
      o[i * d + c] = acc;
    }
  }
}

struct PrefillShape {
  int64_t b, t, g, w;
};

template <typename KV>
void PrefillBlock(const Cache& c, const PrefillShape& s, int64_t bi, int64_t hi, int64_t qb, const float* q,
                  const KV* k_pages, const KV* v_pages, const int32_t* table, int64_t ctx, float* out,
                  std::vector<float>& buf) {
  const int64_t d = c.d, g = s.g, bs = c.bs;
  const int64_t t0 = qb * kQueryBlock, t1 = std::min<int64_t>(t0 + kQueryBlock, s.t);
  const int64_t rows = (t1 - t0) * g;  // (token, group member) pairs
  const int64_t n_keys = ctx + t1;     // the keys the block's last token sees
  buf.resize(d * kKeyBlock + rows * kKeyBlock + rows * d + 2 * rows);
  float* kt = buf.data();               // [d][kKeyBlock]
  float* sc = kt + d * kKeyBlock;       // [rows][kKeyBlock]
  float* o = sc + rows * kKeyBlock;     // [rows][d]
  float* mx = o + rows * d;             // [rows]
  float* l = mx + rows;                 // [rows]
  std::vector<const float*> qrow(rows);
  const auto at = [&](int64_t r) { return ((bi * s.t + t0 + r / g) * c.h + hi) * g + r % g; };
  for (int64_t r = 0; r < rows; ++r) {
    qrow[r] = q + at(r) * d;
    mx[r] = kMasked;
    l[r] = 0.0f;
  }
  std::fill(o, o + rows * d, 0.0f);
  const int32_t* pages = table + bi * s.w;
  const KV* k_head = k_pages + hi * c.rows * bs * d;
  const KV* v_head = v_pages + hi * c.rows * bs * d;
  const KV* vrow[kKeyBlock];
  for (int64_t k0 = 0; k0 < n_keys; k0 += kKeyBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kKeyBlock, n_keys - k0));
    for (int j = 0; j < kKeyBlock; ++j) {  // the block's keys, transposed (zeros past n, masked below)
      if (j < n) {
        const int64_t key = k0 + j, at_row = (static_cast<int64_t>(pages[key / bs]) * bs + key % bs) * d;
        vrow[j] = v_head + at_row;
        for (int64_t k = 0; k < d; ++k) kt[k * kKeyBlock + j] = Load(k_head + at_row, k);
      } else {
        for (int64_t k = 0; k < d; ++k) kt[k * kKeyBlock + j] = 0.0f;
      }
    }
    int64_t r = 0;
    for (; r + kTileRows <= rows; r += kTileRows) ScoreTile<kTileRows>(qrow.data() + r, kt, d, sc + r * kKeyBlock);
    for (; r < rows; ++r) ScoreTile<1>(qrow.data() + r, kt, d, sc + r * kKeyBlock);

    // Online softmax: mask the keys a row does not see, rescale what the row has summed so far.
    const bool diagonal = k0 + kKeyBlock > ctx + t0;
    for (r = 0; r < rows; ++r) {
      float* srow = sc + r * kKeyBlock;
      const int seen = diagonal ? static_cast<int>(std::clamp<int64_t>(ctx + t0 + r / g - k0 + 1, 0, n)) : n;
      for (int j = seen; j < kKeyBlock; ++j) srow[j] = kMasked;
      v8 m8 = Splat(mx[r]);
      for (int j = 0; j < kKeyBlock; j += 8) {
        const v8 x = Load8(srow + j);
        m8 = x > m8 ? x : m8;
      }
      const float m = HMax(m8);
      const float corr = ExpNonPositive(mx[r] - m);
      v8 sum = Splat(0.0f);
      m8 = Splat(m);
      for (int j = 0; j < kKeyBlock; j += 8) {
        const v8 e = Exp8(Load8(srow + j) - m8);
        Store8(srow + j, e);
        sum += e;
      }
      l[r] = l[r] * corr + HSum(sum);
      mx[r] = m;
      if (corr != 1.0f) {
        for (int64_t k = 0; k < d; ++k) o[r * d + k] *= corr;
      }
    }
    for (r = 0; r + kTileRows <= rows; r += kTileRows)
      ValueTile<kTileRows>(sc + r * kKeyBlock, vrow, n, o + r * d, d);
    for (; r < rows; ++r) ValueTile<1>(sc + r * kKeyBlock, vrow, n, o + r * d, d);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / l[r];
    float* dst = out + at(r) * d;
    for (int64_t k = 0; k < d; ++k) dst[k] = o[r * d + k] * inv;
  }
}

// ---- checks and entry points -----------------------------------------------------------------------------------

// The cache's shape into `c`, or an error when the two cache arrays or their dtype do not fit.
ffi::Error CacheOf(const ffi::AnyBuffer& k_pages, const ffi::AnyBuffer& v_pages, Cache* c) {
  const auto kd = k_pages.dimensions();
  if (kd.size() != 4 || v_pages.dimensions().size() != 4 || v_pages.element_count() != k_pages.element_count() ||
      v_pages.element_type() != k_pages.element_type()) {
    return ffi::Error::InvalidArgument("paged attention: k_pages and v_pages must both be [H, rows, bs, D]");
  }
  const auto type = k_pages.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::U16 && type != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("paged attention: the cache must be float32 or bfloat16 (or its uint16 bits)");
  }
  *c = Cache{kd[0], kd[1], kd[2], kd[3]};
  return ffi::Error::Success();
}

// Every page a sequence reads (its first `tokens[b]` tokens) is a row of the cache.
ffi::Error CheckTable(const Cache& c, const int32_t* table, int64_t b, int64_t width, const int32_t* ctx_len,
                      int64_t new_tokens) {
  for (int64_t bi = 0; bi < b; ++bi) {
    const int64_t tokens = static_cast<int64_t>(ctx_len[bi]) + new_tokens;
    if (ctx_len[bi] < 0 || tokens > width * c.bs) {
      return ffi::Error::InvalidArgument("paged attention: ctx_len " + std::to_string(ctx_len[bi]) +
                                         " outside [0, pages * block_size]");
    }
    for (int64_t pi = 0; pi * c.bs < tokens; ++pi) {
      const int32_t row = table[bi * width + pi];
      if (row < 0 || row >= c.rows) {
        return ffi::Error::InvalidArgument("paged attention: page table row " + std::to_string(row) +
                                           " outside the cache's " + std::to_string(c.rows) + " rows");
      }
    }
  }
  return ffi::Error::Success();
}

// Calls fn with the cache arrays as float or bfloat16-bits pointers.
template <typename F>
void WithCache(const ffi::AnyBuffer& k_pages, const ffi::AnyBuffer& v_pages, F fn) {
  if (k_pages.element_type() == ffi::DataType::F32) {
    fn(static_cast<const float*>(k_pages.untyped_data()), static_cast<const float*>(v_pages.untyped_data()));
  } else {
    fn(static_cast<const uint16_t*>(k_pages.untyped_data()), static_cast<const uint16_t*>(v_pages.untyped_data()));
  }
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                           ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                           ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> ctx_len,
                           ffi::ResultBuffer<ffi::F32> out) {
  Cache c;
  if (auto err = CacheOf(k_pages, v_pages, &c); err.failure()) return err;
  const auto qd = q.dimensions();
  const auto td = table.dimensions();
  if (qd.size() != 4 || td.size() != 2 || qd[1] != c.h || qd[3] != c.d || td[0] != qd[0] ||
      ctx_len.element_count() != qd[0] || k_new.element_count() != qd[0] * c.h * c.d ||
      v_new.element_count() != qd[0] * c.h * c.d) {
    return ffi::Error::InvalidArgument("paged decode: q must be [B, H, G, D], k_new and v_new [B, H, D], "
                                       "table [B, P], ctx_len [B], with the cache's H and D");
  }
  const int64_t b = qd[0], g = qd[2], width = td[1];
  const int32_t* tab = table.typed_data();
  const int32_t* lens = ctx_len.typed_data();
  if (auto err = CheckTable(c, tab, b, width, lens, 0); err.failure()) return err;
  int64_t longest = 0, keys = 0;
  for (int64_t bi = 0; bi < b; ++bi) {
    longest = std::max<int64_t>(longest, lens[bi]);
    keys += lens[bi] + 1;
  }
  const float *qp = q.typed_data(), *kn = k_new.typed_data(), *vn = v_new.typed_data();
  float* o = out->typed_data();
  WithCache(k_pages, v_pages, [&](auto* kp, auto* vp) {
    // Items in (sequence, head) order, so neighbouring items share a sequence's page table.
    ParallelFor(pool, b * c.h, 2 * keys * c.h * g * c.d, [=](int64_t item, std::vector<float>& scratch) {
      scratch.resize(g * (longest + 2));
      const int64_t bi = item / c.h, hi = item % c.h;
      DecodeOne(c, width, g, bi, hi, qp, kn, vn, kp, vp, tab, lens[bi], scratch.data(), o);
    });
  });
  return ffi::Error::Success();
}

ffi::Error PagedPrefillImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                            ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> ctx_len,
                            ffi::ResultBuffer<ffi::F32> out) {
  Cache c;
  if (auto err = CacheOf(k_pages, v_pages, &c); err.failure()) return err;
  const auto qd = q.dimensions();
  const auto td = table.dimensions();
  if (qd.size() != 5 || td.size() != 2 || qd[2] != c.h || qd[4] != c.d || td[0] != qd[0] ||
      ctx_len.element_count() != qd[0]) {
    return ffi::Error::InvalidArgument("paged prefill: q must be [B, T, H, G, D], table [B, W], ctx_len [B], "
                                       "with the cache's H and D");
  }
  const PrefillShape s{qd[0], qd[1], qd[3], td[1]};
  const int32_t* tab = table.typed_data();
  const int32_t* lens = ctx_len.typed_data();
  if (auto err = CheckTable(c, tab, s.b, s.w, lens, s.t); err.failure()) return err;
  const int64_t blocks = (s.t + kQueryBlock - 1) / kQueryBlock, per_block = s.b * c.h;
  int64_t pairs = 0;  // (query, key) pairs of the causal attention
  for (int64_t bi = 0; bi < s.b; ++bi) pairs += s.t * (lens[bi] + (s.t + 1) / 2);
  const float* qp = q.typed_data();
  float* o = out->typed_data();
  WithCache(k_pages, v_pages, [&](auto* kp, auto* vp) {
    const int64_t macs = 2 * pairs * c.h * s.g * c.d;
    ParallelFor(pool, blocks * per_block, macs, [=](int64_t item, std::vector<float>& scratch) {
      const int64_t qb = blocks - 1 - item / per_block;  // the last query blocks, which see the most keys, first
      const int64_t bi = item % per_block / c.h, hi = item % c.h;
      PrefillBlock(c, s, bi, hi, qb, qp, kp, vp, tab, lens[bi], o, scratch);
    });
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MooncakePagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_new
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_new
                                  .Arg<ffi::AnyBuffer>()         // k_pages
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ctx_len
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MooncakePagedPrefill, PagedPrefillImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_pages
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ctx_len
                                  .Ret<ffi::Buffer<ffi::F32>>());
