// Paged decode attention for XLA:CPU, an XLA FFI custom call (see cpu_kernel/__init__.py for why it exists).
//
// One query token per sequence attends its cached context, read in place from the paged cache through the page
// table, plus its own new key/value. Work items are (sequence, kv head) pairs spread over XLA's intra-op thread
// pool; each item reads its keys once (scores for the whole query group), takes the softmax over the scores held
// in a small per-thread buffer, then reads its values once. Nothing is gathered or copied.
//
// Operands (shapes checked in Python and again here):
//   q        f32 [B, H, G, D]     query heads grouped by kv head, already scaled
//   k_new    f32 [B, H, D]        the new token's key and value (not read from the pages)
//   v_new    f32 [B, H, D]
//   k_pages  [H, R, bs, D]        f32, or uint16 holding bfloat16 bits (the CPU's stored 16-bit cache)
//   v_pages  [H, R, bs, D]        same dtype as k_pages
//   table    s32 [B, P]           cache rows of each sequence's context pages, in order
//   ctx_len  s32 [B]              cached tokens of each sequence (<= P * bs)
// Result:
//   out      f32 [B, H, G, D]

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

inline float Load(const float* p, int64_t i) { return p[i]; }

inline float Load(const uint16_t* p, int64_t i) {  // bfloat16 bits
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp(x) for x <= 0 (scores minus their max), vectorisable: 2^n * p(r) with r in [-ln2/2, ln2/2], a degree-6
// polynomial (relative error about 2e-7); below -87 it returns about 1.6e-38 rather than 0.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

struct Shapes {
  int64_t b, h, g, d, rows, bs, p;
};

// One (sequence, kv head) item. `scores` holds G * (ctx + 1) + G floats: the scores, then each query's sum.
template <typename KV>
void AttendOne(const Shapes& s, int64_t bi, int64_t hi, const float* q, const float* k_new, const float* v_new,
               const KV* k_pages, const KV* v_pages, const int32_t* table, int64_t ctx, float* scores,
               float* out) {
  const int64_t d = s.d, g = s.g, bs = s.bs, n = ctx + 1;
  const float* qg = q + (bi * s.h + hi) * g * d;
  const int32_t* pages = table + bi * s.p;
  const int64_t page_stride = bs * d;
  const KV* k_head = k_pages + hi * s.rows * page_stride;
  const KV* v_head = v_pages + hi * s.rows * page_stride;

  // Scores: every key read once, against the whole query group.
  for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
    const KV* kp = k_head + static_cast<int64_t>(pages[t0 / bs]) * page_stride;
    const int64_t m = std::min(bs, ctx - t0);
    for (int64_t t = 0; t < m; ++t) {
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
  const float* kn = k_new + (bi * s.h + hi) * d;
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
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      const float e = ExpNonPositive(row[t] - mx);
      row[t] = e;
      sum += e;
    }
    total[gi] = sum;
  }

  // Weighted sum of the values: every value read once, into the whole group's accumulators.
  float* o = out + (bi * s.h + hi) * g * d;
  const float* vn = v_new + (bi * s.h + hi) * d;
  for (int64_t gi = 0; gi < g; ++gi) {
    const float w = scores[gi * n + ctx];
    for (int64_t i = 0; i < d; ++i) o[gi * d + i] = w * vn[i];
  }
  for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
    const KV* vp = v_head + static_cast<int64_t>(pages[t0 / bs]) * page_stride;
    const int64_t m = std::min(bs, ctx - t0);
    for (int64_t t = 0; t < m; ++t) {
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

// Items shared between the calling thread and the pool's; kept alive by every task holding it.
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t items = 0;
};

template <typename KV>
void Run(ffi::ThreadPool& pool, const Shapes s, const float* q, const float* k_new, const float* v_new,
         const KV* k_pages, const KV* v_pages, const int32_t* table, const int32_t* ctx_len, float* out) {
  int64_t longest = 0;
  for (int64_t bi = 0; bi < s.b; ++bi) longest = std::max<int64_t>(longest, ctx_len[bi]);
  const int64_t scratch = s.g * (longest + 2);
  auto work = std::make_shared<Work>();
  work->items = s.b * s.h;
  // Items in (sequence, head) order, so neighbouring items share a sequence's page table. The body captures by
  // value: a task that starts after the call has returned finds no item left and touches nothing freed.
  auto body = [=]() {
    std::vector<float> scores;
    for (;;) {
      const int64_t item = work->next.fetch_add(1, std::memory_order_relaxed);
      if (item >= work->items) return;
      scores.resize(scratch);
      const int64_t bi = item / s.h, hi = item % s.h;
      AttendOne(s, bi, hi, q, k_new, v_new, k_pages, v_pages, table, ctx_len[bi], scores.data(), out);
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(body)(body));  // a copy: Schedule takes F&&
  body();
  while (work->done.load(std::memory_order_acquire) < work->items) std::this_thread::yield();
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                           ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                           ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> ctx_len,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  const auto td = table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_decode: q must be [B, H, G, D], pages [H, R, bs, D], table [B, P]");
  }
  const Shapes s{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], td[1]};
  if (kd[0] != s.h || kd[3] != s.d || td[0] != s.b || ctx_len.element_count() != s.b ||
      k_new.element_count() != s.b * s.h * s.d || v_new.element_count() != s.b * s.h * s.d ||
      v_pages.dimensions().size() != 4 || v_pages.element_count() != k_pages.element_count() ||
      v_pages.element_type() != k_pages.element_type()) {
    return ffi::Error::InvalidArgument("paged_decode: operand shapes do not agree");
  }
  const int32_t* tab = table.typed_data();
  const int32_t* lens = ctx_len.typed_data();
  for (int64_t bi = 0; bi < s.b; ++bi) {
    if (lens[bi] < 0 || lens[bi] > s.p * s.bs) {
      return ffi::Error::InvalidArgument("paged_decode: ctx_len " + std::to_string(lens[bi]) +
                                         " outside [0, pages * block_size]");
    }
    for (int64_t pi = 0; pi * s.bs < lens[bi]; ++pi) {
      const int32_t row = tab[bi * s.p + pi];
      if (row < 0 || row >= s.rows) {
        return ffi::Error::InvalidArgument("paged_decode: page table row " + std::to_string(row) +
                                           " outside the cache's " + std::to_string(s.rows) + " rows");
      }
    }
  }
  switch (k_pages.element_type()) {
    case ffi::DataType::F32:
      Run(pool, s, q.typed_data(), k_new.typed_data(), v_new.typed_data(),
          static_cast<const float*>(k_pages.untyped_data()), static_cast<const float*>(v_pages.untyped_data()), tab,
          lens, out->typed_data());
      return ffi::Error::Success();
    case ffi::DataType::U16:
    case ffi::DataType::BF16:
      Run(pool, s, q.typed_data(), k_new.typed_data(), v_new.typed_data(),
          static_cast<const uint16_t*>(k_pages.untyped_data()),
          static_cast<const uint16_t*>(v_pages.untyped_data()), tab, lens, out->typed_data());
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("paged_decode: the cache must be float32 or bfloat16 (or its uint16 bits)");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MooncakePagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
