// Shared helpers of the cpp backend: row geometry, dtype load/store, a vectorizable exp/tanh,
// the online (max, sum-exp) row reduction, ISA dispatch and the OpenMP row loop.
//
// This header is torch-free: the kernels (logprobs.cpp, cross_entropy.cpp, grpo.cpp, distill.cpp,
// vocab_shard.cpp) see raw pointers, element strides and float hyperparameters only; bindings.cpp
// unpacks tensors.
//
// Vectorization: the inner loops are plain loops over always-inline helpers, written so the
// compiler vectorizes them without -ffast-math (elementwise loops under `#pragma omp simd`;
// reductions over a fixed array of kLanes partial results; selects through integer masks, so no
// float op is executed conditionally). Each kernel is instantiated once per ISA (generic x86-64,
// AVX2+FMA, AVX-512) through `__attribute__((target(...)))` wrappers and picked at run time
// (`active_isa()`), so the binary is portable and needs no `-march=native`; inf and NaN keep
// their IEEE meaning (exp(-inf) = 0, NaN propagates), which -ffast-math would not guarantee.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>

#include <omp.h>

#if defined(__x86_64__) || defined(_M_X64)
#define ASTRAI_X86 1
#else
#define ASTRAI_X86 0
#endif

#define ASTRAI_INLINE inline __attribute__((always_inline))
#define ASTRAI_NOINLINE __attribute__((noinline))

#if ASTRAI_X86
#define ASTRAI_TARGET_AVX512                                                               \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,avx,fma,f16c,bmi,bmi2," \
                        "popcnt,prefer-vector-width=512")))
#define ASTRAI_TARGET_AVX2 __attribute__((target("avx2,avx,fma,f16c,bmi,bmi2,popcnt")))
// M(attribute, suffix) once per instruction set the kernels are compiled for.
#define ASTRAI_FOR_EACH_ISA(M) M(ASTRAI_TARGET_AVX512, avx512) M(ASTRAI_TARGET_AVX2, avx2) M(, generic)
#else
#define ASTRAI_FOR_EACH_ISA(M) M(, generic)
#endif

namespace astrai {

constexpr float kInf = std::numeric_limits<float>::infinity();

// GRPO's log-ratios are clamped to [-kLogRatioClamp, kLogRatioClamp] before exp: the value of
// kernels/primitives.py's LOG_RATIO_CLAMP (a test reads it through the `_log_ratio_clamp`
// binding and holds the two equal).
constexpr float kLogRatioClamp = 20.0f;

// ---------------------------------------------------------------------------------------------
// Instruction-set dispatch
// ---------------------------------------------------------------------------------------------

enum class Isa : int { Generic = 0, Avx2 = 1, Avx512 = 2 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "generic";
  }
}

// The best instruction set this CPU (and OS) supports among those the kernels are built for.
inline Isa detected_isa() {
#if ASTRAI_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2"))
    return Isa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2"))
    return Isa::Avx2;
#endif
  return Isa::Generic;
}

inline std::atomic<int>& isa_slot() {
  // -1: not chosen yet. The env var ASTRAI_KERNELS_CPU_ISA (generic | avx2 | avx512) may lower
  // the choice (never above what the CPU supports).
  static std::atomic<int> slot{-1};
  return slot;
}

inline Isa clamp_isa(Isa wanted) {
  const Isa best = detected_isa();
  return static_cast<int>(wanted) > static_cast<int>(best) ? best : wanted;
}

inline Isa active_isa() {
  int v = isa_slot().load(std::memory_order_relaxed);
  if (v < 0) {
    Isa isa = detected_isa();
    if (const char* env = std::getenv("ASTRAI_KERNELS_CPU_ISA")) {
      if (!std::strcmp(env, "generic")) isa = Isa::Generic;
      else if (!std::strcmp(env, "avx2")) isa = clamp_isa(Isa::Avx2);
      else if (!std::strcmp(env, "avx512")) isa = clamp_isa(Isa::Avx512);
    }
    v = static_cast<int>(isa);
    isa_slot().store(v, std::memory_order_relaxed);
  }
  return static_cast<Isa>(v);
}

inline void set_active_isa(Isa isa) {
  isa_slot().store(static_cast<int>(clamp_isa(isa)), std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------------------------
// Bit casts and element types: load as float, store float with round-to-nearest-even
// ---------------------------------------------------------------------------------------------

ASTRAI_INLINE float bits_to_float(uint32_t b) { return __builtin_bit_cast(float, b); }
ASTRAI_INLINE uint32_t float_to_bits(float f) { return __builtin_bit_cast(uint32_t, f); }

// c ? a : b through integer masks: both operands are computed unconditionally, so loops using it
// vectorize without -fno-trapping-math (the compiler may not speculate float ops on its own).
ASTRAI_INLINE float select(bool c, float a, float b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return bits_to_float((float_to_bits(a) & m) | (float_to_bits(b) & ~m));
}

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };

struct F32T {
  using storage = float;
  static ASTRAI_INLINE float load(float v) { return v; }
  static ASTRAI_INLINE float store(float v) { return v; }
};

struct BF16T {
  using storage = uint16_t;
  static ASTRAI_INLINE float load(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }
  // Same rounding as c10::BFloat16 (round to nearest even, NaN -> quiet NaN); branch-free.
  static ASTRAI_INLINE uint16_t store(float f) {
    const uint32_t u = float_to_bits(f);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return f != f ? uint16_t(0x7FC0) : uint16_t(r);
  }
};

struct F16T {
  using storage = uint16_t;
  // IEEE half -> float, exact for normals, subnormals, inf and NaN; branch-free.
  static ASTRAI_INLINE float load(uint16_t h) {
    const uint32_t sign = (uint32_t(h) & 0x8000u) << 16;
    const uint32_t em = uint32_t(h) & 0x7FFFu;
    uint32_t mag = float_to_bits(bits_to_float(em << 13) * 0x1.0p112f);
    mag = em >= 0x7C00u ? (mag | 0x7F800000u) : mag;
    return bits_to_float(mag | sign);
  }
  // float -> IEEE half, round to nearest even (the algorithm c10::Half uses); branch-free.
  static ASTRAI_INLINE uint16_t store(float f) {
    const float base0 = (__builtin_fabsf(f) * 0x1.0p112f) * 0x1.0p-110f;
    const uint32_t w = float_to_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t bias = std::max(shl1_w & 0xFF000000u, 0x71000000u);
    const float base = bits_to_float((bias >> 1) + 0x07800000u) + base0;
    const uint32_t bits = float_to_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    // NaN -> 0x7E00 through a mask: an integer `?:` here keeps the store loops scalar
    const uint32_t nan_mask = 0u - static_cast<uint32_t>(shl1_w > 0xFF000000u);
    return uint16_t((sign >> 16) | (0x7E00u & nan_mask) | (nonsign & ~nan_mask));
  }
};

// ---------------------------------------------------------------------------------------------
// Vectorizable exp and tanh (plain arithmetic + selects, so `omp simd` loops vectorize them)
// ---------------------------------------------------------------------------------------------

// exp(x) for float32: Cody-Waite reduction x = n*ln2 + r, |r| <= ln2/2, and the Cephes
// degree-6 polynomial; max error about 1 ulp on [-87.3, 88.3]. x < -87.3365 (log FLT_MIN,
// including -inf) gives exactly 0 (no subnormal results); NaN gives NaN. Domain: x <= 88.3 (the
// branch-free body has no upper clamp): the kernels call it with a value relative to a shift at
// most 64 below the running max (the online reduction), or with a log-prob clamped at <= 0
// (log_prob_exp).
ASTRAI_INLINE float fast_exp(float x) {
  // No input clamp: below `lo` the scale's exponent bits wrap (unsigned arithmetic, defined) and
  // the final select replaces the result by 0; NaN flows through every step.
  const float lo = -87.33654475f;
  const float k = x * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23: round to integer
  const float n = k - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const float scale = bits_to_float((float_to_bits(k) << 23) + 0x3F800000u);  // 2^n
  const float res = p * scale;
  return select(lo > x, 0.0f, res);
}

// p = exp(d) for a log-prob d: clamped at d <= 0 first (NaN kept), so a rounding that leaves
// d slightly positive, e.g. a contracted `x * inv_t - lse`, cannot leave fast_exp's domain.
// The clamp is an integer-mask select: a `?:` on floats here is not if-converted inside the
// caller's `omp simd` loop, which then runs scalar (the 5x log-prob backward of a234fd3).
ASTRAI_INLINE float log_prob_exp(float d) { return fast_exp(select(d > 0.0f, 0.0f, d)); }

// tanh(x) (Cephes tanhf): an odd polynomial for |x| <= 0.625, (1 - e) / (1 + e) with
// e = exp(-2|x|) above; about 2 ulp. tanh(+-inf) = +-1, NaN gives NaN.
ASTRAI_INLINE float fast_tanh(float x) {
  const float a = __builtin_fabsf(x);
  const float e = fast_exp(-2.0f * a);
  const float big = __builtin_copysignf((1.0f - e) / (1.0f + e), x);
  const float s = x * x;
  float q = -5.70498872745e-3f;
  q = q * s + 2.06390887954e-2f;
  q = q * s - 5.37397155531e-2f;
  q = q * s + 1.33314422036e-1f;
  q = q * s - 3.33332819422e-1f;
  const float small = q * s * x + x;
  return select(a > 0.625f, big, small);
}

// log(q) - offset * ln 2 for a positive normal float q: Cephes logf on the mantissa split at
// sqrt(1/2) (musl's exponent split), the offset folded into the exponent before ln 2's two-part
// product; about 1 ulp. Plain integer and float arithmetic, no select, so `omp simd` loops
// vectorize it. q = 0 gives a finite value; NaN propagates through `q - q`.
ASTRAI_INLINE float log_with_offset(float q, int offset) {
  const uint32_t bits = float_to_bits(q);
  const uint32_t ix = bits - 0x3F3504F3u;               // relative to sqrt(1/2)'s bits
  const int32_t k = static_cast<int32_t>(ix) >> 23;     // q = 2^k * z
  const float z = bits_to_float(bits - (ix & 0xFF800000u));  // in [sqrt(1/2), sqrt(2))
  const float x = z - 1.0f;
  const float e = static_cast<float>(k - offset);
  const float x2 = x * x;
  float y = 7.0376836292e-2f;
  y = y * x - 1.1514610310e-1f;
  y = y * x + 1.1676998740e-1f;
  y = y * x - 1.2420140846e-1f;
  y = y * x + 1.4249322787e-1f;
  y = y * x - 1.6668057665e-1f;
  y = y * x + 2.0000714765e-1f;
  y = y * x - 2.4999993993e-1f;
  y = y * x + 3.3333331174e-1f;
  y = y * x * x2 + e * -2.12194440e-4f - 0.5f * x2;
  return ((x + y) + e * 0.693359375f) + (q - q);
}

// ---------------------------------------------------------------------------------------------
// Row geometry: an [A, B, V] tensor with arbitrary element strides; row n = [n / B, n % B]
// ---------------------------------------------------------------------------------------------

struct RowsView {
  const void* data = nullptr;
  int64_t A = 0, B = 0, V = 0;
  int64_t sA = 0, sB = 0, sV = 1;  // element strides

  int64_t rows() const { return A * B; }
  template <class S>
  ASTRAI_INLINE const S* row(int64_t n) const {
    const int64_t a = n / B;
    const int64_t b = n - a * B;
    return static_cast<const S*>(data) + a * sA + b * sB;
  }
};

struct GradView {
  void* data = nullptr;  // null: no gradient requested
  int64_t B = 1;
  int64_t sA = 0, sB = 0, sV = 1;

  template <class S>
  ASTRAI_INLINE S* row(int64_t n) const {
    const int64_t a = n / B;
    const int64_t b = n - a * B;
    return static_cast<S*>(data) + a * sA + b * sB;
  }
};

struct Targets {
  const void* data = nullptr;
  bool is64 = true;
  ASTRAI_INLINE int64_t operator[](int64_t n) const {
    return is64 ? static_cast<const int64_t*>(data)[n]
                : static_cast<int64_t>(static_cast<const int32_t*>(data)[n]);
  }
};

// First row whose target is out of range (kernels never read out of bounds; the binding raises).
struct BadRow {
  std::atomic<int64_t> row{-1};
  int64_t target = 0;
  void set(int64_t n, int64_t y) {
    int64_t expected = -1;
    if (row.compare_exchange_strong(expected, n)) target = y;
  }
};

// ---------------------------------------------------------------------------------------------
// Online (max, sum-exp) reduction of one row
// ---------------------------------------------------------------------------------------------

// Reductions keep kLanes independent partial results in a small array updated lane by lane:
// the compiler vectorizes that at whatever width the function's ISA has (no `omp simd
// reduction`, whose lane arrays OpenMP sizes for the ISA of the inlined helper, not the caller).
constexpr int kLanes = 32;

constexpr int kBlock = 2048;  // elements per block of the online reduction (8 KB of float32)

// The streaming loops read their rows this many bytes ahead with a software prefetch: on a KVM
// Intel Xeon (AMX) the hardware prefetchers left the log-prob backward waiting on its loads
// (bf16, N = 4096, V = 32768, 1 thread: 123 ms, 67 ms with the prefetch; docs/benchmarks.md).
constexpr int kPrefetchBytes = 8192;

// One prefetch per 64-byte line of the kLanes elements of `row` at j, kPrefetchBytes ahead (a
// prefetch past the row's end is a hint, never a fault).
template <class S>
ASTRAI_INLINE void prefetch_ahead(const S* row, int64_t j) {
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(row + j) + kPrefetchBytes;
  for (int b = 0; b < kLanes * static_cast<int>(sizeof(S)); b += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(ahead + b));
  }
}

// Running state over the values v_j of a row seen so far, in the row's own units (the raw
// logits; the softmax is over s_j = v_j * scale, scale = 1 / T > 0), relative to `shift` (a value
// of the row never above the running max, so the largest term exp((max - shift) * scale) >= 1 is
// never lost; 0 while the max is infinite, as torch.logsumexp does):
//   sum  = sum_j exp(d_j),  d_j = (v_j - shift) * scale
//   wsum = sum_j exp(d_j) * d_j                      (for the entropy; terms with exp = 0 are 0)
//   zsum = sum_j (v_j - zref)                        (for label smoothing; zref is a row value)
// When the row is done, shift is its max (finite rows), and every result is formed from
// (v_y - shift) * scale and log(sum): log p_y = (v_y - shift) * scale - log(sum) keeps its
// precision however large the logits are (v_y * scale - lse would lose ulp(lse)).
struct OnlineLse {
  float max = -kInf;
  float shift = 0.0f;
  float sum = 0.0f;
  float wsum = 0.0f;
  float zsum = 0.0f;
  float zref = 0.0f;

  // log sum_j exp((v_j - shift) * scale); NaN when the row holds +inf (its softmax is undefined,
  // as in float64 torch) or NaN.
  ASTRAI_INLINE float log_sum() const {
    return max == kInf ? std::numeric_limits<float>::quiet_NaN() : std::log(sum);
  }
  // logsumexp of the row (+inf when it holds +inf, as torch.logsumexp).
  ASTRAI_INLINE float lse(float scale) const {
    return max == kInf ? kInf : shift * scale + std::log(sum);
  }
  // lse - sum_j p_j s_j  =  log(sum) - wsum / sum
  ASTRAI_INLINE float entropy() const { return log_sum() - wsum / sum; }

  // Re-express sum and wsum relative to a larger shift.
  template <bool ENT>
  ASTRAI_INLINE void rebase(float new_shift, float scale) {
    if (sum > 0.0f) {
      const float delta = (shift - new_shift) * scale;
      const float alpha = std::exp(delta);
      if (ENT) wsum = (wsum + delta * sum) * alpha;
      sum *= alpha;
    }
    shift = new_shift;
  }
};

struct BlockSums {
  float max = -kInf, sum = 0.0f, wsum = 0.0f, zsum = 0.0f;
};

// One streaming pass over elements [b0, b0 + len): their max, and their exp-sums relative to
// `shift` (valid while (max - shift) * scale stays well below 88, see online_lse_row).
// With KEEP, also stores exp((v_j - shift) * scale) to e_out[j - b0].
template <bool ENT, bool ZSUM, bool KEEP, class Load>
ASTRAI_INLINE BlockSums accumulate_block(const Load& load, int64_t b0, int len, float shift,
                                         float scale, float zref, float* e_out) {
  float vmax[kLanes], vs[kLanes], vw[kLanes], vz[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    vmax[l] = -kInf;
    vs[l] = vw[l] = vz[l] = 0.0f;
  }
  int j = 0;
  for (; j + kLanes <= len; j += kLanes) {
    load.prefetch(b0 + j);
    for (int l = 0; l < kLanes; ++l) {
      const float v = load(b0 + j + l);
      vmax[l] = vmax[l] < v ? v : vmax[l];
      const float d = (v - shift) * scale;
      const float e = fast_exp(d);
      if (KEEP) e_out[j + l] = e;
      vs[l] += e;
      if (ENT) vw[l] += select(e > 0.0f, e * d, 0.0f);
      if (ZSUM) vz[l] += v - zref;
    }
  }
  for (int l = 0; j < len; ++j, ++l) {
    const float v = load(b0 + j);
    vmax[l] = vmax[l] < v ? v : vmax[l];
    const float d = (v - shift) * scale;
    const float e = fast_exp(d);
    if (KEEP) e_out[j] = e;
    vs[l] += e;
    if (ENT) vw[l] += select(e > 0.0f, e * d, 0.0f);
    if (ZSUM) vz[l] += v - zref;
  }
  BlockSums b;
  for (int l = 0; l < kLanes; ++l) {
    b.max = b.max < vmax[l] ? vmax[l] : b.max;
    b.sum += vs[l];
    if (ENT) b.wsum += vw[l];
    if (ZSUM) b.zsum += vz[l];
  }
  return b;
}

template <class Load>
ASTRAI_INLINE float block_max(const Load& load, int64_t b0, int len) {
  float vmax[kLanes];
  for (int l = 0; l < kLanes; ++l) vmax[l] = -kInf;
  int j = 0;
  for (; j + kLanes <= len; j += kLanes) {
    load.prefetch(b0 + j);
    for (int l = 0; l < kLanes; ++l) {
      const float v = load(b0 + j + l);
      vmax[l] = vmax[l] < v ? v : vmax[l];
    }
  }
  for (int l = 0; j < len; ++j, ++l) {
    const float v = load(b0 + j);
    vmax[l] = vmax[l] < v ? v : vmax[l];
  }
  float m = -kInf;
  for (int l = 0; l < kLanes; ++l) m = m < vmax[l] ? vmax[l] : m;
  return m;
}

// Feed all V values of a row to `st`; `load(j)` returns v_j as float (it may read strided memory
// or apply a softcap), the softmax is over v_j * scale. `hint` is one of the row's values (the
// target's): the exps are taken relative to it from the first element on, so each block is read
// once, computing its max and its exp-sum in the same loop while the memory streams; the shift
// moves up to a block's max after the block, and a block whose max exceeds the shift by more
// than 64 / scale (its exps could overflow) is summed again. A non-finite hint falls back to a
// max pass before each block.
//
// With KEEP (`exps`: V floats, `shifts`: one float per block), the exps are kept:
// exps[j] = exp((v_j - shifts[j / kBlock]) * scale), so a gradient pass needs no second exp:
// p_j = exps[j] * exp((shifts[j / kBlock] - shift) * scale - log_sum).
// `block` (without KEEP) sets the block's length; `block_maxima` (one float per block), when
// given, receives each block's max (the sampling kernel's group maxima).
template <bool ENT, bool ZSUM, bool KEEP = false, class Load>
ASTRAI_INLINE void online_lse_row(int64_t V, const Load& load, OnlineLse& st, float hint,
                                  float scale, float* exps = nullptr, float* shifts = nullptr,
                                  int64_t block = kBlock, float* block_maxima = nullptr) {
  const bool hinted = std::isfinite(hint);
  st.shift = hinted ? hint : 0.0f;
  st.zref = st.shift;
  for (int64_t b0 = 0, blk = 0; b0 < V; b0 += block, ++blk) {
    const int len = static_cast<int>(std::min<int64_t>(block, V - b0));
    float* e_out = KEEP ? exps + b0 : nullptr;
    if (!hinted) {
      const float m = block_max(load, b0, len);
      if (m > st.max) {
        st.max = m;
        st.rebase<ENT>(std::isinf(m) ? 0.0f : m, scale);
      }
    }
    BlockSums b =
        accumulate_block<ENT, ZSUM, KEEP, Load>(load, b0, len, st.shift, scale, st.zref, e_out);
    if (block_maxima) block_maxima[blk] = b.max;
    if (ZSUM) st.zsum += b.zsum;
    if (!hinted || b.max == kInf) {
      if (b.max == kInf) st.max = kInf;  // the row's lse is +inf; its sums no longer matter
      if (KEEP) shifts[blk] = st.shift;
      st.sum += b.sum;
      if (ENT) st.wsum += b.wsum;
      continue;
    }
    if ((b.max - st.shift) * scale > 64.0f) {  // exps relative to the old shift may overflow
      st.rebase<ENT>(b.max, scale);
      const float bz = b.zsum;
      b = accumulate_block<ENT, false, KEEP, Load>(load, b0, len, st.shift, scale, st.zref,
                                                   e_out);
      b.zsum = bz;
    }
    if (KEEP) shifts[blk] = st.shift;
    st.sum += b.sum;
    if (ENT) st.wsum += b.wsum;
    if (b.max > st.shift) st.rebase<ENT>(b.max, scale);
    if (b.max > st.max) st.max = b.max;
  }
}

// Per-thread scratch for the kept exps of one row (grows, never shrinks).
struct RowScratch {
  float* exps;
  float* shifts;
};

// Whether fused kernels keep the first pass's exps (on by default; tests turn it off to cover
// the recomputing path).
inline std::atomic<bool>& keep_exps_enabled() {
  static std::atomic<bool> enabled{true};
  return enabled;
}

// Returns null pointers when the memory cannot be had or keeping is off (callers then recompute
// the exps).
inline RowScratch row_scratch(int64_t V) {
  if (!keep_exps_enabled().load(std::memory_order_relaxed)) return {nullptr, nullptr};
  struct Buffer {
    float* data = nullptr;
    int64_t cap = 0;
    ~Buffer() { std::free(data); }
  };
  thread_local Buffer buf;
  const int64_t padded = ((V + 15) / 16) * 16;
  const int64_t need = padded + (V + kBlock - 1) / kBlock + 16;
  if (need > buf.cap) {
    std::free(buf.data);
    buf.data = static_cast<float*>(std::aligned_alloc(64, ((need * 4 + 63) / 64) * 64));
    buf.cap = buf.data ? need : 0;
  }
  if (!buf.data) return {nullptr, nullptr};
  return {buf.data, buf.data + padded};
}

// Loaders: v_j of a row of element type T (contiguous when C).
template <class T, bool C>
struct RawLoad {  // v_j = x_j (the softmax scale 1 / T is applied relative to the shift)
  const typename T::storage* row;
  int64_t sv;
  ASTRAI_INLINE float operator()(int64_t j) const { return T::load(row[C ? j : j * sv]); }
  ASTRAI_INLINE void prefetch(int64_t j) const {
    if (C) prefetch_ahead(row, j);
  }
};

template <class T, bool C, bool SOFTCAP>
struct CappedLoad {  // z_j = c * tanh(a * x_j / c) when SOFTCAP, else a * x_j (a: logit scale)
  const typename T::storage* row;
  int64_t sv;
  float cap, mul;  // mul = a / c when SOFTCAP, else a (exact at a = 1)
  ASTRAI_INLINE float operator()(int64_t j) const {
    const float x = T::load(row[C ? j : j * sv]) * mul;
    return SOFTCAP ? cap * fast_tanh(x) : x;
  }
  ASTRAI_INLINE void prefetch(int64_t j) const {
    if (C) prefetch_ahead(row, j);
  }
};

template <class T, bool C>
ASTRAI_INLINE void zero_row(typename T::storage* g, int64_t sg, int64_t V) {
  const auto zero = T::store(0.0f);
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) g[C ? j : j * sg] = zero;
}

// The sum of term(j) over j in [0, V), in kLanes lane-wise partial sums (the order
// accumulate_block uses). `omp simd` over the lanes: a term may write through a pointer that
// aliases what it reads (a gradient written over its logits), which the vectorizer must not be
// left to disprove. Always inlined, so each caller's loop vectorizes as its own. `streamed`: the
// unit-stride rows the terms read, prefetched ahead.
template <class F, class... Rows>
ASTRAI_INLINE float lane_sum(int64_t V, const F& term, const Rows*... streamed) {
  float lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = 0.0f;
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes) {
    (prefetch_ahead(streamed, j), ...);
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) lanes[l] += term(j + l);
  }
  for (int l = 0; j < V; ++j, ++l) lanes[l] += term(j);
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// body(j) for j in [0, V), kLanes at a time under `omp simd` (body may write where it reads, as
// lane_sum's terms), the unit-stride rows `streamed` prefetched ahead.
template <class F, class... Rows>
ASTRAI_INLINE void for_each_streamed(int64_t V, const F& body, const Rows*... streamed) {
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes) {
    (prefetch_ahead(streamed, j), ...);
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) body(j + l);
  }
#pragma omp simd
  for (int64_t k = j; k < V; ++k) body(k);
}

// grad_j = coef * (d_jy - p_j) / T  [ - g_H / T * p_j * (log p_j + H) ],
// log p_j = (x_j - ref) * inv_t - log_sum: ref the row max and log_sum = log sum_j exp((x_j -
// ref) * inv_t), or ref = 0 and log_sum = lse (log p_j = s_j - lse). Shared by
// logprobs_backward and grpo_forward. Reads each element before writing it, so `grad` may be
// the logits themselves; the target element is written last from `x_y`.
// The target's 1 - p_y is taken as sum_{j != y} p_j / sum_j p_j: log_sum's rounding (a saved
// lse is off by up to half its ulp) scales every p_j alike and cancels in that ratio, whereas
// 1 - p_y amplifies it by p_y / (1 - p_y) on a confident row (20x at p_y = 0.95, issue 34).
template <class T, bool C, bool ENT>
ASTRAI_INLINE void write_logprob_grad(const typename T::storage* x, int64_t sv,
                                      typename T::storage* g, int64_t sg, int64_t V, int64_t y,
                                      float x_y, float ref, float inv_t, float log_sum, float coef,
                                      float g_entropy, float entropy) {
  const float gh = g_entropy * inv_t;
  const float neg_coef = -coef * inv_t;
  // writes grad_j (the non-target form) and returns p_j, or 0 at the target
  const auto write_non_target = [&](int64_t j) {
    const float d = (T::load(x[C ? j : j * sv]) - ref) * inv_t - log_sum;
    const float p = log_prob_exp(d);
    float v = p * neg_coef;
    if (ENT) v -= gh * select(p > 0.0f, p * (d + entropy), 0.0f);
    g[C ? j : j * sg] = T::store(v);
    return select(j == y, 0.0f, p);
  };
  const float others =
      C ? lane_sum(V, write_non_target, x) : lane_sum(V, write_non_target);
  const float d = (x_y - ref) * inv_t - log_sum;
  const float p = log_prob_exp(d);
  // others + p >= p_max > 0 for finite logits (p_max >= exp(-log V) up to log_sum's rounding)
  const float one_minus_p = others / (others + p);
  float v = coef * one_minus_p * inv_t;
  if (ENT) v -= gh * select(p > 0.0f, p * (d + entropy), 0.0f);
  g[C ? y : y * sg] = T::store(v);
}

// sampled_logprobs_backward's gradient of one row (sampling.cpp), grad_j = coef * ([j == y] - p'_j [x_j >= threshold]) with
// p'_j = exp(x_j * inv_t - lse_kept). Every scalar is a by-value argument (a float read through
// the arguments struct inside the loop may alias a float32 `g` and keep the loop scalar, issue
// 32). Reads x_j before writing g_j, and x_y before the loop, so `g` may be `x` (in place).
template <class T, bool C>
ASTRAI_INLINE void write_kept_grad(const typename T::storage* x, int64_t sv,
                                   typename T::storage* g, int64_t sg, int64_t V, int64_t y,
                                   float x_y, float inv_t, float lse_kept, float threshold,
                                   float coef) {
  const float neg_coef = -coef;
  // writes grad_j (the non-target form) and returns p'_j, or 0 at the target
  const auto write_non_target = [&](int64_t j) {
    const float xj = T::load(x[C ? j : j * sv]);
    const float p = select(xj >= threshold, log_prob_exp(xj * inv_t - lse_kept), 0.0f);
    g[C ? j : j * sg] = T::store(p * neg_coef);
    return select(j == y, 0.0f, p);
  };
  const float others =
      C ? lane_sum(V, write_non_target, x) : lane_sum(V, write_non_target);
  const float p = log_prob_exp(x_y * inv_t - lse_kept);
  // 1 - p'_y as the kept others over the kept total (> 0: the target is kept)
  g[C ? y : y * sg] = T::store(coef * (others / (others + p)));
}

// exp((block_shift - shift) * scale - log_sum): the factor turning the exps kept for a block
// into probabilities (block_shift <= shift, so the exponent is <= 0).
ASTRAI_INLINE float kept_to_prob(float block_shift, const OnlineLse& st, float scale,
                                 float log_sum) {
  const float d = (block_shift - st.shift) * scale - log_sum;
  return std::exp(d > 0.0f ? 0.0f : d);
}

// The same gradient (without the entropy term) from the exps kept by online_lse_row: no exp
// per element, and no read of the logits (so also safe in place).
template <class T, bool C>
ASTRAI_INLINE void write_logprob_grad_from_exps(typename T::storage* g, int64_t sg, int64_t V,
                                                int64_t y, const RowScratch& keep,
                                                const OnlineLse& st, float inv_t, float log_sum,
                                                float coef) {
  const float neg_coef = -coef * inv_t;
  const float* e = keep.exps;
  for (int64_t b0 = 0, blk = 0; b0 < V; b0 += kBlock, ++blk) {
    const int64_t b1 = std::min<int64_t>(V, b0 + kBlock);
    const float factor = kept_to_prob(keep.shifts[blk], st, inv_t, log_sum) * neg_coef;
#pragma omp simd
    for (int64_t j = b0; j < b1; ++j) g[C ? j : j * sg] = T::store(e[j] * factor);
  }
  const float p = e[y] * kept_to_prob(keep.shifts[y / kBlock], st, inv_t, log_sum);
  g[C ? y : y * sg] = T::store((-p * coef + coef) * inv_t);
}

// vocab_shard_backward floors log p before it multiplies beta: a p = 0 entry (an all -inf shard
// row) then gives 0 * beta * floor, never 0 * inf (portable.py's LOG_P_FLOOR).
constexpr float kShardLogPFloor = -1e4f;

// vocab_shard_backward's gradient of one row, every column in the non-target form (the caller
// then writes the target's column): z_j = c * tanh(x_j / c) when SOFTCAP (inv_cap = 1 / c),
// else x_j; log p_j = max(z_j * inv_t - lse, kShardLogPFloor);
//   grad_j = dz_j/dx_j * (p_j * (alpha + beta * log p_j) + delta)
// with alpha, beta, delta already divided by T. Plain arithmetic and selects only (no branch on
// a float), so the loop vectorizes; every scalar is a by-value argument: a float read through
// the arguments struct inside the loop may alias a float32 `g`, and GCC then left the loop
// scalar ("latch block not empty"; float32 ran 10x slower than bfloat16, issue 32). Reads x_j
// before writing g_j, so `g` may be `x` (in place).
template <class T, bool C, bool SOFTCAP>
ASTRAI_INLINE void write_shard_grad(const typename T::storage* x, int64_t sv,
                                    typename T::storage* g, int64_t sg, int64_t V, float inv_t,
                                    float cap, float inv_cap, float lse, float alpha, float beta,
                                    float delta) {
  const auto write = [=](int64_t j) __attribute__((always_inline)) {
    const float xj = T::load(x[C ? j : j * sv]);
    const float t = SOFTCAP ? fast_tanh(xj * inv_cap) : 0.0f;
    const float d = (SOFTCAP ? cap * t : xj) * inv_t - lse;
    const float log_p = select(d < kShardLogPFloor, kShardLogPFloor, d);
    const float p = log_prob_exp(log_p);
    float v = p * (alpha + beta * log_p) + delta;
    if (SOFTCAP) v *= 1.0f - t * t;
    g[C ? j : j * sg] = T::store(v);
  };
  if (C) {
    for_each_streamed(V, write, x);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) write(j);
  }
}

// g_j = p_j * scale with p_j = exp((x_j - ref) * inv_t - log_sum): the dense part of a gradient
// whose sparse part (a few columns) the caller writes afterwards (topk_distill.cpp). Every scalar
// is a by-value argument (issue 32, as write_shard_grad). Reads x_j before writing g_j, so `g`
// may be `x` (in place).
template <class T, bool C>
ASTRAI_INLINE void write_softmax_grad(const typename T::storage* x, int64_t sv,
                                      typename T::storage* g, int64_t sg, int64_t V, float ref,
                                      float inv_t, float log_sum, float scale) {
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) {
    const float d = (T::load(x[C ? j : j * sv]) - ref) * inv_t - log_sum;
    g[C ? j : j * sg] = T::store(log_prob_exp(d) * scale);
  }
}

// ---------------------------------------------------------------------------------------------
// Dispatch helpers and the parallel row loop
// ---------------------------------------------------------------------------------------------

template <class F>
ASTRAI_INLINE auto with_dtype(DType d, F&& f) {
  switch (d) {
    case DType::BF16: return f(BF16T{});
    case DType::F16: return f(F16T{});
    default: return f(F32T{});
  }
}

template <bool B>
struct Bool {
  static constexpr bool value = B;
};

template <class F>
ASTRAI_INLINE auto with_bool(bool b, F&& f) {
  return b ? f(Bool<true>{}) : f(Bool<false>{});
}

template <class Args>
using RowsFn = void (*)(const Args&, int64_t, int64_t);

// Rows [0, n_rows) in chunks of about 256K elements, dealt round-robin to the threads
// (OpenMP static schedule), so rows ignored in long runs (prompts) do not unbalance them.
struct RowChunks {
  int64_t chunk, n_chunks;
  int threads;  // 1: the caller's thread runs every chunk
};

inline RowChunks row_chunks(int64_t n_rows, int64_t V, int nthreads) {
  const int64_t chunk = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(V, 1));
  const int64_t n_chunks = (n_rows + chunk - 1) / chunk;
  return {chunk, n_chunks, static_cast<int>(std::min<int64_t>(std::max(nthreads, 1), n_chunks))};
}

template <class Args>
inline void run_rows(RowsFn<Args> fn, const Args& args, int64_t n_rows, int64_t V, int nthreads) {
  if (n_rows <= 0) return;
  const RowChunks rc = row_chunks(n_rows, V, nthreads);
  if (rc.threads <= 1) {
    fn(args, 0, n_rows);
    return;
  }
#pragma omp parallel for schedule(static, 1) num_threads(rc.threads)
  for (int64_t c = 0; c < rc.n_chunks; ++c) {
    fn(args, c * rc.chunk, std::min(n_rows, (c + 1) * rc.chunk));
  }
}

// ---------------------------------------------------------------------------------------------
// Rows of another vocabulary stride: served through contiguous copies
// ---------------------------------------------------------------------------------------------

// The kernels are compiled for rows of unit vocabulary stride only (a strided variant of each
// doubled the build, issue 42). A view of another stride (a transposed or sliced tensor) is
// served a row at a time: the row copied into a per-thread contiguous buffer before the kernel
// reads it, the gradient's row written into another and copied out after; the copy reads the
// strided row once, where a strided kernel read it in every pass. The buffers are allocated
// before the threads start (an allocation failure raises there, not inside OpenMP).

inline bool unit_stride(const RowsView& v) { return v.sV == 1 || v.V <= 1; }
inline bool unit_stride(const GradView& g, int64_t V) {
  return g.data == nullptr || g.sV == 1 || V <= 1;
}

// A half-precision row widened to float32 (exact), compiled per ISA: a 16-bit distillation
// student's teacher of the other 16-bit dtype is widened a row at a time (copy_row_in); 2048
// float16 rows of 32768 took 30 ms at SSE2 width, 11 ms with AVX-512.
#define ASTRAI_WIDEN_VARIANTS(ATTR, SUFFIX)                                              \
  ATTR inline void widen_row_##SUFFIX(const uint16_t* src, float* dst, int64_t V,        \
                                      bool bf16) {                                       \
    if (bf16) {                                                                          \
      _Pragma("omp simd") for (int64_t j = 0; j < V; ++j) dst[j] = BF16T::load(src[j]);  \
    } else {                                                                             \
      _Pragma("omp simd") for (int64_t j = 0; j < V; ++j) dst[j] = F16T::load(src[j]);   \
    }                                                                                    \
  }
ASTRAI_FOR_EACH_ISA(ASTRAI_WIDEN_VARIANTS)
#undef ASTRAI_WIDEN_VARIANTS

inline void widen_row(const uint16_t* src, float* dst, int64_t V, bool bf16) {
#if ASTRAI_X86
  const Isa isa = active_isa();
  if (isa == Isa::Avx512) return widen_row_avx512(src, dst, V, bf16);
  if (isa == Isa::Avx2) return widen_row_avx2(src, dst, V, bf16);
#endif
  widen_row_generic(src, dst, V, bf16);
}

// Copies row n of `v` (elements of `from`) into `buf` as elements of `to` (`from` itself, or
// float32) and points `v` at the copy: v.row(m) is the copy for every m.
inline void copy_row_in(RowsView& v, int64_t n, DType from, DType to, void* buf) {
  const int64_t V = v.V, s = v.sV;
  if (from == DType::F32) {
    const float* src = v.row<float>(n);
    float* dst = static_cast<float*>(buf);
    for (int64_t j = 0; j < V; ++j) dst[j] = src[j * s];
  } else if (to == from) {
    const uint16_t* src = v.row<uint16_t>(n);
    uint16_t* dst = static_cast<uint16_t*>(buf);
    for (int64_t j = 0; j < V; ++j) dst[j] = src[j * s];
  } else if (s == 1) {
    widen_row(v.row<uint16_t>(n), static_cast<float*>(buf), V, from == DType::BF16);
  } else {
    const uint16_t* src = v.row<uint16_t>(n);
    float* dst = static_cast<float*>(buf);
    for (int64_t j = 0; j < V; ++j) {
      dst[j] = from == DType::BF16 ? BF16T::load(src[j * s]) : F16T::load(src[j * s]);
    }
  }
  v.data = buf;
  v.sA = v.sB = 0;
  v.sV = 1;
}

// Points `g` at `buf` for row n; returns where the row belongs (for copy_row_out).
inline void* redirect_grad_row(GradView& g, int64_t n, DType dtype, void* buf) {
  void* row = dtype == DType::F32 ? static_cast<void*>(g.row<float>(n))
                                  : static_cast<void*>(g.row<uint16_t>(n));
  g.data = buf;
  g.sA = g.sB = 0;
  g.sV = 1;
  return row;
}

inline void copy_row_out(const void* buf, void* row, int64_t stride, int64_t V, DType dtype) {
  if (dtype == DType::F32) {
    const float* src = static_cast<const float*>(buf);
    float* dst = static_cast<float*>(row);
    for (int64_t j = 0; j < V; ++j) dst[j * stride] = src[j];
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(buf);
    uint16_t* dst = static_cast<uint16_t*>(row);
    for (int64_t j = 0; j < V; ++j) dst[j * stride] = src[j];
  }
}

// Whether an arguments struct has a teacher's view (`t`) or a gradient (`grad`); C++17, as
// test_cpp_vectorize compiles this header.
template <class Args, class = void>
struct HasTeacher : std::false_type {};
template <class Args>
struct HasTeacher<Args, std::void_t<decltype(std::declval<Args>().t)>> : std::true_type {};
template <class Args, class = void>
struct HasGrad : std::false_type {};
template <class Args>
struct HasGrad<Args, std::void_t<decltype(std::declval<Args>().grad)>> : std::true_type {};

template <class Args>
struct CopiedRows {
  const Args* args;
  RowsFn<Args> rows;     // the unit-stride kernel
  bool teacher_to_f32;   // (distillation) the kernel reads the teacher as float32
  unsigned char* buffers;
  int64_t row_bytes;     // one buffer's bytes: a float32 row, rounded up to 64
  int threads;
};

template <class Args>
void copied_rows(const CopiedRows<Args>& call, int64_t n0, int64_t n1) {
  const Args& args = *call.args;
  const int thread = call.threads > 1 ? omp_get_thread_num() : 0;
  unsigned char* const mine = call.buffers + thread * 3 * call.row_bytes;
  const int64_t V = args.x.V;
  for (int64_t n = n0; n < n1; ++n) {
    Args a = args;
    if (!unit_stride(args.x)) copy_row_in(a.x, n, args.dtype, args.dtype, mine);
    if constexpr (HasTeacher<Args>::value) {
      if (!unit_stride(args.t) || call.teacher_to_f32) {
        const DType to = call.teacher_to_f32 ? DType::F32 : args.teacher_dtype;
        copy_row_in(a.t, n, args.teacher_dtype, to, mine + call.row_bytes);
        a.teacher_dtype = to;
      }
    }
    void* grad_row = nullptr;
    if constexpr (HasGrad<Args>::value) {
      if (!unit_stride(args.grad, V)) {
        grad_row = redirect_grad_row(a.grad, n, args.dtype, mine + 2 * call.row_bytes);
      }
    }
    call.rows(a, n, n + 1);
    if constexpr (HasGrad<Args>::value) {
      if (grad_row) {
        copy_row_out(mine + 2 * call.row_bytes, grad_row, args.grad.sV, V, args.dtype);
      }
    }
  }
}

// Runs `rows`, a kernel compiled for unit vocabulary strides, over every row of `args`: directly
// when its views (the logits, a teacher's, the gradient) have unit stride, else through
// contiguous copies. `teacher_to_f32`: the kernel reads a distillation teacher as float32
// (it was compiled for that pair of dtypes, not the teacher's own).
template <class Args>
inline void run_unit_stride_rows(RowsFn<Args> rows, const Args& args, int nthreads,
                                 bool teacher_to_f32 = false) {
  const int64_t n_rows = args.x.rows(), V = args.x.V;
  bool copies = !unit_stride(args.x) || teacher_to_f32;
  if constexpr (HasTeacher<Args>::value) copies = copies || !unit_stride(args.t);
  if constexpr (HasGrad<Args>::value) copies = copies || !unit_stride(args.grad, V);
  if (!copies) {
    run_rows(rows, args, n_rows, V, nthreads);
    return;
  }
  if (n_rows <= 0) return;
  const int threads = row_chunks(n_rows, V, nthreads).threads;
  const int64_t row_bytes = (V * 4 + 63) / 64 * 64;
  std::unique_ptr<unsigned char[]> buffers(new unsigned char[threads * 3 * row_bytes]);
  const CopiedRows<Args> call{&args, rows, teacher_to_f32, buffers.get(), row_bytes, threads};
  run_rows<CopiedRows<Args>>(copied_rows<Args>, call, n_rows, V, nthreads);
}

// ---------------------------------------------------------------------------------------------
// Kernel arguments and entry points (defined in logprobs.cpp, cross_entropy.cpp, grpo.cpp,
// distill.cpp, vocab_shard.cpp, sampling.cpp, topk_distill.cpp)
// ---------------------------------------------------------------------------------------------

struct LogprobsFwdArgs {
  RowsView x;
  Targets y;
  DType dtype;
  float inv_t;
  int64_t ignore_index;
  float* logp;
  float* entropy;  // null when not requested
  float* lse;
  BadRow* bad;
};

struct LogprobsBwdArgs {
  RowsView x;
  Targets y;
  DType dtype;
  float inv_t;
  int64_t ignore_index;
  const float* lse;
  const float* entropy;       // null when entropy was not requested
  const float* grad_logp;
  const float* grad_entropy;  // null when entropy was not requested
  GradView grad;
  BadRow* bad;
};

struct CrossEntropyArgs {
  RowsView x;
  Targets y;
  DType dtype;
  int64_t ignore_index;
  float label_smoothing;
  float one_minus_eps;     // 1 - label_smoothing (computed in double, as torch does)
  float eps_minus_one;     // label_smoothing - 1
  float smoothing_over_v;  // label_smoothing / V
  float z_loss;
  float softcap;  // 0: off
  float logit_scale;  // 1: off
  const float* grad_scale;  // null when no gradient
  int64_t grad_scale_numel;
  GradView grad;            // grad.data null when no gradient
  float* loss;
  float* lse;
  BadRow* bad;
};

struct GrpoArgs {
  RowsView x;
  Targets y;
  DType dtype;
  float inv_t;
  const float* advantages;
  const float* old_logprobs;  // null: on-policy
  const float* ref_logprobs;  // null: no KL term
  const float* token_weight;
  float ratio_lo, ratio_hi;  // 1 - clip_low, 1 + clip_high (computed in double)
  float delta, beta;
  bool kl_ratio_correction;  // the k3 term times the (uncapped) ratio
  GradView grad;  // grad.data null when no gradient
  float* logp;
  float* loss;
  float* entropy;  // null when not requested
  BadRow* bad;
};

struct DistillArgs {
  RowsView x;        // the student's logits
  RowsView t;        // the teacher's (same A, B, V; own strides)
  Targets y;
  DType dtype, teacher_dtype;
  float inv_t;
  int64_t ignore_index;
  bool forward_kl;   // beta == 0
  float w_t, w_s;    // the mixture weights (beta, 1 - beta); (0, 1) for reverse KL
  float log_w_s, log_w_t;
  float hard_weight;
  // forward outputs (null in the backward)
  float* loss;
  float* lse_s;
  float* lse_t;
  float* kl_s;
  float* hard_lse;   // null without the hard term
  // backward inputs (null in the forward)
  const float* saved_lse_s;
  const float* saved_lse_t;
  const float* saved_kl_s;
  const float* saved_hard_lse;
  // d loss / d row loss, 1 or N elements (row n reads element n or the single one); with
  // `grad` in the forward too, which then writes the gradient as well
  const float* grad_loss;
  int64_t grad_loss_numel;
  GradView grad;
  BadRow* bad;
  // a forward with `grad`: what serves a row that gets no scratch (its forward without the
  // gradient, then the backward from the outputs just written)
  void (*plain_forward)(const DistillArgs&, int64_t, int64_t);
  void (*backward)(const DistillArgs&, int64_t, int64_t);
};

struct VocabShardArgs {
  RowsView x;        // one vocabulary shard of the logits
  Targets y;         // local columns; ignore_index; anything else: the target is elsewhere
  DType dtype;
  float inv_t;
  float softcap;     // 0: off
  int64_t ignore_index;
  const float* lse;  // the whole vocabulary's, per row
  const float* alpha;
  const float* beta;   // null: 0
  const float* gamma;
  const float* delta;  // null: 0
  GradView grad;
};

// sampled_logprobs_forward / sampled_logprobs_backward (sampling.cpp): the support
// K = {j : x_j >= threshold} of vLLM's min_p, top_k and top_p, in the logits' own units.
struct SampledArgs {
  RowsView x;
  Targets y;
  DType dtype;
  float temperature;  // s = x / temperature (float32 division, as vLLM)
  float inv_t;        // 1 / temperature
  int64_t ignore_index;
  int64_t top_k;      // active when 0 < top_k < V
  double top_p;       // active when < 1
  float log_min_p;    // active when min_p > 0 (then log(min_p) as float32)
  bool min_p_on;
  // forward outputs (null in the backward)
  float* logp;
  float* lse_kept;
  float* threshold;
  float* log_kept_mass;
  int64_t* support_size;
  bool* in_support;
  // backward inputs (null in the forward)
  const float* saved_lse_kept;
  const float* saved_threshold;
  const float* coef;  // g / T per row, 0 for a row outside the support or ignored
  GradView grad;
  BadRow* bad;
};

// topk_distill_forward (topk_distill.cpp): a loss over a teacher's top-K support per row.
enum class TopkObjective : int { TrlJsd = 0, VerlForwardKl = 1, AxolotlKd = 2 };
enum class DivergenceKind : int { ForwardKl = 0, ReverseKl = 1, Mixture = 2 };  // beta 0, 1, else

// TRL's clamp of log(sum p) over the support before its tail bucket log(1 - sum p): the value of
// reference.TOPK_TAIL_LOG_SUM_MAX (a test reads it through the binding and holds the two equal).
constexpr float kTopkTailLogSumMax = -1e-7f;

struct TopkDistillArgs {
  RowsView x;               // the student's logits
  DType dtype;
  int64_t K;
  const int64_t* ids;       // [N, K] contiguous; only live entries are read
  const float* teacher;     // [N, K] the teacher's log-probs
  const bool* live;         // [N, K] entries that count (false on every entry of a row not counted)
  const bool* counted;      // [N]
  TopkObjective objective;
  bool tail;                // trl_jsd's tail bucket
  bool normalize_topk;      // axolotl_kd's renormalisation over the support
  bool full_softmax;        // the loss reads the row's log-sum-exp (else only the K logits)
  float inv_t, t_squared;
  DivergenceKind kind;
  float beta, one_minus_beta;
  bool low_on, high_on;     // verl's clamps (log_prob_min_clamp, loss_max_clamp)
  float low, high;
  // d loss / d row loss, 1 or N elements (row n reads element n or the single one); with
  // `grad` the kernel writes the gradient as well
  const float* grad_loss;
  int64_t grad_loss_numel;
  GradView grad;
  float* loss;
  float* row_max;           // the row's max and sum_j exp((x_j - max) / T) (0 without full_softmax)
  float* sums;
  float* coef;              // [N, K] d loss / d s_k
  BadRow* bad;
};

void logprobs_forward_kernel(const LogprobsFwdArgs& args, int nthreads);
void logprobs_backward_kernel(const LogprobsBwdArgs& args, int nthreads);
void cross_entropy_forward_kernel(const CrossEntropyArgs& args, int nthreads);
void grpo_forward_kernel(const GrpoArgs& args, int nthreads);
void distill_forward_kernel(const DistillArgs& args, int nthreads);
void distill_backward_kernel(const DistillArgs& args, int nthreads);
void vocab_shard_backward_kernel(const VocabShardArgs& args, int nthreads);
void sampled_logprobs_forward_kernel(const SampledArgs& args, int nthreads);
void sampled_logprobs_backward_kernel(const SampledArgs& args, int nthreads);
void topk_distill_forward_kernel(const TopkDistillArgs& args, int nthreads);

}  // namespace astrai
