"""Per-sequence completion log-probabilities from one forward, without the ``[tokens, vocab]`` logits.

The model runs to its last hidden states only (a Hugging Face model with ``output_hidden_states`` and
``logits_to_keep=1``, so its head projects one position per row; shardkit's Llama with ``return_hidden=True``),
always through the set-up (wrapped) model so that the strategy's hooks run. The completion positions are then
scored against the LM head weight by :func:`shardkit.ops.linear_log_probs` (through
:func:`shardkit.nn.head_log_probs`), chunked over rows, and summed per sequence. The mean logit (TRL's
``logits/*`` metrics) is ``hidden . mean(W) + mean(b)`` (the mean of a linear map), exact and
``O(tokens x hidden)``; with a softcap, and for WPO's ``log sum p^2``, the logits are rebuilt under ``no_grad``
a bounded block of rows at a time.

Where the head's weight is whole only inside the model's forward (FSDP2's shards:
:func:`shardkit.nn.log_probs.whole_only_in_forward`), the completion positions are scored *inside* that forward:
for the one call, the head's ``forward`` is replaced by a scorer (:class:`_ForwardScorer`) that turns the hidden
states it is handed into the completion tokens' log-probs (and the metrics' logit statistics) with the weight
the engine has just gathered. Its output is the model's output, so the engine's backward hooks gather the head
again for backward and reduce its gradient. A Hugging Face model runs with ``logits_to_keep=0`` (its head sees
every position), shardkit's Llama through its loss path (its head is handed the shifted rows and labels).
:func:`score_positions` is the same mechanism for any positions (the family's NLL over whole sequences and entropy),
handing back the detached final hidden states for metrics read after the forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from shardkit.nn.log_probs import whole_only_in_forward
from shardkit.trainer.peft_support import base_model_of
from shardkit.utils.partitioned import gathered_for_read

__all__ = ["SequenceLogps", "lm_head_of", "score_positions", "sequence_log_probs", "token_log_probs"]

# Rows x vocab elements of one no-grad block (metrics only): 2^22 floats, 16 MiB in fp32.
_BLOCK_ELEMENTS = 1 << 22
_CHUNK_BYTES = 32 << 20


@dataclass
class SequenceLogps:
    """One forward's completions, each ``[sequences]`` (chosen rows first, then rejected).

    Attributes:
        logps: summed completion log-probabilities (LD-DPO weighted when ``ld_alpha`` is set), with gradient.
        sum_logps: the plain sums (no LD weighting), with gradient: ``sum_logps / tokens`` is the mean log-prob
            (ORPO, SimPO), ``-sum_logps`` the NLL (ORPO's and ``sft``'s SFT term).
        tokens: completion tokens per sequence (float).
        mean_logits: summed mean logits of the completion tokens (no gradient), or None.
        wpo_logps: WPO's per-token mean of ``log p - log sum_v p_v^2`` (no gradient), or None.
        entropy: summed entropies of the next-token distributions at the completion tokens (no gradient), or None.
        top1: completion tokens whose label is the most likely token (the first on ties, as ``argmax``), per
            sequence; counted for the chosen sequences only (the rejected ones get 0), or None.
    """

    logps: Tensor
    sum_logps: Tensor
    tokens: Tensor
    mean_logits: Tensor | None = None
    wpo_logps: Tensor | None = None
    entropy: Tensor | None = None
    top1: Tensor | None = None


def lm_head_of(model: nn.Module) -> nn.Module:
    """The output projection of a causal LM (a PeftModel's base model's)."""
    base = base_model_of(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else getattr(base, "lm_head", None)
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(base).__name__} has no LM head (get_output_embeddings() or .lm_head with a weight): "
                         "preference trainers score completions against the output projection")
    return head


def _is_shardkit_llama(module: nn.Module) -> bool:
    from shardkit.models import Llama

    return isinstance(module, Llama)


def _llama_padding(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """shardkit Llama's ``attention_mask`` argument where the batch needs it: padding before a real token (RL's
    left-padded prompts). Padding only after a row's last real token changes nothing a causal model scores, so it
    is left out (the model keeps its unmasked attention, and context parallelism its split)."""
    mask = batch.get("attention_mask")
    if mask is None or mask.shape[1] < 2 or not bool((mask[:, 1:] > mask[:, :-1]).any()):
        return {}
    return {"attention_mask": mask}


def last_hidden_states(model: nn.Module, unwrapped: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The final (normed) hidden states ``[rows, T, H]`` of ``batch``, through the set-up ``model``."""
    position_ids = batch.get("position_ids")
    if _is_shardkit_llama(base_model_of(unwrapped)):
        return model(batch["input_ids"], position_ids=position_ids, return_hidden=True, **_llama_padding(batch))
    kwargs: dict[str, Any] = {"input_ids": batch["input_ids"], "use_cache": False, "output_hidden_states": True,
                              "logits_to_keep": 1, "return_dict": True}
    if batch.get("attention_mask") is not None:
        kwargs["attention_mask"] = batch["attention_mask"]
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    out = model(**kwargs)
    states = getattr(out, "hidden_states", None)
    if not states:
        raise ValueError(f"{type(base_model_of(unwrapped)).__name__} returned no hidden_states for "
                         "output_hidden_states=True: preference trainers need a Hugging Face causal LM or shardkit's "
                         "Llama")
    return states[-1]


def token_log_probs(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None,
                    softcap: float | None = None, return_entropy: bool = False,
                    temperature: float = 1.0) -> Tensor | tuple[Tensor, Tensor]:
    """``log softmax((hidden @ weight.T + bias) / temperature)[labels]`` per row of ``hidden [N, H]`` without the
    ``[N, V]`` logits (fp32), and with ``return_entropy`` each row's entropy: :func:`shardkit.nn.head_log_probs`, which
    gathers a ZeRO-3 head and combines a TensorParallel vocabulary split (and refuses an FSDP2 shard read outside
    the forward)."""
    from shardkit.nn.log_probs import head_log_probs

    # Rows per chunk so that one chunk's fp32 logits stay near 32 MiB whatever the vocabulary (the op's default
    # budget is 256 MiB): the logits are what preference training would otherwise spend its memory on.
    rows = max(16, _CHUNK_BYTES // (4 * max(weight.shape[0], 1)))
    out = head_log_probs(hidden, weight, labels, bias=bias, softcap=softcap, chunk_size=rows,
                         return_entropy=return_entropy, temperature=temperature)
    return (out[0].float(), out[1].float()) if return_entropy else out.float()


def _whole(t: Tensor | None) -> Tensor | None:
    """A DTensor (TensorParallel's vocabulary split) gathered whole; anything else as it is. For the no-grad
    metrics only: the log-probs themselves combine the split without gathering it."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def _logit_stats(hidden: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None,
                 need_sq: bool) -> tuple[Tensor, Tensor | None]:
    """Per row: the mean logit over the vocabulary, and ``log sum_v p_v^2`` when ``need_sq``."""
    if softcap is None and not need_sq:
        mean = hidden.float() @ _whole(weight.float().mean(0))
        return (mean + _whole(bias.float().mean())) if bias is not None else mean, None
    weight, bias = _whole(weight), _whole(bias)
    rows = max(1, _BLOCK_ELEMENTS // max(weight.shape[0], 1))
    means, squares = [], []
    for i in range(0, hidden.shape[0], rows):
        logits = (hidden[i:i + rows] @ weight.t()).float()
        if bias is not None:
            logits += bias.float()
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        means.append(logits.mean(1))
        if need_sq:
            squares.append(torch.logsumexp(2 * logits, 1) - 2 * torch.logsumexp(logits, 1))
    empty = hidden.new_zeros(0, dtype=torch.float32)
    return (torch.cat(means) if means else empty), ((torch.cat(squares) if squares else empty) if need_sq else None)


@torch.no_grad()
def _top1(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor) -> Tensor:
    """Per row, whether its label is the argmax of its logits (a softcap keeps the order), a bounded block of
    rows at a time."""
    weight, bias = _whole(weight), _whole(bias)
    rows = max(1, _BLOCK_ELEMENTS // max(weight.shape[0], 1))
    hits = [torch.nn.functional.linear(hidden[i:i + rows], weight, bias).argmax(1) == labels[i:i + rows]
            for i in range(0, hidden.shape[0], rows)]
    return torch.cat(hits) if hits else labels.new_zeros(0, dtype=torch.bool)


def _completion_positions(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(mask over the predicting positions ``[rows, T-1]``, their labels, the sequence index of each scored token).

    Padded rows are sequences; a padding-free row holds several, told apart by ``position_ids`` restarting at 0
    (a position that starts a sequence never scores from the previous one)."""
    ids, completion = batch["input_ids"], batch["completion_mask"].bool()
    mask = completion[:, 1:]
    position_ids = batch.get("position_ids")
    if position_ids is not None and batch.get("packed_sequences") is not None:
        starts = position_ids == 0
        mask = mask & ~starts[:, 1:]
        sequence = (starts.reshape(-1).long().cumsum(0) - 1).reshape(ids.shape)[:, 1:]
    else:
        sequence = torch.arange(ids.shape[0], device=ids.device)[:, None].expand(-1, ids.shape[1] - 1)
    return mask, ids[:, 1:][mask], sequence[mask]


@dataclass
class _Wanted:
    """What is scored besides the label log-probs (all without gradient)."""

    softcap: float | None = None
    mean_logits: bool = False
    wpo: bool = False
    entropy: bool = False
    top1_rows: Tensor | None = None  # rows whose label's top-1 hit is counted
    # the final hidden states too (metrics over positions of the caller's choosing): "hidden" ``[rows, T-1, H]`` at
    # the predicting positions and "last" ``[rows, H]`` (absent where the model hands its head no last position)
    keep_hidden: bool = False
    temperature: float = 1.0  # the label log-probs and entropy of softmax(logits / temperature) (RL's sampling)


def _score_rows(rows: Tensor, head: nn.Module, labels: Tensor, wanted: _Wanted) -> tuple[Tensor, dict[str, Tensor]]:
    """The scored rows' label log-probs (with gradient) and, as ``wanted``, per row: ``means`` (the mean logit),
    ``squares`` (WPO's ``log sum p^2``), ``entropy``, ``top1`` (over ``top1_rows``), from the head's weight as it
    is at the call."""
    weight, bias = head.weight, getattr(head, "bias", None)
    stats: dict[str, Tensor] = {}
    token_logps = token_log_probs(rows, weight, labels, bias=bias, softcap=wanted.softcap,
                                  return_entropy=wanted.entropy, temperature=wanted.temperature)
    if wanted.entropy:
        token_logps, entropy = token_logps
        stats["entropy"] = entropy.detach()
    if wanted.mean_logits or wanted.wpo or wanted.top1_rows is not None:
        with gathered_for_read(weight, bias):  # ZeRO-3's partitions (the op above gathers them for itself)
            w, b = weight.detach(), None if bias is None else bias.detach()
            if wanted.mean_logits or wanted.wpo:
                stats["means"], squares = _logit_stats(rows.detach(), w, b, wanted.softcap, wanted.wpo)
                if squares is not None:
                    stats["squares"] = squares
            if wanted.top1_rows is not None:
                stats["top1"] = _top1(rows.detach()[wanted.top1_rows], w, b, labels[wanted.top1_rows])
    return token_logps, stats


class _ForwardScorer:
    """Stands in for the LM head's ``forward`` during one model forward (see the module docstring): scores the
    completion positions with the weight the engine has gathered for that forward."""

    def __init__(self, head: nn.Module, mask: Tensor, labels: Tensor, wanted: _Wanted):
        self.head, self.mask, self.labels, self.wanted = head, mask, labels, wanted
        self.stats: dict[str, Tensor] = {}
        self.returned: Tensor | None = None
        self.calls = 0

    def __call__(self, hidden: Tensor, labels: Tensor | None = None) -> Tensor:
        self.calls += 1
        if labels is not None:  # shardkit's Llama: its loss path hands the head the shifted rows and their labels
            keep = labels.reshape(-1) != -100
            rows, targets = hidden.reshape(-1, hidden.shape[-1])[keep], labels.reshape(-1)[keep]
        elif hidden.dim() == 3 and hidden.shape[:2] == (self.mask.shape[0], self.mask.shape[1] + 1):
            rows, targets = hidden[:, :-1][self.mask], self.labels
        else:
            raise ValueError(f"preference scoring inside the forward: the LM head was handed hidden states of shape "
                             f"{tuple(hidden.shape)} for a batch of {tuple(self.mask.shape[:1])} rows of "
                             f"{self.mask.shape[1] + 1} tokens; the model must project every position of its last "
                             "hidden states with its head (logits_to_keep=0)")
        if targets.shape != self.labels.shape or not torch.equal(targets, self.labels):
            raise ValueError("preference scoring inside the forward: the LM head was handed other labels than the "
                             "batch's completion tokens; the model must pass its head the shifted labels unchanged")
        token_logps, self.stats = _score_rows(rows, self.head, targets, self.wanted)
        if self.wanted.keep_hidden:  # detached: the metrics read them without gradient
            kept = hidden.detach()
            if labels is not None:
                self.stats["hidden"] = kept.reshape(self.mask.shape[0], self.mask.shape[1], -1)
            else:
                self.stats["hidden"], self.stats["last"] = kept[:, :-1], kept[:, -1]
        # FSDP2 warns on a view returned by a module it wraps (an in-place op on it would skip its backward hook);
        # the op's output is a view of its flat result: a copy of one float per scored token
        self.returned = token_logps.clone() if token_logps._is_view() else token_logps
        return self.returned


@contextmanager
def _scoring_head(head: nn.Module, scorer: _ForwardScorer) -> Iterator[None]:
    """The head's ``forward`` is ``scorer`` inside the block. An instance attribute: ``nn.Module.__call__`` (and the
    engine's hooks around it) still run; a ``forward`` the instance had of its own is put back after."""
    own = head.__dict__.get("forward")
    head.forward = scorer
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def _score_in_forward(model: nn.Module, unwrapped: nn.Module, batch: dict[str, Tensor], head: nn.Module,
                      mask: Tensor, labels: Tensor, wanted: _Wanted) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`_score_rows` run inside the set-up ``model``'s forward (see the module docstring)."""
    scorer = _ForwardScorer(head, mask, labels, wanted)
    position_ids = batch.get("position_ids")
    with _scoring_head(head, scorer):
        if _is_shardkit_llama(base_model_of(unwrapped)):
            # its loss path projects hidden[:, :-1] against labels[:, 1:]: the completion tokens, -100 elsewhere
            full = torch.full_like(batch["input_ids"], -100)
            full[:, 1:][mask] = labels
            out = model(batch["input_ids"], labels=full, position_ids=position_ids, **_llama_padding(batch))
        else:
            kwargs: dict[str, Any] = {"input_ids": batch["input_ids"], "use_cache": False, "logits_to_keep": 0,
                                      "return_dict": True}
            if batch.get("attention_mask") is not None:
                kwargs["attention_mask"] = batch["attention_mask"]
            if position_ids is not None:
                kwargs["position_ids"] = position_ids
            out = getattr(model(**kwargs), "logits", None)
    # The model's output must be the head's, unchanged: an engine's hooks may hand back a new tensor of the same
    # values, but a model that scales or softcaps its logits after the head would turn log-probs into garbage.
    same = (scorer.calls == 1 and isinstance(out, Tensor) and out.shape == labels.shape
            and out.dtype == scorer.returned.dtype and torch.equal(out.detach(), scorer.returned.detach()))
    if not same:
        raise ValueError(f"{type(base_model_of(unwrapped)).__name__}: preference scoring inside the forward needs a "
                         "model whose forward returns its LM head's output as is (a Hugging Face causal LM or "
                         f"shardkit's Llama); the head ran {scorer.calls} time(s) and the model returned "
                         f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))} instead of the head's output")
    # the model's output, not the scorer's tensor: the engine's backward hooks sit on what the forward returned
    return out, scorer.stats


def _score(model: nn.Module, unwrapped: nn.Module, batch: dict[str, Tensor], mask: Tensor, labels: Tensor,
           wanted: _Wanted) -> tuple[Tensor, dict[str, Tensor]]:
    """The positions in ``mask`` scored against ``labels`` (and ``wanted``): inside the model's forward where the
    head's weight is whole only there, after it from the last hidden states otherwise."""
    head = lm_head_of(unwrapped)
    if whole_only_in_forward(head.weight):
        return _score_in_forward(model, unwrapped, batch, head, mask, labels, wanted)
    hidden = last_hidden_states(model, unwrapped, batch)
    token_logps, stats = _score_rows(hidden[:, :-1][mask], head, labels, wanted)
    if wanted.keep_hidden:
        stats["hidden"], stats["last"] = hidden[:, :-1].detach(), hidden[:, -1].detach()
    return token_logps, stats


def score_positions(model: nn.Module, unwrapped: nn.Module, batch: dict[str, Tensor], mask: Tensor, *,
                    entropy: bool = False, temperature: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
    """The label log-probs (with gradient) at the positions in ``mask [rows, T-1]`` of ``batch`` (position ``t``
    scores token ``t + 1``), scored as :func:`sequence_log_probs` scores completions (inside the forward where the
    engine has the head whole only there), and the detached extras: ``"hidden"`` (the final hidden states at the
    predicting positions ``[rows, T-1, H]``), ``"last"`` (the last position's ``[rows, H]``; absent where the
    model hands its head no last position: shardkit's Llama scored inside its forward) and, with ``entropy``,
    ``"entropy"`` per scored position. ``temperature`` scores ``softmax(logits / temperature)`` (the log-probs
    and the entropy; the hidden states are the model's)."""
    mask = mask.bool()
    labels = batch["input_ids"][:, 1:][mask]
    return _score(model, unwrapped, batch, mask, labels,
                  _Wanted(entropy=entropy, keep_hidden=True, temperature=temperature))


def sequence_log_probs(model: nn.Module, unwrapped: nn.Module, batch: dict[str, Tensor], sequences: int, *,
                       ld_alpha: float | None = None, mean_logits: bool = True, wpo: bool = False,
                       softcap: float | None = None, token_stats: bool = False) -> SequenceLogps:
    """Summed completion log-probs of the ``sequences`` in ``batch`` (see :func:`last_hidden_states`).

    Args:
        model: the set-up model (its forward runs the strategy's hooks); ``unwrapped``: the module inside it.
        batch: ``input_ids``, ``completion_mask`` (1 on completion tokens), optional ``attention_mask``,
            ``position_ids`` (+ ``packed_sequences``, padding-free).
        sequences: number of sequences (chosen + rejected).
        ld_alpha: LD-DPO: tokens past the shorter completion of the pair weigh ``ld_alpha``.
        token_stats: also the summed entropies and the chosen sequences' top-1 hits (TRL's ``entropy`` and
            ``mean_token_accuracy``).
    """
    mask, labels, seq = _completion_positions(batch)
    wanted = _Wanted(softcap, mean_logits, wpo, token_stats, seq < sequences // 2 if token_stats else None)
    token_logps, stats = _score(model, unwrapped, batch, mask, labels, wanted)
    zeros = token_logps.new_zeros(sequences)
    sums = zeros.index_add(0, seq, token_logps)
    tokens = zeros.detach().index_add(0, seq, torch.ones_like(token_logps.detach()))
    logps = sums
    if ld_alpha is not None:
        logps = zeros.index_add(0, seq, token_logps * _ld_weights(seq, tokens, ld_alpha))
    out = SequenceLogps(logps, sums, tokens)
    if mean_logits:
        out.mean_logits = zeros.detach().index_add(0, seq, stats["means"])
    if wpo:
        aligned = zeros.detach().index_add(0, seq, token_logps.detach() - stats["squares"])
        out.wpo_logps = aligned / tokens.clamp(min=1)
    if token_stats:
        out.entropy = zeros.detach().index_add(0, seq, stats["entropy"])
        out.top1 = zeros.detach().index_add(0, seq[wanted.top1_rows], stats["top1"].to(zeros.dtype))
    return out


def _ld_weights(seq: Tensor, tokens: Tensor, alpha: float) -> Tensor:
    """LD-DPO's per-token weights: 1 within the pair's shorter completion length, ``alpha`` past it."""
    half = tokens.shape[0] // 2
    shared = torch.minimum(tokens[:half], tokens[half:]).repeat(2)
    firsts = torch.cumsum(tokens, 0) - tokens  # index of each sequence's first scored token
    position = torch.arange(seq.shape[0], device=seq.device) - firsts[seq].long() + 1
    beyond = position > shared[seq]
    return torch.where(beyond, torch.full_like(position, alpha, dtype=torch.float32),
                       torch.ones_like(position, dtype=torch.float32))
