// Python bindings of the cpp backend: read the params objects of kernels/primitives.py, unpack
// tensors into the torch-free kernel arguments of common.h, allocate the per-row outputs, run
// the kernels without the GIL.
// The headers of what it uses, not <torch/extension.h>: that one brings torch's whole C++
// frontend, and parsing it was half this file's compile time (31 -> 16 CPU-seconds, issue 42).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <type_traits>

#include "common.h"

namespace py = pybind11;
using at::Tensor;

namespace astrai {
// csrc/row_topk.cpp (a kernel without an arguments struct, so not among common.h's)
void row_kth_largest_kernel(const RowsView& x, DType dtype, int64_t k, const int64_t* ids,
                            int64_t n_ids, float* value, int64_t* index, bool* in_top,
                            BadRow* bad, int nthreads);
}  // namespace astrai

namespace {

using namespace astrai;

DType dtype_of(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    default:
      TORCH_CHECK_TYPE(false, name, " must be float32, bfloat16 or float16, got ",
                       t.scalar_type());
  }
  return DType::F32;  // unreachable
}

RowsView rows_of(const Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu(), "the cpp backend serves CPU tensors only, logits are on ",
              logits.device());
  TORCH_CHECK(logits.dim() == 3, "logits must be a 3-D [A, B, V] view, got ", logits.dim(),
              " dims");
  RowsView v;
  v.data = logits.data_ptr();
  v.A = logits.size(0);
  v.B = logits.size(1);
  v.V = logits.size(2);
  v.sA = logits.stride(0);
  v.sB = logits.stride(1);
  v.sV = logits.stride(2);
  return v;
}

Targets targets_of(const Tensor& target, int64_t n_rows) {
  TORCH_CHECK(target.device().is_cpu(), "target must be a CPU tensor");
  TORCH_CHECK(target.scalar_type() == at::kLong || target.scalar_type() == at::kInt,
              "target must be int64 or int32, got ", target.scalar_type());
  TORCH_CHECK(target.is_contiguous(), "target must be contiguous");
  TORCH_CHECK(target.numel() == n_rows, "target must have ", n_rows, " elements, got ",
              target.numel());
  return Targets{target.data_ptr(), target.scalar_type() == at::kLong};
}

// A float32 contiguous per-row tensor of n elements (or nullptr when absent / empty allowed).
const float* rows_f32(const Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, name, " must have ", n, " elements, got ", t.numel());
  return t.data_ptr<float>();
}

GradView grad_of(const Tensor& grad, const Tensor& logits) {
  TORCH_CHECK(grad.device().is_cpu(), "grad must be a CPU tensor");
  TORCH_CHECK(grad.scalar_type() == logits.scalar_type(), "grad must have the logits' dtype ",
              logits.scalar_type(), ", got ", grad.scalar_type());
  TORCH_CHECK(grad.sizes() == logits.sizes(), "grad must have the logits' shape ",
              logits.sizes(), ", got ", grad.sizes());
  GradView g;
  g.data = grad.data_ptr();
  g.B = grad.size(1);
  g.sA = grad.stride(0);
  g.sB = grad.stride(1);
  g.sV = grad.stride(2);
  return g;
}

int kernel_threads() { return at::in_parallel_region() ? 1 : at::get_num_threads(); }

void raise_if_bad(const BadRow& bad, int64_t vocab, const char* what) {
  const int64_t row = bad.row.load();
  if (row >= 0) {
    throw py::value_error(std::string("target out of range in ") + what + ": row " +
                          std::to_string(row) + " has target " + std::to_string(bad.target) +
                          ", expected a value in [0, " + std::to_string(vocab) +
                          ") or the ignore index");
  }
}

// ---------------------------------------------------------------------------------------------
// The params objects of kernels/primitives.py: one struct per class, filled by one reader that
// takes the Python object's fields by name and checks them (the type casters after this
// namespace hand the struct to the bindings, so a binding's signature is that of the Backend
// protocol: tensors, params, grad).
// ---------------------------------------------------------------------------------------------

template <class V>
V cast_field(py::handle params, const char* name, py::handle value) {
  try {
    return value.cast<V>();
  } catch (const py::cast_error&) {
    const char* kind = std::is_same_v<V, bool> ? "a bool"
                       : std::is_integral_v<V> ? "an int"
                                               : "a float";
    throw py::type_error(std::string(py::str(py::type::of(params).attr("__qualname__"))) + "." +
                         name + " must be " + kind + ", got " +
                         std::string(py::repr(value)));
  }
}

template <class V>
V field(py::handle params, const char* name) {
  return cast_field<V>(params, name, params.attr(name));  // AttributeError names a missing one
}

// A float field whose None means off, like 0.0 (softcap, delta).
double off_field(py::handle params, const char* name) {
  py::object value = params.attr(name);
  return value.is_none() ? 0.0 : cast_field<double>(params, name, value);
}

double temperature_field(py::handle params) {
  const double t = field<double>(params, "temperature");
  TORCH_CHECK(t > 0, "temperature must be > 0, got ", t);
  return t;
}

struct LogprobsParams {  // LogprobsArgs
  static constexpr char py_name[] = "LogprobsArgs";
  double temperature;
  int64_t ignore_index;
  bool with_entropy;

  static LogprobsParams read(py::handle p) {
    return {temperature_field(p), field<int64_t>(p, "ignore_index"),
            field<bool>(p, "with_entropy")};
  }
};

struct CrossEntropyParams {  // CrossEntropyArgs
  static constexpr char py_name[] = "CrossEntropyArgs";
  int64_t ignore_index;
  double label_smoothing, z_loss, softcap, logit_scale;

  static CrossEntropyParams read(py::handle p) {
    return {field<int64_t>(p, "ignore_index"), field<double>(p, "label_smoothing"),
            field<double>(p, "z_loss"), off_field(p, "softcap"), field<double>(p, "logit_scale")};
  }
};

struct SurrogateParams {  // SurrogateArgs
  static constexpr char py_name[] = "SurrogateArgs";
  double temperature, clip_eps_low, clip_eps_high, delta, beta;
  bool kl_ratio_correction, with_entropy;

  static SurrogateParams read(py::handle p) {
    return {temperature_field(p), field<double>(p, "clip_eps_low"),
            field<double>(p, "clip_eps_high"), off_field(p, "delta"), field<double>(p, "beta"),
            field<bool>(p, "kl_ratio_correction"), field<bool>(p, "with_entropy")};
  }
};

struct DistillParams {  // DistillArgs, with its mixture weights (DistillArgs.weights)
  static constexpr char py_name[] = "DistillArgs";
  double beta, temperature;
  int64_t ignore_index;
  double hard_weight;
  double w_t, w_s, log_w_s, log_w_t;

  static DistillParams read(py::handle p) {
    const double beta = field<double>(p, "beta");
    TORCH_CHECK(beta >= 0 && beta <= 1, "beta must be in [0, 1], got ", beta);
    py::object w = p.attr("weights");
    return {beta, temperature_field(p), field<int64_t>(p, "ignore_index"),
            field<double>(p, "hard_weight"), field<double>(w, "w_t"), field<double>(w, "w_s"),
            field<double>(w, "log_w_s"), field<double>(w, "log_w_t")};
  }
};

struct ShardGradParams {  // ShardGradArgs
  static constexpr char py_name[] = "ShardGradArgs";
  double temperature, softcap;
  int64_t ignore_index;

  static ShardGradParams read(py::handle p) {
    const double softcap = off_field(p, "softcap");
    TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: off), got ", softcap);
    return {temperature_field(p), softcap, field<int64_t>(p, "ignore_index")};
  }
};

struct SampledParams {  // SamplingArgs
  static constexpr char py_name[] = "SamplingArgs";
  double temperature;
  int64_t top_k;
  double top_p, min_p;
  int64_t ignore_index;

  static SampledParams read(py::handle p) {
    const int64_t top_k = field<int64_t>(p, "top_k");
    const double top_p = field<double>(p, "top_p"), min_p = field<double>(p, "min_p");
    TORCH_CHECK(top_k >= 0, "top_k must be >= 0 (0: off), got ", top_k);
    TORCH_CHECK(top_p > 0 && top_p <= 1, "top_p must be in (0, 1] (1: off), got ", top_p);
    TORCH_CHECK(min_p >= 0 && min_p <= 1, "min_p must be in [0, 1] (0: off), got ", min_p);
    return {temperature_field(p), top_k, top_p, min_p, field<int64_t>(p, "ignore_index")};
  }
};

struct TopkDistillParams {  // TopkDistillArgs
  static constexpr char py_name[] = "TopkDistillArgs";
  double beta, temperature;
  bool tail;
  TopkObjective objective;
  bool normalize_topk;
  std::optional<double> log_prob_min_clamp, loss_max_clamp;  // None: off

  static TopkDistillParams read(py::handle p) {
    const double beta = field<double>(p, "beta");
    TORCH_CHECK(beta >= 0 && beta <= 1, "beta must be in [0, 1], got ", beta);
    py::object objective_value = p.attr("objective");
    TORCH_CHECK_TYPE(py::isinstance<py::str>(objective_value),
                     "TopkDistillArgs.objective must be a str, got ",
                     std::string(py::repr(objective_value)));
    const std::string name = objective_value.cast<std::string>();
    TopkObjective objective;
    if (name == "trl_jsd") objective = TopkObjective::TrlJsd;
    else if (name == "verl_forward_kl") objective = TopkObjective::VerlForwardKl;
    else if (name == "axolotl_kd") objective = TopkObjective::AxolotlKd;
    else
      throw py::value_error("objective must be 'trl_jsd', 'verl_forward_kl' or 'axolotl_kd', "
                            "got '" + name + "'");
    const auto clamp = [&](const char* field_name) -> std::optional<double> {
      py::object value = p.attr(field_name);
      if (value.is_none()) return std::nullopt;
      return cast_field<double>(p, field_name, value);
    };
    return {beta, temperature_field(p), field<bool>(p, "tail"), objective,
            field<bool>(p, "normalize_topk"), clamp("log_prob_min_clamp"),
            clamp("loss_max_clamp")};
  }
};

}  // namespace

namespace pybind11::detail {

// A params struct from its Python object, read in either of pybind11's passes (with or without
// implicit conversions): each binding has one overload, and the reader raises its own errors.
template <class P>
struct params_caster {
  PYBIND11_TYPE_CASTER(P, const_name(P::py_name));
  bool load(handle src, bool) {
    value = P::read(src);
    return true;
  }
};

template <> struct type_caster<LogprobsParams> : params_caster<LogprobsParams> {};
template <> struct type_caster<CrossEntropyParams> : params_caster<CrossEntropyParams> {};
template <> struct type_caster<SurrogateParams> : params_caster<SurrogateParams> {};
template <> struct type_caster<DistillParams> : params_caster<DistillParams> {};
template <> struct type_caster<ShardGradParams> : params_caster<ShardGradParams> {};
template <> struct type_caster<SampledParams> : params_caster<SampledParams> {};
template <> struct type_caster<TopkDistillParams> : params_caster<TopkDistillParams> {};

}  // namespace pybind11::detail

namespace {

// ---------------------------------------------------------------------------------------------
// The setup every binding shares
// ---------------------------------------------------------------------------------------------

// The logits' row view and dtype, and the targets, into the kernel arguments `a`; returns N.
template <class A>
int64_t bind_rows(A& a, const Tensor& logits, const Tensor& target, const char* name) {
  a.x = rows_of(logits);
  a.dtype = dtype_of(logits, name);
  a.y = targets_of(target, a.x.rows());
  return a.x.rows();
}

float inverse(double temperature) { return static_cast<float>(1.0 / temperature); }

// A per-row float32 input, or nullptr when absent.
const float* optional_rows_f32(const std::optional<Tensor>& t, int64_t n, const char* name) {
  return t.has_value() ? rows_f32(*t, n, name) : nullptr;
}

// A new zeroed float32 output of n elements (of none when `on` is false), its data in *dst
// (nullptr when off).
Tensor output_rows(float** dst, int64_t n, bool on = true) {
  Tensor t = at::zeros({on ? n : 0}, at::TensorOptions().dtype(at::kFloat));
  *dst = on ? t.data_ptr<float>() : nullptr;
  return t;
}

// The gradient scale of a forward that writes the gradient: 1 or n float32 elements (its
// count in *numel).
const float* grad_scale_of(const std::optional<Tensor>& grad_scale, int64_t n, int64_t* numel) {
  TORCH_CHECK(grad_scale.has_value(), "grad_scale is required with grad");
  const Tensor& gs = *grad_scale;
  TORCH_CHECK(gs.numel() == 1 || gs.numel() == n, "grad_scale must have 1 or ", n,
              " elements, got ", gs.numel());
  *numel = gs.numel();
  return rows_f32(gs, gs.numel(), "grad_scale");
}

// Run `kernel` without the GIL on all threads (one inside a parallel region), then raise for
// the first out-of-range target it met (kernel arguments without a `bad` have none).
template <class A>
void run(void (*kernel)(const A&, int), A& a, const char* what) {
  BadRow bad;
  if constexpr (requires { a.bad; }) a.bad = &bad;
  {
    py::gil_scoped_release no_gil;
    kernel(a, kernel_threads());
  }
  raise_if_bad(bad, a.x.V, what);
}

// ---------------------------------------------------------------------------------------------
// The primitives (kernels/primitives.py states their math and arguments)
// ---------------------------------------------------------------------------------------------

py::tuple logprobs_forward(const Tensor& logits, const Tensor& target, const LogprobsParams& p) {
  LogprobsFwdArgs a{};
  const int64_t n = bind_rows(a, logits, target, "logits");
  a.inv_t = inverse(p.temperature);
  a.ignore_index = p.ignore_index;
  Tensor logp = output_rows(&a.logp, n), lse = output_rows(&a.lse, n);
  Tensor entropy = output_rows(&a.entropy, n, p.with_entropy);
  run(logprobs_forward_kernel, a, "logprobs_forward");
  return py::make_tuple(logp, entropy, lse);
}

// `entropy` and `grad_entropy` are None when entropy was not requested.
void logprobs_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                       const std::optional<Tensor>& entropy, const Tensor& grad_logp,
                       const std::optional<Tensor>& grad_entropy, const LogprobsParams& p,
                       const Tensor& grad) {
  LogprobsBwdArgs a{};
  const int64_t n = bind_rows(a, logits, target, "logits");
  a.inv_t = inverse(p.temperature);
  a.ignore_index = p.ignore_index;
  a.lse = rows_f32(lse, n, "lse");
  a.grad_logp = rows_f32(grad_logp, n, "grad_logp");
  a.grad_entropy = optional_rows_f32(grad_entropy, n, "grad_entropy");
  if (a.grad_entropy) {
    TORCH_CHECK(entropy.has_value(), "entropy is required with grad_entropy");
    a.entropy = rows_f32(*entropy, n, "entropy");
  }
  a.grad = grad_of(grad, logits);
  run(logprobs_backward_kernel, a, "logprobs_backward");
}

py::tuple cross_entropy_forward(const Tensor& logits, const Tensor& target,
                                const std::optional<Tensor>& grad_scale,
                                const CrossEntropyParams& p, const std::optional<Tensor>& grad) {
  CrossEntropyArgs a{};
  const int64_t n = bind_rows(a, logits, target, "logits");
  const double eps = p.label_smoothing;
  a.ignore_index = p.ignore_index;
  a.label_smoothing = static_cast<float>(eps);
  a.one_minus_eps = static_cast<float>(1.0 - eps);
  a.eps_minus_one = static_cast<float>(eps - 1.0);
  a.smoothing_over_v = a.x.V > 0 ? static_cast<float>(eps / static_cast<double>(a.x.V)) : 0.0f;
  a.z_loss = static_cast<float>(p.z_loss);
  a.softcap = static_cast<float>(p.softcap);
  a.logit_scale = static_cast<float>(p.logit_scale);
  if (grad.has_value()) {
    a.grad_scale = grad_scale_of(grad_scale, n, &a.grad_scale_numel);
    a.grad = grad_of(*grad, logits);
  }
  Tensor loss = output_rows(&a.loss, n), lse = output_rows(&a.lse, n);
  run(cross_entropy_forward_kernel, a, "cross_entropy_forward");
  return py::make_tuple(loss, lse);
}

py::tuple grpo_forward(const Tensor& logits, const Tensor& target, const Tensor& advantages,
                       const std::optional<Tensor>& old_logprobs,
                       const std::optional<Tensor>& ref_logprobs, const Tensor& token_weight,
                       const SurrogateParams& p, const std::optional<Tensor>& grad) {
  GrpoArgs a{};
  const int64_t n = bind_rows(a, logits, target, "logits");
  a.inv_t = inverse(p.temperature);
  a.advantages = rows_f32(advantages, n, "advantages");
  a.token_weight = rows_f32(token_weight, n, "token_weight");
  a.old_logprobs = optional_rows_f32(old_logprobs, n, "old_logprobs");
  a.ref_logprobs = optional_rows_f32(ref_logprobs, n, "ref_logprobs");
  TORCH_CHECK_VALUE(!(p.beta > 0) || ref_logprobs.has_value(),
                    "ref_logprobs is required when beta > 0");
  a.ratio_lo = static_cast<float>(1.0 - p.clip_eps_low);
  a.ratio_hi = static_cast<float>(1.0 + p.clip_eps_high);
  a.delta = static_cast<float>(p.delta);
  a.beta = static_cast<float>(p.beta);
  a.kl_ratio_correction = p.kl_ratio_correction;
  if (grad.has_value()) a.grad = grad_of(*grad, logits);
  Tensor logp = output_rows(&a.logp, n), loss = output_rows(&a.loss, n);
  Tensor entropy = output_rows(&a.entropy, n, p.with_entropy);
  run(grpo_forward_kernel, a, "grpo_forward");
  return py::make_tuple(logp, loss, entropy);
}

// The shared part of the distill kernels' arguments: both row views, targets, hyperparameters.
DistillArgs distill_args(const Tensor& student, const Tensor& teacher, const Tensor& target,
                         const DistillParams& p) {
  DistillArgs a{};
  bind_rows(a, student, target, "student");
  a.t = rows_of(teacher);
  TORCH_CHECK(a.t.A == a.x.A && a.t.B == a.x.B && a.t.V == a.x.V,
              "teacher must be an [A, B, V] view of the student's sizes ", student.sizes(),
              ", got ", teacher.sizes());
  a.teacher_dtype = dtype_of(teacher, "teacher");
  a.inv_t = inverse(p.temperature);
  a.ignore_index = p.ignore_index;
  a.forward_kl = p.beta == 0.0;
  a.w_t = static_cast<float>(p.w_t);
  a.w_s = static_cast<float>(p.w_s);
  a.log_w_s = static_cast<float>(p.log_w_s);
  a.log_w_t = static_cast<float>(p.log_w_t);
  a.hard_weight = static_cast<float>(p.hard_weight);
  return a;
}

py::tuple distill_forward(const Tensor& student, const Tensor& teacher, const Tensor& target,
                          const std::optional<Tensor>& grad_scale, const DistillParams& p,
                          const std::optional<Tensor>& grad) {
  DistillArgs a = distill_args(student, teacher, target, p);
  const int64_t n = a.x.rows();
  if (grad.has_value()) {
    a.grad_loss = grad_scale_of(grad_scale, n, &a.grad_loss_numel);
    a.grad = grad_of(*grad, student);
  }
  Tensor loss = output_rows(&a.loss, n), lse_s = output_rows(&a.lse_s, n);
  Tensor lse_t = output_rows(&a.lse_t, n), kl_s = output_rows(&a.kl_s, n);
  Tensor hard_lse = output_rows(&a.hard_lse, n, p.hard_weight > 0);
  run(distill_forward_kernel, a, "distill_forward");
  return py::make_tuple(loss, lse_s, lse_t, kl_s, hard_lse);
}

// `hard_lse` is None without the hard term.
void distill_backward(const Tensor& student, const Tensor& teacher, const Tensor& target,
                      const Tensor& lse_s, const Tensor& lse_t, const Tensor& kl_s,
                      const std::optional<Tensor>& hard_lse, const Tensor& grad_loss,
                      const DistillParams& p, const Tensor& grad) {
  DistillArgs a = distill_args(student, teacher, target, p);
  const int64_t n = a.x.rows();
  a.saved_lse_s = rows_f32(lse_s, n, "student_lse");
  a.saved_lse_t = rows_f32(lse_t, n, "teacher_lse");
  a.saved_kl_s = rows_f32(kl_s, n, "student_kl");
  if (p.hard_weight > 0) {
    TORCH_CHECK(hard_lse.has_value(), "hard_lse is required when hard_weight > 0");
    a.saved_hard_lse = rows_f32(*hard_lse, n, "hard_lse");
  }
  a.grad_loss = rows_f32(grad_loss, n, "grad_loss");
  a.grad_loss_numel = n;
  a.grad = grad_of(grad, student);
  run(distill_backward_kernel, a, "distill_backward");
}

void vocab_shard_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                          const Tensor& alpha, const std::optional<Tensor>& beta,
                          const Tensor& gamma, const std::optional<Tensor>& delta,
                          const ShardGradParams& p, const Tensor& grad) {
  VocabShardArgs a{};
  const int64_t n = bind_rows(a, logits, target, "logits");
  a.inv_t = inverse(p.temperature);
  a.softcap = static_cast<float>(p.softcap);
  a.ignore_index = p.ignore_index;
  a.lse = rows_f32(lse, n, "lse");
  a.alpha = rows_f32(alpha, n, "alpha");
  a.gamma = rows_f32(gamma, n, "gamma");
  a.beta = optional_rows_f32(beta, n, "beta");
  a.delta = optional_rows_f32(delta, n, "delta");
  a.grad = grad_of(grad, logits);
  run(vocab_shard_backward_kernel, a, "vocab_shard_backward");
}

// The sampler's settings into the kernel arguments (both directions).
void bind_sampling(SampledArgs& a, const SampledParams& p) {
  a.temperature = static_cast<float>(p.temperature);  // vLLM divides by a float32 temperature
  a.inv_t = inverse(p.temperature);
  a.ignore_index = p.ignore_index;
  a.top_k = p.top_k;
  a.top_p = p.top_p;
  a.min_p_on = p.min_p > 0;
  a.log_min_p = a.min_p_on ? static_cast<float>(std::log(p.min_p)) : 0.0f;
}

py::tuple sampled_logprobs_forward(const Tensor& logits, const Tensor& target,
                                   const SampledParams& p) {
  SampledArgs a{};
  const int64_t n = bind_rows(a, logits, target, "logits");
  bind_sampling(a, p);
  Tensor logp = output_rows(&a.logp, n), lse_kept = output_rows(&a.lse_kept, n);
  Tensor threshold = output_rows(&a.threshold, n);
  Tensor log_kept_mass = output_rows(&a.log_kept_mass, n);
  Tensor support_size = at::zeros({n}, at::TensorOptions().dtype(at::kLong));
  Tensor in_support = at::zeros({n}, at::TensorOptions().dtype(at::kBool));
  a.support_size = support_size.data_ptr<int64_t>();
  a.in_support = in_support.data_ptr<bool>();
  run(sampled_logprobs_forward_kernel, a, "sampled_logprobs_forward");
  return py::make_tuple(logp, lse_kept, threshold, log_kept_mass, support_size, in_support);
}

void sampled_logprobs_backward(const Tensor& logits, const Tensor& target, const Tensor& lse_kept,
                               const Tensor& threshold, const Tensor& coef,
                               const SampledParams& p, const Tensor& grad) {
  SampledArgs a{};
  const int64_t n = bind_rows(a, logits, target, "logits");
  bind_sampling(a, p);
  a.saved_lse_kept = rows_f32(lse_kept, n, "lse_kept");
  a.saved_threshold = rows_f32(threshold, n, "threshold");
  a.coef = rows_f32(coef, n, "coef");
  a.grad = grad_of(grad, logits);
  run(sampled_logprobs_backward_kernel, a, "sampled_logprobs_backward");
}

// A contiguous [n, K] (or [n] when K < 0) tensor of `type` on the CPU.
void check_support_tensor(const Tensor& t, at::ScalarType type, int64_t n, int64_t K,
                          const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK_TYPE(t.scalar_type() == type, name, " must be ", type, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  if (K < 0) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == n, name, " must have shape [", n, "], got ",
                t.sizes());
  } else {
    TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == K, name, " must have shape [",
                n, ", ", K, "], got ", t.sizes());
  }
}

py::tuple topk_distill_forward(const Tensor& logits, const Tensor& support_ids,
                               const Tensor& teacher, const Tensor& live, const Tensor& counted,
                               const std::optional<Tensor>& grad_scale,
                               const TopkDistillParams& p, const std::optional<Tensor>& grad) {
  TopkDistillArgs a{};
  a.x = rows_of(logits);
  a.dtype = dtype_of(logits, "logits");
  const int64_t n = a.x.rows();
  TORCH_CHECK(support_ids.dim() == 2, "support_ids must have shape [N, K], got ",
              support_ids.sizes());
  const int64_t K = support_ids.size(1);
  check_support_tensor(support_ids, at::kLong, n, K, "support_ids");
  check_support_tensor(teacher, at::kFloat, n, K, "teacher");
  check_support_tensor(live, at::kBool, n, K, "live");
  check_support_tensor(counted, at::kBool, n, -1, "counted");
  a.K = K;
  a.ids = support_ids.data_ptr<int64_t>();
  a.teacher = teacher.data_ptr<float>();
  a.live = live.data_ptr<bool>();
  a.counted = counted.data_ptr<bool>();
  a.objective = p.objective;
  a.tail = p.objective == TopkObjective::TrlJsd && p.tail;
  a.normalize_topk = p.objective == TopkObjective::AxolotlKd && p.normalize_topk;
  a.full_softmax = p.objective == TopkObjective::TrlJsd ? a.tail : !a.normalize_topk;
  a.inv_t = inverse(p.temperature);
  a.t_squared = static_cast<float>(p.temperature * p.temperature);
  a.kind = p.beta == 0.0   ? DivergenceKind::ForwardKl
           : p.beta == 1.0 ? DivergenceKind::ReverseKl
                           : DivergenceKind::Mixture;
  a.beta = static_cast<float>(p.beta);
  a.one_minus_beta = static_cast<float>(1.0 - p.beta);
  const bool verl = p.objective == TopkObjective::VerlForwardKl;
  a.low_on = verl && p.log_prob_min_clamp.has_value();
  a.high_on = verl && p.loss_max_clamp.has_value();
  a.low = a.low_on ? static_cast<float>(*p.log_prob_min_clamp) : 0.0f;
  a.high = a.high_on ? static_cast<float>(*p.loss_max_clamp) : 0.0f;
  if (grad.has_value()) {
    a.grad_loss = grad_scale_of(grad_scale, n, &a.grad_loss_numel);
    a.grad = grad_of(*grad, logits);
  }
  Tensor loss = output_rows(&a.loss, n), row_max = output_rows(&a.row_max, n);
  Tensor sums = output_rows(&a.sums, n);
  Tensor coef = at::zeros({n, K}, at::TensorOptions().dtype(at::kFloat));
  a.coef = coef.data_ptr<float>();
  BadRow bad;
  a.bad = &bad;
  {
    py::gil_scoped_release no_gil;
    topk_distill_forward_kernel(a, kernel_threads());
  }
  const int64_t bad_row = bad.row.load();
  if (bad_row >= 0) {
    throw py::value_error("support_ids out of range in topk_distill_forward: row " +
                          std::to_string(bad_row) + " has live id " + std::to_string(bad.target) +
                          ", expected a value in [0, " + std::to_string(a.x.V) + ")");
  }
  return py::make_tuple(loss, row_max, sums, coef);
}

// row_kth_largest of kernels/cpp/backend.py (csrc/row_topk.cpp): per row of [A, B, V] logits,
// the k-th largest element's value (float32) and index (int64), and with ids [A * B, m] (int64,
// contiguous) whether each is among its row's k largest (bool [A * B, m]; else empty).
py::tuple row_kth_largest(const Tensor& logits, int64_t k, const std::optional<Tensor>& ids) {
  const RowsView x = rows_of(logits);
  const DType dtype = dtype_of(logits, "logits");
  TORCH_CHECK_VALUE(k >= 1 && k <= x.V, "k must be between 1 and the logits' last dimension ",
                    x.V, ", got k = ", k);
  TORCH_CHECK_VALUE(x.V <= (int64_t(1) << 32), "row_kth_largest indexes rows of at most 2^32 "
                    "elements, the logits' last dimension is ", x.V);
  const int64_t n = x.rows();
  if (ids.has_value()) {
    TORCH_CHECK_VALUE(ids->dim() == 2, "ids must have shape [N, m], got ", ids->sizes());
    check_support_tensor(*ids, at::kLong, n, ids->size(1), "ids");
  }
  const int64_t m = ids.has_value() ? ids->size(1) : 0;
  Tensor value = at::zeros({n}, at::TensorOptions().dtype(at::kFloat));
  Tensor index = at::zeros({n}, at::TensorOptions().dtype(at::kLong));
  Tensor in_top = at::zeros({n, m}, at::TensorOptions().dtype(at::kBool));
  BadRow bad;
  {
    py::gil_scoped_release no_gil;
    row_kth_largest_kernel(x, dtype, k, m ? ids->data_ptr<int64_t>() : nullptr, m,
                           value.data_ptr<float>(), index.data_ptr<int64_t>(),
                           in_top.data_ptr<bool>(), &bad, kernel_threads());
  }
  const int64_t bad_row = bad.row.load();
  if (bad_row >= 0) {
    throw py::value_error("ids out of range in row_kth_largest: row " + std::to_string(bad_row) +
                          " has id " + std::to_string(bad.target) + ", expected a value in [0, " +
                          std::to_string(x.V) + ")");
  }
  return py::make_tuple(value, index, in_top);
}

// Elementwise fast_exp / fast_tanh of a float32 tensor, for accuracy tests.
template <float (*F)(float)>
Tensor elementwise(const Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "expected a CPU float32 tensor");
  Tensor in = x.contiguous();
  Tensor out = at::empty_like(in);
  const float* src = in.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < in.numel(); ++i) dst[i] = F(src[i]);
  return out;
}

float exp_fn(float x) { return fast_exp(x); }
float tanh_fn(float x) { return fast_tanh(x); }
float log_fn(float x) { return log_with_offset(x, 0); }

Isa parse_isa(const std::string& name) {
  if (name == "avx512") return Isa::Avx512;
  if (name == "avx2") return Isa::Avx2;
  if (name == "generic") return Isa::Generic;
  throw py::value_error("isa must be 'generic', 'avx2' or 'avx512', got '" + name + "'");
}

// The gradient cache (kernels/memory.py) leases a block through a storage whose data pointer's
// deleter gives the block back. Resizable with torch's CPU allocator, as torch.empty's storage
// is, a resize allocates the new bytes there, copies what fits and destroys the old data
// pointer: the block goes back to the cache and the storage owns torch memory from then on.
void make_storage_resizable(const Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "make_storage_resizable: t must be a CPU tensor, got ",
              t.device());
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_allocator(at::getCPUAllocator());
  storage->set_resizable(true);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "astrai_kernels cpp backend: fused log-softmax-gather kernels for CPU tensors";
  // the primitives, each with the Backend protocol's arguments (tensors, params, grad)
  m.def("logprobs_forward", &logprobs_forward);
  m.def("logprobs_backward", &logprobs_backward);
  m.def("cross_entropy_forward", &cross_entropy_forward);
  m.def("grpo_forward", &grpo_forward);
  m.def("distill_forward", &distill_forward);
  m.def("distill_backward", &distill_backward);
  m.def("vocab_shard_backward", &vocab_shard_backward);
  m.def("sampled_logprobs_forward", &sampled_logprobs_forward);
  m.def("sampled_logprobs_backward", &sampled_logprobs_backward);
  m.def("topk_distill_forward", &topk_distill_forward);
  m.def("row_kth_largest", &row_kth_largest, py::arg("logits"), py::arg("k"),
        py::arg("ids") = py::none(),
        "Per row of [A, B, V] logits, the k-th largest element's (value, index), and whether "
        "each of ids [N, m] is among the k largest.");
  m.def("make_storage_resizable", &make_storage_resizable, py::arg("t"),
        "Make t's storage (a fresh gradient-cache lease) resizable with torch's CPU allocator.");
  m.attr("LOG_RATIO_CLAMP") = kLogRatioClamp;  // held equal to kernels/primitives.py's by a test
  m.attr("TOPK_TAIL_LOG_SUM_MAX") = kTopkTailLogSumMax;  // and this to reference.py's
  m.def("_log", &elementwise<log_fn>, "log_with_offset(x, 0) elementwise (for tests)");
  m.def("_fast_exp", &elementwise<exp_fn>, "fast_exp elementwise (for tests)");
  m.def("_fast_tanh", &elementwise<tanh_fn>, "fast_tanh elementwise (for tests)");
  m.def("_set_keep_exps", [](bool on) { return keep_exps_enabled().exchange(on); },
        py::arg("on"),
        "Whether CE / GRPO keep their first pass's exps for the gradient (for tests); returns "
        "the previous setting.");
  m.def("isa", []() { return std::string(isa_name(active_isa())); },
        "The instruction set the kernels run with now.");
  m.def("detected_isa", []() { return std::string(isa_name(detected_isa())); },
        "The best instruction set this CPU supports among those compiled in.");
  m.def("set_isa", [](const std::string& name) {
          const std::string previous = isa_name(active_isa());
          set_active_isa(parse_isa(name));
          return previous;
        },
        py::arg("name"),
        "Use instruction set `name` (capped at the detected one); returns the previous one.");
}
