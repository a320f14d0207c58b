"""The CPU gradient cache (``astrai_kernels.kernels.memory``): reuse, limits, and that an op whose
gradient lands on a reused (dirty) block gives the same result as on fresh memory."""

import pytest
import torch

import astrai_kernels as ak
from astrai_kernels.bench.peak import PeakRss
from astrai_kernels.kernels import memory

from cases import KERNEL_BACKENDS, subprocess_env

VOCAB = 33001  # not a power of two; rows x VOCAB x 4 bytes > memory.MIN_BYTES at 64 rows
ROWS = {torch.float32: 64, torch.bfloat16: 128}


@pytest.fixture
def cache_limit():
    """Run with a 256 MiB cache, emptied before and after."""
    previous = memory.set_gradient_cache_limit(256 << 20)
    memory.release_gradient_cache()
    yield
    memory.release_gradient_cache()
    memory.set_gradient_cache_limit(previous)


def _shape(dtype, rows=None):
    return (rows or ROWS[dtype], VOCAB)


def test_the_cache_is_on_by_default():
    assert memory._gradient_cache().enabled
    assert memory.gradient_cache_limit() > 0


def test_a_released_gradient_is_reused_and_a_live_one_is_not(cache_limit):
    first = memory.cached_empty(_shape(torch.float32), torch.float32, "cpu")
    assert first._base is None and first.is_contiguous()
    address = first.data_ptr()
    second = memory.cached_empty(_shape(torch.float32), torch.float32, "cpu")
    assert second.data_ptr() != address  # first is still alive
    del first
    assert memory.gradient_cache_free_bytes() >= 64 * VOCAB * 4
    third = memory.cached_empty(_shape(torch.float32), torch.float32, "cpu")
    assert third.data_ptr() == address
    view = third[1:]
    del third
    fourth = memory.cached_empty(_shape(torch.float32), torch.float32, "cpu")
    assert fourth.data_ptr() != address  # a view keeps the block in use
    del view, second, fourth


def test_several_blocks_each_serve_their_size(cache_limit):
    sizes = [(64, VOCAB), (96, VOCAB), (160, VOCAB)]
    held = [memory.cached_empty(size, torch.float32, "cpu") for size in sizes]
    addresses = [t.data_ptr() for t in held]
    del held
    again = [memory.cached_empty(size, torch.float32, "cpu") for size in reversed(sizes)]
    assert [t.data_ptr() for t in again] == addresses[::-1]
    assert memory._gradient_cache().cached_bytes() == sum(
        -(-(rows * VOCAB * 4) // memory.HUGE_PAGE) * memory.HUGE_PAGE for rows, _ in sizes)
    del again


def test_a_block_serves_only_fitting_sizes(cache_limit):
    big = memory.cached_empty((4 * 64, VOCAB), torch.float32, "cpu")
    address = big.data_ptr()
    del big
    small = memory.cached_empty((64, VOCAB), torch.float32, "cpu")
    assert small.data_ptr() != address  # over memory.MAX_SLACK times the request
    # the unfitting free block was released before the new one was allocated
    assert memory._gradient_cache().cached_bytes() < 2 * 64 * VOCAB * 4 + (2 << 20)
    del small
    bigger = memory.cached_empty((96, VOCAB), torch.float32, "cpu")
    assert memory._gradient_cache().cached_bytes() < 2 * 96 * VOCAB * 4 + (2 << 20)
    del bigger


def test_small_and_non_cpu_buffers_bypass_the_cache(cache_limit):
    small = memory.cached_empty((4, 100), torch.float32, "cpu")
    assert small.shape == (4, 100) and memory._gradient_cache().cached_bytes() == 0
    if torch.cuda.is_available():
        assert memory.cached_empty(_shape(torch.float32), torch.float32, "cuda").is_cuda


def test_the_limit_bounds_what_is_kept(cache_limit):
    memory.set_gradient_cache_limit(12 << 20)
    first = memory.cached_empty(_shape(torch.float32), torch.float32, "cpu")  # ~8 MiB: kept
    second = memory.cached_empty(_shape(torch.float32), torch.float32, "cpu")  # over: not kept
    assert memory._gradient_cache().cached_bytes() == 10 << 20
    del first, second
    memory.set_gradient_cache_limit(0)
    assert memory.gradient_cache_limit() == 0
    assert memory._gradient_cache().cached_bytes() == 0
    plain = memory.cached_empty(_shape(torch.float32), torch.float32, "cpu")
    assert memory._gradient_cache().cached_bytes() == 0
    del plain


def test_fake_tensors_and_inference_mode(cache_limit):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        fake = memory.cached_empty(_shape(torch.float32), torch.float32, "cpu")
    assert isinstance(fake, FakeTensor) and memory._gradient_cache().cached_bytes() == 0
    with torch.inference_mode():
        inside = memory.cached_empty(_shape(torch.float32), torch.float32, "cpu").fill_(1.0)
        address = inside.data_ptr()
        del inside
    outside = memory.cached_empty(_shape(torch.float32), torch.float32, "cpu")
    assert outside.data_ptr() == address and not outside.is_inference()
    outside.fill_(2.0).requires_grad_()
    del outside


@pytest.mark.parametrize("limit", [-1, 1.5, True, "1"])
def test_a_bad_limit_is_refused(limit):
    with pytest.raises(ValueError, match="limit"):
        memory.set_gradient_cache_limit(limit)


@pytest.mark.parametrize("value", ["lots", "-5"])
def test_a_bad_environment_limit_is_refused(value):
    import subprocess
    import sys

    code = ("import torch; from astrai_kernels.kernels import memory; "
            "memory.cached_empty((64, 33001), torch.float32, 'cpu')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=subprocess_env(**{memory.CACHE_ENV: value}))
    assert run.returncode != 0 and memory.CACHE_ENV in run.stderr


def test_the_environment_sets_the_limit():
    import subprocess
    import sys

    code = ("from astrai_kernels.kernels import memory; print(memory.gradient_cache_limit())")
    for value, expected in (("0", "0"), ("123456789", "123456789")):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=subprocess_env(**{memory.CACHE_ENV: value}), check=True)
        assert run.stdout.strip() == expected


def test_peak_memory_counts_a_reused_gradient(cache_limit):
    meter = PeakRss()
    held = memory.cached_empty((256, VOCAB), torch.float32, "cpu")
    held.fill_(1.0)
    del held
    meter.start()
    again = memory.cached_empty((256, VOCAB), torch.float32, "cpu")
    again.fill_(2.0)
    if meter.resettable:
        assert meter.extra() >= 0.9 * 256 * VOCAB * 4
    del again


def _run_ops(backend, dtype):
    """Every op whose gradient comes from the cache, forward + backward; the gradients."""
    gen = torch.Generator().manual_seed(0)
    rows = ROWS[dtype]
    logits = (torch.randn(rows, VOCAB, generator=gen) * 3).to(dtype)
    teacher = (torch.randn(rows, VOCAB, generator=gen) * 3).to(dtype)
    target = torch.randint(0, VOCAB, (rows,), generator=gen)
    target[::3] = -100
    ignored = torch.full((rows,), -100)
    advantages = torch.randn(2, generator=gen)
    grads = {}

    def grad_of(name, fn):
        x = logits.clone().requires_grad_()
        fn(x).backward()
        grads[name] = x.grad
    grad_of("token_logprobs", lambda x: sum(t.sum() for t in ak.token_logprobs(
        x, target, return_entropy=True, backend=backend)))
    grad_of("cross_entropy", lambda x: ak.cross_entropy(x, target, label_smoothing=0.1,
                                                        z_loss=1e-3, backend=backend))
    grad_of("cross_entropy_all_ignored",
            lambda x: ak.cross_entropy(x, ignored, reduction="sum", backend=backend))
    kept = target != -100
    grad_of("grpo", lambda x: ak.grpo_loss(x.view(2, rows // 2, VOCAB),
                                           target.clamp(min=0).view(2, -1), advantages,
                                           mask=kept.view(2, -1), backend=backend)[0])
    grad_of("distill", lambda x: ak.distill_loss(x, teacher, target, backend=backend))
    return grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# Triton's kernels take CUDA memory from PyTorch's own caching allocator; on CPU tensors they run
# only under the interpreter, 2.5 minutes at these shapes.
@pytest.mark.parametrize("backend", [b for b in KERNEL_BACKENDS if b != "triton"])
def test_ops_on_a_dirty_reused_block_match_fresh_memory(cache_limit, backend, dtype):
    """Poison the cache with NaN blocks, then every op's gradient must equal (bitwise) the one
    it writes into fresh memory, ignored rows included."""
    memory.set_gradient_cache_limit(0)
    fresh = _run_ops(backend, dtype)
    memory.set_gradient_cache_limit(256 << 20)
    poisoned = [memory.cached_empty(_shape(dtype), dtype, "cpu").fill_(float("nan"))
                for _ in range(3)]
    addresses = {p.data_ptr() for p in poisoned}
    del poisoned
    reused = _run_ops(backend, dtype)
    assert any(g.data_ptr() in addresses for g in reused.values())
    for name, grad in reused.items():
        assert torch.equal(grad, fresh[name]), name


# Each reproduction below overwrote or over-kept memory under the use-count cache (issue 36).

def test_a_gradient_kept_through_its_storage_is_not_handed_out_again(cache_limit):
    gen = torch.Generator().manual_seed(0)
    target = torch.randint(0, 8192, (272,), generator=gen)
    x = torch.randn(272, 8192, generator=gen).requires_grad_()
    ak.cross_entropy(x, target).backward()
    storage, before = x.grad.untyped_storage(), x.grad.clone()
    x.grad = None
    x2 = (5 * torch.randn(272, 8192, generator=gen)).requires_grad_()
    ak.cross_entropy(x2, target).backward()
    assert x2.grad.data_ptr() != storage.data_ptr()
    assert torch.equal(torch.empty(0).set_(storage, 0, (272, 8192)), before)


def test_two_threads_never_share_a_block(cache_limit, monkeypatch):
    """A pause right after a block is taken forces the interleaving in which both threads saw
    the same free block; each thread's buffer must keep what that thread wrote."""
    import threading
    import time

    shape = _shape(torch.float32)
    memory.cached_empty(shape, torch.float32, "cpu")  # dropped: a free block both want
    take = memory.GradientCache.take

    def take_then_pause(self, *args, **kwargs):
        block = take(self, *args, **kwargs)
        time.sleep(0.05)
        return block

    monkeypatch.setattr(memory.GradientCache, "take", take_then_pause)
    written = threading.Barrier(2)
    kept = {}

    def fill(value):
        buffer = memory.cached_empty(shape, torch.float32, "cpu").fill_(value)
        written.wait()
        time.sleep(0.05)
        kept[value] = bool((buffer == value).all())

    threads = [threading.Thread(target=fill, args=(float(v),)) for v in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert kept == {1.0: True, 2.0: True}


def test_many_threads_under_fast_switching_keep_their_buffers(cache_limit):
    """Blocks come back from finalizers on whichever thread drops the last reference; under
    thread switches every microsecond no live buffer is handed out again."""
    import sys
    import threading

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    overwritten = []

    def loop(value):
        held = None
        for _ in range(40):
            buffer = memory.cached_empty((9 << 20,), torch.uint8, "cpu").fill_(value)
            if held is not None and not bool((held == value).all()):
                overwritten.append(value)
            held = buffer  # alive while the next buffer is taken; then dropped for reuse

    try:
        threads = [threading.Thread(target=loop, args=(v,)) for v in range(1, 7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert overwritten == []


def _hold_received_gradient(queue, done, result):
    grad = queue.get()
    copy = grad.clone()
    result.put("received")
    done.wait(60)
    result.put(float((grad - copy).abs().max()))


def test_a_gradient_sent_to_another_process_does_not_change_there(cache_limit):
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue, result, done = context.Queue(), context.Queue(), context.Event()
    child = context.Process(target=_hold_received_gradient, args=(queue, done, result))
    child.start()
    try:
        gen = torch.Generator().manual_seed(0)
        target = torch.randint(0, VOCAB, (64,), generator=gen)
        x = torch.randn(64, VOCAB, generator=gen).requires_grad_()
        ak.cross_entropy(x, target).backward()
        queue.put(x.grad)
        assert result.get(timeout=120) == "received"
        x.grad = None
        for _ in range(3):
            y = (3 * torch.randn(64, VOCAB, generator=gen)).requires_grad_()
            ak.cross_entropy(y, target).backward()
            del y
        done.set()
        assert result.get(timeout=120) == 0.0
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()


def test_the_cache_holds_what_the_last_step_held(cache_limit):
    """After 12 gradients were alive at once, ordinary one-gradient steps bring what the cache
    keeps back to one block."""
    shape = _shape(torch.float32)
    block = -(-(64 * VOCAB * 4) // memory.HUGE_PAGE) * memory.HUGE_PAGE
    burst = [memory.cached_empty(shape, torch.float32, "cpu") for _ in range(12)]
    del burst
    assert memory._gradient_cache().cached_bytes() == 12 * block  # what that step held
    for _ in range(2):
        step = memory.cached_empty(shape, torch.float32, "cpu").fill_(1.0)
        del step
    assert memory._gradient_cache().cached_bytes() == block
    assert memory.gradient_cache_free_bytes() == block


def test_a_buffer_from_a_larger_block_carries_only_its_own_bytes(cache_limit):
    import io

    memory.cached_empty((16 << 20,), torch.uint8, "cpu")  # dropped: a free 16 MiB block
    request = (17 << 20) // 2  # 8.5 MiB: served by the freed 16 MiB block
    grad = memory.cached_empty((request // 4,), torch.float32, "cpu")
    assert grad.untyped_storage().nbytes() == request
    saved = io.BytesIO()
    torch.save(grad, saved)
    assert len(saved.getvalue()) < request + (64 << 10)
