// cross_entropy_forward of kernels/primitives.py, with the gradient fused into the same pass:
//   z = c * tanh(a x / c) (softcap c, 0 = off; else z = a x), a the logit scale (1 = off),
//   lse = logsumexp(z), p = softmax(z)
//   loss   = (1 - eps) * (lse - z_y) + eps * (lse - mean_j z_j) + z_loss * lse^2
//   grad_j = a scale ((1 + 2 z_loss lse) p_j - (1 - eps) d_jy - eps / V) [* (1 - (z_j / c)^2)]
// with lse - z_y = log_sum - (z_y - m) and p_j = exp((z_j - m) - log_sum), m the row max and
// log_sum = log sum_j exp(z_j - m): exact however large the logits are.
#include "common.h"

namespace astrai {
namespace {

template <class T, bool SOFTCAP, bool SMOOTH>
ASTRAI_INLINE void cross_entropy_rows(const CrossEntropyArgs& a, int64_t n0, int64_t n1) {
  using S = typename T::storage;
  const int64_t V = a.x.V;
  const bool with_grad = a.grad.data != nullptr;
  const float cap = a.softcap, inv_cap = SOFTCAP ? 1.0f / a.softcap : 0.0f;
  const float mul = SOFTCAP ? a.logit_scale * inv_cap : a.logit_scale;
  const float eps = a.label_smoothing;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t y = a.y[n];
    const bool ignored = y == a.ignore_index;
    if (ignored || y < 0 || y >= V) {
      if (!ignored) a.bad->set(n, y);
      a.loss[n] = 0.0f;
      a.lse[n] = 0.0f;
      if (with_grad) zero_row<T, true>(a.grad.row<S>(n), 1, V);
      continue;
    }
    const S* row = a.x.row<S>(n);
    const CappedLoad<T, true, SOFTCAP> load{row, 1, cap, mul};
    const float z_y = load(y);
    OnlineLse st;
    // With a gradient to write, keep the exps of the first pass for the second.
    const RowScratch keep = with_grad ? row_scratch(V) : RowScratch{nullptr, nullptr};
    if (keep.exps) {
      online_lse_row<false, SMOOTH, true>(V, load, st, z_y, 1.0f, keep.exps, keep.shifts);
    } else {
      online_lse_row<false, SMOOTH>(V, load, st, z_y, 1.0f);
    }
    const float log_sum = st.log_sum();
    const float lse = st.lse(1.0f);
    float loss = a.one_minus_eps * (log_sum - (z_y - st.shift)) + a.z_loss * lse * lse;
    if (SMOOTH) {  // mean_j z_j - m = mean_j (z_j - zref) + (zref - m)
      const float mean_rel = st.zsum / static_cast<float>(V) + (st.zref - st.shift);
      loss = loss + eps * (log_sum - mean_rel);
    }
    a.loss[n] = loss;
    a.lse[n] = lse;
    if (!with_grad) continue;

    S* g = a.grad.row<S>(n);
    // dz/dx carries the logit scale: folded into the row's factor
    const float scale = a.grad_scale[a.grad_scale_numel == 1 ? 0 : n] * a.logit_scale;
    const float k = 1.0f + 2.0f * a.z_loss * lse;
    const float eps_v = a.smoothing_over_v;
    float p_y;
    if (keep.exps) {
      for (int64_t b0 = 0, blk = 0; b0 < V; b0 += kBlock, ++blk) {
        const int64_t b1 = std::min<int64_t>(V, b0 + kBlock);
        const float to_p = kept_to_prob(keep.shifts[blk], st, 1.0f, log_sum);  // p_j = e_j to_p
        const float* e = keep.exps;
#pragma omp simd
        for (int64_t j = b0; j < b1; ++j) {
          float v = (e[j] * to_p * k - eps_v) * scale;
          if (SOFTCAP) {
            const float u = load(j) * inv_cap;
            v *= 1.0f - u * u;
          }
          g[j] = T::store(v);
        }
      }
      p_y = keep.exps[y] * kept_to_prob(keep.shifts[y / kBlock], st, 1.0f, log_sum);
    } else {
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) {
        const float z = load(j);
        float v = (log_prob_exp((z - st.shift) - log_sum) * k - eps_v) * scale;
        if (SOFTCAP) {
          const float u = z * inv_cap;
          v *= 1.0f - u * u;
        }
        g[j] = T::store(v);
      }
      p_y = log_prob_exp((z_y - st.shift) - log_sum);
    }
    // The target element, with the -(1 - eps) folded in float32, written last (in-place safe).
    float v = (p_y * k - eps_v + a.eps_minus_one) * scale;
    if (SOFTCAP) {
      const float u = z_y * inv_cap;
      v *= 1.0f - u * u;
    }
    g[y] = T::store(v);
  }
}

#define ASTRAI_CE_VARIANTS(ATTR, SUFFIX)                                                  \
  template <class T, bool SOFTCAP, bool SMOOTH>                                           \
  ATTR ASTRAI_NOINLINE void cross_entropy_##SUFFIX(const CrossEntropyArgs& a, int64_t n0, \
                                                   int64_t n1) {                          \
    cross_entropy_rows<T, SOFTCAP, SMOOTH>(a, n0, n1);                                    \
  }
ASTRAI_FOR_EACH_ISA(ASTRAI_CE_VARIANTS)
#undef ASTRAI_CE_VARIANTS

template <class T, bool SOFTCAP, bool SMOOTH>
RowsFn<CrossEntropyArgs> pick(Isa isa) {
#if ASTRAI_X86
  if (isa == Isa::Avx512) return &cross_entropy_avx512<T, SOFTCAP, SMOOTH>;
  if (isa == Isa::Avx2) return &cross_entropy_avx2<T, SOFTCAP, SMOOTH>;
#endif
  (void)isa;
  return &cross_entropy_generic<T, SOFTCAP, SMOOTH>;
}

}  // namespace

void cross_entropy_forward_kernel(const CrossEntropyArgs& args, int nthreads) {
  const Isa isa = active_isa();
  const bool softcap = args.softcap != 0.0f;
  const bool smooth = args.label_smoothing != 0.0f;
  RowsFn<CrossEntropyArgs> fn = with_dtype(args.dtype, [&](auto t) {
    return with_bool(softcap, [&](auto sc) {
      return with_bool(smooth, [&](auto sm) {
        return pick<decltype(t), decltype(sc)::value, decltype(sm)::value>(isa);
      });
    });
  });
  run_unit_stride_rows(fn, args, nthreads);
}

}  // namespace astrai
