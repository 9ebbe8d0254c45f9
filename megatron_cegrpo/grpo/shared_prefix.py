"""Shared-prefix packing (issue 32 item 1): each group of G responses to one prompt becomes one
sequence ``[prompt, r_1, ..., r_G, filler]`` in which ``r_i`` attends to the prompt and causally to
its own earlier tokens only, with RoPE positions that continue each ``r_i`` from the prompt length.

Why this is exact: with causal attention the hidden state at a prompt position depends only on the
prompt, so it is the same in the G unshared rows; a response token of ``r_i`` sees exactly the keys
it sees in its own unshared row (the prompt and ``r_i``'s earlier tokens) at the same RoPE
positions, so its scores, and every activation, equal the unshared ones up to fp32 reduction order
(the masked keys add ``exp(-10000 - max) = 0`` to the softmax). The logits of the last prompt
position score ``r_i[0]`` for every i; in the backward their G gradients add up at that one
position, which is the chain rule through one copy instead of G. Prefix Grouper (Liu et al. 2025,
arXiv 2506.05433) proves the same training equivalence for GRPO.

Layout of the batch this packs (``grpo/batch.py``): row i is ``prompt_i + response_i`` from
position 0, right-padded to S; the G rows of a group are consecutive and share their prompt;
``labels[i, j]`` is token j + 1, so the logits at position j score ``labels[i, j]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch

__all__ = ["PAD_TO_MULTIPLE", "SharedPrefixLayout", "pack_shared_prefix", "packed_group_length", "packed_length",
           "rows_from_packed", "packed_microbatch"]

#: the packed length L is rounded up to a multiple of this (``pack_shared_prefix``; ``plan.py``'s budget check)
PAD_TO_MULTIPLE = 8


def packed_length(tokens: int, pad_to_multiple: int = PAD_TO_MULTIPLE) -> int:
    """L for a longest group of ``tokens`` = P + sum R_i tokens: rounded up to ``pad_to_multiple``."""
    return -(-int(tokens) // pad_to_multiple) * pad_to_multiple


def packed_group_length(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, group_size: int,
                        pad_to_multiple: int = PAD_TO_MULTIPLE) -> int:
    """L of a batch packed in groups of ``group_size`` consecutive rows: the longest group's
    P + sum R_i (P: its first row's prompt length), rounded up (:func:`packed_length`).
    ``prompt_lengths``, ``response_lengths``: long [N], N a multiple of ``group_size``."""
    g = int(group_size)
    lengths = prompt_lengths.long()[::g] + response_lengths.long().view(-1, g).sum(dim=1)
    return packed_length(int(lengths.max()), pad_to_multiple)


@dataclass
class SharedPrefixLayout:
    """The shared layout of N = NG x G rows of a batch.

    Attributes:
        tokens: long [NG, L], ``[prompt, r_1, ..., r_G]`` then the filler token.
        position_ids: long [NG, L], 0..P-1 on the prompt, P..P+R_i-1 on ``r_i``, 0 on the filler.
        attention_mask: bool [NG, 1, L, L], True = masked out (megatron's convention, the local
            spec's ``DotProductAttention``): query q may see key k iff k <= q and k is a prompt
            token or in q's own segment (a filler query sees the prompt and earlier fillers).
        token_index: long [N, S], where token j of row i sits in its group's packed row
            (0..L-1); -1 past the row's P_i + R_i tokens.
        logit_index: long [N, S], the packed position whose logits score ``labels[i, j]``; -1
            where the unshared logits score no token of the sequence (j >= P_i + R_i - 1: the
            last response token and the padding; ``loss_mask`` is 0 there).
        group_size: G.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_index: torch.Tensor
    logit_index: torch.Tensor
    group_size: int

    @property
    def seq_length(self) -> int:
        """L, the packed length (one for every group of the batch: the pipeline's fixed shape)."""
        return int(self.tokens.shape[1])


def pack_shared_prefix(tokens: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
                       group_size: int, *, pad_to_multiple: int = PAD_TO_MULTIPLE, filler_token: int | None = None
                       ) -> SharedPrefixLayout:
    """Pack every group of ``group_size`` consecutive rows into one shared-prefix sequence.

    Args:
        tokens: long [N, S], right-padded rows (``pack_rollouts``).
        prompt_lengths, response_lengths: long [N], P_i >= 1 and R_i >= 1 per row.
        group_size: G; must divide N, and the G rows of a group must share P and their prompt tokens.
        pad_to_multiple: L = max over groups of (P + sum R_i), rounded up to a multiple of this.
        filler_token: the token after a group's sequence; default ``tokens[0, -1]`` (a token of the
            batch, so a row cache of the batch's embedding rows holds it: ``tied_embedding.py``).
    Returns:
        the :class:`SharedPrefixLayout` (CPU tensors, on ``tokens``' device).
    Raises:
        ValueError: G does not divide N, or a group's rows do not share their prompt.
    """
    n, s = tokens.shape
    g = int(group_size)
    if g < 1 or n % g:
        raise ValueError(f"shared prefix: the group size {g} does not divide the {n} rows")
    p_len, r_len = prompt_lengths.long().tolist(), response_lengths.long().tolist()
    ng = n // g
    for k in range(ng):
        rows = range(k * g, (k + 1) * g)
        p = p_len[k * g]
        if any(p_len[i] != p or not torch.equal(tokens[i, :p], tokens[k * g, :p]) for i in rows):
            raise ValueError(f"shared prefix: rows {k * g}..{(k + 1) * g - 1} (group {k}) do not share one prompt")
    length = packed_group_length(prompt_lengths, response_lengths, g, pad_to_multiple)
    fill = int(tokens[0, -1]) if filler_token is None else int(filler_token)
    dev = tokens.device
    out_tok = torch.full((ng, length), fill, dtype=torch.long, device=dev)
    pos = torch.zeros((ng, length), dtype=torch.long, device=dev)
    seg = torch.full((ng, length), -1, dtype=torch.long, device=dev)  # 0 prompt, i + 1 response i, -1 filler
    tok_idx = torch.full((n, s), -1, dtype=torch.long, device=dev)
    logit_idx = torch.full((n, s), -1, dtype=torch.long, device=dev)
    for k in range(ng):
        p = p_len[k * g]
        out_tok[k, :p] = tokens[k * g, :p]
        pos[k, :p] = torch.arange(p)
        seg[k, :p] = 0
        off = p
        for m in range(g):
            i, r = k * g + m, r_len[k * g + m]
            out_tok[k, off:off + r] = tokens[i, p:p + r]
            pos[k, off:off + r] = torch.arange(p, p + r)
            seg[k, off:off + r] = m + 1
            tok_idx[i, :p] = torch.arange(p)
            tok_idx[i, p:p + r] = torch.arange(off, off + r)
            # logits at j score token j + 1: j < P - 1 the prompt's, j = P - 1 the shared last prompt
            # position scoring r_i[0], then r_i's own tokens up to its second-to-last
            logit_idx[i, :p + r - 1] = tok_idx[i, :p + r - 1]
            off += r
    q = torch.arange(length, device=dev)
    causal = q.view(1, -1, 1) >= q.view(1, 1, -1)  # [1, Lq, Lk]: k <= q
    visible = causal & ((seg.unsqueeze(1) == 0) | (seg.unsqueeze(2) == seg.unsqueeze(1)))
    return SharedPrefixLayout(tokens=out_tok, position_ids=pos, attention_mask=~visible.unsqueeze(1),
                              token_index=tok_idx, logit_index=logit_idx, group_size=g)


def rows_from_packed(x: torch.Tensor, index: torch.Tensor, group_size: int) -> torch.Tensor:
    """The unshared ``[b, S, ...]`` view of a packed tensor, differentiable (a gather: the backward
    adds the gradients of every row that reads one packed position, e.g. the G rows' ``r_i[0]``
    scores at the last prompt position).

    Args:
        x: [b / G, L, ...] (any dtype), packed groups in row order.
        index: long [b, S], a :class:`SharedPrefixLayout` ``token_index`` or ``logit_index`` of
            the same b rows; -1 entries read packed position 0 of the row's group (a placeholder
            the caller masks out).
        group_size: G.
    Returns:
        [b, S, ...], x's dtype: ``out[i, j] = x[i // G, index[i, j]]``.
    """
    b, s = index.shape
    ng, length = x.shape[0], x.shape[1]
    if ng * group_size != b:
        raise ValueError(f"rows_from_packed: {ng} packed groups of {group_size} rows != {b} rows")
    group = torch.arange(b, device=index.device).div(group_size, rounding_mode="floor").unsqueeze(1)
    flat = (group * length + index.clamp(min=0)).reshape(-1)
    return x.reshape(ng * length, *x.shape[2:]).index_select(0, flat).reshape(b, s, *x.shape[2:])


def packed_microbatch(layout: SharedPrefixLayout, start: int, end: int) -> Dict[str, torch.Tensor]:
    """The packed tensors of rows ``[start, end)`` (whole groups): ``tokens``, ``position_ids``
    long [(end - start) / G, L], ``attention_mask`` bool [(end - start) / G, 1, L, L], and the rows'
    ``logit_index`` long [end - start, S] (indices into their own groups' packed rows).

    Raises:
        ValueError: the rows cut a group.
    """
    g = layout.group_size
    if start % g or end % g:
        raise ValueError(f"shared prefix: rows [{start}, {end}) cut a group of {g}")
    return {"tokens": layout.tokens[start // g:end // g], "position_ids": layout.position_ids[start // g:end // g],
            "attention_mask": layout.attention_mask[start // g:end // g],
            "logit_index": layout.logit_index[start:end]}
