// The CPU kernel of `blocked` for inference: attention over a block table, blocks read in place.
//
// For each (KV head, query block) task: the G query heads' rows of the block as one tile, then for each run
// of up to CHUNK of its key blocks, S = Q K_j^T for each block (batch-reduce GEMMs from torch's CPU BLAS:
// oneDNN ukernels, AMX tiles or AVX512-BF16 dot products in bfloat16), scale and masks, an online softmax in
// float32 (row max, exponentials and sums, the running output rescaled only when the max grows), then
// O += P V_j. Keys and values are packed once per call into the layout the GEMM reads (K_j transposed; VNNI
// pairs in 16-bit dtypes; float32 values are read in place), one pass; no key block is copied per query block, no
// score leaves the thread's buffers. Where the packed copy of every head would outgrow the cores' L2, each block is
// packed by the first task that needs it, inside the tasks' parallel region (LatePacking), and large outputs are
// written with streaming stores (finish_row). float32, and bfloat16 on a CPU with AVX512-BF16 but without
// AMX, take the kernel's own dot-product tiles instead of oneDNN's GEMMs (dot_rows): a register tile's rows at a
// time through the whole softmax, each block computed only over the 16-key vectors one of those rows may see.
// Rows without an allowed key come out zero. A score modification (softcap's tanh, or an additive bias by head and
// distance: ALiBi, T5's relative bias) is applied to the scaled score tile in the inner loop, before the masks,
// and the softmax then reads the modified scores as they are (through oneDNN's GEMMs: the dot tiles take none).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include <unistd.h>

namespace {

using at::native::cpublas::brgemm;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t CHUNK = 8;  // key blocks per softmax pass: 512 columns at bs = 64
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

template <typename T>
constexpr bool kVnni = !std::is_same_v<T, float>;

// dst[i] = src[i] * scale over n floats.
inline void scale_row(float* x, int64_t n, float scale) {
  const Vec s(scale);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(x + i) * s).store(x + i);
  for (; i < n; ++i) x[i] *= scale;
}

inline float max_row(const float* x, int64_t n) {
  Vec m(NEG_INF);
  int64_t i = 0;
  // scores are never NaN here: the plain max instruction, not at::vec::maximum's NaN-propagating one
#if defined(CPU_CAPABILITY_AVX512)
  for (; i + Vec::size() <= n; i += Vec::size()) m = Vec(_mm512_max_ps(m, Vec::loadu(x + i)));
#elif defined(CPU_CAPABILITY_AVX2)
  for (; i + Vec::size() <= n; i += Vec::size()) m = Vec(_mm256_max_ps(m, Vec::loadu(x + i)));
#else
  for (; i + Vec::size() <= n; i += Vec::size()) m = at::vec::maximum(m, Vec::loadu(x + i));
#endif
  float out = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, m);
  for (; i < n; ++i) out = std::max(out, x[i]);
  return out;
}

constexpr float kLog2e = 1.4426950408889634f;

#if defined(CPU_CAPABILITY_AVX512)
// 2^y for probabilities kept in a 16-bit dtype (8 bits of mantissa in bfloat16): a cubic in the fraction (relative
// error 7.6e-5, fitted to 2^f on [-0.5, 0.5]) scaled by 2^round(y), half the instructions of exp_u20; y below -126
// (a masked score's -inf, or a weight under float32's normal range) gives exactly 0.
inline __m512 exp2_for_16bit(__m512 y) {
  const __mmask16 kept = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-126.f), _CMP_GT_OQ);
  y = _mm512_max_ps(y, _mm512_set1_ps(-126.f));
  const __m512 whole = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, whole);
  __m512 poly = _mm512_fmadd_ps(_mm512_set1_ps(0.05517556673814677f), f, _mm512_set1_ps(0.2426211199136025f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.6932611300826482f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.9999272751134166f));
  return _mm512_maskz_scalef_ps(kept, poly, whole);
}
#endif

// p[i] = exp(x[i] * scale - shift) (p: x itself in float32, else the 16-bit probabilities); returns their sum
// (of the float values). shift is finite; exp_u20 is the approximation torch's own flash kernel uses.
template <typename T>
inline float exp_sum_row(float* x, T* p, int64_t n, float scale, float shift) {
  const Vec s(scale), m(shift);
  Vec acc(0.f);
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + Vec::size() <= n; i += Vec::size()) {
      Vec e = at::vec::fmsub(Vec::loadu(x + i), s, m).exp_u20();
      acc = acc + e;
      e.store(p + i);
    }
  } else {  // two float vectors make one vector of 16-bit values
#if defined(CPU_CAPABILITY_AVX512)
    const __m512 s2 = _mm512_set1_ps(scale * kLog2e), m2 = _mm512_set1_ps(shift * kLog2e);
    for (; i + 2 * Vec::size() <= n; i += 2 * Vec::size()) {
      const Vec e0(exp2_for_16bit(_mm512_fmsub_ps(_mm512_loadu_ps(x + i), s2, m2)));
      const Vec e1(exp2_for_16bit(_mm512_fmsub_ps(_mm512_loadu_ps(x + i + Vec::size()), s2, m2)));
      acc = acc + e0 + e1;
      at::vec::convert_from_float<T>(e0, e1).store(p + i);
    }
#endif
    for (; i + 2 * Vec::size() <= n; i += 2 * Vec::size()) {
      Vec e0 = at::vec::fmsub(Vec::loadu(x + i), s, m).exp_u20();
      Vec e1 = at::vec::fmsub(Vec::loadu(x + i + Vec::size()), s, m).exp_u20();
      acc = acc + e0 + e1;
      at::vec::convert_from_float<T>(e0, e1).store(p + i);
    }
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) {
    const float e = std::exp(x[i] * scale - shift);
    p[i] = static_cast<T>(e);
    sum += e;
  }
  return sum;
}

// The score modification of one row of a key block: x[t] = f(x[t] * scale) for the block's valid keys t.
// softcap > 0: f(s) = softcap * tanh(s / softcap); bias (one head's (2N - 1) biases by distance i - j + N - 1,
// row_bias pointing at this row's entry for key 0): f(s) = s + row_bias[-key].
inline void modify_scores(float* x, int64_t valid, float scale, float softcap, const float* row_bias) {
  if (softcap > 0.f) {
    const Vec inner(scale / softcap), cap(softcap);
    int64_t t = 0;
    for (; t + Vec::size() <= valid; t += Vec::size()) (cap * (Vec::loadu(x + t) * inner).tanh()).store(x + t);
    for (; t < valid; ++t) x[t] = softcap * std::tanh(x[t] * (scale / softcap));
    return;
  }
  for (int64_t t = 0; t < valid; ++t) x[t] = x[t] * scale + row_bias[-t];
}

template <typename T>
inline void convert_row(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    at::vec::convert(src, dst, n);
  }
}

// B operands are stored in column chunks of at most NB columns, each a (K x nb) matrix of its own: oneDNN's
// packing of 16-bit B matrices takes at most 64 columns (D = 128 failed to pack whole).
constexpr int64_t NB = 64;

// in (K x N, leading dim ld_in) -> out through oneDNN's packer (AMX machines), chunk by chunk; out holds K * N.
template <typename T>
void library_pack_b(const T* in, int64_t K, int64_t N, int64_t ld_in, T* out, std::vector<T>& plain) {
  const auto dt = c10::CppTypeToScalarType<T>::value;
  for (int64_t n0 = 0; n0 < N; n0 += NB) {
    const int64_t nb = std::min(NB, N - n0);
    for (int64_t x = 0; x < K; ++x) std::memcpy(plain.data() + x * nb, in + x * ld_in + n0, nb * sizeof(T));
    at::native::cpublas::pack(K, nb, nb, nb, dt, dt, plain.data(), out + K * n0);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// out[w * ldo + t] = in[t * ldi + w] over a 16 x 16 tile of 32-bit words: pairs of rows interleaved by words, then
// by word pairs (a 128-bit lane of u[G][c] holds column 4L + c of rows 4G..4G + 3), then the 4 x 4 matrix of lanes
// transposed.
inline void transpose_16x16(const uint32_t* in, int64_t ldi, uint32_t* out, int64_t ldo) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(in + i * ldi);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[g][c] in r[4g + c]
    r[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    r[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    r[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    r[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), b = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i e = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44), f = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    _mm512_storeu_si512(out + (0 + c) * ldo, _mm512_shuffle_i32x4(a, e, 0x88));
    _mm512_storeu_si512(out + (4 + c) * ldo, _mm512_shuffle_i32x4(a, e, 0xDD));
    _mm512_storeu_si512(out + (8 + c) * ldo, _mm512_shuffle_i32x4(b, f, 0x88));
    _mm512_storeu_si512(out + (12 + c) * ldo, _mm512_shuffle_i32x4(b, f, 0xDD));
  }
}
#endif

// The B operand K_j^T (D x bs) of a key block from its rows (valid of bs, the rest zero), chunk by chunk, written
// here. A 32-bit word of a key row is one float32, or in 16-bit dtypes the pair (K[t][2w], K[t][2w + 1]) that VNNI
// stores side by side: either way K_j^T is the transpose of the rows' words, one pass and no staging.
template <typename T>
void pack_keys(const T* rows, int64_t d, int64_t bs, int64_t valid, T* out) {
  const int64_t words = d * static_cast<int64_t>(sizeof(T)) / 4;
  const auto* in = reinterpret_cast<const uint32_t*>(rows);
  for (int64_t n0 = 0; n0 < bs; n0 += NB) {
    const int64_t nb = std::min(NB, bs - n0);
    auto* dst = reinterpret_cast<uint32_t*>(out + d * n0);
    int64_t t0 = 0, w_done = 0;
#if defined(CPU_CAPABILITY_AVX512)
    w_done = words - words % 16;  // whole 16 x 16 tiles of valid rows by vector transposes, the rest below
    for (; t0 + 16 <= nb && n0 + t0 + 16 <= valid; t0 += 16)
      for (int64_t w = 0; w < w_done; w += 16) transpose_16x16(in + (n0 + t0) * words + w, words, dst + w * nb + t0, nb);
#endif
    for (int64_t w = 0; w < words; ++w)
      for (int64_t t = w < w_done ? t0 : 0; t < nb; ++t) dst[w * nb + t] = n0 + t < valid ? in[(n0 + t) * words + w] : 0u;
  }
}

// The B operand V_j (bs x D) of a value block from its rows (valid of bs, the rest zero), chunk by chunk, written
// here: float32 rows as they are; 16-bit rows in VNNI pairs, row pair x/2 and column c holding (V[x][c],
// V[x + 1][c]) side by side in one 32-bit word.
template <typename T>
void pack_values(const T* rows, int64_t d, int64_t bs, int64_t valid, T* out) {
  for (int64_t n0 = 0; n0 < d; n0 += NB) {
    const int64_t nb = std::min(NB, d - n0);
    T* dst = out + bs * n0;
    if constexpr (!kVnni<T>) {
      for (int64_t x = 0; x < bs; ++x) {
        if (x < valid) std::memcpy(dst + x * nb, rows + x * d + n0, nb * sizeof(T));
        else std::fill(dst + x * nb, dst + (x + 1) * nb, T(0));
      }
    } else {
      auto* pairs = reinterpret_cast<uint32_t*>(dst);
      const auto* in = reinterpret_cast<const uint16_t*>(rows);
      for (int64_t x = 0; x < bs; x += 2) {
        const uint16_t* even = in + x * d + n0;
        const uint16_t* odd = in + (x + 1) * d + n0;
        uint32_t* row = pairs + (x / 2) * nb;
        if (x + 1 < valid) {
          for (int64_t c = 0; c < nb; ++c) row[c] = uint32_t(even[c]) | (uint32_t(odd[c]) << 16);
        } else if (x < valid) {
          for (int64_t c = 0; c < nb; ++c) row[c] = uint32_t(even[c]);
        } else {
          std::fill(row, row + nb, 0u);
        }
      }
    }
  }
}

// The partial blocks' masks (P, bs, bs) as bits: 64 keys of a mask row per word, bit x % 64 of word x / 64.
std::vector<uint64_t> mask_bit_rows(const torch::Tensor& masks, int64_t bs, int64_t words) {
  const int64_t rows = masks.size(0) * bs;
  std::vector<uint64_t> bits(rows * words, 0);
  const auto* allowed = reinterpret_cast<const uint8_t*>(masks.data_ptr<bool>());
  for (int64_t row = 0; row < rows; ++row) {
    const uint8_t* in = allowed + row * bs;
    int64_t x = 0;
#if defined(CPU_CAPABILITY_AVX512)
    for (; x + 64 <= bs; x += 64) {  // 64 bools to 64 bits in one test
      const __m512i b = _mm512_loadu_si512(in + x);
      bits[row * words + x / 64] = _mm512_test_epi8_mask(b, b);
    }
#endif
    for (; x < bs; ++x)
      if (in[x]) bits[row * words + x / 64] |= 1ULL << (x % 64);
  }
  return bits;
}

// Keys outside a row's mask -inf: `bits` that row's allowed keys (mask_bit_rows).
inline void apply_mask(float* block, const uint64_t* bits, int64_t bs) {
  int64_t x = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 masked = _mm512_set1_ps(NEG_INF);
  for (; x + 16 <= bs; x += 16) {
    const auto keep = static_cast<__mmask16>(bits[x / 64] >> (x % 64));
    if (keep != 0xFFFF) _mm512_storeu_ps(block + x, _mm512_mask_mov_ps(masked, keep, _mm512_loadu_ps(block + x)));
  }
#endif
  for (; x < bs; ++x) block[x] = (bits[x / 64] >> (x % 64)) & 1ULL ? block[x] : NEG_INF;
}

// C (M x N, ldc) (+)= A (M x K, lda) B, B as pack_b stored it.
template <typename T>
inline void gemm_b(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldc, bool add, const T* a, const T* b,
                   float* c) {
  for (int64_t n0 = 0; n0 < N; n0 += NB) {
    const int64_t nb = std::min(NB, N - n0);
    brgemm(M, nb, K, lda, nb, ldc, add, a, b + K * n0, c + n0, kVnni<T>);
  }
}

// Whether the product with value block j reads V's rows where they lie: float32 blocks are already the plain (bs x D)
// B operand the GEMM takes (ldb = D), all but a ragged last block, whose rows past N are not there to read.
template <typename T>
inline bool values_in_place(int64_t j, int64_t bs, int64_t n) {
  return !kVnni<T> && (j + 1) * bs <= n;
}

// A run of n stored values (S) as the operand type (T): a copy, or bfloat16 widened to float32 (a shift per value).
template <typename S, typename T>
inline void operand_rows(const S* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<S, T>) {
    std::memcpy(dst, src, n * sizeof(T));
  } else {
    at::vec::convert(src, dst, n);
  }
}

// K and V of every (head, key block) as the B operands of the two products, zero padded past N:
// K_j^T (D x bs) and V_j (bs x D). own_pairs: written here even where oneDNN's packer exists (AMX), for the test
// that the two layouts agree; where the packer exists it is used otherwise. S is the stored dtype, T the operands':
// bfloat16 on a CPU without bfloat16 products is widened to float32 block by block here (T float, S bfloat16), so
// the products run on float32 FMAs and the widened copy lives only in the packed blocks.
template <typename T, typename S = T>
struct BlockPacker {
  const S* k;
  const S* v;
  T* kp;
  T* vp;
  int64_t n, d, bs, nkb;
  bool library;  // through oneDNN's packer

  BlockPacker(const S* k, const S* v, T* kp, T* vp, int64_t n, int64_t d, int64_t bs, bool own_pairs)
      : k(k), v(v), kp(kp), vp(vp), n(n), d(d), bs(bs), nkb((n + bs - 1) / bs), library(library_packs() && !own_pairs) {}

  static constexpr bool kWidened = !std::is_same_v<T, S>;

  static bool library_packs() {
    static const bool packs = kVnni<T> && at::native::cpublas::could_pack(c10::CppTypeToScalarType<T>::value);
    return packs;
  }

  // Scratch for oneDNN's packer and for a widened block's rows, one per thread.
  struct Scratch {
    std::vector<T> kt, vb, plain, wide;
  };
  Scratch scratch() const {
    return {std::vector<T>(library ? d * bs : 0), std::vector<T>(library ? bs * d : 0),
            std::vector<T>(library ? std::max(d, bs) * NB : 0), std::vector<T>(kWidened ? bs * d : 0)};
  }

  // Block j of KV head h.
  void pack(int64_t h, int64_t j, Scratch& s) const {
    const int64_t block = h * nkb + j, valid = std::min(bs, n - j * bs);
    const S* kj_stored = k + (h * n + j * bs) * d;
    const S* vj_stored = v + (h * n + j * bs) * d;
    if constexpr (kWidened) {  // the block's rows widened, then packed as float32 operands
      operand_rows(kj_stored, s.wide.data(), valid * d);
      pack_keys(s.wide.data(), d, bs, valid, kp + block * d * bs);
      operand_rows(vj_stored, s.wide.data(), valid * d);
      pack_values(s.wide.data(), d, bs, valid, vp + block * bs * d);
      return;
    }
    const T* kj = reinterpret_cast<const T*>(kj_stored);
    const T* vj = reinterpret_cast<const T*>(vj_stored);
    if (!library) {
      pack_keys(kj, d, bs, valid, kp + block * d * bs);
      if (!values_in_place<T>(j, bs, n)) pack_values(vj, d, bs, valid, vp + block * bs * d);
      return;
    }
    for (int64_t x = 0; x < d; ++x)
      for (int64_t t = 0; t < bs; ++t) s.kt[x * bs + t] = t < valid ? kj[t * d + x] : T(0);
    std::memcpy(s.vb.data(), vj, valid * d * sizeof(T));
    std::fill(s.vb.begin() + valid * d, s.vb.end(), T(0));
    library_pack_b(s.kt.data(), d, bs, bs, kp + block * d * bs, s.plain);
    library_pack_b(s.vb.data(), bs, d, d, vp + block * bs * d, s.plain);
  }

  // Every block of every head, in one pass before the tasks.
  void pack_all(int64_t heads) const {
    at::parallel_for(0, heads * nkb, 1, [&](int64_t begin, int64_t end) {
      Scratch s = scratch();
      for (int64_t block = begin; block < end; ++block) pack(block / nkb, block % nkb, s);
    });
  }
};

// Blocks packed where a task first needs them (pack_late), inside the tasks' own parallel region: the block is
// then in the cache for its first readers, where a pass over every block before the tasks sent the packed copy
// to memory and back. A state per (KV head, block): 0 not packed, 1 being packed, 2 packed.
template <typename T, typename S = T>
struct LatePacking {
  const BlockPacker<T, S>& packer;
  std::atomic<uint8_t>* state;

  // The blocks of KV head h that a task reads, packed by whoever needs them first; the others wait for the one
  // packing (a block: a microsecond or two).
  void need(int64_t h, const int32_t* blocks, int64_t count, typename BlockPacker<T, S>::Scratch& s) const {
    for (int64_t c = 0; c < count; ++c) {
      std::atomic<uint8_t>& st = state[h * packer.nkb + blocks[c]];
      if (st.load(std::memory_order_acquire) == 2) continue;
      uint8_t idle = 0;
      if (st.compare_exchange_strong(idle, 1, std::memory_order_acq_rel)) {
        try {
          packer.pack(h, blocks[c], s);
        } catch (...) {  // oneDNN's packer failed: release the waiters, the call fails with its error
          st.store(2, std::memory_order_release);
          throw;
        }
        st.store(2, std::memory_order_release);
      } else {
        while (st.load(std::memory_order_acquire) != 2) std::this_thread::yield();
      }
    }
  }
};

// Rows and 16-column vectors per register tile of the dot tiles (below): in float32 6 x 4 (as fast as oneDNN's GEMM
// where every block is whole), in bfloat16 8 x 2: the fastest shapes tried (docs/performance.md, "Measured
// choices", K1).
template <typename T>
struct TileShape {
  static constexpr int rows = 8, vecs = 2;
};
template <>
struct TileShape<float> {
  static constexpr int rows = 6, vecs = 4;
};

#if defined(CPU_CAPABILITY_AVX512)
// The dot-product tiles: bfloat16 products on AVX512-BF16 (vdpbf16ps) where oneDNN would not run AMX, float32 on
// AVX512 FMAs. oneDNN's batch-reduce GEMM ran a hot block near the instruction's rate, but the kernel around it
// ran far below it: the scores of the tile's 64 rows (128 KB) were written and reread from L2 between the two
// products, and partial blocks were computed whole. Here the rows of one register tile (TileShape) go through the
// whole softmax at a time: their scores (8 rows x CHUNK blocks of 64 keys: 16 KB) and probabilities stay in L1,
// their outputs in registers while the products run, and each block is computed only over the 16-key vectors one
// of those rows may see (BlockTable.dot_tile_pairs counts them). What that gained, and the tile shapes tried:
// docs/performance.md, "Measured choices", K2. The functions carry their target themselves: the module runs on AVX512
// CPUs without AVX512-BF16 (the caller says whether it may use it; the float32 instantiations use no bfloat16
// instruction).
#define BF16_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx512dq")))

// A 32-bit word of an operand: a pair of bfloat16 (VNNI), or one float32.
template <typename T>
constexpr int64_t kPerWord = 4 / static_cast<int64_t>(sizeof(T));

// acc + a . b over one word per lane, a broadcast.
template <typename T>
BF16_TARGET inline __m512 word_dot(__m512 acc, __m512i a, __m512i b) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
  } else {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
}

// s[r][16c..] = sum_w q[r][w] . kt[w][16c..]: R rows of q (`words` words, ldq apart) against K_j^T's words (ldk
// apart).
template <typename T, int R, int C>
BF16_TARGET void qk_tile(const uint32_t* q, int64_t ldq, const uint32_t* kt, int64_t ldk, int64_t words, float* s,
                         int64_t lds) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t w = 0; w < words; ++w) {
    __m512i b[C];
    for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_si512(kt + w * ldk + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(q[r * ldq + w]));
      for (int c = 0; c < C; ++c) acc[r][c] = word_dot<T>(acc[r][c], a, b[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(s + r * lds + 16 * c, acc[r][c]);
}

// One block's part of P V: its value words [x0, x1) (rows of V_j, or pairs of rows in VNNI, `ld` words apart from
// `v`, which points at the tile's columns) against the probabilities' words from `at` of each row.
struct PvSpan {
  const uint32_t* v;
  int64_t ld, at, x0, x1;
};

// o[r][16c..] += sum over the spans' words x of p[r][at + x] . v[x][16c..], the outputs held in registers across
// the chunk's blocks (p: R rows, ldp words apart).
template <typename T, int R, int C>
BF16_TARGET void pv_tile(const uint32_t* p, int64_t ldp, const PvSpan* spans, int64_t n_spans, float* o,
                         int64_t ldo) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(o + r * ldo + 16 * c);
  for (int64_t sp = 0; sp < n_spans; ++sp) {
    const PvSpan& span = spans[sp];
    const uint32_t* pr = p + span.at;
    for (int64_t x = span.x0; x < span.x1; ++x) {
      __m512i b[C];
      for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_si512(span.v + x * span.ld + 16 * c);
      for (int r = 0; r < R; ++r) {
        const __m512i a = _mm512_set1_epi32(static_cast<int>(pr[r * ldp + x]));
        for (int c = 0; c < C; ++c) acc[r][c] = word_dot<T>(acc[r][c], a, b[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * ldo + 16 * c, acc[r][c]);
}

template <typename T>
struct QkTile {
  template <int R, int C>
  struct Of {
    BF16_TARGET static void run(const uint32_t* q, int64_t ldq, const uint32_t* kt, int64_t ldk, int64_t words,
                                float* s, int64_t lds) { qk_tile<T, R, C>(q, ldq, kt, ldk, words, s, lds); }
  };
};
template <typename T>
struct PvTile {
  template <int R, int C>
  struct Of {
    BF16_TARGET static void run(const uint32_t* p, int64_t ldp, const PvSpan* spans, int64_t n_spans, float* o,
                                int64_t ldo) { pv_tile<T, R, C>(p, ldp, spans, n_spans, o, ldo); }
  };
};

// F<rows, vecs>::run(args...) for rows in 1..R, vecs in 1..C (the last rows of a tile, the last vector of a span).
template <template <int, int> class F, int R, int C, typename... A>
BF16_TARGET inline void by_shape(int64_t rows, int64_t vecs, A... args) {
  if constexpr (R > 0 && C > 0) {
    if (rows != R) return by_shape<F, R - 1, C>(rows, vecs, args...);
    if (vecs != C) return by_shape<F, R, C - 1>(rows, vecs, args...);
    F<R, C>::run(args...);
  }
}

// One task of the dot tiles: its tile's query rows, its KV head's blocks and its table row.
template <typename T>
struct DotTask {
  const uint32_t* q;  // the tile's rows (mm x d, d / kPerWord words a row)
  const T* kp;  // the KV head's packed K_j^T blocks
  const T* vp;  // and packed V_j blocks (float32: the ragged last block only)
  const T* v;  // and its value rows (float32 reads full blocks where they lie)
  const int32_t* kv_index;  // the task's table row
  const int32_t* mask_slot;
  const int64_t* row_bits;  // or nullptr
  int64_t count, rows, mask_row;  // table entries; query rows per head in the tile; the tile's first mask row
};

// Per-row information shared by the tasks: the mask rows as bits (mask_bit_rows) and their extents.
struct DotMasks {
  const uint64_t* bits;
  int64_t words;
  const int32_t* extent;  // per mask row: its first allowed key and one past its last (0, 0: none)
};

// Rows [r0, r0 + gr) of a task through every chunk of its table row: their o (gr x d), m and l as attend keeps
// them (zero, -inf and zero before the first chunk). s: gr x width floats (float32: the probabilities too, over
// the scores), p: gr x width 16-bit probabilities (bfloat16), span: 2 * CHUNK, pv: CHUNK.
template <typename T>
BF16_TARGET void dot_rows(const DotTask<T>& task, const DotMasks& masks, int64_t r0, int64_t gr, int64_t n,
                          int64_t d, int64_t bs, float scale, float* s, uint16_t* p, int32_t* span, PvSpan* pv,
                          float* o, float* m, float* l) {
  constexpr bool f32 = std::is_same_v<T, float>;
  using Shape = TileShape<T>;
  const int64_t width = CHUNK * bs, words = d / kPerWord<T>;
  const uint32_t* q = task.q + r0 * words;
  const __m512 masked = _mm512_set1_ps(NEG_INF);
  // the probabilities as the second product reads them: 16-bit in p, float32 over the scores
  const uint32_t* pw = f32 ? reinterpret_cast<const uint32_t*>(s) : reinterpret_cast<const uint32_t*>(p);
  const int64_t ldp = width / kPerWord<T>;
  auto row_keeps = [&](int64_t c, int64_t t) {  // whether tile row t selected the chunk's block c
    return task.row_bits == nullptr || ((static_cast<uint64_t>(task.row_bits[c]) >> t) & 1ULL);
  };
  for (int64_t c0 = 0; c0 < task.count; c0 += CHUNK) {
    const int64_t nc = std::min(CHUNK, task.count - c0);
    // scores: each block over the 16-key vectors that hold a key one of the rows may see
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t j = task.kv_index[c0 + c], slot = task.mask_slot[c0 + c];
      const int64_t valid = std::min(bs, n - j * bs);
      int64_t lo = bs, hi = 0;
      for (int64_t i = r0; i < r0 + gr; ++i) {
        const int64_t t = i % task.rows;
        if (!row_keeps(c0 + c, t)) continue;
        const int32_t* e = slot >= 0 ? masks.extent + 2 * (slot * bs + task.mask_row + t) : nullptr;
        const int64_t a = e ? e[0] : 0, b = e ? std::min<int64_t>(e[1], valid) : valid;
        if (a < b) lo = std::min(lo, a), hi = std::max(hi, b);
      }
      lo -= lo % 16, hi = std::min(bs, (hi + 15) / 16 * 16);
      if (lo >= hi) lo = hi = 0;
      span[2 * c] = static_cast<int32_t>(lo), span[2 * c + 1] = static_cast<int32_t>(hi);
      const T* kt = task.kp + j * d * bs;
      for (int64_t n0 = lo - lo % NB; n0 < hi; n0 += NB) {  // K_j^T in column chunks of NB, nb words apart
        const int64_t nb = std::min(NB, bs - n0), a = std::max(lo, n0), b = std::min(hi, n0 + nb);
        const auto* chunk = reinterpret_cast<const uint32_t*>(kt + d * n0);
        for (int64_t x = a; x < b; x += 16 * Shape::vecs)
          by_shape<QkTile<T>::template Of, Shape::rows, Shape::vecs>(
              gr, std::min<int64_t>(Shape::vecs, (b - x) / 16), q, words, chunk + (x - n0), nb, words,
              s + c * bs + x, width);
      }
    }
    // each row: its masks, running max, exponentials and sum, over the computed vectors only
    for (int64_t i = 0; i < gr; ++i) {
      const int64_t t = (r0 + i) % task.rows;
      float* row = s + i * width;
      __m512 mv = masked;
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t slot = task.mask_slot[c0 + c];
        const int64_t valid = std::min(bs, n - task.kv_index[c0 + c] * bs);
        const bool kept = row_keeps(c0 + c, t);
        const uint64_t* bits = slot >= 0 ? masks.bits + (slot * bs + task.mask_row + t) * masks.words : nullptr;
        const int64_t lo = span[2 * c], hi = span[2 * c + 1];  // locals: the vector stores may alias span
        for (int64_t x = lo; x < hi; x += 16) {
          uint32_t keep = kept ? 0xFFFFu : 0u;
          if (bits != nullptr) keep &= static_cast<uint32_t>(bits[x / 64] >> (x % 64));
          if (x + 16 > valid) keep &= valid > x ? (1u << (valid - x)) - 1u : 0u;
          __m512 v = _mm512_loadu_ps(row + c * bs + x);
          if ((keep & 0xFFFFu) != 0xFFFFu) {
            v = _mm512_mask_mov_ps(masked, static_cast<__mmask16>(keep), v);
            _mm512_storeu_ps(row + c * bs + x, v);
          }
          mv = _mm512_max_ps(mv, v);
        }
      }
      // raw scores: scale > 0, so the row's max of scale * s is scale * max(s)
      const float mx = std::max(m[i], _mm512_reduce_max_ps(mv) * scale);
      uint16_t* pi = p + i * width;
      if (mx == NEG_INF) {  // nothing allowed yet: P = 0 over the computed vectors
        for (int64_t c = 0; c < nc; ++c) {
          if constexpr (f32) std::fill(row + c * bs + span[2 * c], row + c * bs + span[2 * c + 1], 0.f);
          else std::fill(pi + c * bs + span[2 * c], pi + c * bs + span[2 * c + 1], 0);
        }
        continue;
      }
      // exp_sum_row's arithmetic, kept apart: exp_sum_row sends a 16-key remainder through std::exp, and given a
      // 16-key step and called here on each run of computed spans it made the kernel slower (K3; its bfloat16
      // conversion is at::vec's integer rounding, as it must run without AVX512-BF16; this is the instruction's)
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t lo = span[2 * c], hi = span[2 * c + 1];
        for (int64_t x = lo; x < hi; x += 16) {
          float* at = row + c * bs + x;
          if constexpr (f32) {  // exp_u20, the approximation torch's own flash kernel uses
            const __m512 e = at::vec::fmsub(Vec::loadu(at), Vec(scale), Vec(mx)).exp_u20();
            sum = _mm512_add_ps(sum, e);
            _mm512_storeu_ps(at, e);
          } else {
            const __m512 e = exp2_for_16bit(_mm512_fmsub_ps(_mm512_loadu_ps(at), _mm512_set1_ps(scale * kLog2e),
                                                            _mm512_set1_ps(mx * kLog2e)));
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pi + c * bs + x), (__m256i)_mm512_cvtneps_pbh(e));
          }
        }
      }
      const float alpha = m[i] == NEG_INF ? 0.f : std::exp(m[i] - mx);
      if (alpha != 1.f && c0 > 0) scale_row(o + i * d, d, alpha);
      l[i] = l[i] * alpha + _mm512_reduce_add_ps(sum);
      m[i] = mx;
    }
    // O += P V over the chunk's blocks, a register tile's vectors of columns at a time. V_j as pack_values
    // laid it out (column chunks of NB: chunk n0 from its element bs * n0, nb words a row or pair of rows), or
    // float32 rows where they lie (D words a row).
    for (int64_t col = 0; col < d; col += 16 * Shape::vecs) {
      const int64_t n0 = col - col % NB, nb = std::min(NB, d - n0);
      int64_t n_spans = 0;
      for (int64_t c = 0; c < nc; ++c) {
        if (span[2 * c] == span[2 * c + 1]) continue;
        const int64_t j = task.kv_index[c0 + c];
        const bool in_place = f32 && (j + 1) * bs <= n;
        const T* base = in_place ? task.v + j * bs * d + col
                                 : task.vp + j * bs * d + bs * n0 + kPerWord<T> * (col - n0);
        pv[n_spans++] = PvSpan{reinterpret_cast<const uint32_t*>(base), in_place ? d : nb, c * bs / kPerWord<T>,
                               span[2 * c] / kPerWord<T>, span[2 * c + 1] / kPerWord<T>};
      }
      by_shape<PvTile<T>::template Of, Shape::rows, Shape::vecs>(gr, std::min<int64_t>(Shape::vecs, (d - col) / 16),
                                                                 pw, ldp, pv, n_spans, o + col, d);
    }
  }
}
#endif

// The L2 of the cores the call's threads run on, in bytes (1 MB a core where the system does not say).
int64_t threads_l2_bytes() {
  static const int64_t per_core = [] {
    const long b = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return b > 0 ? static_cast<int64_t>(b) : int64_t{1} << 20;
  }();
  return per_core * at::get_num_threads();
}

// Whether K and V are packed where the tasks first need them (LatePacking) rather than in a pass before them:
// where the packed copy of all heads would not stay in the L2s between its writing and its reading.
bool pack_late(int64_t packed_bytes) { return packed_bytes > threads_l2_bytes(); }

// Whether the output is written with streaming stores: past the L2s it will not be in the cache when its caller
// reads it, and streaming skips the read that each cached store makes first, and leaves the cache to the packed
// blocks (docs/performance.md, "Measured choices", K4).
bool stream_output(int64_t bytes) { return bytes > threads_l2_bytes(); }

// out[0..d) = o[0..d) * inv in the output dtype; streamed (stream_output) where the row is whole 64-byte lines.
template <typename T>
inline void finish_row(float* o, float inv, T* out, int64_t d, bool stream) {
#if defined(CPU_CAPABILITY_AVX512)
  constexpr int64_t per_line = 64 / static_cast<int64_t>(sizeof(T));
  if (stream && d % per_line == 0 && reinterpret_cast<uintptr_t>(out) % 64 == 0) {
    const __m512 s = _mm512_set1_ps(inv);
    for (int64_t x = 0; x < d; x += per_line) {
      if constexpr (std::is_same_v<T, float>) {
        _mm512_stream_ps(out + x, _mm512_mul_ps(_mm512_loadu_ps(o + x), s));
      } else {
        __m512i line;
        at::vec::convert_from_float<T>(Vec(_mm512_mul_ps(_mm512_loadu_ps(o + x), s)),
                                       Vec(_mm512_mul_ps(_mm512_loadu_ps(o + x + 16), s)))
            .store(&line);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(out + x), line);
      }
    }
    return;
  }
#endif
  scale_row(o, d, inv);
  convert_row(o, out, d);
}

// The block table of task head h: its own (tables == heads: a selection per head) or the one shared by all.
// row_bits (optional, bs <= 64): bit t of a slot says whether row t of the query block keeps that key block
// (a selection per query row, run over the union of its block's rows' blocks). lse (optional): each row's
// log-sum-exp of its allowed scaled scores, -inf for a row without keys. dot: the products on the dot tiles
// (dot_rows; dot_products said they may run), else on oneDNN's GEMMs. late: K and V packed as the tasks first
// need them (pack_late), else packed already. q, v and out are in the stored dtype S, the packed operands and the
// products in T (BlockPacker: bfloat16 widened to float32 where the CPU has no bfloat16 products).
template <typename T, typename S = T>
void attend(const S* q, const T* kp, const T* vp, const S* v, S* out, int64_t heads, int64_t g, int64_t nq, int64_t n,
            int64_t d, int64_t bs, const int32_t* kv_index, const int32_t* kv_count, int64_t max_kv,
            const int32_t* mask_slot, const uint64_t* mask_bits, int64_t mask_words, float scale, int64_t tables,
            int64_t heads_per_kv,
            const int64_t* row_bits, float* lse, int64_t tm, float softcap, const float* dist_bias,
            int64_t bias_heads, int64_t q_offset, bool dot, const int32_t* mask_extent, const LatePacking<T, S>* late) {
  constexpr bool same = std::is_same_v<T, S>;
  const bool modified = softcap > 0.f || dist_bias != nullptr;
  const float score_scale = modified ? 1.f : scale;  // modified scores are scaled already
  const int64_t nqb = (nq + tm - 1) / tm, nkb = (n + bs - 1) / bs;  // nqb: query tiles of tm rows
  const int64_t width = CHUNK * bs;
  // The threads take chunks of tasks from a shared counter (a 64th of a thread's share): one that a neighbour's
  // process slows takes fewer, and a selection's costlier tiles are not all one thread's.
  const int64_t tasks = heads * nqb, slots = std::min<int64_t>(at::get_num_threads(), tasks);
  const int64_t chunk = std::max<int64_t>(1, tasks / (std::max<int64_t>(slots, 1) * 64));
  const bool stream = stream_output(heads * g * nq * d * static_cast<int64_t>(sizeof(S)));
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, slots, 1, [&](int64_t slot_begin, int64_t slot_end) {
    if (slot_begin >= slot_end) return;
    const int64_t max_m = g * bs;
    std::vector<T> qt(max_m * d), pt(kVnni<T> ? max_m * width : 0);
    std::vector<float> s(max_m * width), o(max_m * d), m(max_m), l(max_m);
#if defined(CPU_CAPABILITY_AVX512)
    std::vector<int32_t> span(dot ? 2 * CHUNK : 0);
    std::vector<PvSpan> pv(dot ? CHUNK : 0);
#endif
    auto scratch = late != nullptr ? late->packer.scratch() : typename BlockPacker<T, S>::Scratch{};
    for (int64_t first = next_task.fetch_add(chunk); first < tasks; first = next_task.fetch_add(chunk)) {
      for (int64_t task = first; task < std::min(tasks, first + chunk); ++task) {
        const int64_t h = task / nqb, r = task % nqb;
        const int64_t kvh = h / heads_per_kv;  // the packed K/V head this task reads
        const int64_t slot0 = ((tables == 1 ? 0 : h) * nqb + r) * max_kv;  // this task's table row
        const int64_t rows = std::min(tm, nq - r * tm), mm = g * rows;
        const int64_t mask_row = (r * tm) % bs;  // the tile's first row inside its base query block's masks
        // tile row gi * rows + t = query head gi's row r*tm + t: read where it lies when the G heads' rows are
        // one run of q (one head, or all of q_len in one tile) of the operands' dtype, else copied together
        // (and widened)
        const bool in_place = same && (g == 1 || rows == nq);
        const T* tile_q = in_place ? reinterpret_cast<const T*>(q + (h * g * nq + r * tm) * d) : qt.data();
        for (int64_t gi = 0; gi < (in_place ? 0 : g); ++gi)
          operand_rows(q + ((h * g + gi) * nq + r * tm) * d, qt.data() + gi * rows * d, rows * d);
        std::fill(o.begin(), o.begin() + mm * d, 0.f);
        std::fill(m.begin(), m.begin() + mm, NEG_INF);
        std::fill(l.begin(), l.begin() + mm, 0.f);
        const int64_t count = kv_count[(tables == 1 ? 0 : h) * nqb + r];
        if (late != nullptr) late->need(kvh, kv_index + slot0, count, scratch);
#if defined(CPU_CAPABILITY_AVX512)
        if constexpr (!std::is_same_v<T, at::Half> && same) {
          if (dot) {
            const DotTask<T> tile{reinterpret_cast<const uint32_t*>(tile_q), kp + kvh * nkb * d * bs,
                                  vp + kvh * nkb * bs * d, reinterpret_cast<const T*>(v) + kvh * n * d, kv_index + slot0, mask_slot + slot0,
                                  row_bits == nullptr ? nullptr : row_bits + slot0, count, rows, mask_row};
            const DotMasks dm{mask_bits, mask_words, mask_extent};
            for (int64_t r0 = 0; r0 < mm; r0 += TileShape<T>::rows)
              dot_rows(tile, dm, r0, std::min<int64_t>(TileShape<T>::rows, mm - r0), n, d, bs, scale, s.data(),
                       reinterpret_cast<uint16_t*>(pt.data()), span.data(), pv.data(), o.data() + r0 * d,
                       m.data() + r0, l.data() + r0);
          }
        }
#endif
        for (int64_t c0 = 0; c0 < (dot ? 0 : count); c0 += CHUNK) {  // oneDNN's GEMMs
          const int64_t nc = std::min(CHUNK, count - c0), cols = nc * bs;
          for (int64_t c = 0; c < nc; ++c) {
            const int64_t j = kv_index[slot0 + c0 + c];
            gemm_b(mm, bs, d, d, width, false, tile_q, kp + (kvh * nkb + j) * d * bs, s.data() + c * bs);
          }
          for (int64_t i = 0; i < mm; ++i) {
            float* row = s.data() + i * width;
            const int64_t t = i % rows;
            // the bias row of this row's query head and position (entry for key 0)
            const float* bias_row = dist_bias == nullptr ? nullptr :
                dist_bias + ((h * g + i / rows) % bias_heads) * (2 * n - 1) + q_offset + r * tm + t + n - 1;
            for (int64_t c = 0; c < nc; ++c) {
              const int64_t slot = mask_slot[slot0 + c0 + c];
              const int64_t j = kv_index[slot0 + c0 + c];
              const int64_t valid = std::min(bs, n - j * bs);
              float* block = row + c * bs;
              if (modified)
                modify_scores(block, valid, scale, softcap, bias_row == nullptr ? nullptr : bias_row - j * bs);
              if (row_bits != nullptr && !((static_cast<uint64_t>(row_bits[slot0 + c0 + c]) >> t) & 1ULL)) {
                std::fill(block, block + bs, NEG_INF);  // this row did not select the block
                continue;
              }
              if (slot >= 0) {
                apply_mask(block, mask_bits + (slot * bs + mask_row + t) * mask_words, bs);
              }
              for (int64_t x = valid; x < bs; ++x) block[x] = NEG_INF;
            }
            // raw scores: scale > 0, so the row's max of scale * s is scale * max(s)
            const float mx = std::max(m[i], max_row(row, cols) * score_scale);
            T* probs = kVnni<T> ? pt.data() + i * width : reinterpret_cast<T*>(row);
            if (mx == NEG_INF) {  // nothing allowed yet: P = 0
              std::fill(probs, probs + cols, T(0));
            } else {
              const float sum = exp_sum_row(row, probs, cols, score_scale, mx);
              const float alpha = m[i] == NEG_INF ? 0.f : std::exp(m[i] - mx);
              if (alpha != 1.f && c0 > 0) scale_row(o.data() + i * d, d, alpha);
              l[i] = l[i] * alpha + sum;
              m[i] = mx;
            }
          }
          const T* p = kVnni<T> ? pt.data() : reinterpret_cast<const T*>(s.data());
          for (int64_t c = 0; c < nc; ++c) {
            const int64_t j = kv_index[slot0 + c0 + c];
            if (same && values_in_place<T>(j, bs, n)) {
              const T* vj = reinterpret_cast<const T*>(v) + (kvh * n + j * bs) * d;
              for (int64_t n0 = 0; n0 < d; n0 += NB)
                brgemm(mm, std::min(NB, d - n0), bs, width, d, d, true, p + c * bs, vj + n0, o.data() + n0, false);
            } else {
              gemm_b(mm, d, bs, width, d, true, p + c * bs, vp + (kvh * nkb + j) * bs * d, o.data());
            }
          }
        }
        for (int64_t i = 0; i < mm; ++i) {
          const int64_t gi = i / rows, t = i % rows;
          finish_row(o.data() + i * d, l[i] > 0.f ? 1.f / l[i] : 0.f, out + ((h * g + gi) * nq + r * tm + t) * d, d,
                     stream);
          if (lse != nullptr) lse[(h * g + gi) * nq + r * tm + t] = l[i] > 0.f ? m[i] + std::log(l[i]) : NEG_INF;
        }
      }
    }
#if defined(CPU_CAPABILITY_AVX512)
    if (stream) _mm_sfence();  // the streamed rows visible before the caller reads them
#endif
    at::native::cpublas::brgemm_release(kVnni<T>);
  });
}

// Whether the dot-product tiles run: where the caller allows them (dot_tiles; in bfloat16 only on a CPU with
// AVX512-BF16), float32 on AVX512, bfloat16 where oneDNN would not run AMX; on blocks and heads of whole 16-column
// vectors, without a score modification (applied on the oneDNN path).
bool dot_products(at::ScalarType dtype, int64_t bs, int64_t d, bool modified, bool dot_tiles) {
#if defined(CPU_CAPABILITY_AVX512)
  const bool products = dtype == at::kFloat ||
                        (dtype == at::kBFloat16 && !at::native::cpublas::could_pack(at::kBFloat16));
  return dot_tiles && products && bs % 16 == 0 && d % 16 == 0 && !modified;
#else
  return false;
#endif
}

// q (H, G, Nq, D), k, v (H / heads_per_kv, N, D), all contiguous in one dtype; the block table per query tile of
// tile_rows rows (0: block_size; smaller tiles for selections per row, whose union per tile is then smaller):
// kv_index, mask_slot int32 (T, tiles, max_kv) (mask_slot -1: a full block; p: masks[p], the base query block's
// own, read at the tile's rows), kv_count int32 (T, tiles), T = 1 (one table for every head: a pattern's
// block-sparse view) or H (one per head: a selection); masks bool (P, bs, bs); row_bits int64 (T, tiles,
// max_kv) or empty (module comment of attend). own_pairs: the 16-bit VNNI pairs written by pack_b even where
// oneDNN's packer exists. dot_tiles: the kernel's own dot-product tiles allowed (bfloat16: the caller checked that
// the CPU has AVX512-BF16; dot_products says where they then run). widen: bfloat16 computed on float32 operands,
// widened as the blocks are packed (a CPU with neither AMX nor AVX512-BF16, where a bfloat16 GEMM is emulated). Returns (out (H, G, Nq, D), lse (H, G, Nq)
// float32).
std::vector<torch::Tensor> block_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                           const torch::Tensor& kv_index, const torch::Tensor& kv_count,
                                           const torch::Tensor& mask_slot, const torch::Tensor& masks, double scale,
                                           int64_t bs, bool own_pairs, int64_t heads_per_kv,
                                           const torch::Tensor& row_bits, int64_t tile_rows, double softcap,
                                           const torch::Tensor& dist_bias, int64_t q_offset, bool dot_tiles,
                                           bool widen) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 3 && v.sizes() == k.sizes(), "q (H, G, Nq, D), k and v (H, N, D)");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "one dtype");
  TORCH_CHECK(kv_index.scalar_type() == at::kInt && kv_count.scalar_type() == at::kInt &&
              mask_slot.scalar_type() == at::kInt && masks.scalar_type() == at::kBool, "table dtypes");
  const int64_t heads = q.size(0), g = q.size(1), nq = q.size(2), d = q.size(3), n = k.size(1);
  TORCH_CHECK(heads_per_kv >= 1 && k.size(0) * heads_per_kv == heads && k.size(2) == d,
              "k (H / heads_per_kv, N, D) matching q");
  const int64_t tm = tile_rows > 0 ? tile_rows : bs;
  TORCH_CHECK(tm <= bs && bs % tm == 0, "tile_rows divides block_size");
  const int64_t nkb = (n + bs - 1) / bs, nqb = (nq + tm - 1) / tm;
  TORCH_CHECK(kv_index.dim() == 3 && kv_count.dim() == 2 && mask_slot.sizes() == kv_index.sizes(),
              "kv_index, mask_slot (T, nqb, max_kv), kv_count (T, nqb)");
  const int64_t tables = kv_index.size(0), max_kv = kv_index.size(2);
  TORCH_CHECK((tables == 1 || tables == heads) && kv_count.size(0) == tables, "one table, or one per head");
  TORCH_CHECK(kv_index.size(1) == nqb && kv_count.size(1) == nqb, "one table row per query tile");
  const bool bits = row_bits.defined() && row_bits.numel() > 0;
  TORCH_CHECK(!bits || (row_bits.scalar_type() == at::kLong && row_bits.sizes() == kv_index.sizes() && tm <= 64),
              "row_bits int64 (T, tiles, max_kv), tiles of at most 64 rows");
  const bool biased = dist_bias.defined() && dist_bias.numel() > 0;
  TORCH_CHECK(!biased || (dist_bias.scalar_type() == at::kFloat && dist_bias.dim() == 2 &&
                          dist_bias.size(1) == 2 * n - 1 && dist_bias.is_contiguous()),
              "dist_bias float32 (heads, 2N - 1), contiguous");
  TORCH_CHECK(q_offset >= 0 && q_offset + nq <= n, "q_offset: the query rows are positions q_offset..");
  TORCH_CHECK(masks.dim() == 3 && masks.size(1) == bs && masks.size(2) == bs && masks.is_contiguous(),
              "masks (P, bs, bs), contiguous");
  const int64_t mask_words = (bs + 63) / 64;
  const std::vector<uint64_t> mask_bits = mask_bit_rows(masks, bs, mask_words);
  const bool widened = widen && q.scalar_type() == at::kBFloat16;  // float32 operands (BlockPacker)
  const bool dot = !widened && dot_products(q.scalar_type(), bs, d, biased || softcap > 0.0, dot_tiles);
  std::vector<int32_t> extent(dot ? 2 * masks.size(0) * bs : 0);  // each mask row's allowed keys [first, last + 1)
  for (int64_t row = 0; dot && row < masks.size(0) * bs; ++row) {
    const uint64_t* w = mask_bits.data() + row * mask_words;
    int64_t first = -1, end = 0;
    for (int64_t x = 0; x < mask_words; ++x)
      if (w[x] != 0) {
        if (first < 0) first = x * 64 + __builtin_ctzll(w[x]);
        end = x * 64 + 64 - __builtin_clzll(w[x]);
      }
    extent[2 * row] = static_cast<int32_t>(std::max<int64_t>(first, 0));
    extent[2 * row + 1] = static_cast<int32_t>(end);
  }
  auto out = torch::empty_like(q);
  auto lse = torch::empty({heads, g, nq}, q.options().dtype(at::kFloat));
  const int64_t kv_heads = k.size(0);
  const auto operands = k.options().dtype(widened ? at::kFloat : k.scalar_type());
  const bool late = pack_late(2 * kv_heads * nkb * bs * d * (widened ? 4 : k.element_size()));
  auto kp = torch::empty({kv_heads * nkb * d * bs}, operands);
  auto vp = torch::empty({kv_heads * nkb * bs * d}, operands);
  std::vector<std::atomic<uint8_t>> packed(late ? kv_heads * nkb : 0);  // LatePacking's states, 0: not packed
  auto table = [&](auto tag, auto stored) {
    using T = decltype(tag);
    using S = decltype(stored);
    const BlockPacker<T, S> packer(k.data_ptr<S>(), v.data_ptr<S>(), kp.data_ptr<T>(), vp.data_ptr<T>(), n, d,
                                   bs, own_pairs);
    const LatePacking<T, S> late_packing{packer, packed.data()};
    if (!late) packer.pack_all(kv_heads);
    attend<T, S>(q.data_ptr<S>(), kp.data_ptr<T>(), vp.data_ptr<T>(), v.data_ptr<S>(), out.data_ptr<S>(), heads, g,
                 nq, n, d, bs, kv_index.data_ptr<int32_t>(), kv_count.data_ptr<int32_t>(), max_kv,
                 mask_slot.data_ptr<int32_t>(), mask_bits.data(), mask_words, static_cast<float>(scale), tables,
                 heads_per_kv, bits ? row_bits.data_ptr<int64_t>() : nullptr, lse.data_ptr<float>(), tm,
                 static_cast<float>(softcap), biased ? dist_bias.data_ptr<float>() : nullptr,
                 biased ? dist_bias.size(0) : 1, q_offset, dot, extent.data(), late ? &late_packing : nullptr);
  };
  switch (q.scalar_type()) {
    case at::kFloat: table(float{}, float{}); break;
    case at::kBFloat16:
      if (widened) table(float{}, at::BFloat16{});
      else table(at::BFloat16{}, at::BFloat16{});
      break;
    case at::kHalf: table(at::Half{}, at::Half{}); break;
    default: TORCH_CHECK(false, "float32, bfloat16 or float16, not ", q.scalar_type());
  }
  return {out, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_attention", &block_attention, "attention over a block table (inference, CPU)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("kv_index"), py::arg("kv_count"), py::arg("mask_slot"),
        py::arg("masks"), py::arg("scale"), py::arg("bs"), py::arg("own_pairs") = false,
        py::arg("heads_per_kv") = 1, py::arg("row_bits") = torch::Tensor(), py::arg("tile_rows") = 0,
        py::arg("softcap") = 0.0, py::arg("dist_bias") = torch::Tensor(), py::arg("q_offset") = 0,
        py::arg("dot_tiles") = false, py::arg("widen") = false);
  m.def("dot_products", [](py::object dtype, int64_t bs, int64_t d, bool modified, bool dot_tiles) {
    return dot_products(torch::python::detail::py_object_to_dtype(dtype), bs, d, modified, dot_tiles);
  }, "whether block_attention takes its own dot-product tiles for these operands (else oneDNN's GEMMs)");
  m.def("dot_tile_rows", [](py::object dtype) {
    return torch::python::detail::py_object_to_dtype(dtype) == at::kFloat ? TileShape<float>::rows
                                                                            : TileShape<at::BFloat16>::rows;
  }, "query rows per register tile of the dot tiles in this dtype");
  m.def("cache_bytes", &threads_l2_bytes,
        "the L2 of the cores the call's threads run on: past it K and V are packed as the tasks first need them "
        "and the output is streamed");
  m.def("library_packs", [](py::object dtype) {
    return at::native::cpublas::could_pack(torch::python::detail::py_object_to_dtype(dtype));
  }, "whether oneDNN's packer lays out B operands of this 16-bit dtype (AMX machines)");
}
