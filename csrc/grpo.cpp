// grpo_forward of kernels/primitives.py: per-token clipped surrogate (+ beta * k3, times the ratio
// with kl_ratio_correction) and its gradient, fused with the log-prob pass; with ENT also the
// row's entropy from the same online walk. Rows with token_weight == 0 are masked (target not
// read).
#include "common.h"

namespace astrai {
namespace {

struct TokenTerms {
  float loss;
  float dloss;  // d loss / d logp
};

// The per-token formula of portable.grpo_token_terms, in float32.
inline TokenTerms token_terms(float logp, const float* old, const float* ref, float adv,
                              float lo, float hi, float delta, float beta,
                              bool kl_ratio_correction) {
  const float raw = old ? logp - *old : 0.0f;
  const float log_ratio = std::min(std::max(raw, -kLogRatioClamp), kLogRatioClamp);
  const float ratio = std::exp(log_ratio);
  const float dratio = std::fabs(raw) <= kLogRatioClamp ? ratio : 0.0f;
  float ratio_u = ratio, dratio_u = dratio;
  if (delta > 0.0f) {
    dratio_u = ratio <= delta ? dratio : 0.0f;
    ratio_u = std::min(ratio, delta);
  }
  const float ratio_c = std::min(std::max(ratio, lo), hi);
  const float dratio_c = (ratio >= lo && ratio <= hi) ? dratio : 0.0f;
  const float unclipped = ratio_u * adv;
  const float clipped = ratio_c * adv;
  const bool take_unclipped = unclipped <= clipped;  // ties: the unclipped branch
  float loss = -(take_unclipped ? unclipped : clipped);
  float dloss = -adv * (take_unclipped ? dratio_u : dratio_c);
  if (beta > 0.0f) {
    const float raw_ref = *ref - logp;
    const float ref_ratio = std::min(std::max(raw_ref, -kLogRatioClamp), kLogRatioClamp);
    const float e = std::exp(ref_ratio);
    const bool ref_inside = std::fabs(raw_ref) <= kLogRatioClamp;
    float k3 = e - ref_ratio - 1.0f;
    float dk3 = ref_inside ? 1.0f - e : 0.0f;
    if (kl_ratio_correction) {
      // k3 * r, r the uncapped ratio (not delta's). Its derivative dk3 * r + k3 * dr is
      // r * (1 - e + k3) = -r * dr inside both clamps, formed so: the sum cancels for small dr
      const bool ratio_inside = std::fabs(raw) <= kLogRatioClamp;
      const float inner = ref_inside ? (ratio_inside ? -ref_ratio : dk3)
                                     : (ratio_inside ? k3 : 0.0f);
      dk3 = ratio * inner;
      k3 = k3 * ratio;
    }
    loss = loss + beta * k3;
    dloss = dloss + beta * dk3;
  }
  return {loss, dloss};
}

template <class T, bool ENT>
ASTRAI_INLINE void grpo_rows(const GrpoArgs& a, int64_t n0, int64_t n1) {
  using S = typename T::storage;
  const int64_t V = a.x.V;
  const bool with_grad = a.grad.data != nullptr;
  for (int64_t n = n0; n < n1; ++n) {
    const float w = a.token_weight[n];
    const bool masked = w == 0.0f;
    const int64_t y = masked ? 0 : a.y[n];
    if (masked || y < 0 || y >= V) {
      if (!masked) a.bad->set(n, y);
      a.logp[n] = 0.0f;
      a.loss[n] = 0.0f;
      if (ENT) a.entropy[n] = 0.0f;
      if (with_grad) zero_row<T, true>(a.grad.row<S>(n), 1, V);
      continue;
    }
    const S* row = a.x.row<S>(n);
    const RawLoad<T, true> load{row, 1};
    const float x_y = load(y);
    OnlineLse st;
    const RowScratch keep = with_grad ? row_scratch(V) : RowScratch{nullptr, nullptr};
    if (keep.exps) {
      online_lse_row<ENT, false, true>(V, load, st, x_y, a.inv_t, keep.exps, keep.shifts);
    } else {
      online_lse_row<ENT, false>(V, load, st, x_y, a.inv_t);
    }
    const float log_sum = st.log_sum();
    const float logp = (x_y - st.shift) * a.inv_t - log_sum;  // relative to the row max
    const TokenTerms t = token_terms(logp, a.old_logprobs ? a.old_logprobs + n : nullptr,
                                     a.ref_logprobs ? a.ref_logprobs + n : nullptr,
                                     a.advantages[n], a.ratio_lo, a.ratio_hi, a.delta,
                                     a.ref_logprobs ? a.beta : 0.0f, a.kl_ratio_correction);
    a.logp[n] = logp;
    a.loss[n] = t.loss;
    if (ENT) a.entropy[n] = st.entropy();
    if (!with_grad) continue;
    if (keep.exps) {
      write_logprob_grad_from_exps<T, true>(a.grad.row<S>(n), 1, V, y, keep, st, a.inv_t, log_sum,
                                         t.dloss * w);
    } else {
      write_logprob_grad<T, true, false>(row, 1, a.grad.row<S>(n), 1, V, y, x_y, st.shift,
                                      a.inv_t, log_sum, t.dloss * w, 0.0f, 0.0f);
    }
  }
}

#define ASTRAI_GRPO_VARIANTS(ATTR, SUFFIX)                                                 \
  template <class T, bool ENT>                                                             \
  ATTR ASTRAI_NOINLINE void grpo_##SUFFIX(const GrpoArgs& a, int64_t n0, int64_t n1) {    \
    grpo_rows<T, ENT>(a, n0, n1);                                                          \
  }
ASTRAI_FOR_EACH_ISA(ASTRAI_GRPO_VARIANTS)
#undef ASTRAI_GRPO_VARIANTS

template <class T, bool ENT>
RowsFn<GrpoArgs> pick(Isa isa) {
#if ASTRAI_X86
  if (isa == Isa::Avx512) return &grpo_avx512<T, ENT>;
  if (isa == Isa::Avx2) return &grpo_avx2<T, ENT>;
#endif
  (void)isa;
  return &grpo_generic<T, ENT>;
}

}  // namespace

void grpo_forward_kernel(const GrpoArgs& args, int nthreads) {
  const Isa isa = active_isa();
  const bool ent = args.entropy != nullptr;
  RowsFn<GrpoArgs> fn = with_dtype(args.dtype, [&](auto t) {
    return with_bool(ent, [&](auto e) { return pick<decltype(t), decltype(e)::value>(isa); });
  });
  run_unit_stride_rows(fn, args, nthreads);
}

}  // namespace astrai
