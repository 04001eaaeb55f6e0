// The decode path of `blocked`'s CPU kernel: a few query rows (q_len <= 16) over a long KV cache, read in place.
//
// Decode is bound by memory: every allowed key and value row must be read once, and there is little arithmetic
// per byte (2 * G * q_len FLOPs per element for G query heads per KV head). So K and V are read where they lie -
// contiguous (B, Hkv, N, D) or a pool of pages (P, Hkv, page, D) through a page table per sequence - and never
// packed or copied: each key row is loaded once for all the query rows of its KV head (the G heads' q_len rows as
// R rows), the softmax online in float32. The key blocks of a (sequence, KV head) are split over the threads
// (flash-decoding: each split keeps its own max, sum and output) and the splits are combined by log-sum-exp.
//
// The loop walks the list's blocks as groups of up to 16 key rows (a page of 16; a quarter of a 64-key block), the
// gather through the page table fused into it: a group is one pointer, its page's rows. Through pages and gathered
// tokens four groups make one softmax step (64 keys, whatever the page size: pages of 16 would otherwise pay a
// softmax step each), and while a step computes the next one's rows are prefetched (a page's rows lie anywhere in
// the pool, where the hardware prefetcher cannot follow); a contiguous cache takes steps of up to 1024 keys, its
// value rows prefetched while its keys are scored and the next step's keys while its values are summed
// (attend_lanes). Scores of a group are 16 dot products per
// row reduced to one vector by a transpose-and-add tree (a horizontal sum per key and row cost more than the dot
// products); through pages or gathered tokens, four rows' scores of four keys are reduced together instead, each
// key row loaded once for the four (Lane::quads). On AVX512 with AVX512-BF16 (detected at run time) bfloat16 rows
// go through its dot-product instruction: q . k on bfloat16 pairs, and P V with P rounded to bfloat16 (as torch's
// flash kernel does) against value rows interleaved in pairs; elsewhere the products are float32 FMAs (bfloat16
// widened).
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
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t MAX_ROWS = 256;  // G * q_len rows of one KV head (32 query heads x 8 rows)
constexpr int64_t GK = 16;  // key rows per group: one AVX512 vector of scores
constexpr int64_t STEP_GROUPS = 4;  // groups per softmax step through pages and gathered tokens
// A contiguous cache's step where a KV head has at most STREAM_MAX_ROWS query rows (decode is bound by its reads;
// with more rows by its arithmetic, which the larger steps slowed: docs/performance.md, "Measured choices", D1): as
// many groups as keep a step's scores of all rows within 64 KB, 64 at most (1024 keys; see attend_lanes).
constexpr int64_t STREAM_MAX_ROWS = 8, STREAM_SCORE_FLOATS = 16384, STREAM_STEP_GROUPS = 64;

inline int64_t stream_step_groups(int64_t rows) {
  return std::clamp<int64_t>(STREAM_SCORE_FLOATS / (std::max<int64_t>(rows, 1) * GK), STEP_GROUPS, STREAM_STEP_GROUPS);
}

struct Partial {
  std::vector<float> o, m, l;  // (R, D), (R,), (R,)
};

// A run of up to GK key rows inside one block (one page): offset of its first row in K and V (elements), its first
// key position, how many rows are real, whether every row of the list may see all of them.
struct Group {
  int64_t off, first, valid;
  bool full;
  const int32_t* rows = nullptr;  // a gathered group: key t is row rows[t] after off, not row t
};

// Where key t of a group starts in K or V (elements).
inline int64_t key_row(const Group& g, int64_t t, int64_t d) {
  return g.off + (g.rows != nullptr ? static_cast<int64_t>(g.rows[t]) : t) * d;
}

inline void prefetch_rows(const void* p, int64_t rows, int64_t row_bytes, int hint) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < rows * row_bytes; off += 64) {
    if (hint == 0) _mm_prefetch(c + off, _MM_HINT_T0); else _mm_prefetch(c + off, _MM_HINT_T1);
  }
}

inline float hsum(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(x);
#else
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
#endif
}

// Where a row's allowed keys are looked up for a partial group: row r's mask is base + (r % rows) * n.
struct MaskRows {
  const bool* base;
  int64_t rows, n;
};

// ---- the portable engine (any vector ISA): a horizontal sum per key and row; P in float32 ----------------------

template <typename T>
inline void load2(const T* src, Vec& lo, Vec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo = Vec::loadu(src);
    hi = Vec::loadu(src + Vec::size());
  } else {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src));
  }
}

template <typename T>
struct PortableEngine {
  using P = float;
  // s[r * lds + t] = scale * q_r . k_t for the group's GK slots, -inf where the row may not see the key (or t >= valid).
  static void qk(const float* q, int64_t rows, const T* k, const Group& g, int64_t d, float scale,
                 const MaskRows& mr, float* s, int64_t lds, bool /*quads*/) {
    constexpr int64_t W = Vec::size();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = 0; t < GK; ++t) {
        if (t >= g.valid || !(g.full || mr.base[(r % mr.rows) * mr.n + g.first + t])) {
          s[r * lds + t] = NEG_INF;
          continue;
        }
        Vec acc(0.f);
        for (int64_t x = 0; x < d; x += 2 * W) {
          Vec lo, hi;
          load2(k + key_row(g, t, d) + x, lo, hi);
          acc = at::vec::fmadd(Vec::loadu(q + r * d + x), lo, at::vec::fmadd(Vec::loadu(q + r * d + x + W), hi, acc));
        }
        s[r * lds + t] = hsum(acc) * scale;
      }
  }
  static void to_p(const float* e, int64_t n, float* p) { std::memcpy(p, e, n * sizeof(float)); }
  // o[r] += sum_t p[r][t] v_t over a step's groups, for `rows` rows (ldp: P's row stride).
  static void pv(const float* p, int64_t ldp, int64_t rows, const T* v, const Group* g, int64_t ng, int64_t d,
                 float* o) {
    constexpr int64_t W = Vec::size();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t x = 0; x < d; x += 2 * W) {
        Vec a0 = Vec::loadu(o + r * d + x), a1 = Vec::loadu(o + r * d + x + W);
        for (int64_t gi = 0; gi < ng; ++gi)
          for (int64_t t = 0; t < g[gi].valid; ++t) {
            Vec lo, hi;
            load2(v + key_row(g[gi], t, d) + x, lo, hi);
            const Vec pr(p[r * ldp + gi * GK + t]);
            a0 = at::vec::fmadd(pr, lo, a0);
            a1 = at::vec::fmadd(pr, hi, a1);
          }
        a0.store(o + r * d + x);
        a1.store(o + r * d + x + W);
      }
  }
  static void finish(float*, int64_t, int64_t) {}
};

#if defined(CPU_CAPABILITY_AVX2)
// ---- AVX2: 8 keys' dot products reduced together, float32 FMAs (bfloat16 widened) ----------------------------

// [sum of a[0]'s lanes, ..., sum of a[7]'s lanes]: horizontal adds of pairs, then the two 128-bit halves added.
inline __m256 reduce8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <typename T>
inline __m256 load8(const T* p) {  // 8 elements as floats
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
}

// The FmaEngine below on 8-float vectors: a group's 16 keys as two reductions of 8, P V in tiles of 32 columns
// (AVX2's 16 registers hold 2 rows x 4 vectors of outputs beside the value vectors).
template <typename T>
struct Avx2FmaEngine {
  using P = float;
  static void qk(const float* q, int64_t rows, const T* k, const Group& g, int64_t d, float scale,
                 const MaskRows& mr, float* s, int64_t lds, bool /*quads*/) {
    const int64_t last = g.valid - 1;  // rows past the group's last are never read: its last row stands in
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * d;
      float* sr = s + r * lds;
      for (int half = 0; half < GK / 8; ++half) {
        __m256 acc[8];
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          const T* row = k + key_row(g, std::min<int64_t>(half * 8 + t, last), d);
          __m256 a = _mm256_mul_ps(load8(row), _mm256_loadu_ps(qr));
          for (int64_t x = 8; x < d; x += 8) a = _mm256_fmadd_ps(load8(row + x), _mm256_loadu_ps(qr + x), a);
          acc[t] = a;
        }
        _mm256_storeu_ps(sr + half * 8, _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale)));
      }
      for (int64_t t = 0; t < GK; ++t)  // the keys row r may not see: -inf
        if (t >= g.valid || !(g.full || mr.base[(r % mr.rows) * mr.n + g.first + t])) sr[t] = NEG_INF;
    }
  }
  static void to_p(const float* e, int64_t n, float* p) { std::memcpy(p, e, n * sizeof(float)); }
  template <int NR>
  static void pv_tile(const float* p, int64_t ldp, const T* v, const Group* g, int64_t ng, int64_t d, int64_t x0,
                      float* o) {
    __m256 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_loadu_ps(o + r * d + x0 + 8 * i);
    for (int64_t gi = 0; gi < ng; ++gi)
      for (int64_t t = 0; t < g[gi].valid; ++t) {
        const T* row = v + key_row(g[gi], t, d) + x0;
        __m256 vv[4];
        for (int i = 0; i < 4; ++i) vv[i] = load8(row + 8 * i);
        for (int r = 0; r < NR; ++r) {
          const __m256 pr = _mm256_set1_ps(p[r * ldp + gi * GK + t]);
          for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_fmadd_ps(pr, vv[i], acc[r][i]);
        }
      }
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + r * d + x0 + 8 * i, acc[r][i]);
  }
  // d is a multiple of 32 (HEAD_DIM_MULTIPLE)
  static void pv(const float* p, int64_t ldp, int64_t rows, const T* v, const Group* g, int64_t ng, int64_t d,
                 float* o) {
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2)
      for (int64_t x0 = 0; x0 < d; x0 += 32) pv_tile<2>(p + r * ldp, ldp, v, g, ng, d, x0, o + r * d);
    if (r < rows)
      for (int64_t x0 = 0; x0 < d; x0 += 32) pv_tile<1>(p + r * ldp, ldp, v, g, ng, d, x0, o + r * d);
  }
  static void finish(float*, int64_t, int64_t) {}
};
#endif

#if defined(CPU_CAPABILITY_AVX512)
// ---- AVX512: 16 keys' dot products reduced together ---------------------------------------------------------

// [sum of a[0]'s lanes, ..., sum of a[15]'s lanes]: pairs of vectors interleaved and added at 32-bit, 64-bit, then
// 128-bit granularity (the 64-bit shuffles move float pairs; the adds are of floats).
inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 f0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
  const __m512 f1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f0, f1, 0x88), _mm512_shuffle_f32x4(f0, f1, 0xdd));
}

// The keys of the group row r may see: the real ones, and where the group is partial those its mask allows.
inline __mmask16 allowed_keys(const Group& g, const MaskRows& mr, int64_t r) {
  const __mmask16 real = static_cast<__mmask16>(g.valid >= GK ? 0xffff : (1u << g.valid) - 1);
  if (g.full) return real;
  const __m128i bytes = _mm_maskz_loadu_epi8(real, mr.base + (r % mr.rows) * mr.n + g.first);
  return _mm_test_epi8_mask(bytes, bytes) & real;
}

inline void store_scores(__m512 dots, float scale, __mmask16 allowed, float* s) {
  _mm512_storeu_ps(s, _mm512_mask_mul_ps(_mm512_set1_ps(NEG_INF), allowed, dots, _mm512_set1_ps(scale)));
}

template <typename T>
inline __m512 load16(const T* p) {  // 16 elements as floats
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
}

// float32 FMAs (float32 inputs, or bfloat16 widened where the CPU has no AVX512-BF16).
template <typename T>
struct FmaEngine {
  using P = float;
  static void qk(const float* q, int64_t rows, const T* k, const Group& g, int64_t d, float scale,
                 const MaskRows& mr, float* s, int64_t lds, bool /*quads*/) {
    const int64_t last = g.valid - 1;  // rows past the group's last are never read: its last row stands in
    for (int64_t r = 0; r < rows; ++r) {
      __m512 acc[GK];
      const float* qr = q + r * d;
#pragma GCC unroll 16
      for (int t = 0; t < GK; ++t) {
        const T* row = k + key_row(g, std::min<int64_t>(t, last), d);
        __m512 a = _mm512_mul_ps(load16(row), _mm512_loadu_ps(qr));
        for (int64_t x = 16; x < d; x += 16) a = _mm512_fmadd_ps(load16(row + x), _mm512_loadu_ps(qr + x), a);
        acc[t] = a;
      }
      store_scores(reduce16(acc), scale, allowed_keys(g, mr, r), s + r * lds);
    }
  }
  static void to_p(const float* e, int64_t n, float* p) { std::memcpy(p, e, n * sizeof(float)); }
  // NR rows' outputs over 64 columns from x0 (NV = 4 vectors; 2 at a 32-column tail) in registers while the step's
  // value rows stream by.
  template <int NR, int NV>
  static void pv_tile(const float* p, int64_t ldp, const T* v, const Group* g, int64_t ng, int64_t d, int64_t x0,
                      float* o) {
    __m512 acc[NR][NV];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_loadu_ps(o + r * d + x0 + 16 * i);
    for (int64_t gi = 0; gi < ng; ++gi)
      for (int64_t t = 0; t < g[gi].valid; ++t) {
        const T* row = v + key_row(g[gi], t, d) + x0;
        __m512 vv[NV];
        for (int i = 0; i < NV; ++i) vv[i] = load16(row + 16 * i);
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) {
          const __m512 pr = _mm512_set1_ps(p[r * ldp + gi * GK + t]);
          for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_fmadd_ps(pr, vv[i], acc[r][i]);
        }
      }
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(o + r * d + x0 + 16 * i, acc[r][i]);
  }
  template <int NR>
  static void pv_rows(const float* p, int64_t ldp, const T* v, const Group* g, int64_t ng, int64_t d, float* o) {
    int64_t x0 = 0;
    for (; x0 + 64 <= d; x0 += 64) pv_tile<NR, 4>(p, ldp, v, g, ng, d, x0, o);
    if (x0 < d) pv_tile<NR, 2>(p, ldp, v, g, ng, d, x0, o);
  }
  static void pv(const float* p, int64_t ldp, int64_t rows, const T* v, const Group* g, int64_t ng, int64_t d,
                 float* o) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) pv_rows<4>(p + r * ldp, ldp, v, g, ng, d, o + r * d);
    if (r + 2 <= rows) pv_rows<2>(p + r * ldp, ldp, v, g, ng, d, o + r * d), r += 2;
    if (r < rows) pv_rows<1>(p + r * ldp, ldp, v, g, ng, d, o + r * d);
  }
  static void finish(float*, int64_t, int64_t) {}
};

// AVX512-BF16's dot product of bfloat16 pairs (vdpbf16ps); its functions carry the target themselves, so the
// module runs on AVX512 CPUs without it (the engine is chosen at run time).
#define BF16_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx512dq")))
struct DotEngine {
  using T = at::BFloat16;
  using P = uint16_t;  // bfloat16 bits
  BF16_TARGET static void qk(const uint16_t* q, int64_t rows, const T* k, const Group& g, int64_t d, float scale,
                             const MaskRows& mr, float* s, int64_t lds, bool quads) {
    const uint16_t* kb = reinterpret_cast<const uint16_t*>(k);
    const int64_t last = g.valid - 1;
    int64_t r = 0;
    // Four rows at a time (quads): four keys' rows loaded once for four query rows (16 dot products in 16
    // registers), reduced together; lane 4i + j holds row i's score of key j. A quarter of the loads of the
    // row-by-row loop below, whose bursts of loads over the group's 16 rows overlap DRAM misses better instead:
    // the caller picks (see Lane::quads).
    for (; quads && r + 4 <= rows; r += 4) {
      for (int t0 = 0; t0 < GK; t0 += 4) {
        const uint16_t* kr[4];
        for (int j = 0; j < 4; ++j) kr[j] = kb + key_row(g, std::min<int64_t>(t0 + j, last), d);
        const uint16_t* qr = q + r * d;
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t x = 0; x < d; x += 32) {
          __m512i kv[4];
          for (int j = 0; j < 4; ++j) kv[j] = _mm512_loadu_si512(kr[j] + x);
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(qr + i * d + x);
            for (int j = 0; j < 4; ++j) acc[4 * i + j] = _mm512_dpbf16_ps(acc[4 * i + j], (__m512bh)kv[j], qv);
          }
        }
        const __m512 red = reduce16(acc);
        _mm_storeu_ps(s + (r + 0) * lds + t0, _mm512_extractf32x4_ps(red, 0));
        _mm_storeu_ps(s + (r + 1) * lds + t0, _mm512_extractf32x4_ps(red, 1));
        _mm_storeu_ps(s + (r + 2) * lds + t0, _mm512_extractf32x4_ps(red, 2));
        _mm_storeu_ps(s + (r + 3) * lds + t0, _mm512_extractf32x4_ps(red, 3));
      }
      for (int i = 0; i < 4; ++i) store_scores(_mm512_loadu_ps(s + (r + i) * lds), scale, allowed_keys(g, mr, r + i),
                                               s + (r + i) * lds);
    }
    for (; r < rows; ++r) {
      __m512 acc[GK];
      const uint16_t* qr = q + r * d;
#pragma GCC unroll 16
      for (int t = 0; t < GK; ++t) {
        const uint16_t* row = kb + key_row(g, std::min<int64_t>(t, last), d);
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(row),
                                    (__m512bh)_mm512_loadu_si512(qr));
        for (int64_t x = 32; x < d; x += 32)
          a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(row + x), (__m512bh)_mm512_loadu_si512(qr + x));
        acc[t] = a;
      }
      store_scores(reduce16(acc), scale, allowed_keys(g, mr, r), s + r * lds);
    }
  }
  BF16_TARGET static void to_p(const float* e, int64_t n, uint16_t* p) {  // n a multiple of 16
    for (int64_t i = 0; i < n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(e + i)));
  }
  // NR rows' outputs over 64 columns from x0 (NV = 4 vectors; 2 at a 32-column tail) from value rows taken in pairs
  // (t, t + 1; zeros past the group), interleaved: per 32 columns, lanes 4L + j of `lo` hold column 8L + j and of
  // `hi` column 8L + 4 + j (finish puts them back in order).
  template <int NR, int NV>
  BF16_TARGET static void pv_tile(const uint16_t* p, int64_t ldp, const T* v, const Group* g, int64_t ng, int64_t d,
                                  int64_t x0, float* o) {
    __m512 acc[NR][NV];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_loadu_ps(o + r * d + x0 + 16 * i);
    for (int64_t gi = 0; gi < ng; ++gi) {
      const uint16_t* vb = reinterpret_cast<const uint16_t*>(v) + x0;
      for (int64_t t = 0; t < g[gi].valid; t += 2) {
        const bool second = t + 1 < g[gi].valid;
        const uint16_t* va = vb + key_row(g[gi], t, d);
        const uint16_t* vn = second ? vb + key_row(g[gi], t + 1, d) : va;
        __m512i vv[NV];
        for (int i = 0; i < NV; i += 2) {
          const __m512i a = _mm512_loadu_si512(va + 16 * i);
          const __m512i b = second ? _mm512_loadu_si512(vn + 16 * i) : _mm512_setzero_si512();
          vv[i] = _mm512_unpacklo_epi16(a, b);
          vv[i + 1] = _mm512_unpackhi_epi16(a, b);
        }
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) {
          int32_t both;
          std::memcpy(&both, p + r * ldp + gi * GK + t, sizeof(both));
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(both);
          for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], (__m512bh)vv[i], pp);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(o + r * d + x0 + 16 * i, acc[r][i]);
  }
  template <int NR>
  BF16_TARGET static void pv_rows(const uint16_t* p, int64_t ldp, const T* v, const Group* g, int64_t ng, int64_t d,
                                  float* o) {
    int64_t x0 = 0;
    for (; x0 + 64 <= d; x0 += 64) pv_tile<NR, 4>(p, ldp, v, g, ng, d, x0, o);
    if (x0 < d) pv_tile<NR, 2>(p, ldp, v, g, ng, d, x0, o);
  }
  BF16_TARGET static void pv(const uint16_t* p, int64_t ldp, int64_t rows, const T* v, const Group* g, int64_t ng,
                             int64_t d, float* o) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) pv_rows<4>(p + r * ldp, ldp, v, g, ng, d, o + r * d);
    if (r + 2 <= rows) pv_rows<2>(p + r * ldp, ldp, v, g, ng, d, o + r * d), r += 2;
    if (r < rows) pv_rows<1>(p + r * ldp, ldp, v, g, ng, d, o + r * d);
  }
  static void finish(float* o, int64_t rows, int64_t d) {  // the pairs' lanes back to column order
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t i = 0; i < rows * d; i += 32) {
      const __m512 lo = _mm512_loadu_ps(o + i), hi = _mm512_loadu_ps(o + i + 16);
      _mm512_storeu_ps(o + i, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(o + i + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
  }
};
#endif

// Where a list's blocks lie: the page table (paged) or the contiguous cache, the list and its full flags.
struct ListView {
  const int32_t* blocks;
  const bool* full;
  int64_t bs, n_valid;
  const int32_t* page_row;  // null: contiguous
  int64_t page_stride, head_offset, d;
};

// The groups of blocks [c_begin, c_end) of a list, in order, empty ones left out, into `out` (a thread's, reused).
inline void groups_of(const ListView& lv, int64_t c_begin, int64_t c_end, std::vector<Group>& out) {
  out.clear();
  for (int64_t c = c_begin; c < c_end; ++c) {
    const int64_t j = lv.blocks[c], first = j * lv.bs;
    const int64_t valid = std::min(lv.bs, lv.n_valid - first);
    const int64_t base = lv.page_row != nullptr ? static_cast<int64_t>(lv.page_row[j]) * lv.page_stride + lv.head_offset
                                                : lv.head_offset + first * lv.d;
    for (int64_t t0 = 0; t0 < valid; t0 += GK)
      out.push_back({base + t0 * lv.d, first + t0, std::min(GK, valid - t0), lv.full[c]});
  }
}

// Groups of GK gathered keys [c_begin, c_end) of a list of key rows after `base` (every key allowed), into `out`.
inline void gathered_groups(int64_t base, const int32_t* rows, int64_t c_begin, int64_t c_end,
                            std::vector<Group>& out) {
  out.clear();
  for (int64_t c = c_begin; c < c_end; c += GK) out.push_back({base, c, std::min(GK, c_end - c), true, rows + c});
}

// One row's online-softmax step over `cols` scores s (-inf where not allowed): P into p, the running max, sum and
// output rescaled where the max grows. Returns whether the row had an allowed key here.
template <typename E>
inline bool softmax_step(float* s, int64_t cols, typename E::P* p, float& m, float& l, float* o, int64_t d) {
  Vec top(NEG_INF);
  for (int64_t t = 0; t < cols; t += Vec::size()) top = at::vec::maximum(top, Vec::loadu(s + t));
  const float mx = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, top);
  if (mx == NEG_INF) {
    std::fill(s, s + cols, 0.f);
    E::to_p(s, cols, p);
    return false;
  }
  if (mx > m) {  // a new max: rescale what the row holds, once per step
    const float alpha = m == NEG_INF ? 0.f : std::exp(m - mx);
    const Vec a(alpha);
    for (int64_t x = 0; x < d; x += Vec::size()) (Vec::loadu(o + x) * a).store(o + x);
    l *= alpha;
    m = mx;
  }
  const Vec shift(m);
  Vec sum(0.f);
  for (int64_t t = 0; t < cols; t += Vec::size()) {  // cols: whole groups of 16, a multiple of Vec::size()
    const Vec e = (Vec::loadu(s + t) - shift).exp_u20();  // exp(-inf) = 0: masked keys get no weight
    sum = sum + e;
    e.store(s + t);
  }
  l += hsum(sum);
  E::to_p(s, cols, p);
  return true;
}

// One (sequence, KV head)'s share of a task: its rows of q, the groups of its split, its masks and partial.
template <typename Q>
struct Lane {
  const Q* q;
  std::vector<Group> groups;
  MaskRows mr;
  Partial* part;
  // Scores four query rows at a time (DotEngine): for keys the hardware prefetcher cannot follow (pages, gathered
  // tokens), where the data are prefetched and the arithmetic is what remains; not for a contiguous cache in DRAM,
  // where the row loop's bursts of loads keep more misses in flight (docs/performance.md, "Measured choices", D2).
  bool quads;
};

// A load whose value is not used: its address translated and its line brought in.
inline void touch(const void* p) {
  const volatile char sink = *static_cast<const volatile char*>(p);
  (void)sink;
}

// A group's rows of K or V (`base`) prefetched into L2. A group of rows lies in one or two 4 KB pages of its own
// (a page of 16 rows of 256 bytes; a contiguous cache's rows 16 at a time), whose translation is seldom in the TLB:
// the prefetches alone did nothing measurable, and one load of the group's first byte ahead of them, which walks the
// page table where a prefetch does not, made both the paged and the contiguous call faster. A load of its last byte
// as well was slower; gathered rows (one load each) too; and where rows read the same pages one after the other
// (Quest's page rows) the pages are at hand and the loads only cost (TOUCH false: the caller's pages_reread). A
// template parameter: tested at run time inside the loop, it slowed Quest's rows (docs/performance.md, "Measured
// choices", D3).
template <bool TOUCH, typename T>
inline void prefetch_group(const Group& g, const T* base, int64_t d) {
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  if (g.rows != nullptr) {  // gathered: each key row where it lies
    for (int64_t t = 0; t < g.valid; ++t) prefetch_rows(base + key_row(g, t, d), 1, row_bytes, 1);
  } else {
    if constexpr (TOUCH) touch(base + g.off);
    prefetch_rows(base + g.off, g.valid, row_bytes, 1);
  }
}

// How a lane's steps are walked: groups per step, and whether its reads are streamed (a contiguous cache: this
// step's value rows prefetched while its keys are scored, the next step's key rows while its values are summed),
// else a whole step ahead (pages, gathered tokens: attend_lanes).
struct Stepping {
  int64_t groups;
  bool stream;
  int64_t keys() const { return groups * GK; }
};

// One softmax step of a lane (groups [g0, g0 + step.groups)): the R rows' scores (scaled, masked), a softmax step
// per row, the value rows streamed once through the engine's P V. Streamed: `next` and `next_g0` the lane and
// first group of the step after this one (null: none).
template <typename T, typename E, bool TOUCH, typename Q>
void lane_step(const Lane<Q>& lane, int64_t g0, const Stepping& step, int64_t rows, const T* k, const T* v, int64_t d,
               float scale, float* s, typename E::P* p, const Lane<Q>* next, int64_t next_g0) {
  const int64_t ng = static_cast<int64_t>(lane.groups.size()), nc = std::min(step.groups, ng - g0);
  const int64_t lds = step.keys();
  Partial& part = *lane.part;
  for (int64_t gi = 0; gi < nc; ++gi) {
    if (step.stream) prefetch_group<TOUCH>(lane.groups[g0 + gi], v, d);
    E::qk(lane.q, rows, k, lane.groups[g0 + gi], d, scale, lane.mr, s + gi * GK, lds, lane.quads);
  }
  bool any = false;
  for (int64_t r = 0; r < rows; ++r)
    any |= softmax_step<E>(s + r * lds, nc * GK, p + r * lds, part.m[r], part.l[r], part.o.data() + r * d, d);
  if (!step.stream) {
    if (any) E::pv(p, lds, rows, v, lane.groups.data() + g0, nc, d, part.o.data());
    return;
  }
  // the next step's key rows requested a group at a time between this step's groups of values
  const int64_t next_ng = next != nullptr ? static_cast<int64_t>(next->groups.size()) : 0;
  for (int64_t gi = 0; gi < std::max(nc, std::min(step.groups, next_ng - next_g0)); ++gi) {
    if (next_g0 + gi < next_ng) prefetch_group<TOUCH>(next->groups[next_g0 + gi], k, d);
    if (any && gi < nc) E::pv(p + gi * GK, lds, rows, v, lane.groups.data() + g0 + gi, 1, d, part.o.data());
  }
}

// A task's lanes walked in lockstep, step by step (every lane's step s, then s + 1): the lanes of a paged task are
// one sequence's KV heads, whose rows of one page lie side by side in the pool, so a page is read while its
// neighbours' translations and lines are at hand.
//
// Prefetch. Through pages and gathered tokens, while one lane-step computes, the next one's key and value rows are
// prefetched into L2 (a page's rows lie anywhere in the pool, where the hardware prefetcher cannot follow). A
// contiguous cache streams instead (Stepping::stream), in steps of up to 1024 keys: the values of a step are
// requested while its keys are scored and the next step's keys while its values are summed, a group at a time, so
// that the reads of one product overlap the arithmetic of the other. Scoring and summing each alone reached the
// read bandwidth, one after the other they did not: prefetching a step of 64 keys ahead took longer than scoring
// alone and summing alone together; streaming in steps of 1024 keys did not (docs/performance.md, "Measured
// choices", D4).
// s and p: scratch of rows * step.keys() scores and probabilities.
template <typename T, typename E, bool TOUCH, typename Q>
void attend_lanes(const std::vector<Lane<Q>>& lanes, const Stepping& step, int64_t rows, const T* k, const T* v,
                  int64_t d, float scale, float* s, typename E::P* p) {
  const int64_t nl = static_cast<int64_t>(lanes.size());
  int64_t steps = 0;
  for (const auto& lane : lanes) steps = std::max<int64_t>(steps, lane.groups.size());
  steps = (steps + step.groups - 1) / step.groups;
  if (step.stream && steps > 0)
    for (int64_t gi = 0; gi < std::min<int64_t>(step.groups, lanes[0].groups.size()); ++gi)
      prefetch_group<TOUCH>(lanes[0].groups[gi], k, d);
  for (int64_t unit = 0; unit < steps * nl; ++unit) {
    const int64_t next = unit + 1, next_g0 = (next / nl) * step.groups;
    const Lane<Q>* next_lane = next < steps * nl ? &lanes[next % nl] : nullptr;
    if (!step.stream && next_lane != nullptr) {
      for (int64_t i = next_g0; i < std::min<int64_t>(next_lane->groups.size(), next_g0 + step.groups); ++i) {
        prefetch_group<TOUCH>(next_lane->groups[i], k, d);
        prefetch_group<TOUCH>(next_lane->groups[i], v, d);
      }
    }
    const Lane<Q>& lane = lanes[unit % nl];
    const int64_t g0 = (unit / nl) * step.groups;
    if (g0 < static_cast<int64_t>(lane.groups.size()))
      lane_step<T, E, TOUCH>(lane, g0, step, rows, k, v, d, scale, s, p, next_lane, next_g0);
  }
  for (const auto& lane : lanes) E::finish(lane.part->o.data(), rows, d);
}

// The combination of a (sequence, KV head)'s `splits` partials (consecutive from `parts`) by log-sum-exp, into its
// output rows (`out`: its first) and lse; o: scratch of d floats.
template <typename T>
void combine(const Partial* parts, int64_t splits, int64_t rows, int64_t d, T* out, float* lse, float* o) {
  for (int64_t r = 0; r < rows; ++r) {
    float m = NEG_INF;
    for (int64_t s = 0; s < splits; ++s) m = std::max(m, parts[s].m[r]);
    float l = 0.f;
    std::fill(o, o + d, 0.f);
    if (m != NEG_INF) {
      for (int64_t s = 0; s < splits; ++s) {
        const Partial& part = parts[s];
        if (part.m[r] == NEG_INF) continue;
        const float w = std::exp(part.m[r] - m);
        l += part.l[r] * w;
        for (int64_t x = 0; x < d; ++x) o[x] += part.o[r * d + x] * w;
      }
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int64_t x = 0; x < d; ++x) o[x] *= inv;
    T* dst = out + r * d;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(dst, o, d * sizeof(float));
    } else {
      at::vec::convert(o, dst, d);
    }
    lse[r] = l > 0.f ? m + std::log(l) : NEG_INF;
  }
}

// q (B, Hkv, R, D) with R = G * q_len rows per KV head; contiguous k, v (B, Hkv, N, D), or paged k, v (P, Hkv,
// page, D) with page_table int32 (B, max_pages) and bs = page; blocks int32 (B * Hkv, max_blocks) and their
// count (B * Hkv,), full bool (B * Hkv, max_blocks), or blocks and full of 1 row that every list shares; mask bool
// (T, M, N) with T in {1, B, B * Hkv} and M = R or q_len (the rows of one query head, shared by the G heads: mask
// row = r % M, as q row r = gi * q_len + t);
// lens int32 (B,) keys per sequence. splits >= 1. bf16_dot: bfloat16 products on AVX512-BF16 (the caller checked
// the CPU has it). touch_pages: a load of each group's first byte ahead of its prefetch (prefetch_group). Returns
// (out (B, Hkv, R, D) in q's dtype, lse (B, Hkv, R) float32).
std::vector<torch::Tensor> decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                            const torch::Tensor& page_table, const torch::Tensor& blocks,
                                            const torch::Tensor& counts, const torch::Tensor& full,
                                            const torch::Tensor& mask, const torch::Tensor& lens, int64_t bs,
                                            double scale, int64_t splits, bool bf16_dot,
                                            const torch::Tensor& key_rows, const torch::Tensor& key_base,
                                            bool touch_pages) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes(),
              "q (B, Hkv, R, D); k, v contiguous, one shape");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "one dtype");
  const int64_t b = q.size(0), hkv = q.size(1), rows = q.size(2), d = q.size(3);
  TORCH_CHECK(rows <= MAX_ROWS, "at most ", MAX_ROWS, " rows per KV head");
  TORCH_CHECK(d % 32 == 0, "head_dim a multiple of 32");
  const bool paged = page_table.defined() && page_table.numel() > 0;
  // Gathered lists: (sequence, KV head) bh reads counts[bh] keys, rows key_rows[list][t] of k and v after element
  // key_base[bh], every key allowed (blocks, full and mask unused): a selection of tokens read where they lie.
  // A list per (sequence, KV head), or one per sequence that its KV heads share.
  const bool gathered = key_rows.defined() && key_rows.numel() > 0;
  TORCH_CHECK(!gathered || (!paged && key_rows.scalar_type() == at::kInt && key_rows.dim() == 2 &&
                            (key_rows.size(0) == q.size(0) * q.size(1) || key_rows.size(0) == q.size(0)) &&
                            key_rows.is_contiguous() && key_base.scalar_type() == at::kLong &&
                            key_base.numel() == q.size(0) * q.size(1)),
              "key_rows int32 (B * Hkv or B, max_keys), contiguous, key_base int64 (B * Hkv,), a contiguous cache");
  const int64_t lists_per_seq = gathered && key_rows.size(0) == q.size(0) ? 1 : q.size(1);
  TORCH_CHECK(k.dim() == 4 && k.size(1) == hkv && k.size(3) == d, "k (B or P, Hkv, N or page, D)");
  TORCH_CHECK(!paged || k.size(2) == bs, "a page of bs rows");
  TORCH_CHECK(blocks.dim() == 2 && (blocks.size(0) == b * hkv || blocks.size(0) == 1) && counts.numel() == b * hkv &&
              full.sizes() == blocks.sizes(), "blocks, full (B * Hkv or 1, max_blocks), counts (B * Hkv,)");
  TORCH_CHECK(mask.dim() == 3 && (mask.size(0) == 1 || mask.size(0) == b || mask.size(0) == b * hkv) &&
              rows % mask.size(1) == 0, "mask (T, M, N)");
  const int64_t n_ctx = paged ? 0 : k.size(2);
  const int64_t max_blocks = blocks.size(1), tasks = b * hkv * splits;
  auto out = torch::empty_like(q);
  auto lse = torch::empty({b, hkv, rows}, q.options().dtype(at::kFloat));
  // One split per (sequence, KV head): its lanes write their output rows themselves (Quest's page rows are 131K
  // one-row sequences at 16K: a partial kept for each, and a pass to combine them, were 67 MB and a fifth of the call).
  const bool direct = splits == 1;
  std::vector<Partial> parts(direct ? 0 : tasks);
  const int32_t* pt = paged ? page_table.data_ptr<int32_t>() : nullptr;
  const int64_t max_pages = paged ? page_table.size(1) : 0, mt = mask.size(0), mrows = mask.size(1), mn = mask.size(2);
  // blocks and full: one row per (sequence, KV head), or one row that every list shares (a page selection's lists
  // are its page tables: block i is entry i)
  const int64_t list_stride = blocks.size(0) == 1 ? 0 : max_blocks;
  auto run = [&](auto tag, auto engine, const auto* qp) {
    using T = decltype(tag);
    using E = decltype(engine);
    using Q = std::remove_cv_t<std::remove_pointer_t<decltype(qp)>>;
    const T* kp = k.data_ptr<T>();
    const T* vp = v.data_ptr<T>();
    // A task: one (sequence, KV head)'s split in a contiguous cache; one sequence's split over all its KV heads in
    // a paged one (attend_lanes).
    const int64_t per_task = paged ? hkv : 1;
    // The threads take chunks of tasks in turn from a shared counter: a thread that a neighbour's process slows
    // takes fewer, and a causal selection's later, costlier rows are not all one thread's (a contiguous range per
    // thread put them on the last; docs/performance.md, "Measured choices", D5). A chunk is a
    // 64th of a thread's share (each take is an atomic add), one task where there are few.
    const int64_t units = tasks / per_task, slots = std::min<int64_t>(at::get_num_threads(), units);
    const int64_t chunk = std::max<int64_t>(1, units / (std::max<int64_t>(slots, 1) * 64));
    const bool stream = !paged && !gathered && rows <= STREAM_MAX_ROWS;
    const Stepping step = stream ? Stepping{stream_step_groups(rows), true} : Stepping{STEP_GROUPS, false};
    std::atomic<int64_t> next_task{0};
    at::parallel_for(0, slots, 1, [&](int64_t slot_begin, int64_t slot_end) {
      if (slot_begin >= slot_end) return;
      // A thread's scratch, reused by each of its tasks (no allocation per task).
      std::vector<Lane<Q>> lanes(per_task);
      std::vector<Partial> own(direct ? per_task : 0);
      std::vector<float> s(rows * step.keys()), o(d);
      std::vector<typename E::P> p(rows * step.keys());
      for (int64_t first = next_task.fetch_add(chunk); first < units; first = next_task.fetch_add(chunk)) {
        for (int64_t task = first; task < std::min(units, first + chunk); ++task) {
          for (int64_t lane = 0; lane < per_task; ++lane) {
            const int64_t flat = paged ? ((task / splits) * hkv + lane) * splits + task % splits : task;
            const int64_t bh = flat / splits, split = flat % splits, bi = bh / hkv, h = bh % hkv;
            const int64_t count = counts.data_ptr<int32_t>()[bh], per = (count + splits - 1) / splits;
            const int64_t c0 = std::min(count, split * per), c1 = std::min(count, c0 + per);
            Partial& part = direct ? own[lane] : parts[flat];
            part.o.assign(rows * d, 0.f);
            part.m.assign(rows, NEG_INF);
            part.l.assign(rows, 0.f);
            const ListView lv{blocks.data_ptr<int32_t>() + bh * list_stride, full.data_ptr<bool>() + bh * list_stride,
                              bs, lens.data_ptr<int32_t>()[bi], paged ? pt + bi * max_pages : nullptr,
                              paged ? hkv * bs * d : 0, paged ? h * bs * d : (bi * hkv + h) * n_ctx * d, d};
            const int64_t t_index = mt == 1 ? 0 : (mt == b ? bi : bh);
            const int64_t list = lists_per_seq == 1 ? bi : bh;
            Lane<Q>& ln = lanes[lane];
            if (gathered) {
              gathered_groups(key_base.data_ptr<int64_t>()[bh], key_rows.data_ptr<int32_t>() + list * key_rows.size(1),
                              c0, c1, ln.groups);
            } else {
              groups_of(lv, c0, c1, ln.groups);
            }
            ln.q = qp + bh * rows * d;
            ln.mr = MaskRows{mask.data_ptr<bool>() + t_index * mrows * mn, mrows, mn};
            ln.part = &part;
            ln.quads = paged || gathered;
          }
          if (touch_pages) {
            attend_lanes<T, E, true>(lanes, step, rows, kp, vp, d, static_cast<float>(scale), s.data(), p.data());
          } else {
            attend_lanes<T, E, false>(lanes, step, rows, kp, vp, d, static_cast<float>(scale), s.data(), p.data());
          }
          if (direct) {
            for (int64_t lane = 0; lane < per_task; ++lane) {
              const int64_t bh = paged ? task * hkv + lane : task;
              combine(&own[lane], 1, rows, d, out.data_ptr<T>() + bh * rows * d, lse.data_ptr<float>() + bh * rows,
                      o.data());
            }
          }
        }
      }
    });
    if (direct) return;
    at::parallel_for(0, b * hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> o(d);
      for (int64_t bh = begin; bh < end; ++bh)
        combine(parts.data() + bh * splits, splits, rows, d, out.data_ptr<T>() + bh * rows * d,
                lse.data_ptr<float>() + bh * rows, o.data());
    });
  };
  // float32 query rows: the engines that take q widened (not the bfloat16 dot products)
  const bool widened = !(q.scalar_type() == at::kBFloat16 && bf16_dot);
  auto qf = widened ? q.to(at::kFloat).contiguous() : torch::Tensor();
  const float* qfp = widened ? qf.data_ptr<float>() : nullptr;
  switch (q.scalar_type()) {
#if defined(CPU_CAPABILITY_AVX512)
    case at::kFloat: run(float{}, FmaEngine<float>{}, qfp); break;
    case at::kBFloat16:
      if (bf16_dot) {
        run(at::BFloat16{}, DotEngine{}, reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()));
      } else {
        run(at::BFloat16{}, FmaEngine<at::BFloat16>{}, qfp);
      }
      break;
#elif defined(CPU_CAPABILITY_AVX2)
    case at::kFloat: run(float{}, Avx2FmaEngine<float>{}, qfp); break;
    case at::kBFloat16: run(at::BFloat16{}, Avx2FmaEngine<at::BFloat16>{}, qfp); break;
#else
    case at::kFloat: run(float{}, PortableEngine<float>{}, qfp); break;
    case at::kBFloat16: run(at::BFloat16{}, PortableEngine<at::BFloat16>{}, qfp); break;
#endif
    default: TORCH_CHECK(false, "float32 or bfloat16, not ", q.scalar_type());
  }
  return {out, lse};
}

// The page tables of a page selection read as one decode sequence per (batch, query head, row) (Quest's; the
// page_rows path of impls/blocked/pages.py), in one pass over the selection: picked int32 (B, H, nq, K) each row's
// pages of its query head's KV head (-1 pads), last_key int64 (nq,) the last key a row may see (the base pattern
// a prefix of the keys). A row keeps the pages with a key it may see (page <= its own page), in the selection's
// order, its own page moved last so that its length cuts that page at last_key; entries are pages of the pool
// (B * Hkv * pages pages of `page` rows: KV head kv of batch bi starts at page (bi * Hkv + kv) * pages). Returns
// (table int32 (B * H * nq, K), entries past a row's count 0; counts int32 (B * H * nq,); lens int32, keys).
std::vector<torch::Tensor> page_row_tables(const torch::Tensor& picked, const torch::Tensor& last_key, int64_t page,
                                           int64_t pages, int64_t hkv) {
  TORCH_CHECK(picked.dim() == 4 && picked.scalar_type() == at::kInt && picked.is_contiguous(),
              "picked int32 (B, H, nq, K), contiguous");
  TORCH_CHECK(last_key.scalar_type() == at::kLong && last_key.numel() == picked.size(2), "last_key int64 (nq,)");
  const int64_t b = picked.size(0), h = picked.size(1), nq = picked.size(2), width = picked.size(3);
  TORCH_CHECK(h % hkv == 0, "query heads a multiple of KV heads");
  const int64_t sequences = b * h * nq;
  auto table = torch::zeros({sequences, width}, picked.options());
  auto counts = torch::empty({sequences}, picked.options());
  auto lens = torch::empty({sequences}, picked.options());
  const int32_t* src = picked.data_ptr<int32_t>();
  const int64_t* last = last_key.data_ptr<int64_t>();
  int32_t* dst = table.data_ptr<int32_t>();
  int32_t* count_of = counts.data_ptr<int32_t>();
  int32_t* len_of = lens.data_ptr<int32_t>();
  at::parallel_for(0, sequences, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t row = s % nq, head = (s / nq) % h, bi = s / (nq * h);
      const int64_t first_page = (bi * hkv + head / (h / hkv)) * pages, own = last[row] / page;
      const int32_t* in = src + s * width;
      int32_t* out = dst + s * width;
      int64_t kept = 0;
      bool has_own = false;
      for (int64_t i = 0; i < width; ++i) {
        const int64_t unit = in[i];
        if (unit < 0 || unit > own) continue;
        if (unit == own) { has_own = true; continue; }
        out[kept++] = static_cast<int32_t>(first_page + unit);
      }
      if (has_own) out[kept++] = static_cast<int32_t>(first_page + own);
      count_of[s] = static_cast<int32_t>(kept);
      const int64_t last_page = kept > 0 ? out[kept - 1] - first_page : 0;
      len_of[s] = kept > 0 ? static_cast<int32_t>((kept - 1) * page +
                                                 std::min(page, last[row] - last_page * page + 1)) : 0;
    }
  });
  return {table, counts, lens};
}

// Which engine this build runs for a dtype (the record's config.decode_engine).
std::string engine_name(py::object dtype, bool bf16_dot) {
#if defined(CPU_CAPABILITY_AVX512)
  const bool bf16 = torch::python::detail::py_object_to_dtype(dtype) == at::kBFloat16;
  return bf16 && bf16_dot ? "avx512_bf16_dot" : "avx512_fma";
#elif defined(CPU_CAPABILITY_AVX2)
  return "avx2_fma";
#else
  return "portable";
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "a few query rows over a KV cache read in place (CPU)");
  m.def("engine_name", &engine_name, "the products' engine for a dtype");
  m.def("page_row_tables", &page_row_tables, "a page selection's page tables, one sequence per (head, row)");
}
