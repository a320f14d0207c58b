// vocab_shard_backward of kernels/primitives.py: one vocabulary shard's gradient from the group's lse,
//   z = c * tanh(x / c) (softcap c, 0 = off), s = z / T, log p_j = s_j - lse (the whole
//   vocabulary's lse), and per row
//   grad_j = (1/T) * dz_j/dx_j * (p_j * (alpha + beta * log p_j) + gamma * d_jy + delta)
// with dz/dx = 1 - tanh(x / c)^2. Targets in [0, V) are local columns; ignore_index rows get
// zeros; any other target is a counted row whose target lies in another shard (no gamma term).
#include "common.h"

namespace astrai {
namespace {

template <class T, bool SOFTCAP>
ASTRAI_INLINE void shard_rows(const VocabShardArgs& a, int64_t n0, int64_t n1) {
  using S = typename T::storage;
  const int64_t V = a.x.V;
  const float inv_t = a.inv_t, cap = a.softcap, inv_cap = SOFTCAP ? 1.0f / a.softcap : 0.0f;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t y = a.y[n];
    S* g = a.grad.row<S>(n);
    if (y == a.ignore_index) {
      zero_row<T, true>(g, 1, V);
      continue;
    }
    const S* row = a.x.row<S>(n);
    const bool owned = y >= 0 && y < V;
    // read before the row is written: grad may be the logits themselves (in place)
    const float x_y = owned ? T::load(row[y]) : 0.0f;
    const float alpha = a.alpha[n] * inv_t;
    const float beta = a.beta ? a.beta[n] * inv_t : 0.0f;
    const float delta = a.delta ? a.delta[n] * inv_t : 0.0f;
    const float lse = a.lse[n];
    write_shard_grad<T, true, SOFTCAP>(row, 1, g, 1, V, inv_t, cap, inv_cap, lse, alpha, beta,
                                    delta);
    if (owned) {
      const float t = SOFTCAP ? fast_tanh(x_y * inv_cap) : 0.0f;
      const float d = (SOFTCAP ? cap * t : x_y) * inv_t - lse;
      const float log_p = d < kShardLogPFloor ? kShardLogPFloor : d;
      const float p = log_prob_exp(log_p);
      float v = p * (alpha + beta * log_p) + delta + a.gamma[n] * inv_t;
      if (SOFTCAP) v *= 1.0f - t * t;
      g[y] = T::store(v);
    }
  }
}

#define ASTRAI_SHARD_VARIANTS(ATTR, SUFFIX)                                                  \
  template <class T, bool SOFTCAP>                                                           \
  ATTR ASTRAI_NOINLINE void shard_##SUFFIX(const VocabShardArgs& a, int64_t n0, int64_t n1) { \
    shard_rows<T, SOFTCAP>(a, n0, n1);                                                       \
  }
ASTRAI_FOR_EACH_ISA(ASTRAI_SHARD_VARIANTS)
#undef ASTRAI_SHARD_VARIANTS

template <class T, bool SOFTCAP>
RowsFn<VocabShardArgs> pick(Isa isa) {
#if ASTRAI_X86
  if (isa == Isa::Avx512) return &shard_avx512<T, SOFTCAP>;
  if (isa == Isa::Avx2) return &shard_avx2<T, SOFTCAP>;
#endif
  (void)isa;
  return &shard_generic<T, SOFTCAP>;
}

}  // namespace

void vocab_shard_backward_kernel(const VocabShardArgs& args, int nthreads) {
  const Isa isa = active_isa();
  const bool softcap = args.softcap != 0.0f;
  RowsFn<VocabShardArgs> fn = with_dtype(args.dtype, [&](auto t) {
    return with_bool(softcap, [&](auto sc) { return pick<decltype(t), decltype(sc)::value>(isa); });
  });
  run_unit_stride_rows(fn, args, nthreads);
}

}  // namespace astrai
