// Python bindings of the cpp backend: unpack tensors into the torch-free kernel arguments of
// common.h, allocate the per-row outputs, run the kernels without the GIL.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <optional>
#include <string>

#include "common.h"

namespace py = pybind11;
using at::Tensor;

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

Tensor new_rows(int64_t n) { return at::zeros({n}, at::TensorOptions().dtype(at::kFloat)); }

void raise_if_bad(const BadRow& bad, int64_t vocab, const char* what) {
  const int64_t row = bad.row.load();
  if (row >= 0) {
    throw py::value_error(std::string("target out of range in ") + what + ": row " +
                          std::to_string(row) + " has target " + std::to_string(bad.target) +
                          ", expected a value in [0, " + std::to_string(vocab) +
                          ") or the ignore index");
  }
}

py::tuple logprobs_forward(const Tensor& logits, const Tensor& target, double temperature,
                           int64_t ignore_index, bool with_entropy) {
  TORCH_CHECK(temperature > 0, "temperature must be > 0, got ", temperature);
  LogprobsFwdArgs a{};
  a.x = rows_of(logits);
  a.dtype = dtype_of(logits, "logits");
  const int64_t n = a.x.rows();
  a.y = targets_of(target, n);
  a.inv_t = static_cast<float>(1.0 / temperature);
  a.ignore_index = ignore_index;
  Tensor logp = new_rows(n), lse = new_rows(n);
  Tensor entropy = with_entropy ? new_rows(n) : new_rows(0);
  a.logp = logp.data_ptr<float>();
  a.lse = lse.data_ptr<float>();
  a.entropy = with_entropy ? entropy.data_ptr<float>() : nullptr;
  BadRow bad;
  a.bad = &bad;
  {
    py::gil_scoped_release no_gil;
    logprobs_forward_kernel(a, kernel_threads());
  }
  raise_if_bad(bad, a.x.V, "logprobs_forward");
  return py::make_tuple(logp, entropy, lse);
}

void logprobs_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                       const Tensor& entropy, const Tensor& grad_logp,
                       const Tensor& grad_entropy, double temperature, int64_t ignore_index,
                       const Tensor& grad) {
  TORCH_CHECK(temperature > 0, "temperature must be > 0, got ", temperature);
  LogprobsBwdArgs a{};
  a.x = rows_of(logits);
  a.dtype = dtype_of(logits, "logits");
  const int64_t n = a.x.rows();
  a.y = targets_of(target, n);
  a.inv_t = static_cast<float>(1.0 / temperature);
  a.ignore_index = ignore_index;
  a.lse = rows_f32(lse, n, "lse");
  a.grad_logp = rows_f32(grad_logp, n, "grad_logp");
  const bool with_entropy = grad_entropy.numel() > 0;
  if (with_entropy) {
    a.grad_entropy = rows_f32(grad_entropy, n, "grad_entropy");
    a.entropy = rows_f32(entropy, n, "entropy");
  }
  a.grad = grad_of(grad, logits);
  BadRow bad;
  a.bad = &bad;
  {
    py::gil_scoped_release no_gil;
    logprobs_backward_kernel(a, kernel_threads());
  }
  raise_if_bad(bad, a.x.V, "logprobs_backward");
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

py::tuple cross_entropy_forward(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                                double label_smoothing, double z_loss, double softcap,
                                double logit_scale, const std::optional<Tensor>& grad_scale,
                                const std::optional<Tensor>& grad) {
  CrossEntropyArgs a{};
  a.x = rows_of(logits);
  a.dtype = dtype_of(logits, "logits");
  const int64_t n = a.x.rows();
  a.y = targets_of(target, n);
  a.ignore_index = ignore_index;
  a.label_smoothing = static_cast<float>(label_smoothing);
  a.one_minus_eps = static_cast<float>(1.0 - label_smoothing);
  a.eps_minus_one = static_cast<float>(label_smoothing - 1.0);
  a.smoothing_over_v =
      a.x.V > 0 ? static_cast<float>(label_smoothing / static_cast<double>(a.x.V)) : 0.0f;
  a.z_loss = static_cast<float>(z_loss);
  a.softcap = static_cast<float>(softcap);
  a.logit_scale = static_cast<float>(logit_scale);
  if (grad.has_value()) {
    a.grad_scale = grad_scale_of(grad_scale, n, &a.grad_scale_numel);
    a.grad = grad_of(*grad, logits);
  }
  Tensor loss = new_rows(n), lse = new_rows(n);
  a.loss = loss.data_ptr<float>();
  a.lse = lse.data_ptr<float>();
  BadRow bad;
  a.bad = &bad;
  {
    py::gil_scoped_release no_gil;
    cross_entropy_forward_kernel(a, kernel_threads());
  }
  raise_if_bad(bad, a.x.V, "cross_entropy_forward");
  return py::make_tuple(loss, lse);
}

py::tuple grpo_forward(const Tensor& logits, const Tensor& target, double temperature,
                       const Tensor& advantages, const std::optional<Tensor>& old_logprobs,
                       const std::optional<Tensor>& ref_logprobs, const Tensor& token_weight,
                       double clip_low, double clip_high, double delta, double beta,
                       bool kl_ratio_correction, bool with_entropy,
                       const std::optional<Tensor>& grad) {
  TORCH_CHECK(temperature > 0, "temperature must be > 0, got ", temperature);
  GrpoArgs a{};
  a.x = rows_of(logits);
  a.dtype = dtype_of(logits, "logits");
  const int64_t n = a.x.rows();
  a.y = targets_of(target, n);
  a.inv_t = static_cast<float>(1.0 / temperature);
  a.advantages = rows_f32(advantages, n, "advantages");
  a.token_weight = rows_f32(token_weight, n, "token_weight");
  if (old_logprobs.has_value()) a.old_logprobs = rows_f32(*old_logprobs, n, "old_logprobs");
  if (ref_logprobs.has_value()) a.ref_logprobs = rows_f32(*ref_logprobs, n, "ref_logprobs");
  TORCH_CHECK_VALUE(!(beta > 0) || ref_logprobs.has_value(),
                    "ref_logprobs is required when beta > 0");
  a.ratio_lo = static_cast<float>(1.0 - clip_low);
  a.ratio_hi = static_cast<float>(1.0 + clip_high);
  a.delta = static_cast<float>(delta);
  a.beta = static_cast<float>(beta);
  a.kl_ratio_correction = kl_ratio_correction;
  if (grad.has_value()) a.grad = grad_of(*grad, logits);
  Tensor logp = new_rows(n), loss = new_rows(n);
  Tensor entropy = with_entropy ? new_rows(n) : new_rows(0);
  a.logp = logp.data_ptr<float>();
  a.loss = loss.data_ptr<float>();
  a.entropy = with_entropy ? entropy.data_ptr<float>() : nullptr;
  BadRow bad;
  a.bad = &bad;
  {
    py::gil_scoped_release no_gil;
    grpo_forward_kernel(a, kernel_threads());
  }
  raise_if_bad(bad, a.x.V, "grpo_forward");
  return py::make_tuple(logp, loss, entropy);
}

void vocab_shard_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                          const Tensor& alpha, const std::optional<Tensor>& beta,
                          const Tensor& gamma, const std::optional<Tensor>& delta,
                          double temperature, double softcap, int64_t ignore_index,
                          const Tensor& grad) {
  TORCH_CHECK(temperature > 0, "temperature must be > 0, got ", temperature);
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: off), got ", softcap);
  VocabShardArgs a{};
  a.x = rows_of(logits);
  a.dtype = dtype_of(logits, "logits");
  const int64_t n = a.x.rows();
  a.y = targets_of(target, n);
  a.inv_t = static_cast<float>(1.0 / temperature);
  a.softcap = static_cast<float>(softcap);
  a.ignore_index = ignore_index;
  a.lse = rows_f32(lse, n, "lse");
  a.alpha = rows_f32(alpha, n, "alpha");
  a.gamma = rows_f32(gamma, n, "gamma");
  if (beta.has_value()) a.beta = rows_f32(*beta, n, "beta");
  if (delta.has_value()) a.delta = rows_f32(*delta, n, "delta");
  a.grad = grad_of(grad, logits);
  py::gil_scoped_release no_gil;
  vocab_shard_backward_kernel(a, kernel_threads());
}

// The shared part of the distill kernels' arguments: both row views, targets, hyperparameters.
DistillArgs distill_args(const Tensor& student, const Tensor& teacher, const Tensor& target,
                         int64_t ignore_index, double beta, double temperature,
                         double hard_weight) {
  TORCH_CHECK(temperature > 0, "temperature must be > 0, got ", temperature);
  TORCH_CHECK(beta >= 0 && beta <= 1, "beta must be in [0, 1], got ", beta);
  DistillArgs a{};
  a.x = rows_of(student);
  a.t = rows_of(teacher);
  TORCH_CHECK(a.t.A == a.x.A && a.t.B == a.x.B && a.t.V == a.x.V,
              "teacher must be an [A, B, V] view of the student's sizes ", student.sizes(),
              ", got ", teacher.sizes());
  a.dtype = dtype_of(student, "student");
  a.teacher_dtype = dtype_of(teacher, "teacher");
  a.y = targets_of(target, a.x.rows());
  a.inv_t = static_cast<float>(1.0 / temperature);
  a.ignore_index = ignore_index;
  a.forward_kl = beta == 0.0;
  if (beta == 1.0) {  // reverse KL: m = b
    a.w_t = 0.0f;
    a.w_s = 1.0f;
    a.log_w_s = -kInf;
    a.log_w_t = 0.0f;
  } else if (beta > 0.0) {
    a.w_t = static_cast<float>(beta);
    a.w_s = static_cast<float>(1.0 - beta);
    a.log_w_s = static_cast<float>(std::log1p(-beta));
    a.log_w_t = static_cast<float>(std::log(beta));
  }
  a.hard_weight = static_cast<float>(hard_weight);
  return a;
}

py::tuple distill_forward(const Tensor& student, const Tensor& teacher, const Tensor& target,
                          int64_t ignore_index, double beta, double temperature,
                          double hard_weight, const std::optional<Tensor>& grad_scale,
                          const std::optional<Tensor>& grad) {
  DistillArgs a = distill_args(student, teacher, target, ignore_index, beta, temperature,
                               hard_weight);
  const int64_t n = a.x.rows();
  if (grad.has_value()) {
    a.grad_loss = grad_scale_of(grad_scale, n, &a.grad_loss_numel);
    a.grad = grad_of(*grad, student);
  }
  Tensor loss = new_rows(n), lse_s = new_rows(n), lse_t = new_rows(n), kl_s = new_rows(n);
  Tensor hard_lse = new_rows(hard_weight > 0 ? n : 0);
  a.loss = loss.data_ptr<float>();
  a.lse_s = lse_s.data_ptr<float>();
  a.lse_t = lse_t.data_ptr<float>();
  a.kl_s = kl_s.data_ptr<float>();
  a.hard_lse = hard_weight > 0 ? hard_lse.data_ptr<float>() : nullptr;
  BadRow bad;
  a.bad = &bad;
  {
    py::gil_scoped_release no_gil;
    distill_forward_kernel(a, kernel_threads());
  }
  raise_if_bad(bad, a.x.V, "distill_forward");
  return py::make_tuple(loss, lse_s, lse_t, kl_s, hard_lse);
}

void distill_backward(const Tensor& student, const Tensor& teacher, const Tensor& target,
                      int64_t ignore_index, double beta, double temperature, double hard_weight,
                      const Tensor& lse_s, const Tensor& lse_t, const Tensor& kl_s,
                      const Tensor& hard_lse, const Tensor& grad_loss, const Tensor& grad) {
  DistillArgs a = distill_args(student, teacher, target, ignore_index, beta, temperature,
                               hard_weight);
  const int64_t n = a.x.rows();
  a.saved_lse_s = rows_f32(lse_s, n, "student_lse");
  a.saved_lse_t = rows_f32(lse_t, n, "teacher_lse");
  a.saved_kl_s = rows_f32(kl_s, n, "student_kl");
  if (hard_weight > 0) a.saved_hard_lse = rows_f32(hard_lse, n, "hard_lse");
  a.grad_loss = rows_f32(grad_loss, n, "grad_loss");
  a.grad_loss_numel = n;
  a.grad = grad_of(grad, student);
  BadRow bad;
  a.bad = &bad;
  {
    py::gil_scoped_release no_gil;
    distill_backward_kernel(a, kernel_threads());
  }
  raise_if_bad(bad, a.x.V, "distill_backward");
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "astrai_kernels cpp backend: fused log-softmax-gather kernels for CPU tensors";
  m.def("logprobs_forward", &logprobs_forward, py::arg("logits"), py::arg("target"),
        py::arg("temperature"), py::arg("ignore_index"), py::arg("with_entropy"));
  m.def("logprobs_backward", &logprobs_backward, py::arg("logits"), py::arg("target"),
        py::arg("lse"), py::arg("entropy"), py::arg("grad_logp"), py::arg("grad_entropy"),
        py::arg("temperature"), py::arg("ignore_index"), py::arg("grad"));
  m.def("cross_entropy_forward", &cross_entropy_forward, py::arg("logits"), py::arg("target"),
        py::arg("ignore_index"), py::arg("label_smoothing"), py::arg("z_loss"),
        py::arg("softcap"), py::arg("logit_scale"), py::arg("grad_scale"), py::arg("grad"));
  m.def("grpo_forward", &grpo_forward, py::arg("logits"), py::arg("target"),
        py::arg("temperature"), py::arg("advantages"), py::arg("old_logprobs"),
        py::arg("ref_logprobs"), py::arg("token_weight"), py::arg("clip_low"),
        py::arg("clip_high"), py::arg("delta"), py::arg("beta"),
        py::arg("kl_ratio_correction"), py::arg("with_entropy"), py::arg("grad"));
  m.def("distill_forward", &distill_forward, py::arg("student"), py::arg("teacher"),
        py::arg("target"), py::arg("ignore_index"), py::arg("beta"), py::arg("temperature"),
        py::arg("hard_weight"), py::arg("grad_scale"), py::arg("grad"));
  m.def("distill_backward", &distill_backward, py::arg("student"), py::arg("teacher"),
        py::arg("target"), py::arg("ignore_index"), py::arg("beta"), py::arg("temperature"),
        py::arg("hard_weight"), py::arg("student_lse"), py::arg("teacher_lse"),
        py::arg("student_kl"), py::arg("hard_lse"), py::arg("grad_loss"), py::arg("grad"));
  m.def("vocab_shard_backward", &vocab_shard_backward, py::arg("logits"), py::arg("target"),
        py::arg("lse"), py::arg("alpha"), py::arg("beta"), py::arg("gamma"), py::arg("delta"),
        py::arg("temperature"), py::arg("softcap"), py::arg("ignore_index"), py::arg("grad"));
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
