"""Attention masks and position ids built from the masks a batch carries (never from token ids).

Convention of every mask here: boolean, ``True`` = attend / real token. A 4-D attention mask is
``[B, 1, S_q, S_k]``, the layout ``F.scaled_dot_product_attention`` and the seed's models take.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor


def make_doc_boundary_mask(position_ids: Tensor) -> Tensor:
    """Causal mask that also keeps packed documents apart, ``[B, 1, S, S]`` bool.

    A new document starts wherever the position id does not increase (``pos[t] <= pos[t-1]``),
    as in the seed: token ``q`` may attend to key ``k`` iff ``k <= q`` and both lie in the same
    document.
    """
    if position_ids.dim() != 2:
        raise ValueError(
            f"position_ids must be [batch, seq_len], got shape {tuple(position_ids.shape)}"
        )
    batch, seq_len = position_ids.shape
    device = position_ids.device
    boundaries = position_ids[:, 1:] <= position_ids[:, :-1]
    doc_ids = torch.cat(
        [
            torch.zeros(batch, 1, dtype=torch.long, device=device),
            boundaries.long().cumsum(dim=1),
        ],
        dim=1,
    )
    same_doc = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)
    causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device))
    return (same_doc & causal).unsqueeze(1)


def padded_causal_mask(key_mask: Tensor) -> Tensor:
    """``[B, 1, S, S]`` bool: causal, padding keys hidden, and every query sees at least itself.

    ``key_mask [B, S]`` marks the real tokens. The diagonal is always allowed so a padding query
    never has an empty row (an all-masked softmax row is NaN in most attention kernels, and a
    NaN in an ignored position still poisons a masked sum, ``NaN * 0 = NaN``); real queries are
    unaffected because they may attend to themselves anyway.
    """
    if key_mask.dim() != 2:
        raise ValueError(f"key mask must be [batch, seq_len], got shape {tuple(key_mask.shape)}")
    key_mask = key_mask.bool()
    seq_len = key_mask.shape[1]
    causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool, device=key_mask.device))
    eye = torch.eye(seq_len, dtype=torch.bool, device=key_mask.device)
    return (key_mask[:, None, None, :] & causal) | eye


def positions_from_mask(key_mask: Tensor) -> Tensor:
    """Position ids counting real tokens only: ``cumsum(mask) - 1``, clamped at 0 for padding.

    With left padding the first real token gets position 0, as it had during generation.
    """
    return (key_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def left_align(tokens: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
    """Move the padding of each row to the front, keeping the order of the real tokens.

    Prompts may come right-padded (the seed's rollout generator pads them on the right). When a
    response is appended after a right-padded prompt, the token that "predicts" the first response
    token is a pad, not the last prompt token, and the response positions are shifted by the pad
    count. Left-aligning makes ``prompt + response`` one contiguous run of real tokens.
    """
    order = torch.argsort(mask.to(torch.int8), dim=-1, stable=True)
    return tokens.gather(-1, order), mask.bool().gather(-1, order)


def model_inputs(key_mask: Optional[Tensor], input_ids: Tensor) -> Tuple[Tensor, Tensor]:
    """``(input_mask, position_ids)`` for a ``[B, S]`` batch whose real tokens ``key_mask`` marks.

    Without a key mask (no padding, or right padding only, which a causal mask already hides from
    every real token) the plain causal mask and ``arange`` positions are returned.
    """
    if key_mask is None:
        key_mask = torch.ones_like(input_ids, dtype=torch.bool)
    return padded_causal_mask(key_mask), positions_from_mask(key_mask)
