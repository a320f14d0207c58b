// sampled_logprobs_forward / sampled_logprobs_backward of kernels/primitives.py: targets scored
// under vLLM v1's processed distribution (ops/sampling.py states the contract). With
// s = float32(x) / T (a float32 division, as vLLM's) the support is K = {j : s_j >= tau}, tau
// the largest of min_p's max(s) + log(min_p), top_k's k-th largest s and top_p's crossing value.
//
// The kernels work in the logits' own units: s is a non-decreasing function of x, so
// K = {j : x_j >= theta} with theta = canon(x_tau), canon(x) = unscaled_lower(x / T, T) the least
// logit whose quotient equals that of x; two logits whose quotients round to the same s stay
// tied. The backward then needs no division, and `threshold` (the per-row output the backward
// reads) is theta.
//
// Forward, per row:
//   1. one streaming pass, the online max / sum-exp of common.h (accumulate_block) over groups
//      of g >= 256 elements: the row max M, S = sum_j exp((x_j - M) / T), each group's max, and
//      (when top_p or min_p may run on the row itself) the exps, which give every logit's
//      weight w_j = exp((x_j - M) / T) later for a product, not an exp;
//   2. min_p's threshold, a floor for the other filters;
//   3. the candidates, the logits >= a bound copied out of the row, when that is cheap: for
//      top_k <= the group count the k-th largest group maximum (k distinct logits reach it), for
//      a min_p whose floor few groups reach the floor, for top_p alone the largest group maximum
//      whose group maxima's masses reach p S. Else, on the row itself: large top_k copies the
//      logits >= a bound that a sample of the row places about 3 standard deviations below its
//      k-th largest (bracket_for); top_p (a flat row) tallies the mass above a bracket [lo, hi)
//      placed so around its crossing value and copies the logits inside. A bracket that misses
//      (its tallies say so) is followed by a pass on the side that holds the value;
//   4. each selection on a copied set, the largest value t whose count (top_k) or mass (top_p)
//      at or above reaches k or p W (select_values): a bisection between keys of the set, int
//      keys ordered as the floats, each step one pass that tallies the amount above the
//      midpoint and copies out what stays within the bounds (with AVX-512, compress
//      instructions), so the set shrinks as they close; a large set's first step splits at a
//      sample's bracket. It ends on a value of the set, so ties are exact;
//   5. the support's size and mass: the candidates >= theta, or the tallies.
// Every bracket bound is canonical (canon(b) = b), so no two tied quotients fall on both sides.
// Backward: grad_j = coef * ([j == y] - p'_j [x_j >= theta]), p'_j = exp(x_j / T - lse_kept),
// with the target's 1 - p'_y formed as sum_{kept j != y} p'_j / sum_{kept j} p'_j (as
// write_logprob_grad does).
#include <vector>

#include "common.h"
#if ASTRAI_X86
#include <immintrin.h>
#endif

namespace astrai {
namespace {

// Relative margin on top_p's bound: the masses that choose the bound are float32 sums (of
// float32 exps), so the bound must reach (1 + margin) p S to be sure to reach p S.
constexpr double kTopPBoundMargin = 1e-4;
// The smallest group of pass 1: a call of accumulate_block costs its lanes' set-up and
// reduction, so smaller groups would slow the streaming pass (1.3x at 128, 1.8x at 64).
constexpr int64_t kMinGroup = 256;
// Values are tallied and copied in chunks of this many (a group holds whole chunks).
constexpr int kChunk = 64;
// Values sampled from a row for a bracket, and from a copied set; in runs of kRun.
constexpr int kSample = 512, kSetSample = 128, kRun = 16;
// A set of at most this many values is selected by bisection on its keys.
constexpr int64_t kDirectMax = 1024;
// A round's bracket: the sample's estimate of the selected value's amount +- this many of the
// estimate's standard deviations (a miss, about 0.3% of rounds, costs one more pass).
constexpr double kSigmas = 3.0;
// The most halvings of the sample's value range that place a bracket's bound.
constexpr int kPivotSteps = 24;
// A value whose share of the sample's estimate could exceed this share of the set's mass is
// sampled whole (so a dominant token is never missed by the sample).
constexpr double kHeavyShare = 1.0 / 64;
// Missed brackets on a row before a pass takes all of it (at or above the floor).
constexpr int kMaxMisses = 2;
// The logits of the groups reaching a bound are copied out while they are at most V / this.
constexpr int64_t kGatherShare = 4;

// The smallest float x with x / t >= s (float32 division), for a finite s: the logit threshold
// of the scaled threshold s. -inf for s = -inf (keep every token). x / t is non-decreasing in x,
// so the answer is within a few ulps of s * t.
float unscaled_lower(float s, float t) {
  if (!(s > -kInf)) return -kInf;
  if (t == 1.0f) return s;
  float x = s * t;
  if (std::isinf(x)) x = std::copysign(std::numeric_limits<float>::max(), x);
  for (int i = 0; i < 64 && x / t >= s; ++i) x = std::nextafter(x, -kInf);
  for (int i = 0; i < 64 && !(x / t >= s); ++i) x = std::nextafter(x, kInf);
  return x;
}

// The least logit whose quotient by t equals that of x: x's tie class starts there.
ASTRAI_INLINE float canon(float x, float t) { return x == kInf ? x : unscaled_lower(x / t, t); }

// int32 keys ordered as the floats (sign and magnitude, so -0.0 and 0.0 share the key 0).
ASTRAI_INLINE int32_t order_key(float v) {
  const uint32_t bits = float_to_bits(v);
  const int32_t magnitude = static_cast<int32_t>(bits & 0x7FFFFFFFu);
  const int32_t negative = -static_cast<int32_t>(bits >> 31);  // 0 or -1
  return (magnitude ^ negative) - negative;
}

ASTRAI_INLINE float key_value(int32_t key) {
  return key < 0 ? bits_to_float(static_cast<uint32_t>(-static_cast<int64_t>(key)) | 0x80000000u)
                 : bits_to_float(static_cast<uint32_t>(key));
}

// A key below that of every float (-inf's is -0x7F800000): the padding of key arrays.
constexpr int32_t kNoKey = std::numeric_limits<int32_t>::min();

// The group size of pass 1: a power of two, at least kMinGroup, giving at least 2k groups with
// top_k on where the row allows (the k-th largest group maximum then leaves about k groups to
// gather from).
int64_t group_size(int64_t V, int64_t top_k) {
  const int64_t want = top_k > 0 ? V / (2 * top_k) : kMinGroup;
  int64_t g = kMinGroup;
  while (g * 2 <= want && g * 2 <= kBlock) g *= 2;
  return g;
}

// How many logits the groups whose max reaches c hold.
ASTRAI_INLINE int64_t reach(int64_t V, int64_t g, const float* gmax, float c) {
  int64_t total = 0;
  for (int64_t b0 = 0, grp = 0; b0 < V; b0 += g, ++grp) {
    if (gmax[grp] >= c) total += std::min(g, V - b0);
  }
  return total;
}

// The count and the mass of a set of values.
struct Tally {
  int64_t count = 0;
  double mass = 0.0;
  ASTRAI_INLINE void add(const Tally& o) {
    count += o.count;
    mass += o.mass;
  }
};

// What a selection counts: the values' count, or (WEIGHTED) their mass.
template <bool WEIGHTED>
ASTRAI_INLINE double amount(const Tally& t) {
  return WEIGHTED ? t.mass : static_cast<double>(t.count);
}

// The weights w = exp((x - M) / T) of a selection's values, as at(j, v) * chunk(j): chunk(j) is
// shared by the kChunk values from a multiple j of kChunk, so a pass reads it once a chunk.
struct CountWeights {  // top_k counts: every weight 1
  ASTRAI_INLINE float at(int64_t, float) const { return 1.0f; }
  ASTRAI_INLINE float chunk(int64_t) const { return 1.0f; }
};
struct ListWeights {  // a copied set's weights
  const float* w;
  ASTRAI_INLINE float at(int64_t j, float) const { return w[j]; }
  ASTRAI_INLINE float chunk(int64_t) const { return 1.0f; }
};
struct RowWeights {  // the row's: pass 1's exps (relative to its group's shift) times a factor
  const float* exps;
  const float* factor;  // exp((shift - M) / T) per group of 2^group_bits logits
  int group_bits;
  ASTRAI_INLINE float at(int64_t j, float) const { return exps[j]; }
  ASTRAI_INLINE float chunk(int64_t j) const { return factor[j >> group_bits]; }
};

// exp((x - M) * scale) for a value x of the row.
struct Weigh {
  float m, scale;
  ASTRAI_INLINE float operator()(float v) const { return fast_exp((v - m) * scale); }
  // The least value whose weight, times a sampled value's share of a set of n values of mass
  // `mass`, reaches kHeavyShare of that mass: the values from there on are sampled whole.
  ASTRAI_INLINE float heavy(double mass, int64_t n) const {
    const double w = kHeavyShare * mass * kSample / static_cast<double>(n);
    return w > 1.0 ? kInf : m + static_cast<float>(std::log(w)) / scale;
  }
};

#if ASTRAI_X86
// The values of a chunk in [lo, hi) (and WEIGHTED their weights) appended to out_v (out_w) from
// m on with AVX-512 compress instructions, 16 at a time (each store writes 16 floats: out has
// room for kLanes past its end); returns the new m. Only the AVX-512 variant calls it.
template <bool WEIGHTED>
ASTRAI_TARGET_AVX512 inline int64_t compress_chunk(const float* v, const float* w, float lo,
                                                   float hi, float* out_v, float* out_w,
                                                   int64_t m) {
  const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
  __mmask16 keep[kChunk / 16];
  int any = 0;
  for (int q = 0; q < kChunk / 16; ++q) {
    const __m512 x = _mm512_loadu_ps(v + 16 * q);
    keep[q] = _mm512_cmp_ps_mask(x, vlo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(x, vhi, _CMP_LT_OQ);
    any |= keep[q];
  }
  if (!any) return m;
  for (int q = 0; q < kChunk / 16; ++q) {
    _mm512_storeu_ps(out_v + m, _mm512_maskz_compress_ps(keep[q], _mm512_loadu_ps(v + 16 * q)));
    if (WEIGHTED) {
      _mm512_storeu_ps(out_w + m, _mm512_maskz_compress_ps(keep[q], _mm512_loadu_ps(w + 16 * q)));
    }
    m += __builtin_popcount(keep[q]);
  }
  return m;
}
#endif

// The values v[i] (and WEIGHTED the weights w[i]) of a chunk whose flag hit[i] is set appended
// to out_v (out_w) from m on; returns the new m. A branch-free copy when many are set, else a
// step per set flag (read eight at a time).
template <bool WEIGHTED>
ASTRAI_INLINE int64_t copy_flagged(const float* v, const float* w, const uint8_t* hit, int hits,
                                   float* out_v, float* out_w, int64_t m) {
  if (hits > kChunk / 4) {
    for (int i = 0; i < kChunk; ++i) {
      out_v[m] = v[i];
      if (WEIGHTED) out_w[m] = w[i];
      m += hit[i];
    }
    return m;
  }
  for (int q = 0; q < kChunk; q += 8) {
    uint64_t word;
    std::memcpy(&word, hit + q, 8);
    while (word) {  // each flag byte is 0 or 1: clear the lowest set one
      const int i = q + (__builtin_ctzll(word) >> 3);
      out_v[m] = v[i];
      if (WEIGHTED) out_w[m] = w[i];
      ++m;
      word &= word - 1;
    }
  }
  return m;
}

// One pass over the values v_j = value(j), j in [0, n), with their weights (WEIGHTED; a count
// otherwise): the tallies of those >= hi (above: count and mass), in [lo, hi) (inside: mass) and
// (BELOW) in [floor, lo) (below: mass), and the values in [lo, hi) copied to out_v (their
// weights to out_w) in order; returns how many (room for kLanes past them). floor <= lo <= hi.
// Per chunk one vectorized loop tallies and stages the values, then WIDE (the AVX-512 variant)
// compresses them out, else flags pick them.
template <bool WIDE, bool WEIGHTED, bool BELOW, class Value, class Weights>
ASTRAI_INLINE int64_t split_values(int64_t n, const Value& value, const Weights& weights,
                                   float floor, float lo, float hi, float* out_v, float* out_w,
                                   Tally& above, Tally& inside, Tally& below) {
  int32_t count_above[kLanes];
  float mass_above[kLanes], mass_inside[kLanes], mass_below[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    count_above[l] = 0;
    mass_above[l] = mass_inside[l] = mass_below[l] = 0.0f;
  }
  alignas(64) uint8_t hit[kChunk];
  alignas(64) float chunk_v[kChunk];
  alignas(64) float chunk_w[kChunk];
  int64_t m = 0;
  // one value: its tallies into lane l, its value (weight, flag) into slot i of the chunk
  const auto tally = [&](int64_t j, float scale, int l, int i) {
    const float v = value(j);
    const float w = WEIGHTED ? scale * weights.at(j, v) : 0.0f;
    const bool is_above = v >= hi, at_least_lo = v >= lo;
    const bool is_inside = at_least_lo & !is_above;
    count_above[l] += is_above;
    if (WEIGHTED) {
      mass_above[l] += select(is_above, w, 0.0f);
      mass_inside[l] += select(is_inside, w, 0.0f);
      if (BELOW) mass_below[l] += select((v >= floor) & !at_least_lo, w, 0.0f);
      chunk_w[i] = w;
    }
    chunk_v[i] = v;
    if (!WIDE) hit[i] = static_cast<uint8_t>(is_inside);
    return static_cast<int>(is_inside);
  };
  int64_t j = 0;
  for (; j + kChunk <= n; j += kChunk) {
    const float scale = weights.chunk(j);
    int hits = 0;
    for (int h = 0; h < kChunk; h += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const int in = tally(j + h + l, scale, l, h + l);
        if (!WIDE) hits += in;
      }
    }
#if ASTRAI_X86
    if constexpr (WIDE) {
      m = compress_chunk<WEIGHTED>(chunk_v, chunk_w, lo, hi, out_v, out_w, m);
      continue;
    }
#endif
    if (hits) m = copy_flagged<WEIGHTED>(chunk_v, chunk_w, hit, hits, out_v, out_w, m);
  }
  for (int i = 0; j < n; ++j, ++i) {
    if (tally(j, weights.chunk(j), i % kLanes, i)) {
      out_v[m] = chunk_v[i];
      if (WEIGHTED) out_w[m] = chunk_w[i];
      ++m;
    }
  }
  for (int l = 0; l < kLanes; ++l) {
    above.count += count_above[l];
    above.mass += mass_above[l];
    inside.mass += mass_inside[l];
    below.mass += mass_below[l];
  }
  inside.count += m;
  return m;
}

// The logits x_j >= c of the groups (of g, a multiple of kChunk) whose max reaches c into out
// (room for V + kLanes), in row order; returns their count.
template <bool WIDE, class Load>
ASTRAI_INLINE int64_t gather_at_least(int64_t V, const Load& load, int64_t g, const float* gmax,
                                      float c, float* out) {
  Tally above, inside, below;
  for (int64_t b0 = 0, grp = 0; b0 < V; b0 += g, ++grp) {
    if (!(gmax[grp] >= c)) continue;
    const auto value = [&](int64_t j) { return load(b0 + j); };
    split_values<WIDE, false, false>(std::min(g, V - b0), value, CountWeights{}, -kInf, c, kInf,
                                     out + inside.count, nullptr, above, inside, below);
  }
  return inside.count;
}

// The count and mass of the logits >= c (weights: the row's), from the groups whose max
// reaches c.
template <class Load>
ASTRAI_INLINE Tally tally_at_least(int64_t V, const Load& load, const RowWeights& weights,
                                   int64_t g, const float* gmax, float c) {
  int32_t counts[kLanes];
  float lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    counts[l] = 0;
    lanes[l] = 0.0f;
  }
  for (int64_t b0 = 0, grp = 0; b0 < V; b0 += g, ++grp) {
    if (!(gmax[grp] >= c)) continue;
    const int64_t b1 = std::min(V, b0 + g);
    const float scale = weights.chunk(b0);
    int64_t j = b0;
    for (; j + kLanes <= b1; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const float v = load(j + l);
        counts[l] += v >= c;
        lanes[l] += select(v >= c, scale * weights.at(j + l, v), 0.0f);
      }
    }
    for (int l = 0; j < b1; ++j, ++l) {
      const float v = load(j);
      counts[l] += v >= c;
      lanes[l] += select(v >= c, scale * weights.at(j, v), 0.0f);
    }
  }
  Tally t;
  for (int l = 0; l < kLanes; ++l) {
    t.count += counts[l];
    t.mass += lanes[l];
  }
  return t;
}

// The weight of the keys >= t: their count, or (WEIGHTED) the sum of their weights. n is a
// multiple of kLanes (the arrays are padded with keys no t reaches and weights 0).
template <bool WEIGHTED>
ASTRAI_INLINE double weight_at_least(const int32_t* keys, const float* w, int64_t n, int32_t t) {
  if (!WEIGHTED) {
    int32_t lanes[kLanes] = {};
    for (int64_t i = 0; i < n; i += kLanes) {
      for (int l = 0; l < kLanes; ++l) lanes[l] += keys[i + l] >= t;
    }
    int64_t total = 0;
    for (int l = 0; l < kLanes; ++l) total += lanes[l];
    return static_cast<double>(total);
  }
  float lanes[kLanes] = {};
  for (int64_t i = 0; i < n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += select(keys[i + l] >= t, w[i + l], 0.0f);
  }
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// n rounded up to a multiple of kLanes, the keys (and weights) past n set to the padding.
ASTRAI_INLINE int64_t pad_keys(int32_t* keys, float* w, int64_t n) {
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  for (int64_t i = n; i < padded; ++i) {
    keys[i] = kNoKey;
    if (w) w[i] = 0.0f;
  }
  return padded;
}

// The largest key t in [lo, hi] whose weight at or above, weight_at_least(t), reaches
// `target`, by bisection on the keys (branch-free vectorized passes over the n keys): a key of
// one of the values (the weight only changes there), so tied values go together. lo when even
// lo falls short (rounding); the caller has every key in [lo, hi].
template <bool WEIGHTED>
ASTRAI_INLINE int32_t key_at_least(const int32_t* keys, const float* w, int64_t n, int32_t lo,
                                   int32_t hi, double target) {
  while (lo < hi) {
    const int32_t mid = static_cast<int32_t>(lo + (static_cast<int64_t>(hi) - lo + 1) / 2);
    if (weight_at_least<WEIGHTED>(keys, w, n, mid) >= target) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The smallest and the largest key of keys[0, n) other than kNoKey ({max, kNoKey} when none).
ASTRAI_INLINE void key_range(const int32_t* keys, int64_t n, int32_t& lowest, int32_t& highest) {
  int32_t lo = std::numeric_limits<int32_t>::max(), hi = kNoKey;
  for (int64_t i = 0; i < n; ++i) {
    lo = std::min(lo, keys[i] == kNoKey ? lo : keys[i]);
    hi = std::max(hi, keys[i]);
  }
  lowest = lo;
  highest = hi;
}

// Per-thread buffers of the forward (grow, never shrink).
struct SelectScratch {
  std::vector<float> values, weights, row_exps, heavy_values, heavy_weights, sample_values,
      sample_weights, round_weights[2];
  std::vector<float> group_max, group_shifts, group_factors, group_weights;
  std::vector<int32_t> keys[2], group_keys;
};

SelectScratch& select_scratch(int64_t V, int64_t groups) {
  thread_local SelectScratch s;
  const int64_t values = V + kLanes, padded_groups = groups + kLanes;  // room for padding
  if (static_cast<int64_t>(s.values.size()) < values) {
    for (auto* b : {&s.values, &s.weights, &s.row_exps, &s.heavy_values, &s.heavy_weights,
                    &s.round_weights[0], &s.round_weights[1]}) {
      b->resize(values);
    }
    s.sample_values.resize(values + kSample);  // the heavy values, then the sampled ones
    s.sample_weights.resize(values + kSample);
    s.keys[0].resize(values);
    s.keys[1].resize(values);
  }
  if (static_cast<int64_t>(s.group_max.size()) < padded_groups) {
    for (auto* b : {&s.group_max, &s.group_shifts, &s.group_factors, &s.group_weights}) {
      b->resize(padded_groups);
    }
    s.group_keys.resize(padded_groups);
  }
  return s;
}

// A selection's result: theta = canon(t) for the selected value t, and the tally of the set's
// values >= theta (their mass only when weighted).
struct Selection {
  float theta;
  Tally kept;
};

// A pivot on the sample: a value lo whose sampled amount at or above reaches `target` and a bound
// hi whose amount falls short (the caller's range satisfies it); narrowing ends with no sampled
// value in (lo, hi), so lo is the sample's value for the target exactly.
struct Pivot {
  double target;
  float lo, hi;
  bool done;
};

// One pass of the sample for two pivots at once: at each pivot's midpoint m (of [lo, hi)) the
// amount at or above m, the least sampled value in [m, hi) and the largest in [lo, m); over
// [0, n), n a multiple of kLanes (padded with -inf and 0).
struct PivotPass {
  double amount[2] = {0.0, 0.0};
  float least_above[2] = {kInf, kInf}, largest_below[2] = {-kInf, -kInf};
};
ASTRAI_INLINE PivotPass pivot_pass(const float* v, const float* w, int64_t n, const Pivot* p,
                                   const float* mid) {
  float amount[2][kLanes], least[2][kLanes], largest[2][kLanes];
  for (int q = 0; q < 2; ++q) {
    for (int l = 0; l < kLanes; ++l) {
      amount[q][l] = 0.0f;
      least[q][l] = kInf;
      largest[q][l] = -kInf;
    }
  }
  for (int64_t i = 0; i < n; i += kLanes) {
    for (int q = 0; q < 2; ++q) {
      const float lo = p[q].lo, hi = p[q].hi, m = mid[q];
      for (int l = 0; l < kLanes; ++l) {
        const float x = v[i + l];
        const bool up = x >= m;
        amount[q][l] += select(up, w[i + l], 0.0f);
        least[q][l] = std::min(least[q][l], select(up & (x < hi), x, kInf));
        largest[q][l] = std::max(largest[q][l], select(!up & (x >= lo), x, -kInf));
      }
    }
  }
  PivotPass r;
  for (int q = 0; q < 2; ++q) {
    for (int l = 0; l < kLanes; ++l) {
      r.amount[q] += amount[q][l];
      r.least_above[q] = std::min(r.least_above[q], least[q][l]);
      r.largest_below[q] = std::max(r.largest_below[q], largest[q][l]);
    }
  }
  return r;
}

// Two pivots narrowed together by halving their value ranges, each bound moved to the sampled
// value next to the midpoint (so ties of bfloat16 values end it at once).
ASTRAI_INLINE void narrow_pivots(const float* v, const float* w, int64_t n, Pivot* p) {
  for (int step = 0; step < kPivotSteps; ++step) {
    float mid[2];
    for (int q = 0; q < 2; ++q) {
      mid[q] = p[q].lo + (p[q].hi - p[q].lo) * 0.5f;
      p[q].done = p[q].done || !(mid[q] > p[q].lo && mid[q] < p[q].hi);
    }
    if (p[0].done && p[1].done) break;
    const PivotPass r = pivot_pass(v, w, n, p, mid);
    for (int q = 0; q < 2; ++q) {
      if (p[q].done) continue;
      if (r.amount[q] >= p[q].target) {  // a sampled value lies in [mid, hi): the least one
        p[q].lo = r.least_above[q];
      } else {  // ... in [lo, mid) (lo itself at least): just above the largest one
        p[q].hi = std::nextafter(r.largest_below[q], kInf);
      }
      p[q].done = !(std::nextafter(p[q].lo, kInf) < p[q].hi);
    }
  }
}

// A bracket [lo, hi) that a sample of the set (the values >= floor among value(j), j in [0, n))
// says holds the value selected for `need`, the largest t with amount(>= t) >= need (with
// p > 0: need is p times the set's amount). The sample: the h heavy values hv (weights hw:
// every value of the set >= their cut, each standing for itself), then `samples` values in
// runs of kRun, one run in each of samples / kRun equal cells of [0, n) at an offset from a
// fixed sequence (so that a row periodic in the cell's length is not seen at one phase only),
// those below the cut standing for the set's other values in equal shares. With the set's amount
// `known` (>= 0), amount(>= t) is estimated as known minus the estimate below t: on a peaked
// row the many light values below the crossing estimate their small mass well, where the few
// above it would not. The amounts at lo and hi lie `widen` * kSigmas standard deviations of the
// estimate (binomial for a count; for a mass, the light values' spread at the estimated value),
// plus one share of the largest light value, above and below need. lo = floor when the sample's
// whole amount falls short, hi = +inf when need is within the margin of 0; both canonical.
template <bool WEIGHTED, class Value, class Weights>
ASTRAI_INLINE void bracket_for(int64_t n, int samples, const Value& value, const Weights& weights,
                               float floor, const float* hv, const float* hw, int64_t h, float cut,
                               double need, double p, double known, double widen, float temp,
                               SelectScratch& sc, float& lo, float& hi) {
  lo = floor;
  hi = kInf;
  float* sv = sc.sample_values.data();
  float* w = sc.sample_weights.data();
  for (int64_t i = 0; i < h; ++i) {
    sv[i] = hv[i];
    w[i] = hw[i];
  }
  // runs of kRun consecutive values, one in each of samples / kRun equal cells of [0, n) at an
  // offset from a fixed sequence (so a row periodic in the cell's length is not seen at one
  // phase only); a heavy value's slot stays empty (weight 0, not light)
  const int runs = samples / kRun;
  int64_t heavy_sampled = 0;
  uint32_t state = 0x2545F491u;
  for (int r = 0; r < runs; ++r) {
    const int64_t c0 = n * r / runs, c1 = n * (r + 1) / runs;
    state = state * 1664525u + 1013904223u;
    // a multiple of kRun: a run lies in one chunk, whose factor weights.chunk(j0) is
    const int64_t j0 = (c0 + static_cast<int64_t>((static_cast<uint64_t>(state >> 8) *
                                                   static_cast<uint64_t>(c1 - c0 - kRun + 1)) >>
                                                  24)) & ~int64_t{kRun - 1};
    const float scale = WEIGHTED ? weights.chunk(j0) : 1.0f;
    float* run_v = sv + h + r * kRun;
    float* run_w = w + h + r * kRun;
    int heavy_run = 0;
    for (int l = 0; l < kRun; ++l) {
      const float v = value(j0 + l);
      const bool heavy = v >= cut, in = (v >= floor) & !heavy;
      run_v[l] = select(in, v, -kInf);
      run_w[l] = select(in, WEIGHTED ? scale * weights.at(j0 + l, v) : 1.0f, 0.0f);
      heavy_run += heavy;
    }
    heavy_sampled += heavy_run;
  }
  const int64_t light = runs * kRun - heavy_sampled;
  const double share = light ? static_cast<double>(n - h) / light : 0.0;
  const float share_f = static_cast<float>(share);
  const int64_t padded = (h + runs * kRun + kLanes - 1) / kLanes * kLanes;
  for (int64_t i = h + runs * kRun; i < padded; ++i) {
    sv[i] = -kInf;
    w[i] = 0.0f;
  }
  float lanes_min[kLanes], lanes_max[kLanes];  // over the finite values >= floor
  for (int l = 0; l < kLanes; ++l) {
    lanes_min[l] = kInf;
    lanes_max[l] = -kInf;
  }
  for (int64_t i = 0; i < padded; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = sv[i + l];
      w[i + l] *= select(i + l >= h, share_f, 1.0f);
      lanes_min[l] = std::min(lanes_min[l], select(v > -kInf, v, kInf));
      lanes_max[l] = std::max(lanes_max[l], v);
    }
  }
  float vmin = kInf, vmax = -kInf;
  for (int l = 0; l < kLanes; ++l) {
    vmin = std::min(vmin, lanes_min[l]);
    vmax = std::max(vmax, lanes_max[l]);
  }
  if (!(vmin <= vmax)) return;
  const float above_max = std::nextafter(vmax, kInf);
  float total_lanes[kLanes] = {};
  for (int64_t i = 0; i < padded; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) total_lanes[l] += w[i + l];
  }
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += total_lanes[l];
  // amount(>= t) is estimated by the sample's amount at or above t plus offset
  const bool complement = known >= 0.0;
  const double offset = complement ? known - total : 0.0;
  if (p > 0.0) need = p * (complement ? known : total);
  // a pivot whose whole range reaches (or misses) its target is closed at vmin (above_max)
  const auto pivot = [&](double target) {
    const bool open = total + offset >= target && target - offset > 0.0;
    return Pivot{target - offset, open ? vmin : above_max, above_max, !open};
  };
  double var, largest = 1.0;  // of the light values' amounts on the estimate's side
  if (!WEIGHTED) {  // counts: binomial
    const double f = std::min(1.0, std::max(0.0, need / std::max(total, 1.0)));
    var = f * (1.0 - f);
  } else {
    Pivot estimate[2] = {pivot(need), pivot(-1.0)};
    estimate[1].done = true;
    narrow_pivots(sv, w, padded, estimate);
    // the light values' weights (their amounts / share) on the estimate's side
    float lanes_s1[kLanes] = {}, lanes_s2[kLanes] = {}, lanes_max[kLanes] = {};
    const float unshare = share > 0.0 ? static_cast<float>(1.0 / share) : 0.0f;
    for (int64_t i = 0; i < padded; i += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const bool side = (i + l >= h) & ((sv[i + l] >= estimate[0].lo) != complement);
        const float x = select(side, w[i + l] * unshare, 0.0f);
        lanes_s1[l] += x;
        lanes_s2[l] += x * x;
        lanes_max[l] = std::max(lanes_max[l], x);
      }
    }
    double s1 = 0.0, s2 = 0.0;
    largest = 0.0;
    for (int l = 0; l < kLanes; ++l) {
      s1 += lanes_s1[l];
      s2 += lanes_s2[l];
      largest = std::max(largest, static_cast<double>(lanes_max[l]));
    }
    const double mean = light ? s1 / light : 0.0;
    var = light ? std::max(0.0, s2 / light - mean * mean) : 0.0;
  }
  const double margin = (kSigmas * widen * std::sqrt(light * var) + largest) * share;
  // lo: the estimate's amount there reaches need + margin; hi: it falls below need - margin
  Pivot bounds[2] = {pivot(need + margin), pivot(need - margin)};  // lo's, hi's
  narrow_pivots(sv, w, padded, bounds);
  if (need - margin > 0.0) hi = canon(bounds[1].hi, temp);
  if (total + offset >= need + margin) {
    lo = std::max(canon(bounds[0].lo, temp), floor);
    hi = std::max(hi, lo);
  }
}

// After a split of a set at [lo, hi) into above (>= hi), inside ([lo, hi)) and below: whether
// the bracket holds the value selected for need; if not, [lo, hi) becomes the side of the set
// that holds it, [hi, +inf) or [floor, lo).
template <bool WEIGHTED>
ASTRAI_INLINE bool bracket_holds(const Tally& above, const Tally& inside, double need,
                                 float floor, float& lo, float& hi) {
  const double a = amount<WEIGHTED>(above);
  if (a < need && need <= a + amount<WEIGHTED>(inside)) return true;
  if (a >= need) {
    lo = hi;
    hi = kInf;
  } else {
    hi = lo;
    lo = floor;
  }
  return false;
}

// What one step of select_values finds: the tallies of the keys above the upper bound (leaving
// the set) and of those in [mid, hi], and the extreme keys of the set in [lo, mid) and [mid, hi]
// (the next bounds: keys of the set).
struct BisectStep {
  Tally above, at_mid;
  int32_t low_min = std::numeric_limits<int32_t>::max(), low_max = kNoKey;
  int32_t high_min = std::numeric_limits<int32_t>::max(), high_max = kNoKey;
};

#if ASTRAI_X86
// bisect_step with AVX-512: 16 keys a step, the kept ones compressed out.
template <bool WEIGHTED>
ASTRAI_TARGET_AVX512 inline int64_t bisect_step_wide(const int32_t* k, const float* w, int64_t n,
                                                     int32_t keep, int32_t lo, int32_t mid,
                                                     int32_t hi, int32_t* out_k, float* out_w,
                                                     BisectStep& r) {
  __m512i count_above = _mm512_setzero_si512(), count_mid = _mm512_setzero_si512();
  __m512 mass_above = _mm512_setzero_ps(), mass_mid = _mm512_setzero_ps();
  __m512i low_min = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());
  __m512i high_min = low_min, low_max = _mm512_set1_epi32(kNoKey), high_max = low_max;
  const __m512i v_keep = _mm512_set1_epi32(keep), v_lo = _mm512_set1_epi32(lo);
  const __m512i v_mid = _mm512_set1_epi32(mid), v_hi = _mm512_set1_epi32(hi);
  const __m512i one = _mm512_set1_epi32(1);
  int64_t m = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512i x = _mm512_maskz_loadu_epi32(valid, k + i);
    const __mmask16 above = _mm512_mask_cmpgt_epi32_mask(valid, x, v_hi);
    const __mmask16 kept = _mm512_mask_cmpge_epi32_mask(valid, x, v_keep) & ~above;
    const __mmask16 high = _mm512_mask_cmpge_epi32_mask(kept, x, v_mid);
    const __mmask16 low = _mm512_mask_cmpge_epi32_mask(kept, x, v_lo) & ~high;
    count_above = _mm512_mask_add_epi32(count_above, above, count_above, one);
    count_mid = _mm512_mask_add_epi32(count_mid, high, count_mid, one);
    low_min = _mm512_mask_min_epi32(low_min, low, low_min, x);
    low_max = _mm512_mask_max_epi32(low_max, low, low_max, x);
    high_min = _mm512_mask_min_epi32(high_min, high, high_min, x);
    high_max = _mm512_mask_max_epi32(high_max, high, high_max, x);
    _mm512_storeu_si512(out_k + m, _mm512_maskz_compress_epi32(kept, x));
    if constexpr (WEIGHTED) {
      const __m512 y = _mm512_maskz_loadu_ps(valid, w + i);
      mass_above = _mm512_mask_add_ps(mass_above, above, mass_above, y);
      mass_mid = _mm512_mask_add_ps(mass_mid, high, mass_mid, y);
      _mm512_storeu_ps(out_w + m, _mm512_maskz_compress_ps(kept, y));
    }
    m += __builtin_popcount(kept);
  }
  r.above.count += _mm512_reduce_add_epi32(count_above);
  r.at_mid.count += _mm512_reduce_add_epi32(count_mid);
  if constexpr (WEIGHTED) {
    r.above.mass += _mm512_reduce_add_ps(mass_above);
    r.at_mid.mass += _mm512_reduce_add_ps(mass_mid);
  }
  r.low_min = _mm512_reduce_min_epi32(low_min);
  r.low_max = _mm512_reduce_max_epi32(low_max);
  r.high_min = _mm512_reduce_min_epi32(high_min);
  r.high_max = _mm512_reduce_max_epi32(high_max);
  return m;
}
#endif

// One step of select_values over the n keys k (weights w), bounds [lo, hi] split at mid: its
// BisectStep, and the keys in [keep, hi] (with their weights) copied to out_k (out_w) in order;
// returns how many.
template <bool WIDE, bool WEIGHTED>
ASTRAI_INLINE int64_t bisect_step(const int32_t* k, const float* w, int64_t n, int32_t keep,
                                  int32_t lo, int32_t mid, int32_t hi, int32_t* out_k,
                                  float* out_w, BisectStep& r) {
#if ASTRAI_X86
  if constexpr (WIDE) {
    return bisect_step_wide<WEIGHTED>(k, w, n, keep, lo, mid, hi, out_k, out_w, r);
  }
#endif
  int32_t count_above[kLanes] = {}, count_mid[kLanes] = {};
  float mass_above[kLanes] = {}, mass_mid[kLanes] = {};
  int32_t low_min[kLanes], low_max[kLanes], high_min[kLanes], high_max[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    low_min[l] = high_min[l] = std::numeric_limits<int32_t>::max();
    low_max[l] = high_max[l] = kNoKey;
  }
  const auto one = [&](int64_t j, int l) {
    const int32_t x = k[j];
    const bool is_above = x > hi, kept = (x >= keep) & !is_above;
    const bool high = kept & (x >= mid), low = kept & (x >= lo) & !high;
    count_above[l] += is_above;
    count_mid[l] += high;
    low_min[l] = std::min(low_min[l], low ? x : std::numeric_limits<int32_t>::max());
    low_max[l] = std::max(low_max[l], low ? x : kNoKey);
    high_min[l] = std::min(high_min[l], high ? x : std::numeric_limits<int32_t>::max());
    high_max[l] = std::max(high_max[l], high ? x : kNoKey);
    if (WEIGHTED) {
      mass_above[l] += select(is_above, w[j], 0.0f);
      mass_mid[l] += select(high, w[j], 0.0f);
    }
  };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) one(i + l, l);
  }
  for (int l = 0; i < n; ++i, ++l) one(i, l);
  int64_t m = 0;
  for (int64_t j = 0; j < n; ++j) {  // the copy: branch-free
    out_k[m] = k[j];
    if (WEIGHTED) out_w[m] = w[j];
    m += (k[j] >= keep) & (k[j] <= hi);
  }
  for (int l = 0; l < kLanes; ++l) {
    r.above.count += count_above[l];
    r.above.mass += mass_above[l];
    r.at_mid.count += count_mid[l];
    r.at_mid.mass += mass_mid[l];
    r.low_min = std::min(r.low_min, low_min[l]);
    r.low_max = std::max(r.low_max, low_max[l]);
    r.high_min = std::min(r.high_min, high_min[l]);
    r.high_max = std::max(r.high_max, high_max[l]);
  }
  return m;
}

// Keys below a bisection's lower bound by more than this cannot hold a logit whose quotient by
// T ties with one at or above it (quotients that round together lie within 2 ulps).
constexpr int32_t kTieKeys = 8;

// The selection for `need` on the values >= floor among v[0, n) (weights w; WEIGHTED: of mass
// `mass` there): the largest value t with amount(>= t) >= need (the lowest when even all fall
// short, rounding), by bisection between keys of the set. Each step is one pass over the set
// (bisect_step) that tallies the amount at or above a split key and copies out the keys still
// within the bounds: those above the upper bound leave for `above`, those below the lower bound
// (less kTieKeys) are dropped, and the next bounds are the set's extreme keys on t's side, so the
// set shrinks as the bounds close and ends on a key of the set (ties exact). A large set's first
// step splits at a bracket from a sample (bracket_for), so that most of it leaves at once (if t
// lies above the bracket the step is not taken); the next split at the middle of the bounds'
// values. Returns theta = canon(t) and the tally of the values >= theta.
template <bool WIDE, bool WEIGHTED>
ASTRAI_INLINE Selection select_values(const float* v, float* w, int64_t n, double need,
                                      float floor, double mass, float temp, SelectScratch& sc) {
  const int64_t n0 = n;
  int32_t* src_k = sc.keys[0].data();
  int32_t lanes_min[kLanes], lanes_max[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    lanes_min[l] = std::numeric_limits<int32_t>::max();
    lanes_max[l] = kNoKey;
  }
  const auto key_of = [&](int64_t j, int l) {
    const int32_t key = order_key(v[j]);
    src_k[j] = key;
    lanes_min[l] = std::min(lanes_min[l], key);
    lanes_max[l] = std::max(lanes_max[l], key);
  };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) key_of(i + l, l);
  }
  for (int l = 0; i < n; ++i, ++l) key_of(i, l);
  int32_t lo = std::numeric_limits<int32_t>::max(), hi = kNoKey;
  for (int l = 0; l < kLanes; ++l) {
    lo = std::min(lo, lanes_min[l]);
    hi = std::max(hi, lanes_max[l]);
  }
  Selection s{-kInf, {}};
  if (n == 0) return s;
  lo = std::max(lo, order_key(floor));
  int32_t dropped = order_key(floor);  // every key below it has left the set
  const float* src_w = w;
  Tally above;
  int next = 1;
  bool bracketed = n <= kDirectMax;
  while (lo < hi) {
    int32_t mid, top = hi;
    if (!bracketed) {  // the sample's bracket [mid, top]
      bracketed = true;
      float b_lo, b_hi;
      const auto value = [&](int64_t j) { return v[j]; };
      bracket_for<WEIGHTED>(n, kSetSample, value, ListWeights{w}, floor, nullptr, nullptr, 0, kInf,
                            need, 0.0, WEIGHTED ? mass : -1.0, 1.0, temp, sc, b_lo, b_hi);
      mid = std::max(lo, order_key(b_lo));
      top = b_hi == kInf ? hi : std::min(hi, std::max(mid, order_key(b_hi) - 1));
    } else {
      const float lo_v = key_value(lo), hi_v = key_value(hi);
      mid = order_key(lo_v + (hi_v - lo_v) * 0.5f);
      if (!(std::isfinite(lo_v) && mid > lo && mid <= hi)) {
        mid = static_cast<int32_t>(lo + (static_cast<int64_t>(hi) - lo + 1) / 2);
      }
    }
    const int32_t keep = std::max(dropped, lo > kNoKey + kTieKeys ? lo - kTieKeys : kNoKey);
    BisectStep r;
    int32_t* out_k = sc.keys[next].data();
    float* out_w = sc.round_weights[next].data();
    const int64_t kept = bisect_step<WIDE, WEIGHTED>(src_k, src_w, n, keep, lo, mid, top, out_k,
                                                     out_w, r);
    if (top < hi && amount<WEIGHTED>(above) + amount<WEIGHTED>(r.above) >= need) {
      lo = top + 1;  // t lies above the bracket: the set stays
      continue;
    }
    above.add(r.above);
    dropped = keep;
    n = kept;
    src_k = out_k;
    src_w = out_w;
    next ^= 1;
    // the next bounds: the set's extreme keys in [mid, top] or in [lo, mid) (with none there,
    // rounding between sums: the bound reached)
    if (amount<WEIGHTED>(above) + amount<WEIGHTED>(r.at_mid) >= need) {
      lo = r.high_max >= mid ? r.high_min : top;
      hi = r.high_max >= mid ? r.high_max : top;
    } else {
      hi = r.low_max >= lo ? r.low_max : lo;
      lo = r.low_max >= lo ? r.low_min : lo;
    }
  }
  s.theta = std::max(canon(key_value(lo), temp), floor);
  int32_t from = order_key(s.theta);
  if (from < dropped) {  // (a quotient tie beyond kTieKeys: subnormal logits) the whole set again
    src_k = sc.keys[next].data();
    for (int64_t j = 0; j < n0; ++j) src_k[j] = order_key(v[j]);
    src_w = w;
    n = n0;
    above = Tally{};
  }
  // the set's keys >= theta, with `above` (every key above the bounds): the values >= theta
  int32_t counts[kLanes] = {};
  float lanes[kLanes] = {};
  const auto tally = [&](int64_t j, int l) {
    counts[l] += src_k[j] >= from;
    if (WEIGHTED) lanes[l] += select(src_k[j] >= from, src_w[j], 0.0f);
  };
  i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) tally(i + l, l);
  }
  for (int l = 0; i < n; ++i, ++l) tally(i, l);
  for (int l = 0; l < kLanes; ++l) {
    s.kept.count += counts[l];
    s.kept.mass += lanes[l];
  }
  s.kept.add(above);
  return s;
}

// top_k on the row, for k above the group count: the logits >= floor and >= lo into out, lo from
// a sample of the row so that k of them are >= lo (else a wider bracket, at last lo = floor);
// their count (below k only when fewer than k logits reach floor).
template <bool WIDE, class Load>
ASTRAI_INLINE int64_t gather_top_k(int64_t V, const Load& load, int64_t k, float floor,
                                   float temp, float* out, SelectScratch& sc) {
  for (int missed = 0;; ++missed) {
    float lo = floor, hi = kInf;
    if (missed < kMaxMisses) {
      bracket_for<false>(V, kSample, load, CountWeights{}, floor, nullptr, nullptr, 0, kInf,
                         static_cast<double>(k), 0.0, -1.0, 1 << missed, temp, sc, lo, hi);
    }
    Tally a, in, below;
    split_values<WIDE, false, false>(V, load, CountWeights{}, floor, lo, kInf, out, nullptr, a,
                                     in, below);
    if (in.count >= k || lo == floor) return in.count;
  }
}

// top_p on the row (the logits >= floor with their weights, of mass W <= S): its selection for
// p W, the first round on the row, the next on the bracket's copy.
template <bool WIDE, class Load>
ASTRAI_INLINE Selection select_top_p_on_row(int64_t V, const Load& load,
                                            const RowWeights& weights, int64_t g,
                                            const float* gmax, float floor, double p, double S,
                                            const Weigh& weigh, float temp, SelectScratch& sc) {
  // a floor leaves the set's mass unknown until the first split has tallied it; else the
  // estimate is S less the mass below t, and needs the heavy values only where t may be one of
  // them: where they are few (as on a row whose few dominant tokens hold most of the mass)
  const bool floored = floor > -kInf;
  float* hv = sc.heavy_values.data();
  float* hw = sc.heavy_weights.data();
  float cut = std::max(weigh.heavy(S, V), floor);
  if (!(cut <= weigh.m && (floored || reach(V, g, gmax, cut) * kGatherShare <= V))) cut = kInf;
  const int64_t h = cut < kInf ? gather_at_least<WIDE>(V, load, g, gmax, cut, hv) : 0;
  for (int64_t i = 0; i < h; ++i) hw[i] = weigh(hv[i]);
  float lo = floor, hi = kInf;
  for (int missed = 0;; ++missed) {
    if (missed > kMaxMisses) {
      lo = floor;
      hi = kInf;
    } else if (!missed) {
      bracket_for<true>(V, kSample, load, weights, floor, hv, hw, h, cut, 0.0, p,
                        floored ? -1.0 : S, 1.0, temp, sc, lo, hi);
    }
    Tally a, in, below;
    float* vals = sc.values.data();
    float* wts = sc.weights.data();
    if (floored) {
      split_values<WIDE, true, true>(V, load, weights, floor, lo, hi, vals, wts, a, in, below);
    } else {
      split_values<WIDE, true, false>(V, load, weights, floor, lo, hi, vals, wts, a, in, below);
    }
    const double need = p * (floored ? a.mass + in.mass + below.mass : S);
    if (bracket_holds<true>(a, in, need, floor, lo, hi) || missed > kMaxMisses) {
      Selection s = select_values<WIDE, true>(vals, wts, in.count, need - a.mass, -kInf, in.mass,
                                              temp, sc);
      s.kept.add(a);
      return s;
    }
  }
}

template <class T, bool C, bool WIDE>
ASTRAI_INLINE void forward_rows(const SampledArgs& a, int64_t n0, int64_t n1) {
  using S = typename T::storage;
  const int64_t V = a.x.V, sv = a.x.sV;
  const float temp = a.temperature, inv_t = a.inv_t;
  const bool k_on = a.top_k > 0 && a.top_k < V, p_on = a.top_p < 1.0, min_on = a.min_p_on;
  const bool p_alone = p_on && !k_on && !min_on;
  const int64_t k = a.top_k;
  const int64_t g = group_size(V, k_on ? k : 0);
  const int64_t groups = (V + g - 1) / g;
  const bool small_k = k_on && groups >= k;
  int group_bits = 0;
  while ((int64_t{1} << group_bits) < g) ++group_bits;
  SelectScratch& sc = select_scratch(V, groups);
  float* const vals = sc.values.data();
  float* const wts = sc.weights.data();
  float* const gmax = sc.group_max.data();
  float* const shifts = sc.group_shifts.data();
  // pass 1 keeps its exps for top_p or min_p on the row itself (top_k's candidates take theirs):
  // the row's weights then cost a product, not an exp
  const bool keep_exps = (p_on || min_on) && !k_on;
  const RowWeights row_weights{sc.row_exps.data(), sc.group_factors.data(), group_bits};
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t y = a.y[n];
    const bool ignored = y == a.ignore_index;
    if (ignored || y < 0 || y >= V) {
      if (!ignored) a.bad->set(n, y);
      a.logp[n] = a.lse_kept[n] = a.threshold[n] = a.log_kept_mass[n] = 0.0f;
      a.support_size[n] = 0;
      a.in_support[n] = false;
      continue;
    }
    const RawLoad<T, C> load{a.x.row<S>(n), sv};
    const float x_y = load(y);
    OnlineLse st;
    // pass 1: the row's online reduction in groups of g, each group's max kept (and its exps)
    if (keep_exps) {
      online_lse_row<false, false, true>(V, load, st, x_y, inv_t, sc.row_exps.data(), shifts, g,
                                         gmax);
    } else {
      online_lse_row<false, false>(V, load, st, x_y, inv_t, nullptr, nullptr, g, gmax);
    }
    const float m = st.max;
    if (!(std::isfinite(m) && st.sum >= 1.0f && std::isfinite(st.sum))) {
      // NaN or +inf in the row (or all -inf): its results are NaN, and it stays in the support
      // so that the NaN reaches the loss and the gradient
      const float nan = std::numeric_limits<float>::quiet_NaN();
      a.logp[n] = a.lse_kept[n] = a.log_kept_mass[n] = nan;
      a.threshold[n] = -kInf;
      a.support_size[n] = V;
      a.in_support[n] = true;
      continue;
    }
    const float log_total = std::log(st.sum);
    const int32_t top_key = order_key(m);
    const Weigh weigh{m, inv_t};
    // the row's weights: the kept exps (relative to each group's shift <= m) times these
    const auto row_factors = [&] {
      for (int64_t i = 0; i < groups; ++i) sc.group_factors[i] = weigh(shifts[i]);
    };
    // theta: the support's lower bound in logits, min_p's the floor of the other filters
    float theta = min_on ? unscaled_lower(m / temp + a.log_min_p, temp) : -kInf;
    const float floor = theta;
    int64_t count = -1;  // the candidates in vals (a superset of the support), -1: none
    Tally kept;          // the support's size and mass
    if (small_k) {       // k distinct logits reach the k-th largest group maximum
      int32_t* gk = sc.group_keys.data();
      for (int64_t i = 0; i < groups; ++i) gk[i] = order_key(gmax[i]);
      const int64_t padded = pad_keys(gk, nullptr, groups);
      int32_t lowest, highest;
      key_range(gk, padded, lowest, highest);
      const float c = std::max(floor, key_value(key_at_least<false>(gk, nullptr, padded, lowest,
                                                                    top_key,
                                                                    static_cast<double>(k))));
      // values whose quotient ties with that of c are candidates too
      count = gather_at_least<WIDE>(V, load, g, gmax, canon(c, temp), vals);
    } else if (V <= kDirectMax || (min_on && reach(V, g, gmax, floor) * kGatherShare <= V)) {
      count = gather_at_least<WIDE>(V, load, g, gmax, floor, vals);  // short, or min_p keeps few
    } else if (k_on) {
      count = gather_top_k<WIDE>(V, load, k, floor, temp, vals, sc);
    } else if (p_on) {
      float c = -kInf;
      if (p_alone) {  // the group maxima's masses bound top_p
        int32_t* gk = sc.group_keys.data();
        float* gw = sc.group_weights.data();
        for (int64_t i = 0; i < groups; ++i) {
          gk[i] = order_key(gmax[i]);
          gw[i] = weigh(gmax[i]);
        }
        const int64_t padded = pad_keys(gk, gw, groups);
        int32_t lowest, highest;
        key_range(gk, padded, lowest, highest);
        const double target = a.top_p * static_cast<double>(st.sum) * (1.0 + kTopPBoundMargin);
        if (weight_at_least<true>(gk, gw, padded, lowest) >= target) {
          c = canon(key_value(key_at_least<true>(gk, gw, padded, lowest, top_key, target)), temp);
        }
      }
      if (c > -kInf && reach(V, g, gmax, c) * kGatherShare <= V) {
        count = gather_at_least<WIDE>(V, load, g, gmax, c, vals);
      } else {  // top_p's first round on the row itself
        row_factors();
        const Selection s = select_top_p_on_row<WIDE>(V, load, row_weights, g, gmax, floor,
                                                      a.top_p, st.sum, weigh, temp, sc);
        theta = std::max(theta, s.theta);
        kept = s.kept;
      }
    } else {  // min_p alone, keeping much of the row
      row_factors();
      kept = tally_at_least(V, load, row_weights, g, gmax, floor);
    }
    if (count >= 0) {
      if (k_on && count >= k) {  // fewer: min_p kept fewer than k, so top_k keeps all of them
        const Selection s = select_values<WIDE, false>(vals, nullptr, count,
                                                       static_cast<double>(k), -kInf, 0.0, temp,
                                                       sc);
        theta = std::max(theta, s.theta);
      }
      if (p_on) {
        // the candidates' weights, and the mass of those min_p and top_k keep
        float lanes[kLanes] = {};
        int64_t i = 0;
        for (; i + kLanes <= count; i += kLanes) {
          for (int l = 0; l < kLanes; ++l) {
            wts[i + l] = weigh(vals[i + l]);
            lanes[l] += select(vals[i + l] >= theta, wts[i + l], 0.0f);
          }
        }
        for (int l = 0; i < count; ++i, ++l) {
          wts[i] = weigh(vals[i]);
          lanes[l] += select(vals[i] >= theta, wts[i], 0.0f);
        }
        double mass = 0.0;
        for (int l = 0; l < kLanes; ++l) mass += lanes[l];
        const double total = p_alone ? static_cast<double>(st.sum) : mass;
        const Selection s = select_values<WIDE, true>(vals, wts, count, a.top_p * total, theta,
                                                      mass, temp, sc);
        theta = std::max(theta, s.theta);
        kept = s.kept;  // the candidates >= theta: the support
      } else {  // the support: the candidates >= theta (every kept token is one)
        int32_t counts[kLanes] = {};
        float lanes[kLanes] = {};
        int64_t i = 0;
        for (; i + kLanes <= count; i += kLanes) {
          for (int l = 0; l < kLanes; ++l) {
            const float v = vals[i + l];
            counts[l] += v >= theta;
            lanes[l] += select(v >= theta, weigh(v), 0.0f);
          }
        }
        for (int l = 0; i < count; ++i, ++l) {
          const float v = vals[i];
          counts[l] += v >= theta;
          lanes[l] += select(v >= theta, weigh(v), 0.0f);
        }
        for (int l = 0; l < kLanes; ++l) {
          kept.count += counts[l];
          kept.mass += lanes[l];
        }
      }
    }
    // every token kept: the row's own sum, so log_kept_mass is 0 exactly
    const float log_kept = kept.count == V ? log_total : std::log(static_cast<float>(kept.mass));
    const bool in = x_y >= theta;
    a.in_support[n] = in;
    a.support_size[n] = kept.count;
    a.logp[n] = in ? (x_y - m) * inv_t - log_kept : -kInf;
    a.lse_kept[n] = m * inv_t + log_kept;
    a.threshold[n] = theta;
    a.log_kept_mass[n] = log_kept - log_total;
  }
}

template <class T, bool C>
ASTRAI_INLINE void backward_rows(const SampledArgs& a, int64_t n0, int64_t n1) {
  using S = typename T::storage;
  const int64_t V = a.x.V, sv = a.x.sV, sg = a.grad.sV;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t y = a.y[n];
    const float coef = a.coef[n];
    S* g = a.grad.row<S>(n);
    if (y == a.ignore_index || coef == 0.0f || y < 0 || y >= V) {
      if (y != a.ignore_index && (y < 0 || y >= V)) a.bad->set(n, y);
      zero_row<T, C>(g, sg, V);
      continue;
    }
    const S* row = a.x.row<S>(n);
    const float x_y = T::load(row[C ? y : y * sv]);
    write_kept_grad<T, C>(row, sv, g, sg, V, y, x_y, a.inv_t, a.saved_lse_kept[n],
                          a.saved_threshold[n], coef);
  }
}

// The AVX-512 variant copies selected values with compress instructions (compress_chunk).
constexpr bool kWide_avx512 = true, kWide_avx2 = false, kWide_generic = false;

#define ASTRAI_SAMPLED_VARIANTS(ATTR, SUFFIX)                                                  \
  template <class T, bool C>                                                                   \
  ATTR ASTRAI_NOINLINE void forward_##SUFFIX(const SampledArgs& a, int64_t n0, int64_t n1) {  \
    forward_rows<T, C, kWide_##SUFFIX>(a, n0, n1);                                             \
  }                                                                                            \
  template <class T, bool C>                                                                   \
  ATTR ASTRAI_NOINLINE void backward_##SUFFIX(const SampledArgs& a, int64_t n0, int64_t n1) { \
    backward_rows<T, C>(a, n0, n1);                                                            \
  }
ASTRAI_FOR_EACH_ISA(ASTRAI_SAMPLED_VARIANTS)
#undef ASTRAI_SAMPLED_VARIANTS

template <class T, bool C>
RowsFn<SampledArgs> pick_forward(Isa isa) {
#if ASTRAI_X86
  if (isa == Isa::Avx512) return &forward_avx512<T, C>;
  if (isa == Isa::Avx2) return &forward_avx2<T, C>;
#endif
  (void)isa;
  return &forward_generic<T, C>;
}

template <class T, bool C>
RowsFn<SampledArgs> pick_backward(Isa isa) {
#if ASTRAI_X86
  if (isa == Isa::Avx512) return &backward_avx512<T, C>;
  if (isa == Isa::Avx2) return &backward_avx2<T, C>;
#endif
  (void)isa;
  return &backward_generic<T, C>;
}

}  // namespace

// Compiled for unit vocabulary strides only (C = true): other strides go through
// run_unit_stride_rows' contiguous copies.
void sampled_logprobs_forward_kernel(const SampledArgs& args, int nthreads) {
  const Isa isa = active_isa();
  RowsFn<SampledArgs> fn =
      with_dtype(args.dtype, [&](auto t) { return pick_forward<decltype(t), true>(isa); });
  run_unit_stride_rows(fn, args, nthreads);
}

void sampled_logprobs_backward_kernel(const SampledArgs& args, int nthreads) {
  const Isa isa = active_isa();
  RowsFn<SampledArgs> fn =
      with_dtype(args.dtype, [&](auto t) { return pick_backward<decltype(t), true>(isa); });
  run_unit_stride_rows(fn, args, nthreads);
}

}  // namespace astrai
