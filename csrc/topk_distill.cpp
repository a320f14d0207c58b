// topk_distill_forward of kernels/primitives.py: the loss of ops/topk_distill.py over a teacher's
// top-K support per row, s = z / T. Per row:
//   1. where the loss reads the full softmax, one online pass over the row gives its max m and
//      sum_j exp((z_j - m) / T); the student's log-probs at the support are then
//      s_k = (z_{id_k} - m) / T - log sum (else s_k = z_{id_k} / T: a renormalisation over the
//      support cancels the row's log-sum-exp, and the row is not read);
//   2. the loss and c_k = d loss / d s_k from the K log-probs (support_loss below, the math of
//      ops/topk_distill.py's support_loss for trl_jsd, verl_forward_kl and axolotl_kd);
//   3. with a gradient scale g (the scalar reductions' d loss / d row loss), since
//      d s_k / d z_j = ([j == id_k] - p_j) / T (p_j only with the full softmax):
//        grad_j = g / T * (sum_{k: id_k = j} c_k - p_j sum_k c_k),
//      a dense pass writing -g / T * p_j * sum_k c_k (reading the row again, now in cache), then
//      the support's columns from the logits read in step 1, duplicate ids summed.
// The per-row support math (O(K)) is scalar float32 with libm, as the torch ops compute it; the
// row passes are the vectorized helpers of common.h.
#include <vector>

#include "common.h"

namespace astrai {
namespace {

constexpr float kTiny = std::numeric_limits<float>::min();  // torch.finfo(float32).tiny

// TRL's nan_to_num(nan=0.0) of a KL term (0 * inf where a probability is 0); infinities kept.
inline float nan_as_zero(float x) { return x != x ? 0.0f : x; }

// logsumexp over the live entries (-inf when none is live), as torch.logsumexp of the masked row.
inline float live_logsumexp(const float* x, const bool* live, int64_t K) {
  float m = -kInf;
  for (int64_t k = 0; k < K; ++k)
    if (live[k] && x[k] > m) m = x[k];
  if (m == -kInf || m == kInf) return m;
  float sum = 0.0f;
  for (int64_t k = 0; k < K; ++k)
    if (live[k]) sum += std::exp(x[k] - m);
  return m + std::log(sum);
}

// TRL's masked _jsd_divergence at one live entry of the student's log-prob a and the teacher's
// b: the term and its derivative with respect to a (NaN as 0).
//   beta = 0: q (b - a), -q;   beta = 1: p (a - b), p (a - b) + p;
//   else, m = log(max((1 - beta) p + beta q, tiny)): beta q (b - m) + (1 - beta) p (a - m) and
//   (1 - beta) p (a - m) (dm/da = (1 - beta) p / exp(m) cancels the other terms' share).
inline void divergence(float a, float b, const TopkDistillArgs& args, float* term, float* grad) {
  const float p = std::exp(a), q = std::exp(b);
  float t, g;
  if (args.kind == DivergenceKind::ForwardKl) {
    t = q * (b - a);
    g = -q;
  } else if (args.kind == DivergenceKind::ReverseKl) {
    t = p * (a - b);
    g = t + p;
  } else {
    float mix = args.one_minus_beta * p + args.beta * q;
    mix = mix < kTiny ? kTiny : mix;
    const float log_m = std::log(mix);
    const float student_kl = p * (a - log_m);
    t = args.beta * nan_as_zero(q * (b - log_m)) + args.one_minus_beta * nan_as_zero(student_kl);
    g = args.one_minus_beta * student_kl;
  }
  *term = nan_as_zero(t);
  *grad = nan_as_zero(g);
}

// log(1 - exp(log_sum)) after TRL's clamp of log_sum at kTopkTailLogSumMax (torch's
// log(-expm1(.)) of _tail_bucket).
inline float tail_bucket(float log_sum) {
  return std::log(-std::expm1(log_sum > kTopkTailLogSumMax ? kTopkTailLogSumMax : log_sum));
}

// trl_jsd: the divergence over the live entries and, with the tail, the bucket
// log(1 - sum exp) on both sides (d tail / d s_k = -exp(s_k - tail), 0 where TRL's clamp holds
// log(sum)); without it both renormalised over the support (d a_j / d s_k = [j == k] - exp(a_k)).
float trl_loss(const float* s, const float* t, const bool* live, int64_t K,
               const TopkDistillArgs& args, float* a, float* coef) {
  const float s_lse = live_logsumexp(s, live, K), t_lse = live_logsumexp(t, live, K);
  float loss = 0.0f, grad_sum = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    coef[k] = 0.0f;
    if (!live[k]) continue;
    a[k] = args.tail ? s[k] : s[k] - s_lse;
    float term;
    divergence(a[k], args.tail ? t[k] : t[k] - t_lse, args, &term, &coef[k]);
    loss += term;
    grad_sum += coef[k];
  }
  if (args.tail) {
    const float s_tail = tail_bucket(s_lse);
    float term, tail_grad;
    divergence(s_tail, tail_bucket(t_lse), args, &term, &tail_grad);
    loss += term;
    if (!(s_lse <= kTopkTailLogSumMax)) tail_grad = 0.0f;
    for (int64_t k = 0; k < K; ++k)
      if (live[k]) coef[k] -= tail_grad * std::exp(s[k] - s_tail);
  } else {
    for (int64_t k = 0; k < K; ++k)
      if (live[k]) coef[k] -= std::exp(a[k]) * grad_sum;
  }
  return loss;
}

// verl's forward_kl_topk: sum_k q_k (t_k - s_k) with both log-probs clamped below at `low` and
// q = exp(t), then clamped to [0, high]; c_k = -q_k where s_k passes its clamp (>=, as
// autograd's) and the row its clamps.
float verl_loss(const float* s, const float* t, const bool* live, int64_t K,
                const TopkDistillArgs& args, float* coef) {
  float kl = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    coef[k] = 0.0f;
    if (!live[k]) continue;
    float sk = s[k], tk = t[k];
    const bool passes = !args.low_on || sk >= args.low;
    if (args.low_on) {
      sk = sk < args.low ? args.low : sk;
      tk = tk < args.low ? args.low : tk;
    }
    const float q = std::exp(tk);
    kl += q * (tk - sk);
    coef[k] = passes ? -q : 0.0f;  // times the row's pass below
  }
  bool row_passes = kl >= 0.0f;
  float loss = kl < 0.0f ? 0.0f : kl;
  if (args.high_on) {
    row_passes = row_passes && loss <= args.high;
    loss = loss > args.high ? args.high : loss;
  }
  if (!row_passes)
    for (int64_t k = 0; k < K; ++k) coef[k] = 0.0f;
  return loss;
}

// axolotl_kd: TRL's divergence terms between the student's log-probs (renormalised over the
// support with normalize_topk) and the teacher's as given, times T**2.
float axolotl_loss(const float* s, const float* t, const bool* live, int64_t K,
                   const TopkDistillArgs& args, float* a, float* coef) {
  const float s_lse = args.normalize_topk ? live_logsumexp(s, live, K) : 0.0f;
  float loss = 0.0f, grad_sum = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    coef[k] = 0.0f;
    if (!live[k]) continue;
    a[k] = s[k] - s_lse;
    float term;
    divergence(a[k], t[k], args, &term, &coef[k]);
    loss += term;
    grad_sum += coef[k];
  }
  for (int64_t k = 0; k < K; ++k) {
    if (!live[k]) continue;
    if (args.normalize_topk) coef[k] -= std::exp(a[k]) * grad_sum;
    coef[k] *= args.t_squared;
  }
  return loss * args.t_squared;
}

// The row's loss and coef[k] = d loss / d s_k (0 on entries not live); `a`: K floats of scratch.
ASTRAI_NOINLINE float support_loss(const float* s, const float* t, const bool* live, int64_t K,
                                   const TopkDistillArgs& args, float* a, float* coef) {
  switch (args.objective) {
    case TopkObjective::VerlForwardKl: return verl_loss(s, t, live, K, args, coef);
    case TopkObjective::AxolotlKd: return axolotl_loss(s, t, live, K, args, a, coef);
    default: return trl_loss(s, t, live, K, args, a, coef);
  }
}

// K floats of per-thread scratch, twice (grows, never shrinks).
inline float* support_scratch(int64_t K) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < 2 * K) buffer.resize(2 * K);
  return buffer.data();
}

template <class T, bool GRAD>
ASTRAI_INLINE void forward_rows(const TopkDistillArgs& a, int64_t n0, int64_t n1) {
  using S = typename T::storage;
  const int64_t V = a.x.V, K = a.K;
  const float inv_t = a.inv_t;
  float* s = support_scratch(K);
  float* shifted = s + K;  // the log-probs as the loss read them (trl / axolotl scratch)
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t* ids = a.ids + n * K;
    const bool* live = a.live + n * K;
    float* coef = a.coef + n * K;
    S* g = GRAD ? a.grad.row<S>(n) : nullptr;
    int64_t first_live = -1;
    bool bad = false;
    for (int64_t k = 0; k < K; ++k) {
      if (!live[k]) continue;
      if (ids[k] < 0 || ids[k] >= V) {
        a.bad->set(n, ids[k]);
        bad = true;
      }
      if (first_live < 0) first_live = k;
    }
    if (!a.counted[n] || bad) {  // a row not counted may hold anything: it is not read
      a.loss[n] = 0.0f;
      a.row_max[n] = 0.0f;
      a.sums[n] = a.full_softmax ? static_cast<float>(V) : 0.0f;  // the torch ops' masked row
      for (int64_t k = 0; k < K; ++k) coef[k] = 0.0f;
      if (GRAD) zero_row<T, true>(g, 1, V);
      continue;
    }
    const S* row = a.x.row<S>(n);
    const RawLoad<T, true> load{row, 1};
    float ref = 0.0f, log_sum = 0.0f;
    if (a.full_softmax) {
      OnlineLse st;
      online_lse_row<false, false>(V, load, st, load(first_live < 0 ? 0 : ids[first_live]),
                                   inv_t);
      ref = st.shift;
      log_sum = st.log_sum();
      a.row_max[n] = st.shift;
      a.sums[n] = st.sum;
    } else {
      a.row_max[n] = 0.0f;
      a.sums[n] = 0.0f;
    }
    for (int64_t k = 0; k < K; ++k)
      s[k] = live[k] ? (load(ids[k]) - ref) * inv_t - log_sum : -kInf;
    a.loss[n] = support_loss(s, a.teacher + n * K, live, K, a, shifted, coef);
    if (!GRAD) continue;
    const float w = a.grad_loss[a.grad_loss_numel == 1 ? 0 : n] * inv_t;
    float coef_sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) coef_sum += coef[k];
    const float dense = a.full_softmax ? -coef_sum * w : 0.0f;
    if (a.full_softmax) {
      write_softmax_grad<T, true>(row, 1, g, 1, V, ref, inv_t, log_sum, dense);
    } else {
      zero_row<T, true>(g, 1, V);
    }
    // the support's columns: the dense term at p = exp(s_k) plus every entry's c_k at that id
    for (int64_t k = 0; k < K; ++k) {
      if (!live[k]) continue;
      bool seen = false;
      for (int64_t e = 0; e < k && !seen; ++e) seen = live[e] && ids[e] == ids[k];
      if (seen) continue;
      float total = 0.0f;
      for (int64_t e = k; e < K; ++e)
        if (live[e] && ids[e] == ids[k]) total += coef[e];
      const float p = a.full_softmax ? log_prob_exp(s[k]) : 0.0f;
      g[ids[k]] = T::store(total * w + p * dense);
    }
  }
}

#define ASTRAI_TOPK_VARIANTS(ATTR, SUFFIX)                                                  \
  template <class T, bool GRAD>                                                             \
  ATTR ASTRAI_NOINLINE void forward_##SUFFIX(const TopkDistillArgs& a, int64_t n0,          \
                                             int64_t n1) {                                  \
    forward_rows<T, GRAD>(a, n0, n1);                                                       \
  }
ASTRAI_FOR_EACH_ISA(ASTRAI_TOPK_VARIANTS)
#undef ASTRAI_TOPK_VARIANTS

template <class T, bool GRAD>
RowsFn<TopkDistillArgs> pick_forward(Isa isa) {
#if ASTRAI_X86
  if (isa == Isa::Avx512) return &forward_avx512<T, GRAD>;
  if (isa == Isa::Avx2) return &forward_avx2<T, GRAD>;
#endif
  (void)isa;
  return &forward_generic<T, GRAD>;
}

}  // namespace

void topk_distill_forward_kernel(const TopkDistillArgs& args, int nthreads) {
  const Isa isa = active_isa();
  const bool with_grad = args.grad.data != nullptr;
  RowsFn<TopkDistillArgs> fn = with_dtype(args.dtype, [&](auto t) {
    return with_bool(with_grad, [&](auto g) {
      return pick_forward<decltype(t), decltype(g)::value>(isa);
    });
  });
  run_unit_stride_rows(fn, args, nthreads);
}

}  // namespace astrai
