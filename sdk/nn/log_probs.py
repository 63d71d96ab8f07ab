"""Token log-probabilities of a causal language model from its hidden states and its head, without the logits.

The preference losses (DPO and its family) need, per sequence, the sum of the label tokens' log-probabilities
under the policy and the reference model. :func:`causal_lm_log_probs` gives them per token from the last hidden
states and the ``lm_head`` module through :func:`shardkit.ops.linear_log_probs`, wherever the head's weight lives:

- whole (one device, DDP, ZeRO-1/2, FSDP2 inside the model's forward, where the root unit has gathered it);
- partitioned in place by an engine (ZeRO-3): gathered read-only for the call (:mod:`shardkit.utils.partitioned`),
  as the fused cross-entropy loss does, for a frozen model (no gradient: backward would find the weight
  partitioned again, so a weight that wants one is refused; score inside the head's forward instead);
- split on the vocabulary by TensorParallel (a DTensor sharded on dim 0 over a mesh dimension named ``"tp"``): each
  rank runs the chunked kernels on its slice, and the per-row logsumexp, the label's logit and the entropy's
  mean are combined across the tp group (a few floats per token); backward sums grad_hidden over the group.

Under ContextParallel each rank holds a slice of every sequence and the result is per token, so it is local.
A weight still sharded by FSDP2 (read outside the model's forward) is refused: its gradient would skip FSDP's
reduction; :func:`whole_only_in_forward` tells a caller to score inside the forward instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from shardkit.ops.fused_linear_cross_entropy import check_label_range, flce_compute_dtype
from shardkit.ops.linear_log_probs import check_options, linear_log_probs, log_prob_grads, log_prob_stats

__all__ = ["causal_lm_log_probs", "head_log_probs", "shift_labels", "whole_only_in_forward"]


def shift_labels(labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Labels for next-token prediction: position t gets ``labels[t + 1]``, the last position ``ignore_index``."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _vocab_split_dim(weight: Tensor) -> int | None:
    """The mesh dim of a DTensor ``weight`` split on the vocabulary (dim 0) over a mesh dim named "tp" and
    replicated elsewhere; None for any other placement."""
    from torch.distributed.tensor import Shard

    placements = weight.placements
    names = weight.device_mesh.mesh_dim_names or ()
    sharded = [i for i, p in enumerate(placements) if not p.is_replicate()]
    if (len(sharded) == 1 and type(placements[sharded[0]]) is Shard and placements[sharded[0]].dim == 0
            and len(names) > sharded[0] and names[sharded[0]] == "tp"):
        return sharded[0]
    return None


def _partitioned(weight: Tensor) -> bool:
    from shardkit.utils.partitioned import handlers  # here: importing shardkit.nn loads no strategy

    return any(handler.is_partitioned(weight) for handler in handlers())


def whole_only_in_forward(weight: Tensor) -> bool:
    """Whether a head's ``weight`` is sharded by an engine that has it whole only inside its module's forward (and
    again for that module's backward): a DTensor that is not TensorParallel's vocabulary split (FSDP2's shards),
    or a parameter partitioned in place (ZeRO-3). Such a head is scored inside its module's forward (the preference
    trainers: :mod:`shardkit.preference.logps`), where the engine gathers it and reduces its gradient."""
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        return _vocab_split_dim(weight) is None
    return _partitioned(weight)


def _vocab_parallel_group(weight: Tensor) -> Any | None:
    """The tp process group when ``weight`` is a DTensor split on the vocabulary over a mesh dim named "tp"; None
    for a plain tensor. Raises for any other sharding (FSDP2's, read outside the forward that gathers it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(weight, DTensor):
        return None
    dim = _vocab_split_dim(weight)
    if dim is not None:
        return weight.device_mesh.get_group(dim)
    mesh, placements = weight.device_mesh, weight.placements
    names = mesh.mesh_dim_names or ()
    raise ValueError(
        f"causal_lm_log_probs: the head's weight is a DTensor with placements {tuple(placements)} on mesh dims "
        f"{names}; only a vocabulary split over the 'tp' dim (TensorParallel's ColwiseParallel head) is read here. "
        "A weight sharded by FSDP is whole only inside the model's forward: compute the log-probs there (e.g. "
        "shardkit's Llama: model(input_ids, labels, return_log_probs=True)), so that FSDP gathers the head and "
        "reduces its gradient")


def _vocab_offset(vocab: int, local: int, group: Any) -> int:
    """First vocabulary row of this rank's slice: DTensor's Shard(0) splits as torch.chunk does."""
    per = -(-vocab // dist.get_world_size(group))
    offset = min(dist.get_group_rank(group, dist.get_rank()) * per, vocab)
    if local != max(0, min(per, vocab - offset)):
        raise ValueError(f"causal_lm_log_probs: a vocab slice of {local} rows at {offset} is not torch.chunk's "
                         f"split of {vocab} rows; shard the head with Shard(0) (ColwiseParallel)")
    return offset


class _VocabParallelLogProbs(torch.autograd.Function):
    """linear_log_probs on this rank's vocabulary slice, combined across ``group`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, group: Any,
                offset: int, opts: tuple) -> tuple[Tensor, Tensor]:
        ignore_index, softcap, inv_temp, chunk_rows, compute_dtype, want_entropy = opts
        valid = labels != ignore_index
        local = weight.shape[0]
        inside = valid & (labels >= offset) & (labels < offset + local)
        columns = torch.where(inside, labels - offset, torch.full_like(labels, -1))
        lse_l, target, m_l = log_prob_stats(hidden, weight, columns, bias, softcap, inv_temp, chunk_rows,
                                            compute_dtype, want_entropy)
        top = lse_l.clone()
        dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
        # one all-reduce for the sums: this rank's exp-sum (relative to the max), the label's logit, its share of m
        parts = [torch.exp(lse_l - top), target] + ([torch.exp(lse_l - top) * m_l] if want_entropy else [])
        sums = torch.stack(parts)
        dist.all_reduce(sums, group=group)
        lse = top + torch.log(sums[0])
        zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
        logp = torch.where(valid, sums[1] - lse, zero)
        m = sums[2] / sums[0] if want_entropy else lse.new_empty(0)
        entropy = torch.where(valid, lse - m, zero) if want_entropy else lse.new_empty(0)
        ctx.save_for_backward(hidden, weight, bias, columns, valid, lse, m)
        ctx.group, ctx.opts = group, opts
        ctx.has_bias = bias is not None
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_lp: Tensor | None, grad_ent: Tensor | None):
        hidden, weight, bias, columns, valid, lse, m = ctx.saved_tensors
        _, softcap, inv_temp, chunk_rows, compute_dtype, _ = ctx.opts
        zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
        grad_lp = torch.where(valid, grad_lp.to(lse.dtype), zero) if grad_lp is not None else torch.zeros_like(lse)
        grad_ent = (torch.where(valid, grad_ent.to(lse.dtype), zero) if grad_ent is not None and m.numel()
                    else lse.new_empty(0))
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
        gh, gw, gb = log_prob_grads(grad_lp, grad_ent, hidden, weight, columns, bias, lse, m, softcap, inv_temp,
                                    chunk_rows, compute_dtype, need)
        if need[0]:  # every rank's slice of the vocabulary adds to the gradient of the (replicated) hidden states
            dist.all_reduce(gh, group=ctx.group)
        return (gh if need[0] else None, gw if need[1] else None, gb if need[2] else None, None, None, None, None)


def head_log_probs(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                   softcap: float | None = None, ignore_index: int = -100, temperature: float = 1.0,
                   return_entropy: bool = False, chunk_size: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`shardkit.ops.linear_log_probs` for a head weight wherever it lives (see the module docstring).

    Every rank of a ZeRO-3 or tp group must call it together (the gathers and reductions are collectives).
    """
    from shardkit.utils.partitioned import gathered_for_read  # here: importing shardkit.nn loads no strategy

    check_options(softcap, temperature, chunk_size, op="causal_lm_log_probs")
    if torch.is_grad_enabled() and weight.requires_grad and _partitioned(weight):
        raise ValueError(
            "causal_lm_log_probs: the head's weight is partitioned by ZeRO-3 and would be gathered for this call only, "
            "so backward would find it partitioned again (and its gradient would skip the engine's reduction). Score "
            "it inside the head module's forward, where the engine gathers it for forward and backward (the "
            "preference trainers do), or under torch.no_grad() for a frozen model")
    with gathered_for_read(weight, bias):
        group = _vocab_parallel_group(weight)
        if group is None:
            return linear_log_probs(hidden, weight, labels, bias=bias, softcap=softcap, ignore_index=ignore_index,
                                    temperature=temperature, return_entropy=return_entropy, chunk_size=chunk_size)
        return _vocab_parallel(hidden, weight, labels, bias, group, softcap, ignore_index, temperature,
                               return_entropy, chunk_size)


def _vocab_parallel(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, group: Any,
                    softcap: float | None, ignore_index: int, temperature: float, return_entropy: bool,
                    chunk_size: int | None) -> Tensor | tuple[Tensor, Tensor]:
    from torch.distributed.tensor import DTensor

    vocab = weight.shape[0]
    local_w = weight.to_local()
    local_b = bias.to_local() if isinstance(bias, DTensor) else bias
    if isinstance(hidden, DTensor):  # a replicated activation: every rank holds it whole
        hidden = hidden.to_local()
    flat = labels.reshape(-1).long().to(hidden.device)
    check_label_range(flat, vocab, ignore_index, op="causal_lm_log_probs")
    offset = _vocab_offset(vocab, local_w.shape[0], group)
    opts = (int(ignore_index), float(softcap or 0.0), 1.0 / float(temperature), int(chunk_size or 0),
            flce_compute_dtype(hidden, local_w, local_b), bool(return_entropy))
    logp, entropy = _VocabParallelLogProbs.apply(hidden.reshape(-1, hidden.shape[-1]), local_w, local_b, flat,
                                                 group, offset, opts)
    logp = logp.view(labels.shape)
    return (logp, entropy.view(labels.shape)) if return_entropy else logp


def causal_lm_log_probs(hidden: Tensor, lm_head: nn.Module, labels: Tensor | None = None, *,
                        shifted_labels: Tensor | None = None, ignore_index: int = -100, softcap: float | None = None,
                        temperature: float = 1.0, return_entropy: bool = False,
                        chunk_size: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log-probabilities of the next token under a causal LM, from its last hidden states.

    Args:
        hidden: (B, T, H) last hidden states (after the final norm).
        lm_head: the output projection (weight (V, H), optional bias); its forward is not called, so no logits.
        labels: (B, T) token ids, shifted here: position t scores ``labels[t + 1]``, the last position gets 0.
        shifted_labels: (B, T) labels already shifted (wins over ``labels``).
        ignore_index: label value whose positions give 0 (prompt and padding tokens).
        softcap: the model's final logit softcap (Gemma 2), if any.
        temperature, return_entropy, chunk_size: as :func:`shardkit.ops.linear_log_probs`.

    Returns:
        (B, T) log-probabilities (fp32), or ``(logp, entropy)``; a sequence's log-probability is ``.sum(-1)``.
    """
    if shifted_labels is None:
        if labels is None:
            raise ValueError("causal_lm_log_probs: pass labels or shifted_labels")
        shifted_labels = shift_labels(labels, ignore_index)
    if shifted_labels.shape != hidden.shape[:-1]:
        raise ValueError(f"causal_lm_log_probs: labels {tuple(shifted_labels.shape)} do not match the hidden states "
                         f"{tuple(hidden.shape[:-1])}")
    return head_log_probs(hidden, lm_head.weight, shifted_labels.to(hidden.device), bias=getattr(lm_head, "bias", None),
                          softcap=softcap, ignore_index=ignore_index, temperature=temperature,
                          return_entropy=return_entropy, chunk_size=chunk_size)
