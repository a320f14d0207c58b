// sampled_logprobs_forward / sampled_logprobs_backward of kernels/primitives.py: targets scored
// under vLLM v1's processed distribution (ops/sampling.py states the contract). With
// s = float32(x) / T (a float32 division, as vLLM's) the support is K = {j : s_j >= tau}, tau
// the largest of min_p's max(s) + log(min_p), top_k's k-th largest s and top_p's crossing value.
//
// The kernels work in the logits' own units: s is a non-decreasing function of x, so
// K = {j : x_j >= theta} with theta = unscaled_lower(tau), the smallest float whose quotient
// reaches tau; two logits whose quotients round to the same s stay tied. The backward then
// needs no division, and `threshold` (the per-row output the backward reads) is theta.
//
// Forward, per row:
//   1. one streaming pass, the online max / sum-exp of common.h (accumulate_block) over groups
//      of g >= 256 elements: the row max M, S = sum_j exp((x_j - M) / T) and each group's max;
//   2. a lower bound c <= theta: the k-th largest group maximum (k distinct logits reach it,
//      so it is at most the k-th largest logit), min_p's threshold, or, for top_p alone, the
//      largest group maximum whose group maxima's masses reach p S (else a cut 8, 16, 32 or
//      64 below the max whose mass does, else none); then the candidates x_j >= c are gathered
//      from the groups whose max reaches c (about k groups for top_k). With fewer groups than
//      k (k <= V / 8), a max pass over chunks of kLanes * r logits keeps the maxima of their
//      kLanes strided sub-groups (r logits each, V / r >= 2k of them): k disjoint sub-groups
//      reach the k-th largest, so it bounds c the same way;
//   3. exact selection on the candidates: a bisection on int keys ordered as the floats (each
//      step a branch-free vectorized pass over the candidates' keys) for the largest key whose
//      count (top_k) or mass (top_p) at or above reaches its target: a key
//      of a candidate, so ties are exact; the support's size and mass are those of the
//      candidates >= theta.
// Backward: grad_j = coef * ([j == y] - p'_j [x_j >= theta]), p'_j = exp(x_j / T - lse_kept),
// with the target's 1 - p'_y formed as sum_{kept j != y} p'_j / sum_{kept j} p'_j (as
// write_logprob_grad does).
#include <vector>

#include "common.h"

namespace astrai {
namespace {

// Relative margin on top_p's bound: the masses that choose the bound are float32 sums (of
// float32 exps), so the bound must reach (1 + margin) p S to be sure to reach p S.
constexpr double kTopPBoundMargin = 1e-4;
// The smallest group of pass 1: a call of accumulate_block costs its lanes' set-up and
// reduction, so smaller groups would slow the streaming pass (1.3x at 128, 1.8x at 64).
constexpr int64_t kMinGroup = 256;
// Candidates are gathered from a group in chunks of this many logits; a chunk with none is
// skipped after one vectorized test.
constexpr int kGatherChunk = 64;
// The most logits of a strided sub-group (strided_maxima): a chunk of kLanes * 8 is kMinGroup.
constexpr int kMaxStrideRows = 8;
// Fewer rows (top_k > V / 8) cost more than they save: the selection over V / 2 maxima, then
// over the k or more logits gathered, was slower than one over the whole row (k = 5000 of
// 32768: 1.3x slower).
constexpr int kMinStrideRows = 4;

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

// The group size of pass 1: a power of two, at least kMinGroup, giving at least 2k groups with
// top_k on where the row allows (the k-th largest group maximum then leaves about k groups to
// gather from).
int64_t group_size(int64_t V, int64_t top_k) {
  const int64_t want = top_k > 0 ? V / (2 * top_k) : kMinGroup;
  int64_t g = kMinGroup;
  while (g * 2 <= want && g * 2 <= kBlock) g *= 2;
  return g;
}

// sum_{j in [b0, b0 + len)} [x_j >= c] exp((x_j - m) * scale): the mass a cut keeps there.
template <class Load>
ASTRAI_INLINE float mass_at_least(const Load& load, int64_t b0, int64_t len, float c, float m,
                                  float scale) {
  float lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = 0.0f;
  int64_t j = 0;
  for (; j + kLanes <= len; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = load(b0 + j + l);
      lanes[l] += select(v >= c, fast_exp((v - m) * scale), 0.0f);
    }
  }
  for (int l = 0; j < len; ++j, ++l) {
    const float v = load(b0 + j);
    lanes[l] += select(v >= c, fast_exp((v - m) * scale), 0.0f);
  }
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// The rows of the strided maxima bounding top_k when there are fewer groups than k: the most
// (a power of two, at most kMaxStrideRows) leaving at least 2k maxima.
int strided_rows(int64_t V, int64_t top_k) {
  int rows = 1;
  while (rows * 2 <= kMaxStrideRows && V / (rows * 2) >= 2 * top_k) rows *= 2;
  return rows;
}

// The row in chunks of kLanes * rows logits, each split into its kLanes strided sub-groups
// (logits l, l + kLanes, ..., of the chunk): their maxima into sub[chunk * kLanes + l] (-inf
// past V) and each chunk's max into chunk_max. One vectorized max pass, with no reduction
// across lanes but the chunk maxima's.
template <class Load>
ASTRAI_INLINE int64_t strided_maxima(int64_t V, const Load& load, int rows, float* sub,
                                     float* chunk_max) {
  const int64_t chunk = static_cast<int64_t>(kLanes) * rows;
  int64_t chunks = 0;
  for (int64_t b0 = 0; b0 < V; b0 += chunk, ++chunks) {
    float* lanes = sub + chunks * kLanes;
    for (int l = 0; l < kLanes; ++l) lanes[l] = -kInf;
    if (b0 + chunk <= V) {
      for (int r = 0; r < rows; ++r) {
        for (int l = 0; l < kLanes; ++l) {
          const float v = load(b0 + r * kLanes + l);
          lanes[l] = lanes[l] < v ? v : lanes[l];
        }
      }
    } else {
      for (int64_t j = b0; j < V; ++j) {
        const int l = static_cast<int>((j - b0) % kLanes);
        lanes[l] = std::max(lanes[l], load(j));
      }
    }
    float mx = -kInf;
    for (int l = 0; l < kLanes; ++l) mx = mx < lanes[l] ? lanes[l] : mx;
    chunk_max[chunks] = mx;
  }
  return chunks;
}

// The logits x_j >= c of the groups whose max reaches c into out (room for V), in row order;
// returns their count. A chunk's test is one vectorized loop (a flag byte per logit); the
// flags are then read eight at a time, so a chunk holding one candidate costs a few steps.
template <class Load>
ASTRAI_INLINE int64_t gather_at_least(int64_t V, const Load& load, int64_t g, const float* gmax,
                                      float c, float* out) {
  int64_t n = 0;
  alignas(64) uint8_t hit[kGatherChunk];
  for (int64_t b0 = 0, grp = 0; b0 < V; b0 += g, ++grp) {
    if (!(gmax[grp] >= c)) continue;
    const int64_t b1 = std::min(V, b0 + g);
    int64_t j = b0;
    for (; j + kGatherChunk <= b1; j += kGatherChunk) {
      int hits = 0;
      for (int l = 0; l < kGatherChunk; ++l) {
        const int h = load(j + l) >= c;
        hit[l] = static_cast<uint8_t>(h);
        hits += h;
      }
      if (hits == 0) continue;
      if (hits > kGatherChunk / 4) {  // many: a branch-free copy beats a step per flag
        for (int l = 0; l < kGatherChunk; ++l) {
          out[n] = load(j + l);
          n += hit[l];
        }
        continue;
      }
      for (int w = 0; w < kGatherChunk; w += 8) {
        uint64_t word;
        std::memcpy(&word, hit + w, 8);
        while (word) {  // each flag byte is 0 or 1: clear the lowest set one
          out[n++] = load(j + w + (__builtin_ctzll(word) >> 3));
          word &= word - 1;
        }
      }
    }
    for (; j < b1; ++j) {
      const float v = load(j);
      out[n] = v;
      n += v >= c;
    }
  }
  return n;
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
    keys[i] = std::numeric_limits<int32_t>::min();  // below every key of a float
    if (w) w[i] = 0.0f;
  }
  return padded;
}

// The largest key t in [lo, hi] whose weight at or above, weight_at_least(t), reaches
// `target`, by bisection on the keys (branch-free vectorized passes over the n keys): a key of
// one of the values (the weight only changes there), so tied values go together. lo when even
// lo falls short (rounding); the caller has every key in [lo, hi].
template <bool WEIGHTED>
ASTRAI_INLINE int32_t key_at_least(const int32_t* keys, const float* w, int64_t n, int32_t lo, int32_t hi,
                     double target) {
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

// Keys of v[0, n) into keys; returns the smallest.
ASTRAI_INLINE int32_t keys_of(const float* v, int64_t n, int32_t* keys) {
  int32_t lowest = std::numeric_limits<int32_t>::max();
  for (int64_t i = 0; i < n; ++i) {
    keys[i] = order_key(v[i]);
    lowest = std::min(lowest, keys[i]);
  }
  return lowest;
}

// Per-thread buffers of the forward (grow, never shrink).
struct SelectScratch {
  std::vector<float> values, weights, group_max, group_weights;
  std::vector<float> sub_max, sub_values, chunk_max;
  std::vector<int32_t> keys, group_keys;
};

SelectScratch& select_scratch(int64_t V, int64_t groups) {
  thread_local SelectScratch s;
  const int64_t values = V + kLanes, padded_groups = groups + kLanes;  // room for padding
  if (static_cast<int64_t>(s.values.size()) < values) {
    s.values.resize(values);
    s.weights.resize(values);
    s.keys.resize(values);
    s.sub_max.resize(values + kLanes);
    s.sub_values.resize(values + kLanes);
    s.chunk_max.resize(V / kLanes + kLanes);
  }
  if (static_cast<int64_t>(s.group_max.size()) < padded_groups) {
    s.group_max.resize(padded_groups);
    s.group_weights.resize(padded_groups);
    s.group_keys.resize(padded_groups);
  }
  return s;
}

// The value of the largest key t whose weight at or above (the count of the values >= t, or
// WEIGHTED the sum of their weights w) reaches `target`: key_at_least on the keys of v[0, n)
// (the lowest value's when even that falls short). w needs room for n + kLanes (padding).
template <bool WEIGHTED>
ASTRAI_INLINE float select_at_least(const float* v, float* w, int64_t n, double target,
                                    int32_t top_key, SelectScratch& sc) {
  int32_t* keys = sc.keys.data();
  const int32_t lowest = keys_of(v, n, keys);
  const int64_t padded = pad_keys(keys, WEIGHTED ? w : nullptr, n);
  return key_value(key_at_least<WEIGHTED>(keys, w, padded, lowest, top_key, target));
}

// sum_i w[i] over [0, n) in kLanes lane sums (those of weight_at_least over every key).
ASTRAI_INLINE double total_weight(const float* w, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += w[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) lanes[l] += w[i];
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

template <class T, bool C>
ASTRAI_INLINE void forward_rows(const SampledArgs& a, int64_t n0, int64_t n1) {
  using S = typename T::storage;
  const int64_t V = a.x.V, sv = a.x.sV;
  const float temp = a.temperature, inv_t = a.inv_t;
  const bool k_on = a.top_k > 0 && a.top_k < V, p_on = a.top_p < 1.0, min_on = a.min_p_on;
  const bool p_alone = p_on && !k_on && !min_on;
  const int64_t k = a.top_k;
  const int64_t g = group_size(V, k_on ? k : 0);
  const int64_t groups = (V + g - 1) / g;
  const int stride_rows = k_on ? strided_rows(V, k) : 1;
  SelectScratch& sc = select_scratch(V, groups);
  float* const vals = sc.values.data();
  float* const wts = sc.weights.data();
  float* const gmax = sc.group_max.data();
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
    // pass 1: the row's online reduction in groups of g, each group's max kept
    online_lse_row<false, false>(V, load, st, x_y, inv_t, nullptr, nullptr, g, gmax);
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
    // theta: the support's lower bound in logits; c <= theta: the candidates' bound
    float theta = min_on ? unscaled_lower(m / temp + a.log_min_p, temp) : -kInf;
    float c = theta;
    if (k_on && groups >= k) {  // k distinct logits reach the k-th largest group maximum
      int32_t* gk = sc.group_keys.data();
      const int32_t lowest = keys_of(gmax, groups, gk);
      const int64_t padded = pad_keys(gk, nullptr, groups);
      c = std::max(c, key_value(key_at_least<false>(gk, nullptr, padded, lowest, top_key,
                                                    static_cast<double>(k))));
    } else if (p_alone) {  // the group maxima's masses, else cuts below the max, bound top_p
      int32_t* gk = sc.group_keys.data();
      float* gw = sc.group_weights.data();
      const int32_t lowest = keys_of(gmax, groups, gk);
      for (int64_t i = 0; i < groups; ++i) gw[i] = fast_exp((gmax[i] - m) * inv_t);
      const int64_t padded = pad_keys(gk, gw, groups);
      const double target = a.top_p * static_cast<double>(st.sum) * (1.0 + kTopPBoundMargin);
      if (weight_at_least<true>(gk, gw, padded, lowest) >= target) {
        c = key_value(key_at_least<true>(gk, gw, padded, lowest, top_key, target));
      } else {
        c = -kInf;
        for (float below = 8.0f; below <= 64.0f; below *= 2.0f) {
          const float cut = m - below * temp;
          double mass = 0.0;
          for (int64_t b0 = 0, grp = 0; b0 < V; b0 += g, ++grp) {
            if (gmax[grp] >= cut) mass += mass_at_least(load, b0, std::min(g, V - b0), cut, m,
                                                        inv_t);
          }
          if (mass >= target) {
            c = cut;
            break;
          }
        }
      }
    }
    int64_t gather_group = g;
    const float* gather_max = gmax;
    if (k_on && groups < k && stride_rows >= kMinStrideRows) {  // k distinct sub-groups reach the k-th maximum
      float* sub = sc.sub_max.data();
      float* reaching = sc.sub_values.data();
      const int64_t chunks = strided_maxima(V, load, stride_rows, sub, sc.chunk_max.data());
      int64_t n_reaching = 0;
      for (int64_t i = 0; i < chunks * kLanes; ++i) {
        reaching[n_reaching] = sub[i];
        n_reaching += sub[i] >= c;
      }
      if (n_reaching >= k) {
        c = std::max(c, select_at_least<false>(reaching, nullptr, n_reaching,
                                               static_cast<double>(k), top_key, sc));
      }
      gather_group = static_cast<int64_t>(kLanes) * stride_rows;
      gather_max = sc.chunk_max.data();
    }
    // values whose quotient ties with that of c are candidates too
    c = unscaled_lower(c / temp, temp);
    int64_t count = gather_at_least(V, load, gather_group, gather_max, c, vals);
    if (k_on && count >= k) {  // fewer: min_p kept fewer than k, so top_k keeps all of them
      const float kth = select_at_least<false>(vals, nullptr, count, static_cast<double>(k),
                                               top_key, sc);
      theta = std::max(theta, unscaled_lower(kth / temp, temp));
    }
    if (p_on) {
      int64_t kept = 0;  // the candidates min_p and top_k keep, with their masses
      for (int64_t i = 0; i < count; ++i) {
        const float v = vals[i];
        vals[kept] = v;
        kept += v >= theta;
      }
      count = kept;
      for (int64_t i = 0; i < count; ++i) wts[i] = fast_exp((vals[i] - m) * inv_t);
      const double mass = p_alone ? static_cast<double>(st.sum) : total_weight(wts, count);
      const float crossing = select_at_least<true>(vals, wts, count, a.top_p * mass, top_key, sc);
      theta = std::max(theta, unscaled_lower(crossing / temp, temp));
    }
    // the support: the candidates >= theta (every kept token is one)
    int64_t support = 0;
    float lanes[kLanes];
    for (int l = 0; l < kLanes; ++l) lanes[l] = 0.0f;
    int64_t i = 0;
    for (; i + kLanes <= count; i += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const float v = vals[i + l];
        support += v >= theta;
        lanes[l] += select(v >= theta, fast_exp((v - m) * inv_t), 0.0f);
      }
    }
    for (int l = 0; i < count; ++i, ++l) {
      const float v = vals[i];
      support += v >= theta;
      lanes[l] += select(v >= theta, fast_exp((v - m) * inv_t), 0.0f);
    }
    float kept_mass = 0.0f;
    for (int l = 0; l < kLanes; ++l) kept_mass += lanes[l];
    // every token kept: the row's own sum, so log_kept_mass is 0 exactly
    const float log_kept = support == V ? log_total : std::log(kept_mass);
    const bool in = x_y >= theta;
    a.in_support[n] = in;
    a.support_size[n] = support;
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

#define ASTRAI_SAMPLED_VARIANTS(ATTR, SUFFIX)                                                  \
  template <class T, bool C>                                                                   \
  ATTR ASTRAI_NOINLINE void forward_##SUFFIX(const SampledArgs& a, int64_t n0, int64_t n1) {  \
    forward_rows<T, C>(a, n0, n1);                                                             \
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
