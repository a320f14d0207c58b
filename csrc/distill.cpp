// distill_forward / distill_backward of kernels/primitives.py: TRL's generalized JSD between the
// student's and the teacher's softmax(z / T), a_j and b_j their log-probs, p = exp of them,
//   beta = 0 (Fkl):  loss = sum_j p_t (b - a),              grad_j = g / T * (p_s - p_t)
//   beta = 1 (Rkl):  m = b,  K = sum_j p_s (a - m),  loss = K
//   otherwise (Mix): m = log(w_s p_s + w_t p_t),  K = sum_j p_s (a - m),
//                    loss = w_t sum_j p_t (b - m) + w_s K
//   (Rkl and Mix)    grad_j = g / T * w_s * p_s,j * (a_j - m_j - K)
// plus hard_weight * (lse(x) - x_y) at temperature 1 (grad: g * hard_weight * (p1_j - d_jy)).
// Terms with p == 0 are 0; an id -inf on both sides has m = -inf and no terms.
//
// Work per element: the forward reads both rows once for their (max, sum-exp) statistics
// (2 exps), then once more for the loss: p_s and p_t from the log-probs (2 exps; 1 for Fkl and
// Rkl) and m with one log (Mix). For Mix with a bf16/fp16 student the forward instead finds
// each row's max, keeps exp((x - max) / T) of both rows in per-thread scratch while summing
// them, and takes p = e / sum in the loss pass: 2 exps and 1 log per element in all. The exps
// are relative to the exact max, not to the online shift started at the target's logit
// (rescaled, those carried about 3x the K error in the gradient). Measured against float64 at
// V = 32771, T = 0.8 on float32 inputs it is within 1.7x of exp of the log-prob either way
// (loss 1.5e-7 vs 5e-8 relative at logit scale 1; gradient 2.3e-4 vs 1.4e-4 of its max at
// scale 4), which a float32 trainer's tolerance did not take; bf16 gradients are unchanged.
// The backward is one pass over both rows: 2 exps and 1 log (Mix), 2 exps (Fkl), 1 exp (Rkl),
// writing the student's gradient. A forward given the gradient's scale (grad_loss: the scalar
// reductions' d loss / d row loss is known up front) writes the gradient too: its loss pass
// stores p_s and q = p_s (a - m) (p_t for Fkl) of each element in the row scratch (two floats
// per element, cache-resident), and once K is known a last pass writes
// grad_j = g / T * w_s * (q_j - p_j K) (g / T * (p_j - q_j) for Fkl) from them: no exp or log
// per element, where the backward takes 2 exps and a log and reads both rows again.
// m is the log of the mixture's probability itself, not a logaddexp of the log-probs (which
// takes an exp and a log1p on top of p_s and p_t).
// Log-probs are (x - ref) * scale - log_sum with ref the row max (or 0 with log_sum = lse),
// exps of them clamped at <= 0 (log_prob_exp), so a contracted FMA cannot push p above 1.
#include <type_traits>

#include "common.h"

namespace astrai {
namespace {

// As in logprobs.cpp: the saved lse serves while |lse| <= this, else the row is re-reduced.
constexpr float kDirectLseLimit = 64.0f;

enum class Kind : int { Fkl, Rkl, Mix };

struct RowLogProbs {
  float ref, log_sum;  // log p_j = (x_j - ref) * scale - log_sum
};

template <class T>
ASTRAI_INLINE RowLogProbs fresh_stats(int64_t V, const RawLoad<T, true>& load, float hint,
                                      float scale, float* lse) {
  OnlineLse st;
  online_lse_row<false, false>(V, load, st, hint, scale);
  if (lse) *lse = st.lse(scale);
  return {st.shift, st.log_sum()};
}

// The row reduction is compiled once per (dtype, ISA), out of line (Stats below), so
// the many loss variants stay small: each holds only its elementwise loops.
// `hint` is the row's element at the target (for V = 1 the only one: log p = 0 exactly).
template <class Stats, class T>
ASTRAI_INLINE RowLogProbs saved_stats(int64_t V, const RawLoad<T, true>& load, float hint,
                                      float scale, float lse) {
  if (V == 1) return {hint, 0.0f};
  if (std::fabs(lse) <= kDirectLseLimit) return {0.0f, lse};
  return Stats::template run<T>(V, load, hint, scale, nullptr);
}

// The mixture's weights are scaled by 2^kWeightExp (exact), so w p of any normal weight and
// nonzero p (>= 2^-126: fast_exp flushes below) is a normal float, which mixture_log's
// exponent split needs; q <= 2^127 stays finite.
constexpr int kWeightExp = 126;

// log(q) - kWeightExp * ln 2 for q = ws_scaled * p_s + wt_scaled * p_t (common.h's
// log_with_offset; q = 0, both p zero, gives a finite value the callers mask).
ASTRAI_INLINE float mixture_log(float ps, float pt, float ws_scaled, float wt_scaled) {
  return log_with_offset(ws_scaled * ps + wt_scaled * pt, kWeightExp);
}

// What the elementwise loops need of the arguments, as locals: read through `args` inside a
// loop that stores float32, each field would be reloaded (the store may alias it) and the
// loop would stay scalar.
struct RowConsts {
  float inv_t;
  RowLogProbs s, t;
  float ws_scaled, wt_scaled;
};

ASTRAI_INLINE float log_prob(float x, const RowLogProbs& r, float inv_t) {
  return (x - r.ref) * inv_t - r.log_sum;
}

// The loss terms at one element: term_t = p_t (b - m) (m = a for Fkl), term_s = p_s (a - m)
// (m = b for Rkl).
// The mixture's terms at one element from its log-probs and probabilities.
ASTRAI_INLINE void mixture_terms(float la, float lb, float ps, float pt, const RowConsts& c,
                                 float& term_t, float& term_s) {
  const float m = mixture_log(ps, pt, c.ws_scaled, c.wt_scaled);
  term_t = select(pt != 0.0f, pt * (lb - m), 0.0f);
  term_s = select(ps != 0.0f, ps * (la - m), 0.0f);
}

// Also hands out p_s and p_t (inlined, a caller that ignores one does not compute it: Fkl's
// terms need only p_t, Rkl's only p_s).
template <Kind K>
ASTRAI_INLINE void loss_terms(float xs, float xt, const RowConsts& c, float& term_t,
                              float& term_s, float& ps, float& pt) {
  const float la = log_prob(xs, c.s, c.inv_t);
  const float lb = log_prob(xt, c.t, c.inv_t);
  ps = log_prob_exp(la);
  pt = log_prob_exp(lb);
  if (K == Kind::Fkl) {
    term_t = select(pt != 0.0f, pt * (lb - la), 0.0f);
    term_s = 0.0f;
  } else if (K == Kind::Rkl) {
    term_t = 0.0f;
    term_s = select(ps != 0.0f, ps * (la - lb), 0.0f);
  } else {
    mixture_terms(la, lb, ps, pt, c, term_t, term_s);
  }
}

// Adds terms(j, term_t, term_s) over a row into kLanes partial sums each (vectorized lane by
// lane, as the reductions of common.h).
// `load_s`, `load_t`: the rows the terms read, prefetched ahead.
template <class LoadS, class LoadT, class F>
ASTRAI_INLINE void sum_terms(int64_t V, float* vt, float* vs, const LoadS& load_s,
                             const LoadT& load_t, const F& terms) {
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes) {
    load_s.prefetch(j);
    load_t.prefetch(j);
    for (int l = 0; l < kLanes; ++l) {
      float term_t, term_s;
      terms(j + l, term_t, term_s);
      vt[l] += term_t;
      vs[l] += term_s;
    }
  }
  for (int l = 0; j < V; ++j, ++l) {
    float term_t, term_s;
    terms(j, term_t, term_s);
    vt[l] += term_t;
    vs[l] += term_s;
  }
}

// The kept-exps statistics of one row: its max, then e_j = exp((v_j - max) * scale) into `e`
// block by block, summed: every e_j <= 1, and p_j = e_j / sum needs no rescale. Needs a finite
// max (the caller falls back otherwise).
template <class Load>
ASTRAI_INLINE RowLogProbs kept_stats(int64_t V, const Load& load, float scale, float* e,
                                     float* inv_sum, float* lse) {
  float max = -kInf;
  for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
    const float m = block_max(load, b0, static_cast<int>(std::min<int64_t>(kBlock, V - b0)));
    max = max < m ? m : max;
  }
  if (!(std::fabs(max) < kInf)) return {max, 0.0f};
  float sum = 0.0f;
  for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
    sum += accumulate_block<false, false, true>(
               load, b0, static_cast<int>(std::min<int64_t>(kBlock, V - b0)), max, scale, 0.0f,
               e + b0).sum;
  }
  *inv_sum = 1.0f / sum;
  const float log_sum = std::log(sum);
  *lse = max * scale + log_sum;
  return {max, log_sum};
}

// p from a kept exp, flushed below FLT_MIN as fast_exp of the log-prob is (mixture_log needs a
// normal or zero p).
ASTRAI_INLINE float kept_prob(float e, float inv_sum) {
  const float p = e * inv_sum;
  return select(p < std::numeric_limits<float>::min(), 0.0f, p);
}

// What a row's gradient needs besides its elements.
struct GradCoefs {
  float coef;       // g / T (Fkl), g / T * w_s (Rkl, Mix)
  float kl;         // the row's student_kl K (0 for Fkl)
  float hard_coef;  // g * hard_weight
  RowLogProbs h;    // the student's statistics at temperature 1 (the hard term)
};

template <Kind K>
ASTRAI_INLINE GradCoefs grad_coefs(const DistillArgs& a, int64_t n, float kl, RowLogProbs h) {
  const float upstream = a.grad_loss[a.grad_loss_numel == 1 ? 0 : n];
  return {upstream * a.inv_t * (K == Kind::Fkl ? 1.0f : a.w_s), K == Kind::Fkl ? 0.0f : kl,
          upstream * a.hard_weight, h};
}

// The student's gradient at one element, without the hard term's -d_jy.
template <Kind K, bool HARD>
ASTRAI_INLINE float grad_element(float xs, float xt, const RowConsts& c, const GradCoefs& gc) {
  const float la = log_prob(xs, c.s, c.inv_t);
  const float lb = log_prob(xt, c.t, c.inv_t);
  const float ps = log_prob_exp(la);
  float v;
  if (K == Kind::Fkl) {
    v = (ps - log_prob_exp(lb)) * gc.coef;
  } else {
    const float m = K == Kind::Rkl ? lb
                                   : mixture_log(ps, log_prob_exp(lb), c.ws_scaled, c.wt_scaled);
    v = select(ps != 0.0f, ps * ((la - m) - gc.kl), 0.0f) * gc.coef;
  }
  if (HARD) v += log_prob_exp((xs - gc.h.ref) - gc.h.log_sum) * gc.hard_coef;
  return v;
}

// The same from the loss pass's stored p = p_s and q = p_s (a - m) (Rkl, Mix) or q = p_t
// (Fkl): no exp or log but the hard term's.
template <Kind K, bool HARD>
ASTRAI_INLINE float stored_grad_element(float p, float q, float xs, const GradCoefs& gc) {
  float v = K == Kind::Fkl ? (p - q) * gc.coef : select(p != 0.0f, q - p * gc.kl, 0.0f) * gc.coef;
  if (HARD) v += log_prob_exp((xs - gc.h.ref) - gc.h.log_sum) * gc.hard_coef;
  return v;
}

// Writes one row's gradient: grad_of(j, x_j) is element j's without the hard term's -d_jy,
// which is folded in float32 at the target afterwards (x_y read before the row may be
// overwritten: grad may be the student itself). `streamed`: the unit-stride rows the loop
// reads (the student's, and the teacher's where grad_of reads it), prefetched ahead.
template <class TS, bool HARD, class Load, class F, class... Rows>
ASTRAI_INLINE void write_grad_row(int64_t V, const Load& load_s, float x_y, int64_t y,
                                  float hard_coef, typename TS::storage* g, const F& grad_of,
                                  const Rows*... streamed) {
  for_each_streamed(
      V, [&](int64_t j) __attribute__((always_inline)) { g[j] = TS::store(grad_of(j, load_s(j))); },
      streamed...);
  if (HARD) g[y] = TS::store(grad_of(y, x_y) - hard_coef);
}

// The forward's arguments as the backward's: its per-row outputs as the saved inputs.
DistillArgs with_saved_outputs(const DistillArgs& a) {
  DistillArgs saved = a;
  saved.saved_lse_s = a.lse_s;
  saved.saved_lse_t = a.lse_t;
  saved.saved_kl_s = a.kl_s;
  saved.saved_hard_lse = a.hard_lse;
  return saved;
}

template <class Stats, class TS, class TT, Kind K, bool GRAD>
ASTRAI_INLINE void forward_rows(const DistillArgs& a, int64_t n0, int64_t n1) {
  using SS = typename TS::storage;
  using ST = typename TT::storage;
  const int64_t V = a.x.V;
  RowConsts c;
  c.inv_t = a.inv_t;
  c.ws_scaled = std::ldexp(a.w_s, kWeightExp);
  c.wt_scaled = std::ldexp(a.w_t, kWeightExp);
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t y = a.y[n];
    const bool ignored = y == a.ignore_index;
    if (ignored || y < 0 || y >= V) {
      if (!ignored) a.bad->set(n, y);
      a.loss[n] = a.lse_s[n] = a.lse_t[n] = a.kl_s[n] = 0.0f;
      if (a.hard_lse) a.hard_lse[n] = 0.0f;
      if (GRAD) zero_row<TS, true>(a.grad.row<SS>(n), 1, V);
      continue;
    }
    const RawLoad<TS, true> load_s{a.x.row<SS>(n), 1};
    const RawLoad<TT, true> load_t{a.t.row<ST>(n), 1};
    const float x_y = load_s(y);
    float lse_s = 0.0f, lse_t = 0.0f;
    float vt[kLanes], vs[kLanes];
    for (int l = 0; l < kLanes; ++l) vt[l] = vs[l] = 0.0f;
    // For the mixture (2 exps and a log per element) of a bf16/fp16 student, both rows' exps
    // are kept from their statistics pass: 2 exps per element fewer, where scratch is had and
    // both maxima are finite; else each p is exp of its log-prob. Not for a float32 student:
    // p = e / sum is not exactly exp of the log-prob the terms also use, and that raised a
    // float32 trainer's gradient error past the tolerance (GKD, 1.26x); in bf16 the gradient's
    // own rounding dwarfs it. Not for Fkl and Rkl (1 exp per element): the extra max pass and
    // the scratch traffic cost more than the exp saved (measured slower).
    constexpr bool kKeep = K == Kind::Mix && !std::is_same<TS, F32T>::value;
    // With the gradient (GRAD), the loss pass stores p_s and q (p_s (a - m), or p_t for Fkl)
    // of each element in the same scratch (over the kept exps it has just read), and the
    // gradient pass takes no exp or log from them.
    const int64_t padded = (V + 15) / 16 * 16;
    const RowScratch scratch = (kKeep || GRAD) && V > 1 ? row_scratch(2 * padded)
                                                        : RowScratch{nullptr, nullptr};
    float* const sp = scratch.exps;
    float* const sq = scratch.exps == nullptr ? nullptr : scratch.exps + padded;
    if (GRAD && sp == nullptr) {  // no scratch (or keeping is off): two passes for this row
      a.plain_forward(a, n, n + 1);
      a.backward(with_saved_outputs(a), n, n + 1);
      continue;
    }
    float inv_zs = 0.0f, inv_zt = 0.0f;
    bool kept = kKeep && sp != nullptr;
    if (kept) {
      c.s = kept_stats(V, load_s, c.inv_t, sp, &inv_zs, &lse_s);
      c.t = kept_stats(V, load_t, c.inv_t, sq, &inv_zt, &lse_t);
      kept = std::fabs(c.s.ref) < kInf && std::fabs(c.t.ref) < kInf;
    }
    if (kept) {  // the mixture's terms with p_s, p_t from the kept exps (no exp per element)
      const RowConsts rc = c;
      const auto terms = [=](int64_t j, float& term_t, float& term_s)
                             __attribute__((always_inline)) {
        const float ps = kept_prob(sp[j], inv_zs);
        mixture_terms(log_prob(load_s(j), rc.s, rc.inv_t), log_prob(load_t(j), rc.t, rc.inv_t),
                      ps, kept_prob(sq[j], inv_zt), rc, term_t, term_s);
        if (GRAD) {
          sp[j] = ps;
          sq[j] = term_s;
        }
      };
      sum_terms(V, vt, vs, load_s, load_t, terms);
    } else {
      c.s = Stats::template run<TS>(V, load_s, x_y, c.inv_t, &lse_s);
      c.t = Stats::template run<TT>(V, load_t, load_t(y), c.inv_t, &lse_t);
      const RowConsts rc = c;
      sum_terms(V, vt, vs, load_s, load_t, [=](int64_t j, float& term_t, float& term_s)
                               __attribute__((always_inline)) {
        float ps, pt;
        loss_terms<K>(load_s(j), load_t(j), rc, term_t, term_s, ps, pt);
        if (GRAD) {
          sp[j] = ps;
          sq[j] = K == Kind::Fkl ? pt : term_s;
        }
      });
    }
    float sum_t = 0.0f, sum_s = 0.0f;
    for (int l = 0; l < kLanes; ++l) {
      sum_t += vt[l];
      sum_s += vs[l];
    }
    float loss = K == Kind::Fkl ? sum_t : K == Kind::Rkl ? sum_s : a.w_t * sum_t + a.w_s * sum_s;
    RowLogProbs h = c.s;
    if (a.hard_lse) {  // hard_weight * (lse - x_y) at temperature 1, relative to the row max
      float hard_lse = lse_s;
      if (a.inv_t != 1.0f) h = Stats::template run<TS>(V, load_s, x_y, 1.0f, &hard_lse);
      loss += a.hard_weight * ((h.ref - x_y) + h.log_sum);
      a.hard_lse[n] = hard_lse;
    }
    a.loss[n] = loss;
    a.lse_s[n] = lse_s;
    a.lse_t[n] = lse_t;
    a.kl_s[n] = K == Kind::Fkl ? 0.0f : sum_s;
    if (!GRAD) continue;
    const GradCoefs gc = grad_coefs<K>(a, n, sum_s, h);
    SS* g = a.grad.row<SS>(n);
    with_bool(a.hard_lse != nullptr, [&](auto hard) {
      constexpr bool kHard = decltype(hard)::value;
      // the stored p and q replace the teacher's row: only the student's is read
      write_grad_row<TS, kHard>(V, load_s, x_y, y, gc.hard_coef, g,
                                [=](int64_t j, float xs) __attribute__((always_inline)) {
                                  return stored_grad_element<K, kHard>(sp[j], sq[j], xs, gc);
                                }, load_s.row);
    });
  }
}

template <class Stats, class TS, class TT, Kind K, bool HARD>
ASTRAI_INLINE void backward_rows(const DistillArgs& a, int64_t n0, int64_t n1) {
  using SS = typename TS::storage;
  using ST = typename TT::storage;
  const int64_t V = a.x.V;
  RowConsts c;
  c.inv_t = a.inv_t;
  c.ws_scaled = std::ldexp(a.w_s, kWeightExp);
  c.wt_scaled = std::ldexp(a.w_t, kWeightExp);
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t y = a.y[n];
    SS* g = a.grad.row<SS>(n);
    const bool ignored = y == a.ignore_index;
    if (ignored || y < 0 || y >= V) {
      if (!ignored) a.bad->set(n, y);
      zero_row<TS, true>(g, 1, V);
      continue;
    }
    const RawLoad<TS, true> load_s{a.x.row<SS>(n), 1};
    const RawLoad<TT, true> load_t{a.t.row<ST>(n), 1};
    const float x_y = load_s(y);
    c.s = saved_stats<Stats>(V, load_s, x_y, c.inv_t, a.saved_lse_s[n]);
    c.t = saved_stats<Stats>(V, load_t, load_t(y), c.inv_t, a.saved_lse_t[n]);
    RowLogProbs h{0.0f, 0.0f};
    if (HARD) h = saved_stats<Stats>(V, load_s, x_y, 1.0f, a.saved_hard_lse[n]);
    const GradCoefs gc = grad_coefs<K>(a, n, a.saved_kl_s[n], h);
    const RowConsts rc = c;
    write_grad_row<TS, HARD>(V, load_s, x_y, y, gc.hard_coef, g,
                             [=](int64_t j, float xs) __attribute__((always_inline)) {
                               return grad_element<K, HARD>(xs, load_t(j), rc, gc);
                             }, load_s.row, load_t.row);
  }
}

#define ASTRAI_DISTILL_VARIANTS(ATTR, SUFFIX)                                                \
  template <class T>                                                                         \
  ATTR ASTRAI_NOINLINE RowLogProbs stats_##SUFFIX(int64_t V, const RawLoad<T, true>& load,   \
                                                  float hint, float scale, float* lse) {     \
    return fresh_stats(V, load, hint, scale, lse);                                           \
  }                                                                                          \
  struct Stats_##SUFFIX {                                                                    \
    template <class T>                                                                       \
    static ASTRAI_INLINE RowLogProbs run(int64_t V, const RawLoad<T, true>& load, float hint, \
                                         float scale, float* lse) {                          \
      return stats_##SUFFIX<T>(V, load, hint, scale, lse);                                   \
    }                                                                                        \
  };                                                                                         \
  template <class TS, class TT, Kind K, bool GRAD>                                           \
  ATTR ASTRAI_NOINLINE void forward_##SUFFIX(const DistillArgs& a, int64_t n0, int64_t n1) { \
    forward_rows<Stats_##SUFFIX, TS, TT, K, GRAD>(a, n0, n1);                                \
  }                                                                                          \
  template <class TS, class TT, Kind K, bool HARD>                                           \
  ATTR ASTRAI_NOINLINE void backward_##SUFFIX(const DistillArgs& a, int64_t n0,              \
                                              int64_t n1) {                                  \
    backward_rows<Stats_##SUFFIX, TS, TT, K, HARD>(a, n0, n1);                               \
  }
ASTRAI_FOR_EACH_ISA(ASTRAI_DISTILL_VARIANTS)
#undef ASTRAI_DISTILL_VARIANTS

template <class TS, class TT, Kind K, bool GRAD>
RowsFn<DistillArgs> pick_forward(Isa isa) {
#if ASTRAI_X86
  if (isa == Isa::Avx512) return &forward_avx512<TS, TT, K, GRAD>;
  if (isa == Isa::Avx2) return &forward_avx2<TS, TT, K, GRAD>;
#endif
  (void)isa;
  return &forward_generic<TS, TT, K, GRAD>;
}

template <class TS, class TT, Kind K, bool HARD>
RowsFn<DistillArgs> pick_backward(Isa isa) {
#if ASTRAI_X86
  if (isa == Isa::Avx512) return &backward_avx512<TS, TT, K, HARD>;
  if (isa == Isa::Avx2) return &backward_avx2<TS, TT, K, HARD>;
#endif
  (void)isa;
  return &backward_generic<TS, TT, K, HARD>;
}

template <class F>
ASTRAI_INLINE auto with_kind(const DistillArgs& args, F&& f) {
  if (args.forward_kl) return f(std::integral_constant<Kind, Kind::Fkl>{});
  if (args.w_t == 0.0f) return f(std::integral_constant<Kind, Kind::Rkl>{});  // beta = 1
  return f(std::integral_constant<Kind, Kind::Mix>{});
}

// The teacher is read in its own dtype by a float32 student's kernels, and by a 16-bit
// student's when it is the student's dtype or float32 (7 dtype pairs of the 9): a teacher of the
// other 16-bit dtype is widened to float32 a row at a time (run_unit_stride_rows), exactly,
// which measured 3% faster than reading it directly (bf16 student, fp16 teacher, N = 2048,
// V = 32768). A float32 student's bf16 teacher widened so was 12% slower, hence read directly.
bool teacher_to_f32(const DistillArgs& args) {
  return args.dtype != DType::F32 && args.teacher_dtype != args.dtype &&
         args.teacher_dtype != DType::F32;
}

template <class F>
ASTRAI_INLINE auto with_dtypes(const DistillArgs& args, F&& f) {
  return with_dtype(args.dtype, [&](auto ts) {
    using TS = decltype(ts);
    if constexpr (std::is_same<TS, F32T>::value) {
      return with_dtype(args.teacher_dtype, [&](auto tt) { return f(ts, tt); });
    } else {
      return with_bool(args.teacher_dtype == args.dtype, [&](auto same) {
        return f(ts, std::conditional_t<decltype(same)::value, TS, F32T>{});
      });
    }
  });
}

template <bool GRAD>
RowsFn<DistillArgs> forward_fn(const DistillArgs& args, Isa isa) {
  return with_dtypes(args, [&](auto ts, auto tt) {
    return with_kind(args, [&](auto kind) {
      return pick_forward<decltype(ts), decltype(tt), decltype(kind)::value, GRAD>(isa);
    });
  });
}

RowsFn<DistillArgs> backward_fn(const DistillArgs& args, Isa isa) {
  return with_dtypes(args, [&](auto ts, auto tt) {
    return with_kind(args, [&](auto kind) {
      return with_bool(args.saved_hard_lse != nullptr || args.hard_lse != nullptr,
                       [&](auto hard) {
        return pick_backward<decltype(ts), decltype(tt), decltype(kind)::value,
                             decltype(hard)::value>(isa);
      });
    });
  });
}

}  // namespace

void distill_forward_kernel(const DistillArgs& args, int nthreads) {
  const Isa isa = active_isa();
  if (args.grad.data == nullptr) {
    run_unit_stride_rows(forward_fn<false>(args, isa), args, nthreads, teacher_to_f32(args));
    return;
  }
  DistillArgs a = args;
  a.plain_forward = forward_fn<false>(args, isa);
  a.backward = backward_fn(args, isa);
  run_unit_stride_rows(forward_fn<true>(a, isa), a, nthreads, teacher_to_f32(args));
}

void distill_backward_kernel(const DistillArgs& args, int nthreads) {
  run_unit_stride_rows(backward_fn(args, active_isa()), args, nthreads, teacher_to_f32(args));
}

}  // namespace astrai
