// logprobs_forward / logprobs_backward of ops/_backend.py: s = z / T, p = softmax(s),
//   forward:  logp = s_y - lse, entropy = lse - sum_j p_j s_j, lse (ignored rows: all 0)
//   backward: grad_j = (1/T) * (g_lp * (d_jy - p_j) - g_H * p_j * (s_j - lse + H))
#include "common.h"

namespace astrai {
namespace {

template <class T, bool C, bool ENT>
ASTRAI_INLINE void forward_rows(const LogprobsFwdArgs& a, int64_t n0, int64_t n1) {
  using S = typename T::storage;
  const int64_t V = a.x.V, sv = a.x.sV;
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
    const ScaledLoad<T, C> load{row, sv, a.inv_t};
    const float s_y = load(y);
    OnlineLse st;
    online_lse_row<ENT, false>(V, load, st, s_y);
    const float lse = st.lse();
    a.logp[n] = s_y - lse;
    a.lse[n] = lse;
    if (ENT) a.entropy[n] = st.entropy();
  }
}

template <class T, bool C, bool ENT>
ASTRAI_INLINE void backward_rows(const LogprobsBwdArgs& a, int64_t n0, int64_t n1) {
  using S = typename T::storage;
  const int64_t V = a.x.V, sv = a.x.sV, sg = a.grad.sV;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t y = a.y[n];
    S* g = a.grad.row<S>(n);
    const bool ignored = y == a.ignore_index;
    if (ignored || y < 0 || y >= V) {
      if (!ignored) a.bad->set(n, y);
      zero_row<T, C>(g, sg, V);
      continue;
    }
    const S* row = a.x.row<S>(n);
    const float s_y = T::load(row[C ? y : y * sv]) * a.inv_t;
    write_logprob_grad<T, C, ENT>(row, sv, g, sg, V, y, s_y, a.inv_t, a.lse[n], a.grad_logp[n],
                                  ENT ? a.grad_entropy[n] : 0.0f, ENT ? a.entropy[n] : 0.0f);
  }
}

#define ASTRAI_LOGPROBS_VARIANTS(ATTR, SUFFIX)                                              \
  template <class T, bool C, bool ENT>                                                      \
  ATTR ASTRAI_NOINLINE void forward_##SUFFIX(const LogprobsFwdArgs& a, int64_t n0,          \
                                             int64_t n1) {                                  \
    forward_rows<T, C, ENT>(a, n0, n1);                                                     \
  }                                                                                         \
  template <class T, bool C, bool ENT>                                                      \
  ATTR ASTRAI_NOINLINE void backward_##SUFFIX(const LogprobsBwdArgs& a, int64_t n0,         \
                                              int64_t n1) {                                 \
    backward_rows<T, C, ENT>(a, n0, n1);                                                    \
  }
ASTRAI_FOR_EACH_ISA(ASTRAI_LOGPROBS_VARIANTS)
#undef ASTRAI_LOGPROBS_VARIANTS

template <class T, bool C, bool ENT>
RowsFn<LogprobsFwdArgs> pick_forward(Isa isa) {
#if ASTRAI_X86
  if (isa == Isa::Avx512) return &forward_avx512<T, C, ENT>;
  if (isa == Isa::Avx2) return &forward_avx2<T, C, ENT>;
#endif
  (void)isa;
  return &forward_generic<T, C, ENT>;
}

template <class T, bool C, bool ENT>
RowsFn<LogprobsBwdArgs> pick_backward(Isa isa) {
#if ASTRAI_X86
  if (isa == Isa::Avx512) return &backward_avx512<T, C, ENT>;
  if (isa == Isa::Avx2) return &backward_avx2<T, C, ENT>;
#endif
  (void)isa;
  return &backward_generic<T, C, ENT>;
}

}  // namespace

void logprobs_forward_kernel(const LogprobsFwdArgs& args, int nthreads) {
  const Isa isa = active_isa();
  const bool contiguous = args.x.sV == 1 || args.x.V <= 1;
  const bool ent = args.entropy != nullptr;
  RowsFn<LogprobsFwdArgs> fn = with_dtype(args.dtype, [&](auto t) {
    return with_bool(contiguous, [&](auto c) {
      return with_bool(ent, [&](auto e) {
        return pick_forward<decltype(t), decltype(c)::value, decltype(e)::value>(isa);
      });
    });
  });
  run_rows(fn, args, args.x.rows(), args.x.V, nthreads);
}

void logprobs_backward_kernel(const LogprobsBwdArgs& args, int nthreads) {
  const Isa isa = active_isa();
  const bool contiguous = (args.x.sV == 1 && args.grad.sV == 1) || args.x.V <= 1;
  const bool ent = args.grad_entropy != nullptr;
  RowsFn<LogprobsBwdArgs> fn = with_dtype(args.dtype, [&](auto t) {
    return with_bool(contiguous, [&](auto c) {
      return with_bool(ent, [&](auto e) {
        return pick_backward<decltype(t), decltype(c)::value, decltype(e)::value>(isa);
      });
    });
  });
  run_rows(fn, args, args.x.rows(), args.x.V, nthreads);
}

}  // namespace astrai
