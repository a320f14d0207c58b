// row_kth_largest of kernels/cpp/backend.py: per row of [N, V] logits, the k-th largest element
// under the order "larger value first, NaN above every number (as torch.topk ranks it), the lower
// index first among equal values", as its value (float32; 0.0 for a -0.0) and its index. Element
// j is then among the row's k largest iff (x_j, -j) ranks at or above (value, -index): what
// verl's top-K overlap needs for each teacher id, without the k indices. Given ids [N, m], it
// also says which of them are among their row's k largest.
//
// One streaming read of each row, at memory speed:
//   1. a window of the first min(V, k * kLanes) elements, in k interleaved groups (element j in
//      group j mod k): the least of the groups' maxima is at most the window's k-th largest, so
//      the window's elements >= it (and NaN) hold its k best; they go to a candidate buffer (the
//      window is still in L1 for this second read);
//   2. the buffer's k-th best (a quickselect) is the running threshold; the rest of the row
//      streams kLanes at a time through one vectorized test "lane > threshold or NaN" into a bit
//      mask, the rare passing lanes go to the buffer (an equal value cannot enter: an earlier
//      index holds it), and a buffer of 2k is cut back to its k best, raising the threshold;
//   3. the buffer's k-th best is the answer.
// A threshold that is NaN (k NaNs met) ends the row: no later element ranks above it. On a
// random row (V = 32768, k = 64) about 280 window elements and 250 later ones are buffered.
#include <algorithm>
#include <functional>

#include "common.h"

namespace astrai {
namespace {

// A candidate as one integer whose order is the ranking: the value's order key in the high half
// (NaN above +inf; -0.0 and 0.0 one key, as they compare equal), the index's complement in the
// low half (the lower index ranks above). nth_element then compares integers, not (value, index)
// pairs through branches.
using Candidate = uint64_t;

ASTRAI_INLINE uint32_t value_key(float v) {
  const uint32_t u = float_to_bits(v + 0.0f);  // -0.0 + 0.0 = 0.0
  const uint32_t ordered = (u >> 31) ? ~u : (u | 0x80000000u);
  return v != v ? 0xFFFFFFFFu : ordered;
}

ASTRAI_INLINE float key_value(uint32_t key) {
  if (key == 0xFFFFFFFFu) return std::numeric_limits<float>::quiet_NaN();
  return bits_to_float((key >> 31) ? (key & 0x7FFFFFFFu) : ~key);
}

ASTRAI_INLINE Candidate candidate(float v, int64_t j) {
  return (Candidate(value_key(v)) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(j));
}

struct RowKthArgs {
  RowsView x;
  DType dtype;
  int64_t k;
  Candidate* buffers;  // `capacity` candidates per thread: the window's, or 2k + kLanes
  int64_t capacity;
  float* maxima;       // k per thread
  int threads;
  const int64_t* ids;  // [N, n_ids]: ids whose membership in the row's k largest is asked
  int64_t n_ids;
  float* value;
  int64_t* index;
  bool* in_top;        // [N, n_ids]
  BadRow* bad;
};

// The k-th best (largest) of the n >= k candidates in c, which it reorders: quickselect whose
// partition has no data-dependent branch (std::nth_element's compare branches mispredict on
// random keys and cost most of its time), std::nth_element past a depth that random keys do
// not reach. Keys are distinct, so a median of three has a key on either side.
ASTRAI_INLINE Candidate kth_best(Candidate* c, int64_t n, int64_t k) {
  int64_t lo = 0, hi = n;  // the k-th best is in [lo, hi)
  for (int depth = 0; hi - lo > 16; ++depth) {
    if (depth > 64) {
      std::nth_element(c + lo, c + (k - 1), c + hi, std::greater<Candidate>());
      return c[k - 1];
    }
    const Candidate a = c[lo], b = c[lo + (hi - lo) / 2], d = c[hi - 1];
    const Candidate pivot = std::max(std::min(a, b), std::min(std::max(a, b), d));
    int64_t store = lo;  // [lo, store) > pivot, [store, i) <= pivot
    for (int64_t i = lo; i < hi; ++i) {
      const Candidate x = c[i];
      c[i] = c[store];
      c[store] = x;
      store += x > pivot;
    }
    if (k - 1 < store) hi = store; else lo = store;
  }
  std::sort(c + lo, c + hi, std::greater<Candidate>());
  return c[k - 1];
}

ASTRAI_INLINE float candidate_value(Candidate c) { return key_value(static_cast<uint32_t>(c >> 32)); }

// Appends the elements of [j0, j0 + len), len <= 32, that keep(v) accepts; returns the new
// count. The test runs vectorized into a bit mask; only the passing lanes are then visited.
template <class Load, class Keep>
ASTRAI_INLINE int64_t append_passing(const Load& load, int64_t j0, int64_t len, const Keep& keep,
                                     Candidate* c, int64_t n) {
  uint32_t mask = 0;
  for (int64_t l = 0; l < len; ++l) mask |= static_cast<uint32_t>(keep(load(j0 + l))) << l;
  for (; mask; mask &= mask - 1) {
    const int64_t j = j0 + __builtin_ctz(mask);
    c[n++] = candidate(load(j), j);
  }
  return n;
}

template <class T>
ASTRAI_INLINE void kth_rows(const RowKthArgs& a, int64_t n0, int64_t n1) {
  using S = typename T::storage;
  const int64_t V = a.x.V, k = a.k;
  const int thread = a.threads > 1 ? omp_get_thread_num() : 0;
  Candidate* const c = a.buffers + thread * a.capacity;
  const int64_t window = std::min(V, k * kLanes);
  const int64_t group = window / k;  // kLanes, or less on a row shorter than k * kLanes
  for (int64_t row = n0; row < n1; ++row) {
    const RawLoad<T, true> load{a.x.row<S>(row), 1};
    // k interleaved groups (element j in group j mod k), maxima updated k lanes at a time
    float* const maxima = a.maxima + thread * k;
    for (int64_t l = 0; l < k; ++l) maxima[l] = -kInf;
    for (int64_t g0 = 0; g0 < k * group; g0 += k) {
      for (int64_t p = g0; p < g0 + k; p += kLanes) load.prefetch(p);
      for (int64_t l = 0; l < k; ++l) {
        const float v = load(g0 + l);
        maxima[l] = maxima[l] < v ? v : maxima[l];
      }
    }
    float floor = kInf;
    for (int64_t l = 0; l < k; ++l) floor = floor > maxima[l] ? maxima[l] : floor;
    const auto at_least_floor = [floor](float v) { return int(!(v < floor)); };
    int64_t n = 0, j = 0;
    for (; j + kLanes <= window; j += kLanes) {
      n = append_passing(load, j, kLanes, at_least_floor, c, n);
    }
    n = append_passing(load, j, window - j, at_least_floor, c, n);
    float threshold = candidate_value(kth_best(c, n, k));
    n = k;
    for (j = window; j + kLanes <= V && threshold == threshold; j += kLanes) {
      load.prefetch(j);
      n = append_passing(load, j, kLanes, [threshold](float v) { return int(!(v <= threshold)); },
                         c, n);
      if (n >= 2 * k) {  // cut back to k: on a random row a few times, on a rising one O(V / k)
        threshold = candidate_value(kth_best(c, n, k));
        n = k;
      }
    }
    if (threshold == threshold) {
      n = append_passing(load, j, V - j, [threshold](float v) { return int(!(v <= threshold)); },
                         c, n);
    }
    const Candidate best = kth_best(c, n, k);
    a.value[row] = candidate_value(best);
    a.index[row] = 0xFFFFFFFFu - static_cast<uint32_t>(best);
    for (int64_t t = row * a.n_ids; t < (row + 1) * a.n_ids; ++t) {
      const int64_t id = a.ids[t];
      const bool valid = id >= 0 && id < V;
      if (!valid) a.bad->set(row, id);
      a.in_top[t] = valid && candidate(load(id), id) >= best;
    }
  }
}

#define ASTRAI_ROW_TOPK_VARIANTS(ATTR, SUFFIX)                                           \
  template <class T>                                                                     \
  ATTR ASTRAI_NOINLINE void kth_##SUFFIX(const RowKthArgs& a, int64_t n0, int64_t n1) { \
    kth_rows<T>(a, n0, n1);                                                              \
  }
ASTRAI_FOR_EACH_ISA(ASTRAI_ROW_TOPK_VARIANTS)
#undef ASTRAI_ROW_TOPK_VARIANTS

template <class T>
RowsFn<RowKthArgs> pick_kth(Isa isa) {
#if ASTRAI_X86
  if (isa == Isa::Avx512) return &kth_avx512<T>;
  if (isa == Isa::Avx2) return &kth_avx2<T>;
#endif
  (void)isa;
  return &kth_generic<T>;
}

}  // namespace

void row_kth_largest_kernel(const RowsView& x, DType dtype, int64_t k, const int64_t* ids,
                            int64_t n_ids, float* value, int64_t* index, bool* in_top,
                            BadRow* bad, int nthreads) {
  const int64_t n_rows = x.rows();
  if (n_rows <= 0) return;
  const int threads = row_chunks(n_rows, x.V, nthreads).threads;
  const int64_t capacity = std::max(std::min(x.V, k * kLanes), 2 * k) + kLanes;
  std::unique_ptr<Candidate[]> buffers(new Candidate[threads * capacity]);
  std::unique_ptr<float[]> maxima(new float[threads * k]);
  const RowKthArgs a{x,     dtype, k,     buffers.get(), capacity, maxima.get(), threads,
                     ids,   n_ids, value, index,         in_top,   bad};
  const RowsFn<RowKthArgs> fn =
      with_dtype(dtype, [&](auto t) { return pick_kth<decltype(t)>(active_isa()); });
  run_unit_stride_rows(fn, a, nthreads);
}

}  // namespace astrai
