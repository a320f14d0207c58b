// logprobs_forward / logprobs_backward of kernels/primitives.py: s = z / T, p = softmax(s),
//   forward:  logp = s_y - lse, entropy = lse - sum_j p_j s_j, lse (ignored rows: all 0)
//   backward: grad_j = (1/T) * (g_lp * (d_jy - p_j) - g_H * p_j * (s_j - lse + H))
// with m the row max, logp = (z_y - m) / T - log sum_j exp((z_j - m) / T): exact however large
// the logits are.
#include "common.h"

namespace astrai {
namespace {

// The backward forms log p_j = s_j - lse from the saved lse while |lse| <= this: its rounding
// (half an ulp, <= 2^-19 here) then changes p by at most that relative amount. Beyond, and for
// a non-finite lse, it recomputes the row's max and log-sum, so the error does not grow with
// the logits.
constexpr float kDirectLseLimit = 64.0f;

template <class T, bool ENT>
ASTRAI_INLINE void forward_rows(const LogprobsFwdArgs& a, int64_t n0, int64_t n1) {
  using S = typename T::storage;
  const int64_t V = a.x.V;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t y = a.y[n];
    const bool ignored = y == a.ignore_index;
    if (ignored || y < 0 || y >= V) {
      if (!ignored) a.bad->set(n, y);
      a.logp[n] = 0.0f;
      a.lse[n] = 0.0f;
      if (ENT) a.entropy[n] = 0.0f;
      continue;
    }
    const S* row = a.x.row<S>(n);
    const RawLoad<T, true> load{row, 1};
    const float x_y = load(y);
    OnlineLse st;
    online_lse_row<ENT, false>(V, load, st, x_y, a.inv_t);
    a.logp[n] = (x_y - st.shift) * a.inv_t - st.log_sum();
    a.lse[n] = st.lse(a.inv_t);
    if (ENT) a.entropy[n] = st.entropy();
  }
}

template <class T, bool ENT>
ASTRAI_INLINE void backward_rows(const LogprobsBwdArgs& a, int64_t n0, int64_t n1) {
  using S = typename T::storage;
  const int64_t V = a.x.V;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t y = a.y[n];
    S* g = a.grad.row<S>(n);
    const bool ignored = y == a.ignore_index;
    if (ignored || y < 0 || y >= V) {
      if (!ignored) a.bad->set(n, y);
      zero_row<T, true>(g, 1, V);
      continue;
    }
    const S* row = a.x.row<S>(n);
    const RawLoad<T, true> load{row, 1};
    const float x_y = load(y);
    float ref = 0.0f, log_sum = a.lse[n];
    if (V == 1) {  // p = 1 exactly (NaN for a non-finite logit); a contracted x * inv_t - lse
      ref = x_y;   // would leave it 1 - 1e-7
      log_sum = 0.0f;
    } else if (!(std::fabs(log_sum) <= kDirectLseLimit)) {
      OnlineLse st;
      online_lse_row<false, false>(V, load, st, x_y, a.inv_t);
      ref = st.shift;
      log_sum = st.log_sum();
    }
    write_logprob_grad<T, true, ENT>(row, 1, g, 1, V, y, x_y, ref, a.inv_t, log_sum,
                                  a.grad_logp[n], ENT ? a.grad_entropy[n] : 0.0f,
                                  ENT ? a.entropy[n] : 0.0f);
  }
}

#define ASTRAI_LOGPROBS_VARIANTS(ATTR, SUFFIX)                                              \
  template <class T, bool ENT>                                                              \
  ATTR ASTRAI_NOINLINE void forward_##SUFFIX(const LogprobsFwdArgs& a, int64_t n0,          \
                                             int64_t n1) {                                  \
    forward_rows<T, ENT>(a, n0, n1);                                                        \
  }                                                                                         \
  template <class T, bool ENT>                                                              \
  ATTR ASTRAI_NOINLINE void backward_##SUFFIX(const LogprobsBwdArgs& a, int64_t n0,         \
                                              int64_t n1) {                                 \
    backward_rows<T, ENT>(a, n0, n1);                                                       \
  }
ASTRAI_FOR_EACH_ISA(ASTRAI_LOGPROBS_VARIANTS)
#undef ASTRAI_LOGPROBS_VARIANTS

template <class T, bool ENT>
RowsFn<LogprobsFwdArgs> pick_forward(Isa isa) {
#if ASTRAI_X86
  if (isa == Isa::Avx512) return &forward_avx512<T, ENT>;
  if (isa == Isa::Avx2) return &forward_avx2<T, ENT>;
#endif
  (void)isa;
  return &forward_generic<T, ENT>;
}

template <class T, bool ENT>
RowsFn<LogprobsBwdArgs> pick_backward(Isa isa) {
#if ASTRAI_X86
  if (isa == Isa::Avx512) return &backward_avx512<T, ENT>;
  if (isa == Isa::Avx2) return &backward_avx2<T, ENT>;
#endif
  (void)isa;
  return &backward_generic<T, ENT>;
}

}  // namespace

void logprobs_forward_kernel(const LogprobsFwdArgs& args, int nthreads) {
  const Isa isa = active_isa();
  const bool ent = args.entropy != nullptr;
  RowsFn<LogprobsFwdArgs> fn = with_dtype(args.dtype, [&](auto t) {
    return with_bool(ent, [&](auto e) {
      return pick_forward<decltype(t), decltype(e)::value>(isa);
    });
  });
  run_unit_stride_rows(fn, args, nthreads);
}

void logprobs_backward_kernel(const LogprobsBwdArgs& args, int nthreads) {
  const Isa isa = active_isa();
  const bool ent = args.grad_entropy != nullptr;
  RowsFn<LogprobsBwdArgs> fn = with_dtype(args.dtype, [&](auto t) {
    return with_bool(ent, [&](auto e) {
      return pick_backward<decltype(t), decltype(e)::value>(isa);
    });
  });
  run_unit_stride_rows(fn, args, nthreads);
}

}  // namespace astrai
