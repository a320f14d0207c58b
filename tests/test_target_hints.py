"""A target that does not fit the logits gets an error that says how to fix the call where the
shapes show it (issue 44): F.cross_entropy's class-second layout, targets one position off
along the sequence (the next-token shift), and probability targets, which no op takes."""

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.testing import assert_close

V = 11


def test_torch_layout_is_named_with_its_fix():
    """F.cross_entropy takes [N, V, d]; these ops take the classes last. The error says so, and
    the fix it names gives F.cross_entropy's loss."""
    torch.manual_seed(0)
    logits = torch.randn(2, V, 5, dtype=torch.float64)
    target = torch.randint(0, V, (2, 5))
    with pytest.raises(ValueError, match=r"target must have shape \(2, 11\) .*got \(2, 5\): this "
                                         r"looks like F\.cross_entropy's \[N, V, \.\.\.\] layout: "
                                         r"pass logits\.movedim\(1, -1\)"):
        ak.cross_entropy(logits.float(), target)
    moved = logits.float().movedim(1, -1)
    expected = reference.cross_entropy(moved.double(), target)
    assert_close(ak.cross_entropy(moved, target), expected, what="loss")
    assert_close(F.cross_entropy(logits.float(), target), expected, what="torch's loss")


@pytest.mark.parametrize("op", ["cross_entropy", "token_logprobs", "grpo_loss"])
def test_logits_one_position_longer_name_the_shift(op):
    logits = torch.randn(2, 17, V)
    target = torch.randint(0, V, (2, 16))
    args = (torch.randn(2),) if op == "grpo_loss" else ()
    with pytest.raises(ValueError, match=r"got \(2, 16\): one position more in logits than in "
                                         r"target along dim 1; .*shift: logits\[:, :-1\]"):
        getattr(ak, op)(logits, target, *args)


def test_target_one_position_longer_names_its_shift():
    with pytest.raises(ValueError, match=r"shift: target\[:, 1:\]"):
        ak.cross_entropy(torch.randn(2, 16, V), torch.randint(0, V, (2, 17)))


def test_fused_head_names_the_hidden_states_shift():
    with pytest.raises(ValueError, match=r"one position more in hidden than in target along "
                                         r"dim 1; .*shift: hidden\[:, :-1\]"):
        ak.linear_cross_entropy(torch.randn(2, 17, 8), torch.randn(V, 8),
                                torch.randint(0, V, (2, 16)))


def test_one_dimensional_rows_shift_along_dim_0():
    with pytest.raises(ValueError, match=r"shift: logits\[:-1\]"):
        ak.cross_entropy(torch.randn(17, V), torch.randint(0, V, (16,)))


def test_shapes_that_show_nothing_get_no_guess():
    with pytest.raises(ValueError) as raised:
        ak.cross_entropy(torch.randn(2, 17, V), torch.randint(0, V, (2, 10)))
    assert str(raised.value) == ("target must have shape (2, 17) (logits' shape without V), "
                                 "got (2, 10)")


SOFT_TARGETS = (r"target must be int32 or int64 class indices, got torch\.float32 with the "
                r"logits' shape \[\.\.\., V\]: probability \(soft\) targets are not supported")


def test_probability_targets_are_refused_as_such():
    """F.cross_entropy also takes class probabilities; these ops do not, and say so (as
    ak.nn.CrossEntropyLoss does), the fused head too."""
    logits = torch.randn(2, 5, V)
    with pytest.raises(TypeError, match=SOFT_TARGETS):
        ak.cross_entropy(logits, logits.softmax(-1))
    with pytest.raises(TypeError, match=SOFT_TARGETS):
        ak.linear_cross_entropy(torch.randn(2, 5, 8), torch.randn(V, 8), logits.softmax(-1))
    with pytest.raises(ValueError, match=r"probability \(soft\) targets are not supported"):
        ak.nn.CrossEntropyLoss()(logits, logits.softmax(-1))


def test_other_float_targets_get_the_dtype_error():
    with pytest.raises(TypeError) as raised:
        ak.cross_entropy(torch.randn(2, 5, V), torch.zeros(2, 5))
    assert str(raised.value) == "target must be int32 or int64, got torch.float32"
