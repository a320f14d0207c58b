// distill_forward / distill_backward of ops/_backend.py: TRL's generalized JSD between the
// student's and the teacher's softmax(z / T), a_j and b_j their log-probs,
//   beta = 0:  loss = sum_j p_t (b - a),              grad_j = g / T * (p_s - p_t)
//   otherwise: m = logaddexp(a + log w_s, b + log w_t) (m = b at beta = 1, w = (0, 1)),
//              K = sum_j p_s (a - m),  loss = w_t sum_j p_t (b - m) + w_s K,
//              grad_j = g / T * w_s * p_s,j * (a_j - m_j - K)
// plus hard_weight * (lse(x) - x_y) at temperature 1 (grad: g * hard_weight * (p1_j - d_jy)).
// Forward: per row, the online (max, sum-exp) pass over the student and over the teacher, then
// a pass over both for the loss and K (the mixture needs both lses first). Backward: one pass
// over both rows writing the student's gradient. Log-probs are (x - ref) * scale - log_sum with
// ref the row max (or 0 with log_sum = lse), exps of them clamped at <= 0 (log_prob_exp), so a
// contracted FMA cannot push p above 1.
#include "common.h"

namespace astrai {
namespace {

// As in logprobs.cpp: the saved lse serves while |lse| <= this, else the row is re-reduced.
constexpr float kDirectLseLimit = 64.0f;

struct RowLogProbs {
  float ref, log_sum;  // log p_j = (x_j - ref) * scale - log_sum
};

template <class T, bool C>
ASTRAI_INLINE RowLogProbs fresh_stats(int64_t V, const RawLoad<T, C>& load, float hint,
                                      float scale, float* lse) {
  OnlineLse st;
  online_lse_row<false, false>(V, load, st, hint, scale);
  if (lse) *lse = st.lse(scale);
  return {st.shift, st.log_sum()};
}

// The row reduction is compiled once per (dtype, layout, ISA), out of line (Stats below), so
// the many loss variants stay small: each holds only its elementwise loop.
// `hint` is the row's element at the target (for V = 1 the only one: log p = 0 exactly).
template <class Stats, class T, bool C>
ASTRAI_INLINE RowLogProbs saved_stats(int64_t V, const RawLoad<T, C>& load, float hint,
                                      float scale, float lse) {
  if (V == 1) return {hint, 0.0f};
  if (std::fabs(lse) <= kDirectLseLimit) return {0.0f, lse};
  return Stats::template run<T, C>(V, load, hint, scale, nullptr);
}

// log m = logaddexp(a + log_w_s, b + log_w_t): the larger plus log1p(exp(smaller - larger));
// -inf when both are -inf: at beta = 1 (w_s = 0) a teacher's -inf id then gives the student's
// term p_s (a - m) = +inf, the reverse KL's value (-inf - -inf inside would make it NaN).
ASTRAI_INLINE float mixture_log(float a, float b, float log_w_s, float log_w_t) {
  const float u = a + log_w_s;
  const float v = b + log_w_t;
  const bool u_big = u > v;
  const float hi = select(u_big, u, v);
  const float lo = select(u_big, v, u);
  return select(hi == -kInf, hi, hi + log1p_unit(fast_exp(lo - hi)));
}

// The row's loss terms at one element: term_t = p_t (b - m) (m = a for forward KL), term_s =
// p_s (a - m); a term with p == 0 is 0 (NaN stays NaN).
template <bool FKL>
ASTRAI_INLINE void loss_terms(float xs, float xt, const RowLogProbs& s, const RowLogProbs& t,
                              const DistillArgs& args, float& term_t, float& term_s) {
  const float la = (xs - s.ref) * args.inv_t - s.log_sum;
  const float lb = (xt - t.ref) * args.inv_t - t.log_sum;
  const float pt = log_prob_exp(lb);
  if (FKL) {
    term_t = select(pt != 0.0f, pt * (lb - la), 0.0f);
    term_s = 0.0f;
    return;
  }
  const float ps = log_prob_exp(la);
  const float m = mixture_log(la, lb, args.log_w_s, args.log_w_t);
  term_t = select(pt != 0.0f, pt * (lb - m), 0.0f);
  term_s = select(ps != 0.0f, ps * (la - m), 0.0f);
}

template <class Stats, class TS, class TT, bool C, bool FKL>
ASTRAI_INLINE void forward_rows(const DistillArgs& a, int64_t n0, int64_t n1) {
  using SS = typename TS::storage;
  using ST = typename TT::storage;
  const int64_t V = a.x.V;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t y = a.y[n];
    const bool ignored = y == a.ignore_index;
    if (ignored || y < 0 || y >= V) {
      if (!ignored) a.bad->set(n, y);
      a.loss[n] = a.lse_s[n] = a.lse_t[n] = a.kl_s[n] = 0.0f;
      if (a.hard_lse) a.hard_lse[n] = 0.0f;
      continue;
    }
    const RawLoad<TS, C> load_s{a.x.row<SS>(n), a.x.sV};
    const RawLoad<TT, C> load_t{a.t.row<ST>(n), a.t.sV};
    const float x_y = load_s(y);
    float lse_s = 0.0f, lse_t = 0.0f;
    const RowLogProbs s = Stats::template run<TS, C>(V, load_s, x_y, a.inv_t, &lse_s);
    const RowLogProbs t = Stats::template run<TT, C>(V, load_t, load_t(y), a.inv_t, &lse_t);
    float vt[kLanes], vs[kLanes];
    for (int l = 0; l < kLanes; ++l) vt[l] = vs[l] = 0.0f;
    int64_t j = 0;
    for (; j + kLanes <= V; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        float term_t, term_s;
        loss_terms<FKL>(load_s(j + l), load_t(j + l), s, t, a, term_t, term_s);
        vt[l] += term_t;
        vs[l] += term_s;
      }
    }
    for (int l = 0; j < V; ++j, ++l) {
      float term_t, term_s;
      loss_terms<FKL>(load_s(j), load_t(j), s, t, a, term_t, term_s);
      vt[l] += term_t;
      vs[l] += term_s;
    }
    float sum_t = 0.0f, sum_s = 0.0f;
    for (int l = 0; l < kLanes; ++l) {
      sum_t += vt[l];
      sum_s += vs[l];
    }
    float loss = FKL ? sum_t : a.w_t * sum_t + a.w_s * sum_s;
    if (a.hard_lse) {  // hard_weight * (lse - x_y) at temperature 1, relative to the row max
      float hard_lse = lse_s;
      RowLogProbs h = s;
      if (a.inv_t != 1.0f) h = Stats::template run<TS, C>(V, load_s, x_y, 1.0f, &hard_lse);
      loss += a.hard_weight * ((h.ref - x_y) + h.log_sum);
      a.hard_lse[n] = hard_lse;
    }
    a.loss[n] = loss;
    a.lse_s[n] = lse_s;
    a.lse_t[n] = lse_t;
    a.kl_s[n] = FKL ? 0.0f : sum_s;
  }
}

// The student's gradient at one element, without the hard term's -d_jy.
template <bool FKL, bool HARD>
ASTRAI_INLINE float grad_element(float xs, float xt, const RowLogProbs& s, const RowLogProbs& t,
                                 const RowLogProbs& h, const DistillArgs& args, float coef,
                                 float kl, float hard_coef) {
  const float la = (xs - s.ref) * args.inv_t - s.log_sum;
  const float lb = (xt - t.ref) * args.inv_t - t.log_sum;
  const float ps = log_prob_exp(la);
  float v;
  if (FKL) {
    v = (ps - log_prob_exp(lb)) * coef;
  } else {
    const float m = mixture_log(la, lb, args.log_w_s, args.log_w_t);
    v = select(ps != 0.0f, ps * ((la - m) - kl), 0.0f) * coef;
  }
  if (HARD) v += log_prob_exp((xs - h.ref) - h.log_sum) * hard_coef;
  return v;
}

template <class Stats, class TS, class TT, bool C, bool FKL, bool HARD>
ASTRAI_INLINE void backward_rows(const DistillArgs& a, int64_t n0, int64_t n1) {
  using SS = typename TS::storage;
  using ST = typename TT::storage;
  const int64_t V = a.x.V, sg = a.grad.sV;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t y = a.y[n];
    SS* g = a.grad.row<SS>(n);
    const bool ignored = y == a.ignore_index;
    if (ignored || y < 0 || y >= V) {
      if (!ignored) a.bad->set(n, y);
      zero_row<TS, C>(g, sg, V);
      continue;
    }
    const RawLoad<TS, C> load_s{a.x.row<SS>(n), a.x.sV};
    const RawLoad<TT, C> load_t{a.t.row<ST>(n), a.t.sV};
    const float x_y = load_s(y);
    const RowLogProbs s = saved_stats<Stats>(V, load_s, x_y, a.inv_t, a.saved_lse_s[n]);
    const RowLogProbs t = saved_stats<Stats>(V, load_t, load_t(y), a.inv_t, a.saved_lse_t[n]);
    RowLogProbs h{0.0f, 0.0f};
    if (HARD) h = saved_stats<Stats>(V, load_s, x_y, 1.0f, a.saved_hard_lse[n]);
    const float upstream = a.grad_loss[n];
    const float coef = upstream * a.inv_t * (FKL ? 1.0f : a.w_s);
    const float kl = FKL ? 0.0f : a.saved_kl_s[n];
    const float hard_coef = HARD ? upstream * a.hard_weight : 0.0f;
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) {
      g[C ? j : j * sg] = TS::store(grad_element<FKL, HARD>(load_s(j), load_t(j), s, t, h, a,
                                                            coef, kl, hard_coef));
    }
    if (HARD) {  // the target's -hard_coef folded in float32 before the one rounding
      const float v = grad_element<FKL, HARD>(x_y, load_t(y), s, t, h, a, coef, kl, hard_coef);
      g[C ? y : y * sg] = TS::store(v - hard_coef);
    }
  }
}

#define ASTRAI_DISTILL_VARIANTS(ATTR, SUFFIX)                                                \
  template <class T, bool C>                                                                 \
  ATTR ASTRAI_NOINLINE RowLogProbs stats_##SUFFIX(int64_t V, const RawLoad<T, C>& load,      \
                                                  float hint, float scale, float* lse) {     \
    return fresh_stats(V, load, hint, scale, lse);                                           \
  }                                                                                          \
  struct Stats_##SUFFIX {                                                                    \
    template <class T, bool C>                                                               \
    static ASTRAI_INLINE RowLogProbs run(int64_t V, const RawLoad<T, C>& load, float hint,   \
                                         float scale, float* lse) {                          \
      return stats_##SUFFIX<T, C>(V, load, hint, scale, lse);                                \
    }                                                                                        \
  };                                                                                         \
  template <class TS, class TT, bool C, bool FKL>                                            \
  ATTR ASTRAI_NOINLINE void forward_##SUFFIX(const DistillArgs& a, int64_t n0, int64_t n1) { \
    forward_rows<Stats_##SUFFIX, TS, TT, C, FKL>(a, n0, n1);                                 \
  }                                                                                          \
  template <class TS, class TT, bool C, bool FKL, bool HARD>                                 \
  ATTR ASTRAI_NOINLINE void backward_##SUFFIX(const DistillArgs& a, int64_t n0,              \
                                              int64_t n1) {                                  \
    backward_rows<Stats_##SUFFIX, TS, TT, C, FKL, HARD>(a, n0, n1);                          \
  }
ASTRAI_FOR_EACH_ISA(ASTRAI_DISTILL_VARIANTS)
#undef ASTRAI_DISTILL_VARIANTS

template <class TS, class TT, bool C, bool FKL>
RowsFn<DistillArgs> pick_forward(Isa isa) {
#if ASTRAI_X86
  if (isa == Isa::Avx512) return &forward_avx512<TS, TT, C, FKL>;
  if (isa == Isa::Avx2) return &forward_avx2<TS, TT, C, FKL>;
#endif
  (void)isa;
  return &forward_generic<TS, TT, C, FKL>;
}

template <class TS, class TT, bool C, bool FKL, bool HARD>
RowsFn<DistillArgs> pick_backward(Isa isa) {
#if ASTRAI_X86
  if (isa == Isa::Avx512) return &backward_avx512<TS, TT, C, FKL, HARD>;
  if (isa == Isa::Avx2) return &backward_avx2<TS, TT, C, FKL, HARD>;
#endif
  (void)isa;
  return &backward_generic<TS, TT, C, FKL, HARD>;
}

bool unit_stride(const DistillArgs& args, bool with_grad) {
  if (args.x.V <= 1) return true;
  return args.x.sV == 1 && args.t.sV == 1 && (!with_grad || args.grad.sV == 1);
}

}  // namespace

void distill_forward_kernel(const DistillArgs& args, int nthreads) {
  const Isa isa = active_isa();
  RowsFn<DistillArgs> fn = with_dtype(args.dtype, [&](auto ts) {
    return with_dtype(args.teacher_dtype, [&](auto tt) {
      return with_bool(unit_stride(args, false), [&](auto c) {
        return with_bool(args.forward_kl, [&](auto fkl) {
          return pick_forward<decltype(ts), decltype(tt), decltype(c)::value,
                              decltype(fkl)::value>(isa);
        });
      });
    });
  });
  run_rows(fn, args, args.x.rows(), args.x.V, nthreads);
}

void distill_backward_kernel(const DistillArgs& args, int nthreads) {
  const Isa isa = active_isa();
  RowsFn<DistillArgs> fn = with_dtype(args.dtype, [&](auto ts) {
    return with_dtype(args.teacher_dtype, [&](auto tt) {
      return with_bool(unit_stride(args, true), [&](auto c) {
        return with_bool(args.forward_kl, [&](auto fkl) {
          return with_bool(args.saved_hard_lse != nullptr, [&](auto hard) {
            return pick_backward<decltype(ts), decltype(tt), decltype(c)::value,
                                 decltype(fkl)::value, decltype(hard)::value>(isa);
          });
        });
      });
    });
  });
  run_rows(fn, args, args.x.rows(), args.x.V, nthreads);
}

}  // namespace astrai
