"""The CPU gradient cache (``astrai_kernels.kernels.memory``): reuse, limits, that an op whose
gradient lands on a reused (dirty) block gives the same result as on fresh memory, and that its
storages resize as torch's do."""

import math

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


# Cached storages resize as torch.empty's do (issue 45): the new bytes come from torch's CPU
# allocator and the block goes back to the cache. Each test runs the same steps on a plain
# torch.empty gradient and requires the same outcome. (Torch crashes on reading a tensor whose
# storage was freed, so none is read before its storage is regrown.)

def _block_of(shape, dtype=torch.float32):
    return -(-(math.prod(shape) * dtype.itemsize) // memory.HUGE_PAGE) * memory.HUGE_PAGE


def _cached_and_plain(shape):
    """A cache-leased tensor and a torch.empty one of ``shape`` (float32)."""
    cache = memory._gradient_cache()
    leased = cache.leased
    cached = memory.cached_empty(shape, torch.float32, "cpu")
    assert cache.leased == leased + 1  # it came from the cache
    return {"cached": cached, "plain": torch.empty(shape)}


def test_freeing_a_cached_storage_gives_its_block_back(cache_limit):
    shape = _shape(torch.float32)
    nbytes, block = math.prod(shape) * 4, _block_of(shape)
    cache = memory._gradient_cache()
    source = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    grads = _cached_and_plain(shape)
    address = grads["cached"].data_ptr()
    for grad in grads.values():
        storage = grad.untyped_storage()
        storage.resize_(0)
        assert storage.nbytes() == 0 and storage.resizable() and grad.shape == shape
    assert cache.leased == 0 and memory.gradient_cache_free_bytes() == block
    again = memory.cached_empty(shape, torch.float32, "cpu").fill_(7.0)
    assert again.data_ptr() == address  # the freed storage's block, handed out once
    for grad in grads.values():  # FSDP's regrow: resize the storage back, set_, copy_
        storage = grad.untyped_storage()
        storage.resize_(nbytes)
        grad.set_(storage, 0, shape).copy_(source)
        assert storage.resizable() and torch.equal(grad, source)
    assert grads["cached"].data_ptr() != address  # torch memory now, not the leased-again block
    assert torch.equal(again, torch.full(shape, 7.0))
    assert cache.cached_bytes() == block and cache.leased == 1


def test_growing_a_cached_gradient_moves_it_off_its_block(cache_limit):
    rows, cache = ROWS[torch.float32], memory._gradient_cache()
    shape, grown = _shape(torch.float32), _shape(torch.float32, rows + 8)
    source = torch.randn(grown, generator=torch.Generator().manual_seed(0))
    grads = _cached_and_plain(shape)
    address = grads["cached"].data_ptr()
    for grad in grads.values():
        grad.copy_(source[:rows])
        grad.resize_(grown)
        assert grad.untyped_storage().nbytes() == math.prod(grown) * 4
        assert torch.equal(grad[:rows], source[:rows])  # what fits is copied
        grad[rows:].copy_(source[rows:])
    assert torch.equal(grads["cached"], grads["plain"])
    assert cache.leased == 0 and memory.gradient_cache_free_bytes() == _block_of(shape)
    again = memory.cached_empty(shape, torch.float32, "cpu").fill_(7.0)
    assert again.data_ptr() == address
    assert torch.equal(grads["cached"], source)  # the block's new user does not write into it
    storage = grads["cached"].untyped_storage()
    storage.resize_(0)  # torch memory: nothing comes back to the cache
    assert cache.leased == 1 and memory.gradient_cache_free_bytes() == 0
    del again
    assert cache.leased == 0


def test_a_resize_within_the_storage_keeps_the_block(cache_limit):
    """A tensor resize that fits the storage, or a view, leaves the storage on its block: the
    block stays leased until the storage's data leaves it."""
    shape = _shape(torch.float32)
    cache = memory._gradient_cache()
    grad = memory.cached_empty(shape, torch.float32, "cpu").fill_(1.0)
    address = grad.data_ptr()
    grad.resize_(2, VOCAB)
    view = grad[1:]
    del grad
    other = memory.cached_empty(shape, torch.float32, "cpu").fill_(2.0)
    assert other.data_ptr() != address and bool((view == 1.0).all())
    view.untyped_storage().resize_(0)
    assert cache.leased == 1 and memory.gradient_cache_free_bytes() == _block_of(shape)
    del view, other
    assert cache.leased == 0


def test_resizing_leases_leaks_no_block(cache_limit):
    """Steps that free, regrow and grow their gradients keep one block and lease none after."""
    shape = _shape(torch.float32)
    cache = memory._gradient_cache()
    for step in range(6):
        grad = memory.cached_empty(shape, torch.float32, "cpu").fill_(float(step))
        if step % 2:
            grad.untyped_storage().resize_(0)
            grad.untyped_storage().resize_(math.prod(shape) * 4)
        else:
            grad.resize_(shape[0] + 1, VOCAB)
        assert cache.leased == 0 and cache.cached_bytes() == _block_of(shape)
        del grad
    memory.release_gradient_cache()
    assert cache.cached_bytes() == 0 and cache.free == []


def _head_weight_grad():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(8192, 256, generator=gen).requires_grad_()  # 8 MiB of fp32 gradient
    hidden = torch.randn(16, 256, generator=gen)
    ak.linear_cross_entropy(hidden, weight, torch.randint(0, 8192, (16,), generator=gen)).backward()
    return weight.grad


def _logits_grad():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(_shape(torch.float32), generator=gen).requires_grad_()
    target = torch.randint(0, VOCAB, (ROWS[torch.float32],), generator=gen)
    ak.cross_entropy(logits, target).backward()
    return logits.grad


@pytest.mark.parametrize("gradient", [_logits_grad, _head_weight_grad], ids=["logits", "head"])
def test_an_op_gradient_frees_and_grows_as_torchs(cache_limit, gradient):
    """The issue's reproduction: resize_(0) and a growing resize_ on an op's cached gradient."""
    grad = gradient()
    expected, cache = grad.clone(), memory._gradient_cache()
    shape, nbytes = grad.shape, grad.untyped_storage().nbytes()
    assert cache.leased == 1 and nbytes >= memory.MIN_BYTES
    grad.resize_(shape[0] + 1, shape[1])
    assert torch.equal(grad[:-1], expected) and cache.leased == 0
    storage = grad.untyped_storage()
    storage.resize_(0)
    storage.resize_(nbytes)
    grad.set_(storage, 0, shape).copy_(expected)
    assert torch.equal(grad, expected) and cache.leased == 0


def test_without_the_extension_buffers_are_plain(cache_limit, monkeypatch):
    """Where the cpp extension is not built no storage could be made resizable: the cache sits
    out and every buffer is a torch.empty of its own."""
    monkeypatch.setattr(memory, "_storage_maker", lambda: None)
    grad = memory.cached_empty(_shape(torch.float32), torch.float32, "cpu")
    assert grad.untyped_storage().resizable() and memory._gradient_cache().cached_bytes() == 0
    grad.resize_(ROWS[torch.float32] + 1, VOCAB)
    del grad
