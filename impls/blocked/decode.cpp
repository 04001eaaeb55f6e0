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

// out[r] = sum_x q[r][x] * key[x] for R rows (q in floats, (R, D)), the key row read once. D is a multiple of
// 2 * Vec::size() (16 elements at least: the kernel's head_dim multiple).
template <typename T>
inline void dot_rows(const float* q, int64_t rows, const T* key, int64_t d, float* out) {
  constexpr int64_t W = Vec::size();
  constexpr int64_t R0 = 8;  // rows per pass: 16 accumulators stay in registers
  for (int64_t r0 = 0; r0 < rows; r0 += R0) {
    const int64_t nr = std::min<int64_t>(R0, rows - r0);
    Vec acc[R0];
    for (int64_t r = 0; r < nr; ++r) acc[r] = Vec(0.f);
    for (int64_t x = 0; x < d; x += 2 * W) {
      Vec lo, hi;
      load2(key + x, lo, hi);
      for (int64_t r = 0; r < nr; ++r) {
        const float* qr = q + (r0 + r) * d + x;
        acc[r] = at::vec::fmadd(Vec::loadu(qr), lo, acc[r]);
        acc[r] = at::vec::fmadd(Vec::loadu(qr + W), hi, acc[r]);
      }
    }
    for (int64_t r = 0; r < nr; ++r) out[r0 + r] = hsum(acc[r]);
  }
}

// o[r] += p[r] * value for R rows, the value row read once.
template <typename T>
inline void axpy_rows(const float* p, int64_t rows, const T* value, int64_t d, float* o) {
  constexpr int64_t W = Vec::size();
  for (int64_t x = 0; x < d; x += 2 * W) {
    Vec lo, hi;
    load2(value + x, lo, hi);
    for (int64_t r = 0; r < rows; ++r) {
      if (p[r] == 0.f) continue;
      const Vec pr(p[r]);
      float* orow = o + r * d + x;
      at::vec::fmadd(pr, lo, Vec::loadu(orow)).store(orow);
      at::vec::fmadd(pr, hi, Vec::loadu(orow + W)).store(orow + W);
    }
  }
}

struct Partial {
  std::vector<float> o, m, l;  // (R, D), (R,), (R,)
};

// One split of one (sequence, KV head): blocks [c_begin, c_end) of its list, into `part`. Per block: the R rows'
// scores against its keys (each key row read once), a softmax step per row over the block (one rescale of the
// running output where the row's max grows), then the value rows read once each, added to every row's output.
template <typename T>
void attend_split(const float* qf, int64_t rows, int64_t d, const T* k, const T* v, const int32_t* blocks,
                  const bool* full, int64_t c_begin, int64_t c_end, int64_t bs, int64_t n_valid,
                  const int32_t* page_row, int64_t page_stride, int64_t head_offset, const bool* mask,
                  int64_t mask_rows, int64_t mask_n, float scale, Partial& part) {
  std::vector<float> s(bs * rows), pcol(rows);  // s: (bs, R), key-major: one key's R scores side by side
  std::vector<float> rmax(rows);
  for (int64_t c = c_begin; c < c_end; ++c) {
    const int64_t j = blocks[c];
    const int64_t first = j * bs;
    const int64_t valid = std::min(bs, n_valid - first);
    if (valid <= 0) continue;
    // where block j's rows lie: a page of the pool, or the contiguous cache
    const int64_t base = page_row != nullptr ? (static_cast<int64_t>(page_row[j]) * page_stride + head_offset)
                                             : (head_offset + first * d);
    for (int64_t t = 0; t < valid; ++t) dot_rows(qf, rows, k + base + t * d, d, s.data() + t * rows);
    std::fill(rmax.begin(), rmax.end(), NEG_INF);
    for (int64_t t = 0; t < valid; ++t) {
      float* st = s.data() + t * rows;
      for (int64_t r = 0; r < rows; ++r) {
        float x = st[r] * scale;
        if (!full[c] && !mask[(r % mask_rows) * mask_n + first + t]) x = NEG_INF;
        st[r] = x;
        rmax[r] = std::max(rmax[r], x);
      }
    }
    bool any = false;
    for (int64_t r = 0; r < rows; ++r) {
      if (rmax[r] == NEG_INF) continue;
      any = true;
      float& m = part.m[r];
      if (rmax[r] > m) {  // a new max: rescale what the row holds, once per block
        const float alpha = m == NEG_INF ? 0.f : std::exp(m - rmax[r]);
        float* o = part.o.data() + r * d;
        for (int64_t x = 0; x < d; ++x) o[x] *= alpha;
        part.l[r] *= alpha;
        m = rmax[r];
      }
    }
    if (!any) continue;
    for (int64_t t = 0; t < valid; ++t) {
      float* st = s.data() + t * rows;
      for (int64_t r = 0; r < rows; ++r) {
        const float e = st[r] == NEG_INF ? 0.f : std::exp(st[r] - part.m[r]);
        pcol[r] = e;
        part.l[r] += e;
      }
      axpy_rows(pcol.data(), rows, v + base + t * d, d, part.o.data());
    }
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
