"""What is benchmarked: the ops, the methods (backends and baselines), one :class:`Case` per
point, and the default point sets of ``astrai-kernels bench``.

A *case* is one (op, method, rows N, vocabulary V, hidden size H, dtype, device). The logits ops
(``token_logprobs``, ``cross_entropy``, ``grpo``, ``distill``, ``token_logprobs_sampling``: token
log-probs under :data:`BENCH_SAMPLING`, ``topk_distill``: ``topk_distill_loss`` against a
teacher's top :data:`TOPK_DISTILL_K`) take ``[N, V]`` logits; the fused-LM-head ops
(``linear_cross_entropy``, ``linear_token_logprobs``, ``linear_token_logprobs_entropy``,
``linear_grpo``, ``linear_distill``) take hidden states ``[N, H]`` and an LM head ``[V, H]``
(distillation: the teacher's too) and never hold the logits. ``method`` is a kernel backend of
this package (``NAME:inplace`` for ``inplace_backward=True``) or a baseline (:data:`BASELINES`).
"""

import json
from dataclasses import asdict, dataclass

LOGITS_OPS = ("token_logprobs", "cross_entropy", "grpo", "distill", "token_logprobs_sampling",
              "topk_distill")
LINEAR_OPS = ("linear_cross_entropy", "linear_token_logprobs", "linear_token_logprobs_entropy",
              "linear_grpo", "linear_distill")
TENSOR_OPS = LOGITS_OPS + LINEAR_OPS  # the ops measured case by case (strategies are not)
OPS = TENSOR_OPS + ("strategies",)
# `astrai-kernels bench` without --ops (`make bench`): the RL ops' naive baselines take seconds
# a call, so they run when named (and in `bench --check`)
DEFAULT_OPS = tuple(op for op in OPS if op not in ("token_logprobs_sampling", "topk_distill"))
INPLACE_OPS = ("token_logprobs", "cross_entropy")
# issue 33's sampler: vLLM's temperature, then top_k, then top_p on the renormalised top-k
BENCH_SAMPLING = {"temperature": 0.8, "top_k": 50, "top_p": 0.9}
# token_logprobs_sampling's samplers by a Case's `sampler` name: (settings, the logits' scale on
# randn rows). "" is issue 33's headline; the tails of issue 42: top_p alone on flat rows (about
# 27k of 32k tokens kept at V = 32768) and a large top_k, far above the kernel's group count.
BENCH_SAMPLERS = {
    "": (BENCH_SAMPLING, 1.0),
    "top_p_flat": ({"temperature": 0.8, "top_p": 0.9}, 0.3),
    "top_k_5000": ({"temperature": 0.8, "top_k": 5000}, 1.0),
}
TOPK_DISTILL_K = 64
# an op that is another op plus an option -> that other op ("against plain" in bench --check)
PLAIN_OP = {"token_logprobs_sampling": "token_logprobs"}
INPLACE_SUFFIX = ":inplace"

KERNEL_BACKENDS = ("triton", "cpp", "torch", "reference")
# naive: the seed's math on materialized logits; compile: torch.compile of it (logits ops);
# gemm: the matmuls a fused LM head must do, the floor of the linear ops; torch_lce(_chunked):
# torch.nn.functional.linear_cross_entropy without / with LinearCrossEntropyOptions().
BASELINES = ("naive", "compile", "gemm", "torch_lce", "torch_lce_chunked")
LOGITS_BASELINES = ("naive", "compile")
LINEAR_BASELINES = ("naive", "gemm", "torch_lce", "torch_lce_chunked")
# torch's op gives a loss or per-token log-probs: no entropy, no GRPO step, no distillation
TORCH_LCE_BASELINES = ("torch_lce", "torch_lce_chunked")
METHOD_NOTES = {
    "naive": "the seed's path: log_softmax(logits.float()).gather (token log-probs), "
             "F.cross_entropy(logits.float(), y), the seed's GRPO loss on three "
             "log_softmax-gathers, TRL's generalized_jsd_loss on the student's and the "
             "teacher's float logits (distill), vLLM's sort + cumsum top-k/top-p mask, then "
             "log_softmax + gather (token_logprobs_sampling), reference.topk_distill_loss on "
             "the float logits (topk_distill); for the linear ops F.linear(hidden, weight) "
             "first (token log-probs with entropy: -(p * log p).sum(-1) of the same fp32 "
             "log-softmax)",
    "compile": "torch.compile of the naive function (compiled in the warm-up)",
    "gemm": "the linear ops' floor: hidden @ weight.T, dlogits @ weight, dlogits.T @ hidden at "
            "the case's shapes and dtype into preallocated outputs (linear_grpo: also one "
            "forward matmul each for the old and the reference model; linear_distill: also "
            "the teacher's)",
    "torch_lce": "torch.nn.functional.linear_cross_entropy(options=None), its reference path "
                 "(token log-probs: minus its reduction='none' result)",
    "torch_lce_chunked": "torch.nn.functional.linear_cross_entropy(options="
                         "torch.nn.LinearCrossEntropyOptions()), its chunked path",
    "copy": "same-run dst.copy_(logits), the median of copies between the timed calls into a "
            "buffer allocated and first touched as the gradient cache's: 2 S bytes",
}

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16",
                 "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16"}
# x S bytes (logits ops); distill reads the student's and the teacher's logits, writes one grad;
# topk_distill reads the student's (the teacher's [N, K] log-probs are negligible)
FLOOR_FACTOR = {"token_logprobs": 2, "cross_entropy": 2, "grpo": 4, "distill": 3,
                "token_logprobs_sampling": 2, "topk_distill": 2}
# linear_grpo: + the old and the reference model's forward; linear_distill: + the teacher's
GEMM_COUNT = {"linear_cross_entropy": 3, "linear_token_logprobs": 3,
              "linear_token_logprobs_entropy": 3, "linear_grpo": 5, "linear_distill": 4}
GRPO_OPS = ("grpo", "linear_grpo")
GRPO_BATCH = 8  # the GRPO step's B; T = rows / B (B=8, T=512 at N=4096)
GRPO_CLIP_EPS = 0.2
GRPO_KL_COEF = 0.01
# issue 13's memory bound of a fused LM head, on top of its gradients and an fp32 weight-sized
# accumulator
LINEAR_WORKSPACE_BOUND = 96 * 2**20

# The CPU defaults of `astrai-kernels bench` (what `make bench` runs), sized so that the whole
# run ends within 10 minutes on a 2-core machine: the logits ops at N = 4096, token_logprobs
# with more vocabulary sizes for the plot; linear_cross_entropy at issue 13's headline
# N = 2048, H = 1024, V = 32768 and at V = 8192 for the curve; linear_token_logprobs and
# linear_token_logprobs_entropy, linear_grpo (B = 8, T = 256) and linear_distill at N = 2048,
# H = 1024, V = 8192 (the headline GEMMs take ~10 s a call here, and the GRPO step does five of
# them). The linear ops run in fp32 only by default
# on CPU: on a CPU without native bf16 matmul (AVX2) a bf16 GEMM runs 6-70x slower than fp32
# (0.4-5 GFLOP/s here), so the bf16 GEMM floor alone at the headline shape takes minutes; pass
# --dtype bf16 to run it. A linear case times one call after its warm-up by default (each
# takes seconds at the headline; --min-repeats overrides). Run order (suite.run_benchmarks):
# every op's largest V first, then the strategies' steps, then torch.compile at the largest V,
# then the smaller V; the deadline below skips whatever is left.
CPU_DEFAULT_ROWS = {"token_logprobs": (4096,), "cross_entropy": (4096,), "grpo": (4096,),
                    "distill": (2048,), "token_logprobs_sampling": (4096,),
                    "topk_distill": (4096,),
                    "linear_cross_entropy": (2048,), "linear_token_logprobs": (2048,),
                    "linear_token_logprobs_entropy": (2048,), "linear_grpo": (2048,),
                    "linear_distill": (2048,)}
CPU_DEFAULT_VOCABS = {"token_logprobs": (4096, 8192, 16384, 32768),
                      "cross_entropy": (8192, 32768), "grpo": (32768,), "distill": (32768,),
                      "token_logprobs_sampling": (32768,), "topk_distill": (32768,),
                      "linear_cross_entropy": (8192, 32768), "linear_token_logprobs": (8192,),
                      "linear_token_logprobs_entropy": (8192,), "linear_grpo": (8192,),
                      "linear_distill": (8192,), "strategies": (32768,)}
DEFAULT_MIN_REPEATS = {op: 1 if op in LINEAR_OPS else 2 for op in TENSOR_OPS}
CPU_DEFAULT_DTYPES = {"token_logprobs": ("fp32", "bf16"), "cross_entropy": ("fp32", "bf16"),
                      "grpo": ("fp32", "bf16"), "distill": ("fp32",),
                      "token_logprobs_sampling": ("fp32", "bf16"), "topk_distill": ("fp32", "bf16"),
                      "linear_cross_entropy": ("fp32",),
                      "linear_token_logprobs": ("fp32",),
                      "linear_token_logprobs_entropy": ("fp32",), "linear_grpo": ("fp32",),
                      "linear_distill": ("fp32",)}
DEFAULT_HIDDEN = 1024
CPU_DEFAULT_DEADLINE_S = 510.0  # no case starts later: `make bench` ends within 10 minutes
STRATEGY_RESERVE_S = 150.0  # the strategies' block starts only with this much time left
# Gemma 3's vocabulary on CPU (issue 42), run by default after the strategies' steps: the logits
# ops at N = 512 (the bytes of the N = 4096, V = 32768 headline) and the fused head in bf16 at
# N = 2048, H = 1024 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX: elsewhere the
# bf16 GEMM floor alone takes minutes); the kernel backend and its floor only.
CPU_LARGE_VOCAB = 262144
CPU_LARGE_VOCAB_CASES = {"token_logprobs": (512, ("fp32", "bf16")),
                         "cross_entropy": (512, ("fp32", "bf16")),
                         "linear_cross_entropy": (2048, ("bf16",)),
                         "linear_token_logprobs_entropy": (2048, ("bf16",))}
BF16_MATMUL_FLAGS = ("avx512_bf16", "amx_bf16")
GPU_DEFAULT_ROWS = 8192
GPU_DEFAULT_VOCABS = (32768, 131072, 262144)
GPU_DEFAULT_DTYPES = ("fp32", "bf16")


def split_method(method):
    """``(name, inplace)`` of a method: ``"cpp:inplace"`` is the cpp backend with
    ``inplace_backward=True`` (the gradient written over the logits; no fresh buffer)."""
    name, inplace = method, False
    if method.endswith(INPLACE_SUFFIX):
        name, inplace = method[:-len(INPLACE_SUFFIX)], True
    if name not in BASELINES + KERNEL_BACKENDS or (inplace and name in BASELINES):
        raise ValueError(f"method must be a backend {KERNEL_BACKENDS} (optionally with "
                         f"{INPLACE_SUFFIX!r}) or one of {BASELINES}, got {method!r}")
    return name, inplace


def method_applies(op, method):
    """Whether ``method`` is measured for ``op`` (each baseline belongs to its op family,
    ``:inplace`` to the ops with ``inplace_backward``)."""
    name, inplace = split_method(method)
    if inplace:
        return op in INPLACE_OPS
    if name in TORCH_LCE_BASELINES:
        return op in ("linear_cross_entropy", "linear_token_logprobs")
    if name in BASELINES:
        return name in (LINEAR_BASELINES if op in LINEAR_OPS else LOGITS_BASELINES)
    return True


def unavailable_baselines():
    """``{baseline: why}`` for the baselines this torch cannot run."""
    import torch
    import torch.nn.functional as F

    missing = {}
    if not hasattr(F, "linear_cross_entropy"):
        why = f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy"
        missing.update({"torch_lce": why, "torch_lce_chunked": why})
    elif not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        missing["torch_lce_chunked"] = (f"torch {torch.__version__} has no "
                                        "torch.nn.LinearCrossEntropyOptions")
    return missing


def normalize_dtype(name):
    try:
        return DTYPE_ALIASES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def torch_dtype(name):
    import torch

    return getattr(torch, DTYPES[normalize_dtype(name)])


@dataclass(frozen=True)
class Case:
    op: str
    method: str
    rows: int
    vocab: int
    dtype: str = "fp32"
    device: str = "cpu"
    repeats: int = 5
    min_repeats: int = 2
    budget_s: float = 4.0
    threads: int = 0
    seed: int = 0
    hidden: int = 0  # H of the linear ops (0 for the logits ops)
    sampler: str = ""  # token_logprobs_sampling's sampler, a BENCH_SAMPLERS name

    def to_json(self):
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text):
        return cls(**json.loads(text))

    def label(self):
        hidden = f" H={self.hidden}" if self.op in LINEAR_OPS else ""
        sampler = f" {self.sampler}" if self.sampler else ""
        return (f"{self.op}{sampler} {self.method} {self.dtype} N={self.rows}{hidden} "
                f"V={self.vocab}")


def plan_cases(ops, rows, vocabs, dtypes, methods, device, repeats, min_repeats, budget_s,
               threads=0, hidden=(DEFAULT_HIDDEN,)):
    """The cases of ``ops``: for each op, dtype, rows, hidden size (linear ops), vocabulary,
    every method that applies to it. ``rows``, ``vocabs``, ``dtypes`` and ``min_repeats`` map
    op -> value (or are one value for every op)."""
    def for_op(values, op):
        return values[op] if isinstance(values, dict) else values

    cases = []
    for op in ops:
        if op not in TENSOR_OPS:
            continue
        hidden_sizes = hidden if op in LINEAR_OPS else (0,)
        for dtype in for_op(dtypes, op):
            for n in for_op(rows, op):
                for h in hidden_sizes:
                    for vocab in for_op(vocabs, op):
                        cases.extend(Case(op, method, n, vocab, dtype, device, repeats,
                                          for_op(min_repeats, op), budget_s, threads, hidden=h)
                                     for method in methods if method_applies(op, method))
    return cases


def native_bf16_matmul(cpu_flags=None):
    """Whether this CPU multiplies bf16 natively (a ``BF16_MATMUL_FLAGS`` flag in
    ``/proc/cpuinfo``, or in ``cpu_flags``); False where that cannot be read."""
    if cpu_flags is None:
        try:
            with open("/proc/cpuinfo") as cpuinfo:
                line = next((line for line in cpuinfo if line.startswith("flags")), "")
        except OSError:
            return False
        cpu_flags = line.split(":", 1)[-1].split()
    return any(flag in cpu_flags for flag in BF16_MATMUL_FLAGS)


def plan_large_vocab_cases(ops, backend, repeats, min_repeats, budget_s, threads=0,
                           hidden=DEFAULT_HIDDEN, cpu_flags=None):
    """The CPU cases of :data:`CPU_LARGE_VOCAB_CASES` for the ops in ``ops``: ``backend`` and,
    for the linear ops, their ``gemm`` floor (the logits ops measure their copy floor in the
    same run); the bf16 linear cases only where :func:`native_bf16_matmul`."""
    fast_bf16 = native_bf16_matmul(cpu_flags)
    cases = []
    for op, (rows, dtypes) in CPU_LARGE_VOCAB_CASES.items():
        if op not in ops:
            continue
        linear = op in LINEAR_OPS
        for dtype in dtypes:
            if linear and dtype != "fp32" and not fast_bf16:
                continue
            methods = (backend, "gemm") if linear else (backend,)
            cases.extend(Case(op, method, rows, CPU_LARGE_VOCAB, dtype, "cpu", repeats,
                              min_repeats if isinstance(min_repeats, int) else min_repeats[op],
                              budget_s, threads, hidden=hidden if linear else 0)
                         for method in methods)
    return cases


def is_headline(case, vocabs):
    """Whether ``case`` is at its op's largest vocabulary of the run (run before the others)."""
    sizes = vocabs[case.op] if isinstance(vocabs, dict) else vocabs
    return case.vocab == max(sizes)
