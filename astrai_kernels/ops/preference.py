"""Preference losses on sequence log-probs, and group-relative advantages.

All act on ``[B]`` / ``[B, G]`` tensors, so they are plain PyTorch computed in float32; the heavy
part, the sequence log-probs of chosen and rejected, runs on the fused log-prob primitive
(``ak.sequence_logprobs``, or ``ak.linear_sequence_logprobs`` from the hidden states).

What the inputs are: each op takes the sequence log-probs ``[B]`` that TRL feeds the same loss.
``dpo_loss``, ``kto_loss`` and ``cpo_loss`` with ``"sigmoid"``/``"hinge"`` take sums over the
completion tokens (``average=False``); ``orpo_loss``, ``simpo_loss`` and ``cpo_loss`` with
``"ipo"``/``"simpo"`` take means over them (``average=True``). ``dpo_loss``'s ``sigmoid_norm``
divides sums by the token counts given as ``chosen_lengths``/``rejected_lengths``.

``dpo_loss``'s scalar options also travel as one object, :class:`DPOOptions`; the smaller ops
(``orpo_loss``, ``simpo_loss``, ``cpo_loss``, ``kto_loss``) take their few keywords only.
"""

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..distributed.dtensor import on_full_tensors
from ..options.keywords import options_from, options_or_keywords
from ..options.scalars import check_choice, check_in_range, check_positive

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair",
                  "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop",
                  "sigmoid_norm")
# The DPO types whose formula has the label-flip rate (TRL's label_smoothing) in it.
DPO_SMOOTHED_TYPES = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired")
DISCOPOP_TAU = 0.05  # TRL's and the DiscoPOP paper's default
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
SIMPO_GAMMA = 0.5  # TRL's CPOConfig.simpo_gamma default
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
ADVANTAGE_SCALES = ("group", "batch", "none")
# The largest float32 probability below 1 is 1 - 2**-24: ORPO's odds p / (1 - p) of a
# sequence log-prob above its log are infinite (a fully-masked sequence averages to 0).
ORPO_MAX_LOGPROB = math.log1p(-2.0 ** -24)

Scalar = Union[float, Tensor]


def _check_sequence_logprobs(tensor, name: str, like: Optional[Tensor] = None,
                             like_name: str = "policy_chosen") -> None:
    if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
        kind = tensor.dtype if isinstance(tensor, Tensor) else type(tensor).__name__
        raise TypeError(f"{name} must be a floating tensor of sequence log-probs [B], got {kind}")
    if tensor.dim() != 1 or (like is not None and tensor.shape != like.shape):
        expected = "[B]" if like is None else str(list(like.shape))
        raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)}")
    if like is not None and tensor.device != like.device:
        raise ValueError(f"{name} is on {tensor.device} but {like_name} is on {like.device}")


def _check_lengths(tensor, name: str, like: Tensor) -> Tensor:
    """Token counts ``[B]`` (integer or floating, e.g. ``mask.sum(-1)``) as float32, at least 1
    (TRL's ``clamp(min=1)``: a fully-masked sequence's sum 0 stays 0)."""
    if not isinstance(tensor, Tensor) or tensor.dtype == torch.bool or tensor.is_complex():
        kind = tensor.dtype if isinstance(tensor, Tensor) else type(tensor).__name__
        raise TypeError(f"{name} must be a real tensor of token counts [B], got {kind}")
    if tensor.shape != like.shape:
        raise ValueError(f"{name} must have shape {list(like.shape)}, got {tuple(tensor.shape)}")
    if tensor.device != like.device:
        raise ValueError(f"{name} is on {tensor.device} but policy_chosen is on {like.device}")
    return tensor.detach().float().clamp(min=1.0)


def _check_scalar(value, name: str, device: torch.device) -> Scalar:
    """A finite real number, or a one-element floating tensor on ``device`` (e.g. a running
    mean kept on the GPU; detached, and not read back, so its value is not checked)."""
    if isinstance(value, Tensor):
        if not value.is_floating_point() or value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element floating tensor, got "
                             f"a {value.dtype} tensor of shape {tuple(value.shape)}")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but the log-probs are on {device}")
        return value.detach().float().reshape(())
    return check_in_range(value, name, -math.inf, math.inf)


def _check_loss_types(loss_type, loss_weights) -> Tuple[Tuple[str, ...], Tuple[float, ...]]:
    types = (loss_type,) if isinstance(loss_type, str) else loss_type
    if not isinstance(types, (list, tuple)) or not types:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES} or a non-empty list of "
                         f"them, got {loss_type!r}")
    types = tuple(check_choice(t, "loss_type", DPO_LOSS_TYPES) for t in types)
    if len(set(types)) != len(types):
        raise ValueError(f"loss_type lists a type twice ({list(types)}): give it once, with "
                         f"the sum of its weights")
    if loss_weights is None:
        return types, (1.0,) * len(types)
    if isinstance(loss_weights, (str, Tensor)) or not isinstance(loss_weights, Sequence):
        raise TypeError(f"loss_weights must be a list of numbers, got "
                        f"{type(loss_weights).__name__}")
    if len(loss_weights) != len(types):
        raise ValueError(f"loss_weights has {len(loss_weights)} entries for {len(types)} loss "
                         f"types; give one weight per type")
    weights = tuple(check_in_range(w, f"loss_weights[{i}]", 0.0, math.inf)
                    for i, w in enumerate(loss_weights))
    return types, weights


@dataclass(frozen=True)
class DPOOptions:
    """Every scalar keyword of ``ak.dpo_loss`` (its docstring has their meaning). The
    log-probs, ``bco_delta`` (BCO's running mean, a per-step value that may be a tensor) and
    the token counts of ``sigmoid_norm`` are inputs. ``loss_type`` is one type or a list of
    them (with ``loss_weights``: MPO); ``discopop_tau=None`` is DiscoPOP's 0.05."""
    beta: float = 0.1
    loss_type: Union[str, Sequence[str]] = "sigmoid"
    label_smoothing: float = 0.0
    loss_weights: Optional[Sequence[float]] = None
    discopop_tau: Optional[float] = None

    def checked(self) -> "DPOOptions":
        """These options, each checked (``ValueError``/``TypeError`` naming it), every rule
        between them included (``label_smoothing`` and ``discopop_tau`` only where a listed
        type reads them); lists become tuples, numbers Python floats. A checked object checks
        again to itself."""
        types, weights = _check_loss_types(self.loss_type, self.loss_weights)
        beta = check_positive(self.beta, "beta")
        high = 0.5 if "robust" in types else 1.0
        label_smoothing = check_in_range(self.label_smoothing, "label_smoothing", 0.0, high)
        if "robust" in types and label_smoothing == 0.5:
            raise ValueError("label_smoothing must be < 0.5 for loss_type 'robust'")
        if "exo_pair" in types and not 0.0 < label_smoothing < 1.0:
            raise ValueError(f"loss_type 'exo_pair' needs label_smoothing (its epsilon) in "
                             f"(0, 1); the EXO paper uses 1e-3, got {label_smoothing}")
        if label_smoothing > 0 and not set(types) & set(DPO_SMOOTHED_TYPES):
            raise ValueError(f"label_smoothing={label_smoothing} is not used by loss_type "
                             f"{list(types)}; only {DPO_SMOOTHED_TYPES} have it")
        discopop_tau = self.discopop_tau
        if discopop_tau is not None:
            if "discopop" not in types:
                raise ValueError("discopop_tau is only used by loss_type 'discopop'")
            discopop_tau = check_positive(discopop_tau, "discopop_tau")
        return dataclasses.replace(
            self, beta=beta, label_smoothing=label_smoothing, discopop_tau=discopop_tau,
            loss_type=self.loss_type if isinstance(self.loss_type, str) else types,
            loss_weights=None if self.loss_weights is None else weights)

    @property
    def loss_types(self) -> Tuple[str, ...]:
        """The listed loss types (``loss_type`` as a tuple)."""
        return (self.loss_type,) if isinstance(self.loss_type, str) else tuple(self.loss_type)

    def keywords(self) -> dict:
        """The options as ``ak.dpo_loss`` keywords."""
        return {field.name: getattr(self, field.name) for field in fields(self)}


#: ``dpo_loss`` refuses ``options=`` beside an option keyword
dpo_options_or_keywords = options_or_keywords(DPOOptions, "DPO")


def _sigmoid(x: Tensor) -> Tensor:
    """``sigmoid(x)`` as ``exp(logsigmoid(x))``: its gradient keeps its relative precision on
    both tails (autograd's ``sigmoid`` forms ``y * (1 - y)``, which cancels where ``y -> 1``)."""
    return torch.exp(F.logsigmoid(x))


def _smoothed_sigmoid(logits: Tensor, label_smoothing: float) -> Tensor:
    """cDPO: ``-(1 - eps) log sigma(x) - eps log sigma(-x)``."""
    return (-(1.0 - label_smoothing) * F.logsigmoid(logits)
            - label_smoothing * F.logsigmoid(-logits))


def _dpo_losses(loss_type: str, chosen: Tensor, rejected: Tensor, ref_logratio: Tensor,
                beta: float, label_smoothing: float, discopop_tau: float, bco_delta: Scalar,
                lengths: Optional[Tuple[Tensor, Tensor]]) -> Tensor:
    """Per-pair loss of one TRL type from the log-ratios ``chosen = pi_c - ref_c`` and
    ``rejected = pi_r - ref_r``; ``ref_logratio = ref_c - ref_r`` (0 without a reference)."""
    margin = chosen - rejected
    if loss_type == "sigmoid":
        return _smoothed_sigmoid(beta * margin, label_smoothing)
    if loss_type == "ipo":
        return (margin - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1.0 - beta * margin)
    if loss_type == "robust":  # Chowdhury et al., 2024: unbiased under label-flip noise
        return ((-(1.0 - label_smoothing) * F.logsigmoid(beta * margin)
                 + label_smoothing * F.logsigmoid(-beta * margin))
                / (1.0 - 2.0 * label_smoothing))
    if loss_type == "exo_pair":  # KL(softmax(beta r) || [1 - eps, eps]) over the pair
        win, lose = F.logsigmoid(beta * margin), F.logsigmoid(-beta * margin)
        return (win.exp() * (win - math.log1p(-label_smoothing))
                + lose.exp() * (lose - math.log(label_smoothing)))
    if loss_type == "nca_pair":
        return (-F.logsigmoid(beta * chosen) - 0.5 * F.logsigmoid(-beta * chosen)
                - 0.5 * F.logsigmoid(-beta * rejected))
    if loss_type == "bco_pair":
        return (-F.logsigmoid(beta * chosen - bco_delta)
                - F.logsigmoid(-(beta * rejected - bco_delta)))
    if loss_type == "sppo_hard":
        return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
    if loss_type == "aot":  # sorted policy log-ratios against sorted reference log-ratios
        policy_logratio = margin + ref_logratio
        delta = torch.sort(policy_logratio).values - torch.sort(ref_logratio).values
        return _smoothed_sigmoid(beta * delta, label_smoothing)
    if loss_type == "aot_unpaired":
        delta = torch.sort(chosen).values - torch.sort(rejected).values
        return _smoothed_sigmoid(beta * delta, label_smoothing)
    if loss_type == "apo_zero":  # 1 - sigma(x) written sigma(-x)
        return _sigmoid(-beta * chosen) + _sigmoid(beta * rejected)
    if loss_type == "apo_down":
        return _sigmoid(beta * chosen) + _sigmoid(-beta * margin)
    if loss_type == "discopop":
        logits = beta * margin
        # exp(-x) * sigma(x / tau) as one exp: the product is finite where exp(-x) alone is not
        blended = torch.exp(F.logsigmoid(logits / discopop_tau) - logits)
        return -F.logsigmoid(logits) * _sigmoid(-logits / discopop_tau) + blended
    # sigmoid_norm: the log-ratios per completion token
    chosen_lengths, rejected_lengths = lengths
    return -F.logsigmoid(beta * (chosen / chosen_lengths - rejected / rejected_lengths))


@on_full_tensors
@dpo_options_or_keywords
def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Optional[Tensor] = None,
             ref_rejected: Optional[Tensor] = None, *, beta: float = 0.1,
             loss_type: Union[str, Sequence[str]] = "sigmoid",
             label_smoothing: float = 0.0, loss_weights: Optional[Sequence[float]] = None,
             discopop_tau: Optional[float] = None, bco_delta: Optional[Scalar] = None,
             chosen_lengths: Optional[Tensor] = None, rejected_lengths: Optional[Tensor] = None,
             options: Optional[DPOOptions] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """``(loss, metrics)`` of TRL's DPO loss types on summed sequence log-probs ``[B]``.

    ``loss_type`` is one of ``DPO_LOSS_TYPES`` or a list of them, summed with ``loss_weights``
    (TRL's multi-loss / MPO: ``sum_i w_i * mean_b loss_i``; weights default to 1). Without
    ``ref_chosen``/``ref_rejected`` the loss is reference-free (the reference log-ratios are 0).
    ``label_smoothing`` is the label-flip rate of ``sigmoid`` (cDPO), ``robust``, ``exo_pair``
    (its epsilon, required in ``(0, 1)``), ``aot`` and ``aot_unpaired``; giving it when no
    listed type uses it is an error. ``discopop_tau`` (default 0.05) is DiscoPOP's temperature.
    ``bco_delta`` is the reward shift of ``bco_pair``: TRL 1.x uses none (the default, 0);
    pass BCO's running mean of ``beta * log-ratio`` (a number or a one-element tensor, used
    detached) for the paper's and TRL 0.x's form. ``sigmoid_norm`` needs ``chosen_lengths`` and
    ``rejected_lengths`` (completion token counts ``[B]``, clamped at 1). ``ipo`` is the paper's
    form on the inputs given; TRL 1.x's length-normalized IPO is ``ipo`` on averaged log-probs.
    ``options``: a :class:`DPOOptions` holding ``beta``, ``loss_type``, ``label_smoothing``,
    ``loss_weights`` and ``discopop_tau`` at once; passing any of those keywords beside it
    raises ``ValueError``, whatever its value (``bco_delta`` and the lengths are inputs, given
    either way).

    Metrics (detached, float32 batch means): ``rewards/chosen`` and ``rewards/rejected``
    (``beta * (log pi - log ref)``), ``rewards/accuracy``, ``rewards/margin``, and with more
    than one type ``loss/<type>`` (each type's unweighted mean).
    """
    _check_sequence_logprobs(policy_chosen, "policy_chosen")
    _check_sequence_logprobs(policy_rejected, "policy_rejected", policy_chosen)
    if (ref_chosen is None) != (ref_rejected is None):
        raise ValueError("give both ref_chosen and ref_rejected, or neither (reference-free)")
    chosen_reward, rejected_reward = policy_chosen.float(), policy_rejected.float()
    ref_logratio = torch.zeros_like(chosen_reward)
    if ref_chosen is not None:
        _check_sequence_logprobs(ref_chosen, "ref_chosen", policy_chosen)
        _check_sequence_logprobs(ref_rejected, "ref_rejected", policy_chosen)
        ref_c, ref_r = ref_chosen.detach().float(), ref_rejected.detach().float()
        chosen_reward, rejected_reward = chosen_reward - ref_c, rejected_reward - ref_r
        ref_logratio = ref_c - ref_r
    options = options_from(options, dict(
        beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
        loss_weights=loss_weights, discopop_tau=discopop_tau), DPOOptions).checked()
    types = options.loss_types
    weights = (1.0,) * len(types) if options.loss_weights is None else options.loss_weights
    beta, label_smoothing = options.beta, options.label_smoothing
    discopop_tau = DISCOPOP_TAU if options.discopop_tau is None else options.discopop_tau
    if bco_delta is not None and "bco_pair" not in types:
        raise ValueError("bco_delta is only used by loss_type 'bco_pair'")
    bco_delta = 0.0 if bco_delta is None else _check_scalar(bco_delta, "bco_delta",
                                                            policy_chosen.device)
    lengths = None
    if "sigmoid_norm" in types:
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("loss_type 'sigmoid_norm' needs chosen_lengths and rejected_lengths "
                             "(the completion token counts [B], e.g. mask.sum(-1))")
        lengths = (_check_lengths(chosen_lengths, "chosen_lengths", policy_chosen),
                   _check_lengths(rejected_lengths, "rejected_lengths", policy_chosen))
    elif chosen_lengths is not None or rejected_lengths is not None:
        raise ValueError("chosen_lengths/rejected_lengths are only used by loss_type "
                         "'sigmoid_norm'")
    loss, parts = 0.0, {}
    for name, weight in zip(types, weights):
        part = _dpo_losses(name, chosen_reward, rejected_reward, ref_logratio, beta,
                           label_smoothing, discopop_tau, bco_delta, lengths).mean()
        parts[name] = part
        loss = loss + weight * part
    margin = chosen_reward - rejected_reward
    with torch.no_grad():
        metrics = {
            "rewards/chosen": beta * chosen_reward.mean(),
            "rewards/rejected": beta * rejected_reward.mean(),
            "rewards/accuracy": (chosen_reward > rejected_reward).float().mean(),
            "rewards/margin": beta * margin.mean(),
        }
        if len(types) > 1:
            metrics.update({f"loss/{name}": part.detach() for name, part in parts.items()})
    return loss, metrics


def _pair_metrics(chosen_reward: Tensor, rejected_reward: Tensor) -> Dict[str, Tensor]:
    with torch.no_grad():
        return {
            "rewards/chosen": chosen_reward.mean(),
            "rewards/rejected": rejected_reward.mean(),
            "rewards/accuracy": (chosen_reward > rejected_reward).float().mean(),
            "rewards/margin": (chosen_reward - rejected_reward).mean(),
        }


def _check_pair(chosen, rejected) -> Tuple[Tensor, Tensor]:
    _check_sequence_logprobs(chosen, "chosen")
    _check_sequence_logprobs(rejected, "rejected", chosen, "chosen")
    return chosen.float(), rejected.float()


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, switching at ``-ln 2`` to avoid cancellation."""
    return torch.where(x < -math.log(2.0), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@on_full_tensors
def orpo_loss(chosen: Tensor, rejected: Tensor, *,
              beta: float = 0.1) -> Tuple[Tensor, Dict[str, Tensor]]:
    """``(loss, metrics)``: ORPO's odds-ratio term ``-beta * mean(logsigmoid(log_odds))``.

    ``chosen``/``rejected`` are length-averaged sequence log-probs ``[B]`` (``average=True``);
    ``log_odds = (c - r) - (log(1 - e^c) - log(1 - e^r))``. The NLL term of ORPO stays the
    caller's cross-entropy on the chosen completions (as in TRL and Liger). Log-probs above
    ``ORPO_MAX_LOGPROB = log(1 - 2**-24)`` (a fully-masked sequence's 0; a float32
    probability of one) are clamped there, with zero gradient: their odds would be infinite.
    Metrics: ``rewards/*`` with rewards ``beta * log-prob``, ``log_odds_ratio`` (the batch
    mean of ``logsigmoid(log_odds)``) and ``log_odds_chosen`` (of ``log_odds``).
    """
    c, r = _check_pair(chosen, rejected)
    beta = check_positive(beta, "beta")
    c_odds, r_odds = c.clamp(max=ORPO_MAX_LOGPROB), r.clamp(max=ORPO_MAX_LOGPROB)
    log_odds = (c_odds - r_odds) - (_log1mexp(c_odds) - _log1mexp(r_odds))
    ratio = F.logsigmoid(log_odds)
    loss = -beta * ratio.mean()
    metrics = _pair_metrics(beta * c, beta * r)
    metrics["log_odds_ratio"] = ratio.detach().mean()
    metrics["log_odds_chosen"] = log_odds.detach().mean()
    return loss, metrics


@on_full_tensors
def simpo_loss(chosen: Tensor, rejected: Tensor, *, beta: float = 2.0, gamma: float = 0.5,
               label_smoothing: float = 0.0) -> Tuple[Tensor, Dict[str, Tensor]]:
    """``(loss, metrics)``: SimPO, ``-logsigmoid(beta * (c - r) - gamma)`` (cDPO-smoothed).

    ``chosen``/``rejected`` are length-averaged sequence log-probs ``[B]``; ``gamma >= 0`` is
    the target reward margin. Equal to TRL's CPO with ``loss_type="simpo"``,
    ``simpo_gamma = gamma`` and no NLL term, and to Liger's ``LigerFusedLinearSimPOLoss``.
    Metrics: ``rewards/*`` with rewards ``beta * log-prob``.
    """
    c, r = _check_pair(chosen, rejected)
    beta = check_positive(beta, "beta")
    gamma = check_in_range(gamma, "gamma", 0.0, math.inf)
    label_smoothing = check_in_range(label_smoothing, "label_smoothing", 0.0, 1.0)
    loss = _smoothed_sigmoid(beta * (c - r) - gamma, label_smoothing).mean()
    return loss, _pair_metrics(beta * c, beta * r)


@on_full_tensors
def cpo_loss(chosen: Tensor, rejected: Tensor, *, beta: float = 0.1,
             label_smoothing: float = 0.0, loss_type: str = "sigmoid",
             simpo_gamma: Optional[float] = None,
             alpha: float = 0.0) -> Tuple[Tensor, Dict[str, Tensor]]:
    """``(loss, metrics)``: TRL's ``CPOTrainer.cpo_loss`` (the preference term of CPO).

    TRL feeds it summed log-probs for ``"sigmoid"``/``"hinge"`` and averaged ones for
    ``"ipo"``/``"simpo"``; pass the same. With ``x = c - r``: ``sigmoid`` is cDPO on
    ``beta * x``, ``hinge`` ``relu(1 - beta * x)``, ``ipo`` ``(x - 1 / (2 beta))**2``,
    ``simpo`` cDPO on ``beta * x - simpo_gamma`` (default 0.5). ``alpha != 0`` is AlphaPO: each
    log-prob ``l`` becomes the reward ``(1 - e^(-alpha l)) / alpha`` first (AlphaPO proper is
    ``"simpo"`` with ``alpha`` and no NLL term). The behaviour-cloning NLL term
    (``cpo_alpha``) stays the caller's cross-entropy. ``label_smoothing`` applies to
    ``sigmoid`` and ``simpo`` only. Metrics: ``rewards/*`` with rewards ``beta * reward``.
    """
    c, r = _check_pair(chosen, rejected)
    beta = check_positive(beta, "beta")
    check_choice(loss_type, "loss_type", CPO_LOSS_TYPES)
    label_smoothing = check_in_range(label_smoothing, "label_smoothing", 0.0, 1.0)
    if label_smoothing > 0 and loss_type in ("hinge", "ipo"):
        raise ValueError(f"label_smoothing is not used by loss_type {loss_type!r}")
    if simpo_gamma is not None and loss_type != "simpo":
        raise ValueError("simpo_gamma is only used by loss_type 'simpo'")
    simpo_gamma = SIMPO_GAMMA if simpo_gamma is None else check_in_range(
        simpo_gamma, "simpo_gamma", 0.0, math.inf)
    alpha = check_in_range(alpha, "alpha", -math.inf, math.inf)
    if alpha != 0.0:  # (1 - p**-alpha) / alpha, with p**-alpha = exp(-alpha * l)
        c, r = -torch.expm1(-alpha * c) / alpha, -torch.expm1(-alpha * r) / alpha
    logits = c - r
    if loss_type == "sigmoid":
        losses = _smoothed_sigmoid(beta * logits, label_smoothing)
    elif loss_type == "simpo":
        losses = _smoothed_sigmoid(beta * logits - simpo_gamma, label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * logits)
    else:
        losses = (logits - 1.0 / (2.0 * beta)) ** 2
    return losses.mean(), _pair_metrics(beta * c, beta * r)


@on_full_tensors
def kto_loss(policy_logps: Tensor, ref_logps: Optional[Tensor], labels: Tensor, *,
             kl: Optional[Scalar] = None, beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0,
             loss_type: str = "kto") -> Tuple[Tensor, Dict[str, Tensor]]:
    """``(loss, metrics)``: TRL's unpaired KTO (or ``"apo_zero_unpaired"``) on summed
    sequence log-probs ``[B]``; ``labels [B]`` bool, True for a desirable completion.

    With ``x = log pi - log ref`` (``ref_logps=None``: reference-free, ``x = log pi``) and
    ``z = max(kl, 0)``: ``kto`` gives ``1 - sigmoid(beta (x - z))`` to a desirable completion
    and ``1 - sigmoid(beta (z - x))`` to an undesirable one; ``apo_zero_unpaired`` gives
    ``1 - sigmoid(beta x)`` and ``sigmoid(beta x)``. Each is multiplied by
    ``desirable_weight``/``undesirable_weight`` and the loss is their mean over all ``B``.
    ``kl`` (required by ``kto``, unused by ``apo_zero_unpaired``) is TRL's batch KL estimate:
    ``(kl_logps - ref_kl_logps).mean()`` over mismatched (prompt, completion) pairs, averaged
    over ranks by the caller; a number or a one-element tensor, used detached. Metrics: ``kl``
    (``z``), ``rewards/chosen`` and ``rewards/rejected`` (means of ``beta * x`` over the
    desirable/undesirable completions; NaN when there are none).
    """
    _check_sequence_logprobs(policy_logps, "policy_logps")
    x = policy_logps.float()
    if ref_logps is not None:
        _check_sequence_logprobs(ref_logps, "ref_logps", policy_logps, "policy_logps")
        x = x - ref_logps.detach().float()
    if not isinstance(labels, Tensor) or labels.dtype != torch.bool:
        kind = labels.dtype if isinstance(labels, Tensor) else type(labels).__name__
        raise TypeError(f"labels must be a bool tensor [B] (True: desirable), got {kind}")
    if labels.shape != policy_logps.shape or labels.device != policy_logps.device:
        raise ValueError(f"labels must have policy_logps' shape {list(policy_logps.shape)} and "
                         f"device, got {tuple(labels.shape)} on {labels.device}")
    check_choice(loss_type, "loss_type", KTO_LOSS_TYPES)
    beta = check_positive(beta, "beta")
    desirable_weight = check_in_range(desirable_weight, "desirable_weight", 0.0, math.inf)
    undesirable_weight = check_in_range(undesirable_weight, "undesirable_weight", 0.0, math.inf)
    if loss_type == "kto":
        if kl is None:
            raise ValueError("loss_type 'kto' needs kl, the batch KL estimate "
                             "(kl_logps - ref_kl_logps).mean(); pass 0.0 for none")
        kl = _check_scalar(kl, "kl", policy_logps.device)
        kl = torch.as_tensor(kl, dtype=torch.float32, device=x.device).clamp(min=0.0)
        desirable, undesirable = beta * (x - kl), beta * (kl - x)
    else:
        if kl is not None:
            raise ValueError("kl is not used by loss_type 'apo_zero_unpaired'")
        kl = torch.zeros((), dtype=torch.float32, device=x.device)
        desirable, undesirable = beta * x, -beta * x
    # 1 - sigmoid(v) written sigmoid(-v)
    losses = torch.where(labels, desirable_weight * _sigmoid(-desirable),
                         undesirable_weight * _sigmoid(-undesirable))
    with torch.no_grad():
        reward = beta * x
        count = labels.sum()

        def side_mean(selected: Tensor, n: Tensor) -> Tensor:
            return torch.where(selected, reward, 0.0).sum() / n  # 0 / 0 = NaN: no completions

        metrics = {"kl": kl.detach(), "rewards/chosen": side_mean(labels, count),
                   "rewards/rejected": side_mean(~labels, labels.numel() - count)}
    return losses.mean(), metrics


def group_advantages(rewards: Tensor, *, scale: str = "group", eps: float = 1e-6) -> Tensor:
    """``(r - mean_g) / (std_g + eps)`` over each row's group (population std), float32.

    ``scale="batch"`` divides by the std of the whole batch, ``"none"`` only centres. A group
    whose rewards are all equal (a group of one included) gives exactly 0, whatever ``eps``
    (with ``eps=0`` it would be ``0 / 0``).
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 2:
        raise ValueError(f"rewards must be a tensor of shape [B, G], got "
                         f"{getattr(rewards, 'shape', type(rewards).__name__)}")
    if rewards.is_complex() or rewards.dtype == torch.bool:
        raise TypeError(f"rewards must be a real tensor, got {rewards.dtype}")
    check_choice(scale, "scale", ADVANTAGE_SCALES)
    eps = check_in_range(eps, "eps", 0.0, float("inf"))
    if not math.isfinite(eps):
        raise ValueError(f"eps must be finite, got {eps}")
    rewards = rewards.float()
    # Tied groups are found exactly: their centred values may be rounding noise, not 0.
    tied = (rewards == rewards[:, :1]).all(dim=-1, keepdim=True)
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if scale == "none":
        return torch.where(tied, 0.0, centred)
    if scale == "group":
        std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    else:
        std = rewards.std(unbiased=False)
    denominator = std + eps
    # A zero denominator outside tied groups needs eps = 0 and a std that underflowed.
    usable = ~tied & (denominator > 0)
    return torch.where(usable, centred / torch.where(usable, denominator, 1.0), 0.0)
