// The decode path of `blocked`'s CPU kernel: a few query rows (q_len <= 16) over a long KV cache, read in place.
//
// Decode is bound by memory: every allowed key and value row must be read once, and there is little arithmetic
// per byte (2 * G * q_len FLOPs per element for G query heads per KV head). So K and V are read where they lie -
// contiguous (B, Hkv, N, D) or a pool of pages (P, Hkv, page, D) through a page table per sequence - and never
// packed or copied: each key block is loaded once for all the query rows of its KV head (the G heads' q_len rows
// as R rows), S = Q K_j^T and O += P V_j are vectorised over the head dimension with the R rows' FMAs on one
// loaded row, the softmax online in float32. The key blocks of a (sequence, KV head) are split over the threads
// (flash-decoding: each split keeps its own max, sum and output) and the splits are combined by log-sum-exp.
//
// Which blocks are read: a list per (sequence, KV head) (the pattern's, or a selection's), each block full or
// partial; a partial block's pairs are looked up in a boolean mask (T, R, N) of the rows' allowed keys, T = 1
// (one for all), B (per sequence) or B * Hkv (per KV head; R = G * q_len when query heads differ).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t MAX_ROWS = 256;  // G * q_len rows of one KV head (32 query heads x 8 rows)

// 2 * Vec::size() elements of src as two float vectors (bfloat16: one 16-bit vector load, widened).
template <typename T>
inline void load2(const T* src, Vec& lo, Vec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo = Vec::loadu(src);
    hi = Vec::loadu(src + Vec::size());
  } else {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src));
  }
}

inline float hsum(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(x);
#else
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
#endif
}

// out[r] = sum_x q[r][x] * key[x] for NR rows (q in floats, (NR, D)), the key row read once. D is a multiple of
// 2 * Vec::size(). The row count is a template argument so that the accumulators stay in registers.
template <int NR, typename T>
inline void dot_rows_n(const float* q, const T* key, int64_t d, float* out) {
  constexpr int64_t W = Vec::size();
  Vec acc[NR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) acc[r] = Vec(0.f);
  for (int64_t x = 0; x < d; x += 2 * W) {
    Vec lo, hi;
    load2(key + x, lo, hi);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      acc[r] = at::vec::fmadd(Vec::loadu(q + r * d + x), lo, acc[r]);
      acc[r] = at::vec::fmadd(Vec::loadu(q + r * d + x + W), hi, acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) out[r] = hsum(acc[r]);
}

template <typename T>
inline void dot_rows(const float* q, int64_t rows, const T* key, int64_t d, float* out) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) dot_rows_n<4>(q + r * d, key, d, out + r);
  switch (rows - r) {
    case 3: dot_rows_n<3>(q + r * d, key, d, out + r); break;
    case 2: dot_rows_n<2>(q + r * d, key, d, out + r); break;
    case 1: dot_rows_n<1>(q + r * d, key, d, out + r); break;
    default: break;
  }
}

constexpr int64_t PREFETCH_ROWS = 8;  // key rows ahead (2 KiB at D = 128 in bfloat16)

inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

struct Partial {
  std::vector<float> o, m, l;  // (R, D), (R,), (R,)
};

// O[r] += sum_t P[r][t] V[t] for NR rows and NV vectors of the head dimension from x0, over `valid` value rows:
// the NR x NV outputs stay in registers while the block's value rows stream by.
template <int NR, int NV, typename T>
inline void pv_tile(const float* p, int64_t ldp, const T* v, int64_t valid, int64_t d, int64_t x0, float* o) {
  constexpr int64_t W = Vec::size();
  Vec acc[NR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) acc[r][i] = Vec::loadu(o + r * d + x0 + i * W);
  for (int64_t t = 0; t < valid; ++t) {
    Vec vv[NV];
#pragma GCC unroll 4
    for (int i = 0; i < NV; i += 2) load2(v + t * d + x0 + i * W, vv[i], vv[i + 1]);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const Vec pr(p[r * ldp + t]);
#pragma GCC unroll 4
      for (int i = 0; i < NV; ++i) acc[r][i] = at::vec::fmadd(pr, vv[i], acc[r][i]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) acc[r][i].store(o + r * d + x0 + i * W);
}

template <int NR, typename T>
inline void pv_rows(const float* p, int64_t ldp, const T* v, int64_t valid, int64_t d, float* o) {
  constexpr int64_t W = Vec::size();
  int64_t x0 = 0;
  for (; x0 + 4 * W <= d; x0 += 4 * W) pv_tile<NR, 4>(p, ldp, v, valid, d, x0, o);
  if (x0 < d) pv_tile<NR, 2>(p, ldp, v, valid, d, x0, o);  // d is a multiple of 2W
}

// O[r] += sum_t P[r][t] V[t] over a block of `valid` value rows, rows four at a time.
template <typename T>
inline void pv_block(const float* p, int64_t ldp, int64_t rows, const T* v, int64_t valid, int64_t d, float* o) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) pv_rows<4>(p + r * ldp, ldp, v, valid, d, o + r * d);
  switch (rows - r) {
    case 3: pv_rows<3>(p + r * ldp, ldp, v, valid, d, o + r * d); break;
    case 2: pv_rows<2>(p + r * ldp, ldp, v, valid, d, o + r * d); break;
    case 1: pv_rows<1>(p + r * ldp, ldp, v, valid, d, o + r * d); break;
    default: break;
  }
}

// One split of one (sequence, KV head): blocks [c_begin, c_end) of its list, into `part`. Per block: the R rows'
// scores against its keys (each key row read once), then per row a vectorised softmax step over the block (one
// rescale of the running output where the row's max grows), then the value rows streamed once through
// `pv_block`.
template <typename T>
void attend_split(const float* qf, int64_t rows, int64_t d, const T* k, const T* v, const int32_t* blocks,
                  const bool* full, int64_t c_begin, int64_t c_end, int64_t bs, int64_t n_valid,
                  const int32_t* page_row, int64_t page_stride, int64_t head_offset, const bool* mask,
                  int64_t mask_rows, int64_t mask_n, float scale, Partial& part) {
  std::vector<float> s(rows * bs), dots(rows);  // s: (R, bs), a row's scores side by side
  for (int64_t c = c_begin; c < c_end; ++c) {
    const int64_t j = blocks[c];
    const int64_t first = j * bs;
    const int64_t valid = std::min(bs, n_valid - first);
    if (valid <= 0) continue;
    // where block j's rows lie: a page of the pool, or the contiguous cache
    const int64_t base = page_row != nullptr ? (static_cast<int64_t>(page_row[j]) * page_stride + head_offset)
                                             : (head_offset + first * d);
    // The loop is bound by memory: ask for the rows a few keys ahead (the hardware prefetcher alone left the
    // loads waiting), and for the next block's first key rows while this one's values stream.
    const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
    for (int64_t t = 0; t < valid; ++t) {
      if (t + PREFETCH_ROWS < valid) prefetch_row(k + base + (t + PREFETCH_ROWS) * d, row_bytes);
      prefetch_row(v + base + t * d, row_bytes);  // its value row, read after the block's scores
      dot_rows(qf, rows, k + base + t * d, d, dots.data());
      for (int64_t r = 0; r < rows; ++r) {
        const bool ok = full[c] || mask[(r % mask_rows) * mask_n + first + t];
        s[r * bs + t] = ok ? dots[r] * scale : NEG_INF;
      }
    }
    bool any = false;
    for (int64_t r = 0; r < rows; ++r) {
      float* row = s.data() + r * bs;
      float mx = NEG_INF;
      for (int64_t t = 0; t < valid; ++t) mx = std::max(mx, row[t]);
      if (mx == NEG_INF) {  // nothing allowed in this block: P = 0
        std::fill(row, row + valid, 0.f);
        continue;
      }
      any = true;
      float& m = part.m[r];
      if (mx > m) {  // a new max: rescale what the row holds, once per block
        const float alpha = m == NEG_INF ? 0.f : std::exp(m - mx);
        float* o = part.o.data() + r * d;
        const Vec a(alpha);
        for (int64_t x = 0; x < d; x += Vec::size()) (Vec::loadu(o + x) * a).store(o + x);
        part.l[r] *= alpha;
        m = mx;
      }
      const Vec shift(m);
      Vec sum(0.f);
      int64_t t = 0;
      for (; t + Vec::size() <= valid; t += Vec::size()) {
        const Vec e = (Vec::loadu(row + t) - shift).exp_u20();  // exp(-inf) = 0: masked keys get no weight
        sum = sum + e;
        e.store(row + t);
      }
      float tail = 0.f;
      for (; t < valid; ++t) {
        row[t] = row[t] == NEG_INF ? 0.f : std::exp(row[t] - m);
        tail += row[t];
      }
      part.l[r] += hsum(sum) + tail;
    }
    if (any) pv_block(s.data(), bs, rows, v + base, valid, d, part.o.data());
  }
}

// q (B, Hkv, R, D) with R = G * q_len rows per KV head; contiguous k, v (B, Hkv, N, D), or paged k, v (P, Hkv,
// page, D) with page_table int32 (B, max_pages) and bs = page; blocks int32 (B * Hkv, max_blocks) and their
// count (B * Hkv,), full bool (B * Hkv, max_blocks); mask bool (T, M, N) with T in {1, B, B * Hkv} and M = R or
// q_len (the rows of one query head, shared by the G heads: mask row = r % M, as q row r = gi * q_len + t);
// lens int32 (B,) keys per sequence. splits >= 1.
// Returns (out (B, Hkv, R, D) in q's dtype, lse (B, Hkv, R) float32).
std::vector<torch::Tensor> decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                            const torch::Tensor& page_table, const torch::Tensor& blocks,
                                            const torch::Tensor& counts, const torch::Tensor& full,
                                            const torch::Tensor& mask, const torch::Tensor& lens, int64_t bs,
                                            double scale, int64_t splits) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes(),
              "q (B, Hkv, R, D); k, v contiguous, one shape");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "one dtype");
  const int64_t b = q.size(0), hkv = q.size(1), rows = q.size(2), d = q.size(3);
  TORCH_CHECK(rows <= MAX_ROWS, "at most ", MAX_ROWS, " rows per KV head");
  TORCH_CHECK(d % (2 * Vec::size()) == 0, "head_dim a multiple of ", 2 * Vec::size());
  const bool paged = page_table.defined() && page_table.numel() > 0;
  TORCH_CHECK(k.dim() == 4 && k.size(1) == hkv && k.size(3) == d, "k (B or P, Hkv, N or page, D)");
  TORCH_CHECK(!paged || k.size(2) == bs, "a page of bs rows");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(0) == b * hkv && counts.numel() == b * hkv &&
              full.sizes() == blocks.sizes(), "blocks, full (B * Hkv, max_blocks), counts (B * Hkv,)");
  TORCH_CHECK(mask.dim() == 3 && (mask.size(0) == 1 || mask.size(0) == b || mask.size(0) == b * hkv) &&
              rows % mask.size(1) == 0, "mask (T, M, N)");
  const int64_t n_ctx = paged ? 0 : k.size(2);
  const int64_t page_stride = paged ? hkv * bs * d : 0;  // elements per page of the pool
  const int64_t max_blocks = blocks.size(1);
  const int64_t tasks = b * hkv * splits;
  auto out = torch::empty_like(q);
  auto lse = torch::empty({b, hkv, rows}, q.options().dtype(at::kFloat));
  std::vector<Partial> parts(tasks);
  auto qf = q.to(at::kFloat).contiguous();
  const float* qp = qf.data_ptr<float>();
  const int32_t* bl = blocks.data_ptr<int32_t>();
  const int32_t* cn = counts.data_ptr<int32_t>();
  const bool* fl = full.data_ptr<bool>();
  const bool* mk = mask.data_ptr<bool>();
  const int32_t* ln = lens.data_ptr<int32_t>();
  const int32_t* pt = paged ? page_table.data_ptr<int32_t>() : nullptr;
  const int64_t max_pages = paged ? page_table.size(1) : 0;
  const int64_t mt = mask.size(0), mrows = mask.size(1), mn = mask.size(2);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* kp = k.data_ptr<T>();
    const T* vp = v.data_ptr<T>();
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t bh = task / splits, split = task % splits, bi = bh / hkv, h = bh % hkv;
        const int64_t count = cn[bh];
        const int64_t per = (count + splits - 1) / splits;
        const int64_t c0 = std::min(count, split * per), c1 = std::min(count, c0 + per);
        Partial& part = parts[task];
        part.o.assign(rows * d, 0.f);
        part.m.assign(rows, NEG_INF);
        part.l.assign(rows, 0.f);
        const int64_t t_index = mt == 1 ? 0 : (mt == b ? bi : bh);
        const int64_t head_offset = paged ? h * bs * d : (bi * hkv + h) * n_ctx * d;
        attend_split<T>(qp + bh * rows * d, rows, d, kp, vp, bl + bh * max_blocks, fl + bh * max_blocks, c0, c1, bs,
                        ln[bi], paged ? pt + bi * max_pages : nullptr, page_stride, head_offset,
                        mk + t_index * mrows * mn, mrows, mn, static_cast<float>(scale), part);
      }
    });
    // combine the splits of each (sequence, KV head) by log-sum-exp
    at::parallel_for(0, b * hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> o(d);
      for (int64_t bh = begin; bh < end; ++bh) {
        for (int64_t r = 0; r < rows; ++r) {
          float m = NEG_INF;
          for (int64_t s = 0; s < splits; ++s) m = std::max(m, parts[bh * splits + s].m[r]);
          float l = 0.f;
          std::fill(o.begin(), o.end(), 0.f);
          if (m != NEG_INF) {
            for (int64_t s = 0; s < splits; ++s) {
              const Partial& part = parts[bh * splits + s];
              if (part.m[r] == NEG_INF) continue;
              const float w = std::exp(part.m[r] - m);
              l += part.l[r] * w;
              for (int64_t x = 0; x < d; ++x) o[x] += part.o[r * d + x] * w;
            }
          }
          const float inv = l > 0.f ? 1.f / l : 0.f;
          for (int64_t x = 0; x < d; ++x) o[x] *= inv;
          T* dst = out.data_ptr<T>() + (bh * rows + r) * d;
          if constexpr (std::is_same_v<T, float>) {
            std::memcpy(dst, o.data(), d * sizeof(float));
          } else {
            at::vec::convert(o.data(), dst, d);
          }
          lse.data_ptr<float>()[bh * rows + r] = l > 0.f ? m + std::log(l) : NEG_INF;
        }
      }
    });
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    default: TORCH_CHECK(false, "float32 or bfloat16, not ", q.scalar_type());
  }
  return {out, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "a few query rows over a KV cache read in place (CPU)");
}
