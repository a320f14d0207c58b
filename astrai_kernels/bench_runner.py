"""Benchmark cases, timing, peak memory, JSON and plot: shared by ``astrai-kernels bench`` and
the pytest-benchmark suite in ``bench/``.

A *case* is one (op, method, rows N, vocabulary V, dtype, device). ``method`` is a kernel backend
of this package (``cpp``, ``torch``, ``triton``, ``reference``) or a baseline:

* ``naive``: the seed's path, ``log_softmax(logits.float())`` + ``gather`` (token log-probs),
  ``F.cross_entropy(logits.float(), y)`` (cross-entropy), and for GRPO the seed's step: that
  log-softmax-gather for the policy (with grad) and for the old and reference logits
  (``no_grad``), then the seed's per-token clipped surrogate and KL, masked mean.
* ``compile``: ``torch.compile`` of the naive function (inductor; compiled in the warm-up).

Every case is timed forward + backward (GRPO: policy forward + backward plus the old and ref
forwards, one step). What each op must move (DESIGN.md's model, ``S`` = bytes of one logits
tensor) is its *floor*: ``2 S`` for token log-probs and cross-entropy (read the logits, write the
gradient), ``4 S`` for the GRPO step (also read the old and the reference logits once).

How one case is measured (:func:`measure`, in a process of its own per case, so each peak is
its own: :class:`CaseRunner` forks it from a server that has imported torch and this package once,
or starts a fresh interpreter with ``isolation="subprocess"``):

1. ``torch.set_num_threads(os.cpu_count())`` (or ``threads``); inputs allocated (seeded).
2. One warm-up call (kernel build/load, ``torch.compile``, first-touch allocations).
3. Peak reset: on CPU writing ``5`` to ``/proc/self/clear_refs`` resets the kernel's resident-set
   high-water mark ``VmHWM`` to the current ``VmRSS``, which is read as the baseline; the child
   runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so every large buffer is its own ``mmap`` and is
   returned to the OS when freed (RSS then follows the live tensors). On CUDA,
   ``torch.cuda.reset_peak_memory_stats`` and ``memory_allocated`` as the baseline.
4. ``repeats`` timed calls (``time.perf_counter``, CUDA synchronized), gradients dropped between
   calls (outside the timed region; a fresh gradient is allocated, and first touched, by each
   call as in training). Fewer calls when the timed calls would exceed ``budget_s`` (at least
   ``min_repeats``); ``repeats`` in the result says how many ran. ``median_s`` is their median.
5. ``peak_extra_bytes``: ``VmHWM - baseline`` (CPU) or ``max_memory_allocated - baseline``
   (CUDA) over those calls: everything the op allocates, the gradient included. Where
   ``clear_refs`` is not writable, ``ru_maxrss`` after the warm-up call minus the ``VmRSS``
   before it is used instead (``peak_method`` says which).
6. The same-run copy: ``dst.copy_(logits)`` (CPU; ``logits.clone()`` on CUDA) of the same
   logits tensor in the same process, after one warm-up copy, median of at least
   ``max(repeats, 5)`` copies (more, up to 4x, while they take under 0.5 s): ``2 S`` bytes. On
   CPU it is timed into a plain and into a huge-page ``dst`` and the faster median is the floor
   (``copy_kind`` says which; ``copy_medians_s`` has both), since one copy's speed varies from
   process to process with where its pages lie.
   ``floor_s = copy_s * floor_bytes / (2 S)``; ``ratio_vs_copy = median_s / floor_s``;
   effective bandwidth = ``floor_bytes / median_s``, against the copy's ``2 S / copy_s``.

:func:`run_benchmarks` (what ``astrai-kernels bench`` calls) runs every case but the
``compile`` baseline first, then the strategies' steps (``bench/bench_strategies.py``, when
present), then the ``compile`` cases, each step only while its deadline allows; it rewrites the
JSON after each case and draws the plot at the end.

``python -m astrai_kernels.bench_runner --case '<json>'`` runs one case and prints its result as
the last stdout line, prefixed with ``@@RESULT``; ``--serve`` is the fork server.

On a shared machine, timings carry the other processes' load: every result records
``loadavg`` (and the machine block ``loadavg_at_start``).
"""

import argparse
import ctypes
import functools
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

OPS = ("token_logprobs", "cross_entropy", "grpo", "strategies")
TENSOR_OPS = ("token_logprobs", "cross_entropy", "grpo")
BASELINES = ("naive", "compile")
KERNEL_BACKENDS = ("triton", "cpp", "torch", "reference")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16",
                 "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16"}
FLOOR_FACTOR = {"token_logprobs": 2, "cross_entropy": 2, "grpo": 4}  # x S bytes
GRPO_BATCH = 8  # the GRPO step's B; T = rows / B (B=8, T=512 at the default N=4096)
GRPO_CLIP_EPS = 0.2
GRPO_KL_COEF = 0.01
RESULT_PREFIX = "@@RESULT "
MMAP_THRESHOLD = "65536"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The CPU default of `astrai-kernels bench` (what `make bench` runs): sized to finish within
# 10 minutes on a 2-core machine. token_logprobs gets more vocabulary sizes for the plot.
CPU_DEFAULT_ROWS = 4096
CPU_DEFAULT_VOCABS = {"token_logprobs": (4096, 8192, 16384, 32768),
                      "cross_entropy": (8192, 32768), "grpo": (32768,), "strategies": (32768,)}
CPU_DEFAULT_DEADLINE_S = 510.0  # no case starts later: `make bench` ends within 10 minutes
STRATEGY_RESERVE_S = 150.0  # the strategies' block starts only with this much time left
GPU_DEFAULT_ROWS = 8192
GPU_DEFAULT_VOCABS = (32768, 131072, 262144)


INPLACE_OPS = ("token_logprobs", "cross_entropy")
INPLACE_SUFFIX = ":inplace"


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


def normalize_dtype(name):
    try:
        return DTYPE_ALIASES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


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

    def to_json(self):
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text):
        return cls(**json.loads(text))

    def label(self):
        return f"{self.op} {self.method} {self.dtype} N={self.rows} V={self.vocab}"


# ---------------------------------------------------------------------------------------------
# The workloads: inputs and one forward + backward call per (op, method)


def _torch_dtype(name):
    import torch

    return getattr(torch, DTYPES[normalize_dtype(name)])


def naive_token_logprobs(logits, target):
    """The seed's token log-probs: ``log_softmax(logits.float())`` then ``gather``."""
    import torch

    return torch.log_softmax(logits.float(), dim=-1).gather(
        -1, target.unsqueeze(-1)).squeeze(-1)


def naive_cross_entropy(logits, target):
    """The seed's cross-entropy: ``F.cross_entropy(logits.float(), y)`` on flattened rows."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def naive_grpo_step(policy, old_logits, ref_logits, target, advantages, mask,
                    clip_eps=GRPO_CLIP_EPS, kl_coef=GRPO_KL_COEF):
    """The seed's GRPO loss (seed/strategy.py): three log-softmax-gathers, clipped surrogate,
    KL ``r - log(r + eps) - 1``, masked means. ``advantages [B]``, ``mask [B, T]`` float."""
    import torch

    eps = 1e-8
    logp = naive_token_logprobs(policy, target) * mask
    with torch.no_grad():
        old = naive_token_logprobs(old_logits, target) * mask
        ref = naive_token_logprobs(ref_logits, target) * mask
    adv = advantages.unsqueeze(-1)
    ratio = torch.exp(logp - old)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    per_token = -torch.min(surr1, surr2)
    count = mask.sum().clamp(min=1.0)
    policy_loss = (per_token * mask).sum() / count
    r = torch.exp(ref - logp)
    kl = r - torch.log(r + eps) - 1.0
    return policy_loss + kl_coef * (kl * mask).sum() / count


@dataclass
class Workload:
    """``run()`` is one timed call; ``reset()`` drops the gradients it made."""
    run: object
    leaves: list
    logits: object  # the tensor the copy floor copies (the policy's logits)
    logits_bytes: int
    floor_bytes: int

    pristine: object = None  # a copy of the logits, restored after an in-place backward

    def reset(self):
        import torch

        for leaf in self.leaves:
            leaf.grad = None
        if self.pristine is not None:
            with torch.no_grad():
                self.logits.copy_(self.pristine)


def build_workload(case):
    """Inputs and the call of ``case`` (on ``case.device``)."""
    import torch

    if case.op not in TENSOR_OPS:
        raise ValueError(f"op must be one of {TENSOR_OPS} here, got {case.op!r}")
    device = torch.device(case.device)
    dtype = _torch_dtype(case.dtype)
    gen = torch.Generator(device=device).manual_seed(case.seed)
    rows, vocab = case.rows, case.vocab

    def logits(shape, grad):
        x = torch.randn(*shape, vocab, dtype=dtype, device=device, generator=gen)
        return x.requires_grad_(grad)

    def targets(shape):
        return torch.randint(0, vocab, shape, device=device, generator=gen)

    method, inplace = split_method(case.method)
    if method == "compile":
        compile_fn = torch.compile
    if inplace and case.op not in INPLACE_OPS:
        raise ValueError(f"{case.method!r}: inplace_backward is an option of {INPLACE_OPS} only")

    if case.op in ("token_logprobs", "cross_entropy"):
        x, y = logits((rows,), True), targets((rows,))
        naive = naive_token_logprobs if case.op == "token_logprobs" else naive_cross_entropy
        if method in ("naive", "compile"):
            fn = naive if method == "naive" else compile_fn(naive)

            def run():
                fn(x, y).sum().backward()
        else:
            import astrai_kernels as ak

            op = ak.token_logprobs if case.op == "token_logprobs" else ak.cross_entropy

            def run():
                op(x, y, backend=method, inplace_backward=inplace).sum().backward()
        leaves, policy = [x], x
    else:  # grpo
        if rows % GRPO_BATCH:
            raise ValueError(f"grpo needs rows divisible by B={GRPO_BATCH}, got {rows}")
        shape = (GRPO_BATCH, rows // GRPO_BATCH)
        policy = logits(shape, True)
        old_logits, ref_logits = logits(shape, False), logits(shape, False)
        target = targets(shape)
        rewards = torch.rand(GRPO_BATCH // 4, 4, device=device, generator=gen)
        advantages = ((rewards - rewards.mean(-1, keepdim=True))
                      / (rewards.std(-1, keepdim=True, unbiased=False) + 1e-8)).reshape(-1)
        mask = torch.ones(shape, device=device)
        mask[:, -shape[1] // 8:] = 0.0  # some padding at the end of each response
        if method in ("naive", "compile"):
            fn = naive_grpo_step if method == "naive" else compile_fn(naive_grpo_step)

            def run():
                fn(policy, old_logits, ref_logits, target, advantages, mask).backward()
        else:
            import astrai_kernels as ak

            def run():
                with torch.no_grad():
                    old = ak.token_logprobs(old_logits, target, backend=method)
                    ref = ak.token_logprobs(ref_logits, target, backend=method)
                loss, _ = ak.grpo_loss(policy, target, advantages, mask=mask, old_logprobs=old,
                                       ref_logprobs=ref, beta=GRPO_KL_COEF,
                                       clip_eps_low=GRPO_CLIP_EPS, loss_type="bnpo",
                                       backend=method)
                loss.backward()
        leaves = [policy]
    logits_bytes = policy.numel() * policy.element_size()
    workload = Workload(run, leaves, policy, logits_bytes, FLOOR_FACTOR[case.op] * logits_bytes)
    if inplace:  # the gradient overwrote the logits: restore them (outside the timed call)
        workload.pristine = policy.detach().clone()
    return workload


# ---------------------------------------------------------------------------------------------
# Measuring one case (in this process)


def _status_bytes(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss():
    """Reset VmHWM to the current RSS; False where /proc/self/clear_refs is not writable."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def _malloc_trim():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure(case, with_copy=True):
    """Time and peak memory of one case in this process (see the module doc); a result dict."""
    import torch

    _fixed_mmap_threshold()
    threads = case.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    cuda = torch.device(case.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    workload = build_workload(case)
    if cuda:
        peak_method = "torch.cuda.max_memory_allocated"
        can_reset = True
    else:
        can_reset = _reset_peak_rss()
        peak_method = ("VmHWM after clear_refs, minus VmRSS" if can_reset else
                       "ru_maxrss minus VmRSS over the first (warm-up) call: "
                       "/proc/self/clear_refs not writable")

    def call():
        start = time.perf_counter()
        workload.run()
        sync()
        elapsed = time.perf_counter() - start
        workload.reset()
        return elapsed

    def baseline_now():
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        _malloc_trim()
        _reset_peak_rss()
        return _status_bytes("VmRSS")

    if can_reset:  # warm-up, then the peak over the timed calls
        warmup_s = call()
        baseline = baseline_now()
    else:  # no way to reset the high-water mark: the peak of the first call is measured
        baseline = baseline_now()
        warmup_s = call()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    times = []
    for _ in range(max(1, case.repeats)):
        times.append(call())
        if len(times) >= case.min_repeats and sum(times) + times[-1] > case.budget_s:
            break
    if cuda:
        peak = torch.cuda.max_memory_allocated() - baseline
    elif can_reset:
        peak = _status_bytes("VmHWM") - baseline
    result = {
        **asdict(case),
        **({"baseline": case.method} if case.method in BASELINES else
           {"backend": split_method(case.method)[0],
            "inplace_backward": split_method(case.method)[1]}),
        "median_s": statistics.median(times),
        "min_s": min(times),
        "times_s": times,
        "repeats": len(times),
        "warmup_s": warmup_s,
        "threads": torch.get_num_threads(),
        "logits_bytes": workload.logits_bytes,
        "floor_bytes": workload.floor_bytes,
        "peak_extra_bytes": int(peak),
        "peak_method": peak_method,
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if case.op == "grpo":
        result["grpo_shape"] = [GRPO_BATCH, case.rows // GRPO_BATCH]
    if with_copy:
        result.update(measure_copy(workload.logits, max(5, case.repeats), cuda))
    return result


def measure_copy(logits, repeats=5, cuda=False):
    """``{"copy_s", "copy_kind", "copy_times_s"}``: the same-run copy of ``logits`` (2 S bytes).

    On CPU a ``copy_`` of the same bytes runs at one of two speeds from process to process
    (up to 1.7x apart, by where the kernel placed the destination's pages), so the copy is
    timed into a plain ``empty_like`` and into a huge-page buffer, and the floor is the faster
    median: the ratios are against the best copy this process gets.
    """
    import torch

    src = logits.detach()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def median_time(fn):
        fn()
        sync()
        times = []
        while len(times) < repeats or (len(times) < 4 * repeats and sum(times) < 0.5):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times), times

    if cuda:
        copy_s, times = median_time(src.clone)
        return {"copy_s": copy_s, "copy_kind": "clone", "copy_times_s": times}
    from astrai_kernels.cpu.memory import empty_gradient

    by_kind = {}
    for kind, make_dst in (("copy_", torch.empty_like),
                           ("copy_ to huge pages",
                            lambda x: empty_gradient(x.shape, x.dtype, x.device))):
        by_kind[kind] = median_time(functools.partial(make_dst(src).copy_, src))
    kind = min(by_kind, key=lambda k: by_kind[k][0])
    result = {"copy_s": by_kind[kind][0], "copy_kind": kind, "copy_times_s": by_kind[kind][1],
              "copy_medians_s": {k: v[0] for k, v in by_kind.items()}}
    # A copy into a fresh buffer: what an op that returns a new gradient also pays for the
    # first touch of its pages (the CUDA caching allocator has no such cost).
    clones = []
    for _ in range(max(3, repeats // 2)):
        start = time.perf_counter()
        out = src.clone()
        clones.append(time.perf_counter() - start)
        del out
    result.update({"clone_s": statistics.median(clones), "clone_times_s": clones})
    return result


# ---------------------------------------------------------------------------------------------
# Running cases in subprocesses, derived figures


def child_env():
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _fixed_mmap_threshold():
    """Every allocation above 64 KiB its own mmap (glibc; a fixed threshold is also not raised
    by frees), so freeing a buffer returns its pages and RSS follows the live tensors."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, int(MMAP_THRESHOLD))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def run_case_subprocess(case, timeout=600, with_copy=True):
    """Run ``case`` in a fresh Python interpreter; its result dict (``error`` set on failure)."""
    cmd = [sys.executable, "-m", "astrai_kernels.bench_runner", "--case", case.to_json()]
    if not with_copy:
        cmd.append("--no-copy")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**asdict(case), "error": f"timed out after {timeout} s",
                "wall_s": time.perf_counter() - start}
    wall = time.perf_counter() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
            result["wall_s"] = wall
            result["isolation"] = "subprocess"
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
    return {**asdict(case), "error": f"exit status {proc.returncode}: " + "\n".join(tail),
            "wall_s": wall}


def _read_all(fd, deadline):
    """Everything written to pipe ``fd`` until EOF, or None when ``deadline`` passes first."""
    import select

    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def serve():
    """The fork server: imports torch and this package once, then for each request line on
    stdin (``{"case": ..., "timeout": ..., "with_copy": ...}``) forks a process that measures the
    case, and writes its result on stdout as one ``@@RESULT`` line. The server itself runs no
    torch op (so no thread pool exists when it forks) and never initializes CUDA."""
    import signal
    import tempfile
    import traceback

    import torch

    import astrai_kernels  # noqa: F401  (preloaded for the children)

    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints go to stderr, not into the protocol
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        case = Case.from_json(request["case"])
        start = time.perf_counter()
        if torch.cuda.is_initialized():
            result = {"error": "the fork server initialized CUDA; use isolation='subprocess'"}
        else:
            log_fd, log_path = tempfile.mkstemp(prefix="astrai-bench-", suffix=".log")
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:  # the case process
                os.close(read_fd)
                os.dup2(log_fd, 1)
                os.dup2(log_fd, 2)
                code = 0
                try:
                    payload = json.dumps(measure(case, with_copy=request.get("with_copy", True)))
                except BaseException as exc:
                    traceback.print_exc()
                    payload = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
                    code = 1
                with os.fdopen(write_fd, "w") as out:
                    out.write(payload)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            os.close(write_fd)
            os.close(log_fd)
            data = _read_all(read_fd, time.monotonic() + float(request.get("timeout", 600)))
            os.close(read_fd)
            if data is None:
                os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            with open(log_path, errors="replace") as handle:
                log = handle.read()
            os.unlink(log_path)
            if data is None:
                result = {"error": f"timed out after {request.get('timeout')} s"}
            elif not data:
                result = {"error": f"case process died (wait status {status})"}
            else:
                result = json.loads(data)
            if "error" in result:
                tail = "\n".join(log.strip().splitlines()[-12:])
                result = {**asdict(case), "error": result["error"] + ("\n" + tail if tail else "")}
        result["wall_s"] = time.perf_counter() - start
        result["isolation"] = "forkserver"
        protocol.write(RESULT_PREFIX + json.dumps(result) + "\n")
        protocol.flush()


class CaseRunner:
    """Runs each case in its own process: forked by a fork server that has already imported
    torch and this package (``isolation="forkserver"``: about a second per case instead of an
    interpreter start and the imports), or a fresh interpreter (``"subprocess"``). Either way each
    case process has its own resident-set high-water mark. Use as a context manager or call
    ``close()``."""

    def __init__(self, isolation="forkserver", timeout=600):
        if isolation not in ("forkserver", "subprocess"):
            raise ValueError(f"isolation must be 'forkserver' or 'subprocess', got {isolation!r}")
        if isolation == "forkserver" and not hasattr(os, "fork"):
            isolation = "subprocess"
        self.isolation, self.timeout, self.server = isolation, timeout, None

    def _start_server(self):
        self.server = subprocess.Popen(
            [sys.executable, "-m", "astrai_kernels.bench_runner", "--serve"], env=child_env(),
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._buffer = b""

    def _read_line(self, deadline):
        """One line from the server (None on timeout or EOF)."""
        import select

        fd = self.server.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def run(self, case, with_copy=True):
        """The result dict of ``case`` (``error`` set when it failed)."""
        if self.isolation == "subprocess":
            return run_case_subprocess(case, self.timeout, with_copy)
        if self.server is None or self.server.poll() is not None:
            self._start_server()
        request = {"case": case.to_json(), "timeout": self.timeout, "with_copy": with_copy}
        start = time.perf_counter()
        try:
            self.server.stdin.write((json.dumps(request) + "\n").encode())
            self.server.stdin.flush()
            # The server enforces the timeout; allow for its imports on the first case.
            deadline = time.monotonic() + self.timeout + 180
            while True:
                line = self._read_line(deadline)
                if line is None or line.startswith(RESULT_PREFIX):
                    break
        except OSError as exc:
            line, why = None, f"fork server failed: {exc}"
        else:
            why = "the fork server stopped without an answer"
        if line is not None:
            return json.loads(line[len(RESULT_PREFIX):])
        self.close()
        return {**asdict(case), "error": why, "wall_s": time.perf_counter() - start}

    def close(self):
        if self.server is not None:
            if self.server.poll() is None:
                try:
                    self.server.stdin.close()
                except OSError:
                    pass
                try:
                    self.server.wait(10)
                except subprocess.TimeoutExpired:
                    self.server.kill()
                    self.server.wait()
            self.server = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def add_ratios(results):
    """Fill ``floor_s``, ``ratio_vs_copy/naive/compile``, bandwidths and memory ratios in place."""
    by_shape = {}
    for r in results:
        if "error" not in r and r.get("op") in TENSOR_OPS:
            by_shape[(r["op"], r["rows"], r["vocab"], r["dtype"], r["device"], r["method"])] = r
    for r in results:
        if "error" in r or r.get("op") not in TENSOR_OPS:
            continue
        if r.get("copy_s"):
            r["floor_s"] = r["copy_s"] * r["floor_bytes"] / (2 * r["logits_bytes"])
            r["ratio_vs_copy"] = r["median_s"] / r["floor_s"]
            r["copy_bandwidth_GBps"] = 2 * r["logits_bytes"] / r["copy_s"] / 1e9
            if r.get("clone_s"):
                # the floor plus the first touch of one fresh S-sized buffer (the gradient)
                r["floor_fresh_grad_s"] = r["floor_s"] + max(r["clone_s"] - r["copy_s"], 0.0)
                r["ratio_vs_floor_fresh_grad"] = r["median_s"] / r["floor_fresh_grad_s"]
        r["effective_bandwidth_GBps"] = r["floor_bytes"] / r["median_s"] / 1e9
        if r.get("copy_bandwidth_GBps"):
            r["bandwidth_vs_copy"] = r["effective_bandwidth_GBps"] / r["copy_bandwidth_GBps"]
        for base in BASELINES:
            other = by_shape.get((r["op"], r["rows"], r["vocab"], r["dtype"], r["device"], base))
            r[f"ratio_vs_{base}"] = r["median_s"] / other["median_s"] if other else None
        r["peak_extra_over_logits"] = r["peak_extra_bytes"] / r["logits_bytes"]
        # Total resident (logits + what the op adds) over logits + one gradient of their size.
        r["peak_over_logits_plus_grad"] = ((r["logits_bytes"] + r["peak_extra_bytes"])
                                           / (2 * r["logits_bytes"]))
    return results


# ---------------------------------------------------------------------------------------------
# Machine description, progress bar, table


def machine_info(device="cpu"):
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cores": os.cpu_count(), "cpu": platform.processor() or platform.machine()}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        info["loadavg_at_start"] = list(os.getloadavg())
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        info["cuda"] = torch.version.cuda
    except ImportError:
        info["torch"] = None
    try:
        from importlib.metadata import version

        info["triton"] = version("triton")
    except Exception:
        info["triton"] = None
    from . import __version__

    info["astrai_kernels"] = __version__
    return info


class Progress:
    """A one-line progress bar on stderr (a line per step where stderr is not a terminal)."""

    def __init__(self, total, stream=None, width=28):
        self.total, self.done, self.width = max(total, 1), 0, width
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def _line(self, label):
        frac = min(self.done / self.total, 1.0)
        filled = int(round(frac * self.width))
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        eta_text = "?" if math.isnan(eta) else _clock(eta)
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{_clock(elapsed)} elapsed, eta {eta_text}  {label}")

    def update(self, label, advance=0):
        self.done += advance
        line = self._line(label)
        if self.tty:
            self.stream.write("\r" + line[:150].ljust(150))
        elif advance:  # not a terminal: one line per finished step
            self.stream.write(line + "\n")
        else:
            return
        self.stream.flush()

    def close(self):
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _method_rank(method):
    """Sort key: baselines, then backends in BACKENDS order, each before its ``:inplace``."""
    try:
        name, inplace = split_method(method)
    except (ValueError, AttributeError):
        return (99, 0, str(method))
    return ((BASELINES + KERNEL_BACKENDS).index(name), int(inplace), method)


def _clock(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def _fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def format_table(results, cuda=False):
    """The results as a text table (ratios: < 1 means faster/smaller than the baseline)."""
    mib = 1 << 20
    head = (f"{'op':<15} {'method':<11} {'dtype':<5} {'N':>6} {'V':>7} {'median ms':>10} "
            f"{'n':>2} {'floor ms':>9} {'x floor':>8} {'x fresh':>8} {'x naive':>8} "
            f"{'x compile':>9} {'peak MiB':>9} {'peak/S':>7}")
    if cuda:
        head += f" {'GB/s':>7} {'clone GB/s':>10} {'%clone':>6}"
    lines = [head, "-" * len(head)]
    tensor_rows = sorted(
        (r for r in results if r.get("op") in TENSOR_OPS),
        key=lambda r: (TENSOR_OPS.index(r["op"]), list(DTYPES).index(r["dtype"])
                       if r.get("dtype") in DTYPES else 9, r.get("rows", 0), r.get("vocab", 0),
                       _method_rank(r.get("method"))))
    for r in tensor_rows:
        prefix = (f"{r['op']:<15} {r['method']:<11} {r['dtype']:<5} {r['rows']:>6} "
                  f"{r['vocab']:>7} ")
        if "error" in r:
            lines.append(prefix + "FAILED: " + r["error"].splitlines()[-1][:100])
            continue
        line = (prefix + f"{r['median_s'] * 1e3:>10.1f} {r['repeats']:>2} "
                f"{_fmt(r.get('floor_s') and r['floor_s'] * 1e3, '>9.1f'):>9} "
                f"{_fmt(r.get('ratio_vs_copy'), '>8.2f'):>8} "
                f"{_fmt(r.get('ratio_vs_floor_fresh_grad'), '>8.2f'):>8} "
                f"{_fmt(r.get('ratio_vs_naive'), '>8.2f'):>8} "
                f"{_fmt(r.get('ratio_vs_compile'), '>9.2f'):>9} "
                f"{r['peak_extra_bytes'] / mib:>9.1f} {r['peak_extra_over_logits']:>7.2f}")
        if cuda:
            pct = r.get("bandwidth_vs_copy") and 100 * r["bandwidth_vs_copy"]
            line += (f" {r['effective_bandwidth_GBps']:>7.0f} "
                     f"{_fmt(r.get('copy_bandwidth_GBps'), '>10.0f'):>10} "
                     f"{_fmt(pct, '>6.0f'):>6}")
        lines.append(line)
    strategy_rows = [r for r in results if r.get("op") == "strategies"]
    if strategy_rows:
        lines += ["", f"{'strategy step':<15} {'method':<9} {'backend':<9} {'V':>7} "
                      f"{'step ms':>9} {'peak MiB':>9} {'peak/S':>7} {'x naive':>8}"]
        for r in strategy_rows:
            if "error" in r:
                lines.append(f"{r.get('strategy', '-'):<15} FAILED: {r['error'][:100]}")
                continue
            lines.append(f"{r['strategy']:<15} {r['method']:<9} {r['backend']:<9} "
                         f"{r['vocab']:>7} {r['median_s'] * 1e3:>9.1f} "
                         f"{r['peak_extra_bytes'] / mib:>9.1f} "
                         f"{r['peak_extra_over_logits']:>7.2f} "
                         f"{_fmt(r.get('ratio_vs_naive'), '>8.2f'):>8}")
    return "\n".join(lines)


LEGEND = ("median ms: forward+backward (GRPO: one step); n: timed calls; floor ms: the same-run "
          "copy_ of the logits (into a buffer already touched) scaled to the bytes the op must "
          "move (2 S; GRPO 4 S); x floor / x naive / x compile: time over that (lower is "
          "better); x fresh (CPU): time over the floor plus the first touch of one fresh S-sized "
          "buffer (clone - copy_ of the logits), what any op returning a new gradient pays; "
          "peak MiB: resident memory the call adds above its inputs (the gradient included); "
          "peak/S: that over the logits' bytes S.")


# ---------------------------------------------------------------------------------------------
# Strategies (bench/bench_strategies.py, owned elsewhere: optional)


def load_strategy_bench():
    """``run_strategy_steps`` from ``bench/bench_strategies.py``, or ``(None, why not)``."""
    import importlib.util

    path = os.path.join(ROOT, "bench", "bench_strategies.py")
    if not os.path.isfile(path):
        return None, f"{path} not found (strategy steps need the repository's bench/ folder)"
    try:
        spec = importlib.util.spec_from_file_location("astrai_bench_strategies", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:
        return None, f"importing {path} failed: {type(exc).__name__}: {exc}"
    fn = getattr(module, "run_strategy_steps", None)
    if fn is None:
        return None, f"{path} has no run_strategy_steps()"
    return fn, None


def run_strategies(vocab, backends, repeats, timeout):
    """Strategy-step rows (one per strategy x method) in this module's result format."""
    fn, why = load_strategy_bench()
    if fn is None:
        return [], why
    rows = []
    for i, backend in enumerate(backends):
        methods = ("fused", "reference") if i == 0 else ("fused",)
        try:
            raw = fn(vocab=vocab, methods=methods, backend=backend, repeats=repeats,
                     timeout=timeout)
        except TypeError:
            raw = fn(vocab=vocab, backend=backend)
        except Exception as exc:
            rows.append({"op": "strategies", "method": backend, "vocab": vocab,
                         "error": f"{type(exc).__name__}: {exc}"})
            continue
        for item in raw:
            method = "naive" if item.get("method") == "reference" else item.get("backend", backend)
            if i > 0 and method == "naive":
                continue
            rows.append({"op": "strategies", "strategy": item.get("strategy"), "method": method,
                         "backend": item.get("backend"), "vocab": vocab, "dtype": "fp32",
                         "median_s": item["seconds"],
                         "time_statistic": "as reported by run_strategy_steps (min of repeats)",
                         "peak_extra_bytes": item["peak_bytes"],
                         "logits_bytes": item.get("logits_bytes"),
                         "peak_extra_over_logits": (item["peak_bytes"] / item["logits_bytes"]
                                                    if item.get("logits_bytes") else None),
                         "peak_method": item.get("peak_method"), "threads": item.get("threads"),
                         "raw": item})
    naive = {r["strategy"]: r for r in rows if r.get("method") == "naive" and "error" not in r}
    for r in rows:
        base = naive.get(r.get("strategy"))
        if "error" not in r and base is not None:
            r["ratio_vs_naive"] = r["median_s"] / base["median_s"]
    return rows, None


# ---------------------------------------------------------------------------------------------
# The whole run (what `astrai-kernels bench` calls)


def plan_cases(ops, rows_list, vocabs, dtypes, methods, device, repeats, min_repeats, budget_s,
               threads=0):
    """The tensor-op cases; ``vocabs`` maps op -> vocabulary sizes. ``NAME:inplace`` methods
    only for the ops that have ``inplace_backward``."""
    cases = []
    for op in ops:
        if op not in TENSOR_OPS:
            continue
        for dtype in dtypes:
            for rows in rows_list:
                for vocab in vocabs[op]:
                    for method in methods:
                        if split_method(method)[1] and op not in INPLACE_OPS:
                            continue
                        cases.append(Case(op, method, rows, vocab, dtype, device, repeats,
                                          min_repeats, budget_s, threads))
    return cases


def run_benchmarks(ops, rows_list, vocabs, dtypes, methods, device="cpu", repeats=5,
                   min_repeats=2, budget_s=4.0, threads=0, isolation="forkserver", timeout=600,
                   strategy_backends=(), strategy_repeats=2, json_path=None, plot_path=None,
                   progress=True, argv=None, deadline_s=None):
    """Run every case (each in its own process), the strategies' steps, write JSON and plot.

    The JSON is rewritten after every case (``"complete": false`` until the end), so a run
    killed from outside still leaves its figures. With ``deadline_s`` no case starts after that
    many seconds; the ones left are listed under ``"skipped"`` and the table, JSON and plot are
    still written. Returns the payload dict.
    """
    started = time.perf_counter()
    cases = plan_cases(ops, rows_list, vocabs, dtypes, methods, device, repeats, min_repeats,
                       budget_s, threads)
    strategy_vocabs = list(vocabs.get("strategies", ())) if "strategies" in ops else []
    cpu_only_note = None
    if strategy_vocabs and device != "cpu":
        strategy_vocabs = []
        cpu_only_note = ("strategies: not run: bench/bench_strategies.py times the strategies' "
                         "steps on CPU only (run `astrai-kernels bench --device cpu --ops "
                         "strategies`)")
    total = len(cases) + len(strategy_vocabs)
    payload = {
        "machine": machine_info(device),
        "config": {"argv": argv, "ops": list(ops), "rows": list(rows_list),
                   "vocab": {op: list(vocabs[op]) for op in ops if op in vocabs},
                   "dtypes": list(dtypes), "methods": list(methods), "device": device,
                   "repeats": repeats, "min_repeats": min_repeats, "case_budget_s": budget_s,
                   "threads": threads or os.cpu_count(), "isolation": isolation,
                   "case_timeout_s": timeout, "deadline_s": deadline_s,
                   "grpo": {"B": GRPO_BATCH, "T": "rows / B", "clip_eps": GRPO_CLIP_EPS,
                            "kl_coef": GRPO_KL_COEF, "loss_type": "bnpo"},
                   "floor_bytes": {op: f"{k} x logits bytes" for op, k in FLOOR_FACTOR.items()},
                   "strategy_backends": list(strategy_backends),
                   "strategy_repeats": strategy_repeats},
        "method_notes": {
            "naive": "the seed's path: log_softmax(logits.float()).gather (token_logprobs), "
                     "F.cross_entropy(logits.float(), y), the seed's GRPO loss on three "
                     "log_softmax-gathers",
            "compile": "torch.compile of the naive function (compiled in the warm-up)",
            "copy": "same-run dst.copy_(logits) (CPU) / logits.clone() (CUDA): 2 S bytes",
        },
        "notes": [cpu_only_note] if cpu_only_note else [],
        "results": [],
        "skipped": [],
        "complete": False,
    }
    bar = Progress(total) if progress else None

    def save():
        payload["total_s"] = time.perf_counter() - started
        if json_path:
            write_json(json_path, payload)

    def late(reserve=0.0):
        return (deadline_s is not None
                and time.perf_counter() - started + reserve > deadline_s)

    def run_tensor_cases(runner, selected):
        for case in selected:
            if late():
                payload["skipped"].append(asdict(case))
                continue
            if bar:
                bar.update(case.label())
            result = runner.run(case)
            payload["results"].append(result)
            add_ratios(payload["results"])
            save()
            if bar:
                bar.update(case.label() + ("  FAILED" if "error" in result else ""), advance=1)

    # Order: every case but the compile baseline, then the strategies' steps (one block that
    # cannot be cut short: started only with STRATEGY_RESERVE_S left), then torch.compile.
    with CaseRunner(isolation, timeout) as runner:
        run_tensor_cases(runner, [c for c in cases if c.method != "compile"])
        for vocab in strategy_vocabs:
            if late(STRATEGY_RESERVE_S):
                payload["skipped"].append({"op": "strategies", "vocab": vocab})
                continue
            if bar:
                bar.update(f"strategies V={vocab} ({', '.join(strategy_backends)} + reference)")
            rows, why = run_strategies(vocab, strategy_backends, strategy_repeats, timeout)
            if why:
                payload["notes"].append(f"strategies: not available: {why}")
            payload["results"].extend(rows)
            save()
            if bar:
                bar.update(f"strategies V={vocab}", advance=1)
        run_tensor_cases(runner, [c for c in cases if c.method == "compile"])
    if bar:
        bar.close()
    if payload["skipped"]:
        payload["notes"].append(f"{len(payload['skipped'])} case(s) not run: the deadline of "
                                f"{deadline_s} s had passed")
    add_ratios(payload["results"])
    payload["complete"] = True
    save()
    if plot_path:
        machine = payload["machine"]
        title = (f"{machine.get('gpu') or machine.get('cpu')}, {machine.get('cores')} cores, "
                 f"torch {machine.get('torch')}")
        if plot(payload["results"], plot_path, title) is None:
            payload["notes"].append("no plot written (matplotlib missing or no results)")
            save()
    return payload


# ---------------------------------------------------------------------------------------------
# JSON and plot


def write_json(path, payload):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as out:
        json.dump(payload, out, indent=1, default=str)
    os.replace(tmp, path)


def plot(results, path, title=None):
    """Two panels per (op, dtype): median time and peak extra memory against V, a line per
    method (log-log), the copy floor and the logits' size dashed. Returns the path or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in results if "error" not in r and r.get("op") in TENSOR_OPS]
    groups = sorted({(r["op"], r["dtype"], r["rows"]) for r in ok},
                    key=lambda g: (TENSOR_OPS.index(g[0]), list(DTYPES).index(g[1]), g[2]))
    if not groups:
        return None
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 3.4 * len(groups)), squeeze=False)
    methods = sorted({r["method"] for r in ok}, key=_method_rank)
    markers = "os^DvP*X"
    styles = {m: dict(color=f"C{i}", marker=markers[i % len(markers)],
                      linestyle="-" if m in BASELINES else "-.", markersize=6 - 0.5 * (i % 3))
              for i, m in enumerate(methods)}
    for (op, dtype, rows), (ax_t, ax_m) in zip(groups, axes):
        sel = [r for r in ok if (r["op"], r["dtype"], r["rows"]) == (op, dtype, rows)]
        for method in methods:
            pts = sorted((r["vocab"], r) for r in sel if r["method"] == method)
            if not pts:
                continue
            vs = [v for v, _ in pts]
            ax_t.plot(vs, [r["median_s"] * 1e3 for _, r in pts], label=method, **styles[method])
            ax_m.plot(vs, [r["peak_extra_bytes"] / 2**20 for _, r in pts], label=method,
                      **styles[method])
        floor = {}
        for r in sel:
            if r.get("floor_s"):
                floor.setdefault(r["vocab"], []).append(r["floor_s"])
        if floor:
            vs = sorted(floor)
            ax_t.plot(vs, [statistics.median(floor[v]) * 1e3 for v in vs], "k+--",
                      label=f"copy floor ({FLOOR_FACTOR[op]} S)")
        sizes = sorted({(r["vocab"], r["logits_bytes"]) for r in sel})
        ax_m.plot([v for v, _ in sizes], [s / 2**20 for _, s in sizes], "k+--",
                  label="logits size S")
        shape = f"B={GRPO_BATCH}, T={rows // GRPO_BATCH}" if op == "grpo" else f"N={rows}"
        for ax, what in ((ax_t, "forward+backward time (ms)"), (ax_m, "peak extra memory (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("vocabulary size V")
            ax.set_ylabel(what)
            ax.set_title(f"{op} {dtype}, {shape}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / (3.4 * len(groups))))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description="run one benchmark case (internal)")
    parser.add_argument("--case", help="a Case as JSON")
    parser.add_argument("--no-copy", action="store_true")
    parser.add_argument("--serve", action="store_true", help="run the fork server")
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return
    result = measure(Case.from_json(args.case), with_copy=not args.no_copy)
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
