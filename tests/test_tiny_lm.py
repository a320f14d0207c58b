"""TinyCausalLM: deterministic, causal, honours masks and position ids; the toy rollout runner."""

import time

import pytest
import torch

from astrai_kernels.strategies import RolloutResult, RolloutRunner, make_doc_boundary_mask
from astrai_kernels.strategies.masks import model_inputs
from astrai_kernels.testing.tiny_lm import TinyCausalLM, ToyRolloutRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (tests/conftest.py)


def tiny(**kwargs):
    kwargs = {"vocab_size": 40, "d_model": 16, "n_layers": 2, "n_heads": 2, **kwargs}
    return TinyCausalLM(**kwargs)


def ids(*shape, seed=0, vocab=40):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_deterministic_from_seed_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b, c = tiny(seed=3), tiny(seed=3), tiny(seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    x = ids(2, 9)
    assert torch.equal(a(x)["logits"], b(x)["logits"])
    assert not torch.allclose(a(x)["logits"], c(x)["logits"])


def test_output_contract():
    out = tiny()(ids(3, 7))
    assert set(out) == {"logits"}
    assert out["logits"].shape == (3, 7, 40) and out["logits"].dtype == torch.float32
    assert float(out["logits"].detach().std()) > 0.3  # a non-degenerate softmax
    moe = tiny(n_experts=3)
    out = moe(ids(3, 7))
    assert set(out) == {"logits", "aux_loss"} and out["aux_loss"].dim() == 0
    out["aux_loss"].backward()
    assert moe.blocks[0].mlp.router.weight.grad.abs().sum() > 0


def test_causal_by_default():
    model = tiny()
    x = ids(2, 10)
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % 40
    torch.testing.assert_close(model(x)["logits"][:, :6], model(y)["logits"][:, :6])
    assert not torch.allclose(model(x)["logits"][:, 6:], model(y)["logits"][:, 6:])


def test_four_d_mask_and_position_ids_are_honoured():
    """Two packed documents under the doc-boundary mask equal each document alone."""
    model = tiny()
    a, b = ids(1, 4, seed=1), ids(1, 6, seed=2)
    packed = torch.cat([a, b], 1)
    positions = torch.cat([torch.arange(4), torch.arange(6)])[None]
    logits = model(packed, input_mask=make_doc_boundary_mask(positions),
                   position_ids=positions)["logits"]
    torch.testing.assert_close(logits[:, :4], model(a)["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[:, 4:], model(b)["logits"], rtol=1e-5, atol=1e-5)
    # Same mask, other positions: different logits (positions are used).
    shifted = model(packed, input_mask=make_doc_boundary_mask(positions),
                    position_ids=torch.arange(10)[None])["logits"]
    assert not torch.allclose(shifted[:, 4:], logits[:, 4:])


def test_left_padding_with_masks_matches_unpadded():
    model = tiny()
    x = ids(1, 6)
    padded = torch.cat([torch.full((1, 3), 7), x], 1)
    key = torch.cat([torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, 6, dtype=torch.bool)], 1)
    for mask in (key, None):  # a 2-D key-padding mask, or the strategies' 4-D mask
        input_mask, positions = model_inputs(key, padded)
        logits = model(padded, input_mask=key if mask is not None else input_mask,
                       position_ids=positions)["logits"]
        torch.testing.assert_close(logits[:, 3:], model(x)["logits"], rtol=1e-5, atol=1e-5)


def test_fully_masked_rows_stay_finite():
    model = tiny()
    mask = torch.zeros(1, 1, 5, 5, dtype=torch.bool)
    out = model(ids(1, 5), input_mask=mask)["logits"]
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_bad_inputs():
    model = tiny(max_seq_len=8)
    with pytest.raises(ValueError, match="input_ids must be"):
        model(ids(5))
    with pytest.raises(TypeError, match="input_mask must be boolean"):
        model(ids(1, 4), input_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="input_mask must be"):
        model(ids(1, 4), input_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="positions up to 7"):
        model(ids(1, 9))


def test_fast_on_cpu():
    model = TinyCausalLM(vocab_size=32768, d_model=32)
    x = ids(2, 64, vocab=32768)
    start = time.perf_counter()
    model(x)["logits"].float().logsumexp(-1).sum().backward()
    assert time.perf_counter() - start < 5.0


def test_generate_and_toy_runner():
    model = tiny()
    prompts = ids(2, 3)
    mask = torch.tensor([[False, True, True], [True, True, True]])
    gen = torch.Generator().manual_seed(0)
    out, out_mask = model.generate(prompts, mask, max_new_tokens=5, eos_token_id=3,
                                   generator=gen)
    again, _ = model.generate(prompts, mask, max_new_tokens=5, eos_token_id=3,
                              generator=torch.Generator().manual_seed(0))
    assert out.shape == out_mask.shape == (2, 5) and torch.equal(out, again)
    for row, row_mask in zip(out.tolist(), out_mask.tolist()):
        if 3 in row[:-1]:
            end = row.index(3)
            assert row_mask == [True] * (end + 1) + [False] * (4 - end)

    runner = ToyRolloutRunner(model, lambda p, r, m: (r == 1).float().mean(-1), group_size=3,
                              max_new_tokens=4, rollout_interval=2)
    assert isinstance(runner, RolloutRunner)
    result, fresh = runner({"prompts": prompts, "prompt_mask": mask})
    assert fresh and isinstance(result, RolloutResult)
    assert result.responses.shape == (2, 3, 4) and result.rewards.shape == (2, 3)
    assert torch.equal(result.prompt_mask, mask)
    runner.step()
    cached, fresh = runner({"prompts": prompts})
    assert not fresh and cached is result
    runner.step()
    assert runner({"prompts": prompts})[1]
