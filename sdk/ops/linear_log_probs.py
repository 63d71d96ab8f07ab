"""Chunked log-probabilities: ``log_softmax(softcap(hidden @ weight.T + bias) / T)[label]`` without the (N, V) logits.

What preference losses (DPO and its family) need from a language model head: per token, the log-probability of the
label (and optionally the entropy of the distribution), with gradients to hidden, weight and bias. The rows are
processed in chunks (:func:`shardkit.ops.fused_linear_cross_entropy.chunk_rows_for` sizes them): forward keeps
per row only the logsumexp and, for the entropy, the mean of the scaled logits under the softmax; backward
recomputes each chunk's logits and folds their gradient into grad_hidden/grad_weight/grad_bias with the fused
cross-entropy's fold (:func:`~shardkit.ops.fused_linear_cross_entropy.fold_chunk_grads`). Unlike the fused
cross-entropy the upstream gradient is per row (a caller sums per sequence, weights chosen against rejected),
so nothing is precomputed in forward.

Math per row, with ``y = softcap * tanh(z / softcap)`` (or ``y = z``) and ``s = y / T``:
``lse = logsumexp(s)``, ``logp = s[t] - lse``, ``p = exp(s - lse)``, ``m = sum(p * s)``, ``entropy = lse - m``;
``dlogp/ds = onehot(t) - p``, ``dentropy/ds = -p * (s - m)``, ``ds/dz = (1 - (y / softcap)^2) / T``.

The two kernels see *column* labels: a label outside ``[0, V)`` means "this row's label is not among these
columns" (target 0, no one-hot term). That is what lets a vocab-parallel head (each rank holding a slice of the
vocabulary, :mod:`shardkit.nn.log_probs`) run the same kernels on its slice and combine ``lse``, ``target`` and
``m`` across ranks; the public op maps ``ignore_index`` rows to such a label and zeroes their results.

Dtypes: as the fused cross-entropy (:func:`~shardkit.ops.fused_linear_cross_entropy.flce_compute_dtype` for the
matmuls, fp32 row math, float64 for the float64 oracle); the results are fp32 (float64 for float64 inputs), the
gradients come back in each input's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .fused_linear_cross_entropy import (
    accumulate_dtype,
    check_label_range,
    chunk_rows_for,
    flce_compute_dtype,
    fold_chunk_grads,
    grad_weight_block_rows,
)
from .registry import OpSpec, native, register

__all__ = [
    "SPEC",
    "linear_log_probs",
    "linear_log_probs_reference",
    "log_prob_grads",
    "log_prob_stats",
    "rows_backward_reference",
    "rows_forward_reference",
]

_HALF = (torch.float16, torch.bfloat16)


def _scaled_logits(z: Tensor, softcap: float, inv_temp: float) -> tuple[Tensor, Tensor]:
    """``(y, s)``: the softcapped logits and the tempered ones (``s`` is ``y`` itself when T = 1)."""
    y = torch.tanh(z / softcap) * softcap if softcap > 0 else z
    return y, (y * inv_temp if inv_temp != 1.0 else y)


def _label_columns(labels: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """``(here, safe)``: which rows have their label among the ``vocab`` columns, and a gatherable index."""
    here = (labels >= 0) & (labels < vocab)
    return here, torch.where(here, labels, torch.zeros_like(labels)).unsqueeze(1)


def rows_forward_reference(z: Tensor, labels: Tensor, softcap: float, inv_temp: float,
                           want_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Row statistics of a chunk of fp32/fp64 logits ``z`` (rows, V): ``(lse, target, m)`` (``m`` empty without
    ``want_entropy``); ``target`` is ``s[label]``, 0 where the label is not a column."""
    _, s = _scaled_logits(z, softcap, inv_temp)
    lse = torch.logsumexp(s, dim=1)
    here, safe = _label_columns(labels, z.shape[1])
    target = torch.where(here, s.gather(1, safe).squeeze(1), torch.zeros_like(lse))
    m = (torch.exp(s - lse.unsqueeze(1)) * s).sum(1) if want_entropy else lse.new_empty(0)
    return lse, target, m


def rows_backward_reference(z: Tensor, labels: Tensor, grad_lp: Tensor, grad_ent: Tensor, lse: Tensor, m: Tensor,
                            softcap: float, inv_temp: float) -> None:
    """Overwrites a chunk of fp32/fp64 logits ``z`` with the gradient of ``sum(grad_lp * logp + grad_ent *
    entropy)`` wrt them (``grad_ent`` empty: no entropy term); ``lse`` and ``m`` are the rows' (global) ones."""
    y, s = _scaled_logits(z, softcap, inv_temp)
    p = torch.exp(s - lse.unsqueeze(1))
    g = p * (-grad_lp.to(p.dtype)).unsqueeze(1)
    if grad_ent.numel():
        g.sub_(p * (s - m.unsqueeze(1)) * grad_ent.to(p.dtype).unsqueeze(1))
    here, safe = _label_columns(labels, z.shape[1])
    g.scatter_add_(1, safe, torch.where(here, grad_lp.to(p.dtype), torch.zeros_like(lse)).unsqueeze(1))
    if inv_temp != 1.0:
        g.mul_(inv_temp)
    if softcap > 0:
        g.mul_(1.0 - (y / softcap).square())
    z.copy_(g)


_BLOCK_BYTES = 2**20


def _block_rows(z: Tensor) -> int:
    """Rows of one block of the row math: 1/32 of the chunk (its fp32 temporaries stay a fraction of it), but at
    least 1 MiB of fp32 logits: every op costs a thread synchronisation, and on a busy CPU 2-row blocks at V=32000
    made the loop 20x slower than the full logits (each tiny op waiting on a descheduled OpenMP thread)."""
    return max(1, z.shape[0] // 32, _BLOCK_BYTES // (4 * max(1, z.shape[1])))


def _blocks(z: Tensor) -> range:
    return range(0, z.shape[0], _block_rows(z))


def _rows_forward_any(z: Tensor, labels: Tensor, softcap: float, inv_temp: float,
                      want_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`rows_forward_reference` on logits of any float dtype, fp32 blocks at a time (float64 whole)."""
    if z.dtype == torch.float64:
        return rows_forward_reference(z, labels, softcap, inv_temp, want_entropy)
    step = _block_rows(z)
    parts = [rows_forward_reference(z[s:s + step].float(), labels[s:s + step], softcap, inv_temp, want_entropy)
             for s in _blocks(z)]
    return tuple(torch.cat(p) for p in zip(*parts))  # type: ignore[return-value]


def _rows_backward_any(z: Tensor, labels: Tensor, grad_lp: Tensor, grad_ent: Tensor, lse: Tensor, m: Tensor,
                       softcap: float, inv_temp: float) -> None:
    """:func:`rows_backward_reference` on logits of any float dtype, blocks at a time: an fp32 block is written in
    place, a 16-bit one through an fp32 copy rounded back (as the Triton row pass does)."""
    if z.dtype == torch.float64:
        rows_backward_reference(z, labels, grad_lp, grad_ent, lse, m, softcap, inv_temp)
        return
    step = _block_rows(z)
    for s in _blocks(z):
        block = z[s:s + step].float()  # a view of fp32 logits: written in place
        rows_backward_reference(block, labels[s:s + step], grad_lp[s:s + step],
                                grad_ent[s:s + step] if grad_ent.numel() else grad_ent, lse[s:s + step],
                                m[s:s + step] if m.numel() else m, softcap, inv_temp)
        if z.dtype != torch.float32:
            z[s:s + step].copy_(block)


def rows_forward_triton(z: Tensor, labels: Tensor, softcap: float, inv_temp: float,
                        want_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`rows_forward_reference` on the Triton row kernel (``sdk/kernels/linear_log_probs.py``)."""
    from shardkit.kernels import linear_log_probs as tk

    return tk.llp_rows_forward(z, labels, softcap, inv_temp, want_entropy)


def rows_backward_triton(z: Tensor, labels: Tensor, grad_lp: Tensor, grad_ent: Tensor, lse: Tensor, m: Tensor,
                         softcap: float, inv_temp: float) -> None:
    """:func:`rows_backward_reference` on the Triton row kernel."""
    from shardkit.kernels import linear_log_probs as tk

    tk.llp_rows_backward_(z, labels, grad_lp, grad_ent, lse, m, softcap, inv_temp)


def _logits(hc: Tensor, wt: Tensor, bias: Tensor | None) -> Tensor:
    return torch.addmm(bias, hc, wt) if bias is not None else hc @ wt


Stats = tuple[Tensor, Tensor, Tensor]


def _forward_loop(rows_fn: Callable[..., Stats]) -> Callable[..., Stats]:
    """The Python chunk loop of forward around ``rows_fn``, in the signature of ``shardkit_C::llp_fwd``."""
    def loop(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, softcap: float, inv_temp: float,
             chunk_rows: int, want_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
        n = hidden.shape[0]
        acc = accumulate_dtype(hidden.dtype)
        lse, target = hidden.new_empty(n, dtype=acc), hidden.new_empty(n, dtype=acc)
        m = hidden.new_empty(n if want_entropy else 0, dtype=acc)
        wt = weight.t()
        for s in range(0, n, chunk_rows):
            e = min(n, s + chunk_rows)
            z = _logits(hidden[s:e], wt, bias)
            ls, tg, mm = rows_fn(z, labels[s:e], softcap, inv_temp, want_entropy)
            lse[s:e], target[s:e] = ls, tg
            if want_entropy:
                m[s:e] = mm
            del z  # before the next chunk's logits exist
        return lse, target, m

    return loop


def _backward_loop(rows_fn: Callable[..., None]) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """The Python chunk loop of backward around ``rows_fn``, in the signature of ``shardkit_C::llp_bwd``: each
    chunk's logits recomputed, overwritten by their gradient, folded into the input gradients."""
    def loop(grad_lp: Tensor, grad_ent: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None,
             lse: Tensor, m: Tensor, softcap: float, inv_temp: float, chunk_rows: int, need_hidden: bool,
             need_weight: bool, need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
        n, vocab = hidden.shape[0], weight.shape[0]
        acc = accumulate_dtype(hidden.dtype)
        fold_bf16 = weight.dtype == torch.bfloat16
        gh = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
        gw = (weight.new_zeros(weight.shape, dtype=torch.bfloat16 if fold_bf16 else acc) if need_weight
              else weight.new_empty(0, dtype=acc))
        gb = weight.new_zeros(vocab, dtype=acc) if need_bias else weight.new_empty(0, dtype=acc)
        wt, block = weight.t(), grad_weight_block_rows(weight)
        ent = grad_ent.numel() > 0
        for s in range(0, n, chunk_rows):
            e = min(n, s + chunk_rows)
            hc = hidden[s:e]
            z = _logits(hc, wt, bias)
            rows_fn(z, labels[s:e], grad_lp[s:e], grad_ent[s:e] if ent else grad_ent, lse[s:e],
                    m[s:e] if ent else m, softcap, inv_temp)
            fold_chunk_grads(z, hc, weight, (gh[s:e] if need_hidden else None, gw if need_weight else None,
                                             gb if need_bias else None), fold_bf16, block)
            del z
        return gh, gw, gb

    return loop


def _prepare(hidden: Tensor, weight: Tensor, bias: Tensor | None,
             compute_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None, str]:
    hidden = hidden.to(compute_dtype).contiguous()
    weight = weight.to(compute_dtype).contiguous()
    bias = bias.to(compute_dtype).contiguous() if bias is not None else None
    # the native kernels take one fp32/16-bit storage dtype; float64 (the test oracle) runs the reference loop
    backend = "reference" if compute_dtype == torch.float64 else SPEC.select("llp_fwd", hidden.device)
    return hidden, weight, bias, backend


def _rows(n: int, vocab: int, compute_dtype: torch.dtype, chunk_rows: int) -> int:
    return chunk_rows if chunk_rows > 0 else chunk_rows_for(n, vocab, compute_dtype)


def log_prob_stats(hidden: Tensor, weight: Tensor, columns: Tensor, bias: Tensor | None, softcap: float,
                   inv_temp: float, chunk_rows: int, compute_dtype: torch.dtype,
                   want_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Forward kernel on (N, H) ``hidden`` and the (V, H) columns ``weight`` holds: per row ``(lse, target, m)``
    (see the module docstring; ``columns`` are labels as column indices, outside [0, V) where not here)."""
    hidden, weight, bias, backend = _prepare(hidden, weight, bias, compute_dtype)
    rows = _rows(hidden.shape[0], weight.shape[0], compute_dtype, chunk_rows)
    with torch.autocast(hidden.device.type, enabled=False):  # the dtypes above are final
        return SPEC.call("llp_fwd", backend, hidden, weight, columns.contiguous(), bias, softcap, inv_temp, rows,
                         want_entropy)


def log_prob_grads(grad_lp: Tensor, grad_ent: Tensor, hidden: Tensor, weight: Tensor, columns: Tensor,
                   bias: Tensor | None, lse: Tensor, m: Tensor, softcap: float, inv_temp: float, chunk_rows: int,
                   compute_dtype: torch.dtype, need: tuple[bool, bool, bool]) -> tuple[Tensor, Tensor, Tensor]:
    """Backward kernel: gradients of ``sum(grad_lp * logp + grad_ent * entropy)`` wrt hidden, weight and bias
    (empty where not needed), in the input dtypes. ``grad_lp``/``grad_ent`` are 0 on rows to skip; ``lse``/``m``
    are the rows' statistics over the whole vocabulary."""
    dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else weight.dtype)
    hidden, weight, bias, backend = _prepare(hidden, weight, bias, compute_dtype)
    acc = accumulate_dtype(compute_dtype)
    rows = _rows(hidden.shape[0], weight.shape[0], compute_dtype, chunk_rows)
    with torch.autocast(hidden.device.type, enabled=False):
        grads = SPEC.call("llp_bwd", backend, grad_lp.to(acc).contiguous(), grad_ent.to(acc).contiguous(), hidden,
                          weight, columns.contiguous(), bias, lse.to(acc).contiguous(), m.to(acc).contiguous(),
                          softcap, inv_temp, rows, *need)
    return tuple(g.to(dt) if g.numel() else g for g, dt in zip(grads, dtypes))  # type: ignore[return-value]


def _columns(labels: Tensor, ignore_index: int) -> Tensor:
    return torch.where(labels != ignore_index, labels, torch.full_like(labels, -1))


@torch.library.custom_op("shardkit::linear_log_probs", mutates_args=())
def _llp_op(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, ignore_index: int, softcap: float,
            inv_temp: float, chunk_rows: int, compute_dtype: torch.dtype,
            want_entropy: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(logp, entropy, lse, m)`` per row (entropy and m empty without ``want_entropy``); 0 on ignored rows."""
    check_label_range(labels, weight.shape[0], ignore_index, op="linear_log_probs")
    valid = labels != ignore_index
    lse, target, m = log_prob_stats(hidden, weight, _columns(labels, ignore_index), bias, softcap, inv_temp,
                                    chunk_rows, compute_dtype, want_entropy)
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    logp = torch.where(valid, target - lse, zero)
    entropy = torch.where(valid, lse - m, zero) if want_entropy else lse.new_empty(0)
    return logp, entropy, lse, m


@_llp_op.register_fake
def _(hidden, weight, labels, bias, ignore_index, softcap, inv_temp, chunk_rows, compute_dtype, want_entropy):
    acc = accumulate_dtype(compute_dtype)
    n = hidden.shape[0]
    return (hidden.new_empty(n, dtype=acc), hidden.new_empty(n if want_entropy else 0, dtype=acc),
            hidden.new_empty(n, dtype=acc), hidden.new_empty(n if want_entropy else 0, dtype=acc))


@torch.library.custom_op("shardkit::linear_log_probs_backward", mutates_args=())
def _llp_backward_op(grad_lp: Tensor, grad_ent: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor,
                     bias: Tensor | None, lse: Tensor, m: Tensor, ignore_index: int, softcap: float, inv_temp: float,
                     chunk_rows: int, compute_dtype: torch.dtype, need_hidden: bool, need_weight: bool,
                     need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    valid = labels != ignore_index
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    grad_lp = torch.where(valid, grad_lp.to(lse.dtype), zero)
    grad_ent = torch.where(valid, grad_ent.to(lse.dtype), zero) if grad_ent.numel() else grad_ent
    gh, gw, gb = log_prob_grads(grad_lp, grad_ent, hidden, weight, _columns(labels, ignore_index), bias, lse, m,
                                softcap, inv_temp, chunk_rows, compute_dtype, (need_hidden, need_weight, need_bias))
    return gh, gw, gb


@_llp_backward_op.register_fake
def _(grad_lp, grad_ent, hidden, weight, labels, bias, lse, m, ignore_index, softcap, inv_temp, chunk_rows,
      compute_dtype, need_hidden, need_weight, need_bias):
    b_dtype = bias.dtype if bias is not None else weight.dtype
    return (hidden.new_empty(hidden.shape if need_hidden else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,)),
            weight.new_empty((weight.shape[0],) if need_bias else (0,), dtype=b_dtype))


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, labels, bias, ignore_index, softcap, inv_temp, chunk_rows, compute_dtype, _ = inputs
    ctx.has_bias = bias is not None
    ctx.args = (ignore_index, softcap, inv_temp, chunk_rows, compute_dtype)
    ctx.set_materialize_grads(False)  # an unused entropy output needs no zero gradient
    ctx.save_for_backward(hidden, weight, labels, bias, output[2], output[3])


def _backward(ctx, grad_lp: Tensor | None, grad_ent: Tensor | None, *_unused):
    hidden, weight, labels, bias, lse, m = ctx.saved_tensors
    if grad_lp is None and grad_ent is None:
        return (None,) * 10
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = ctx.has_bias and ctx.needs_input_grad[3]
    if grad_lp is None:
        grad_lp = torch.zeros_like(lse)
    if grad_ent is None or not m.numel():
        grad_ent = lse.new_empty(0)
    gh, gw, gb = _llp_backward_op(grad_lp, grad_ent, hidden, weight, labels, bias, lse, m, *ctx.args,
                                  need_h, need_w, need_b)
    return (gh if need_h else None, gw if need_w else None, None, gb if need_b else None) + (None,) * 6


_llp_op.register_autograd(_backward, setup_context=_setup_context)


def check_options(softcap: float | None, temperature: float, chunk_size: int | None,
                  op: str = "linear_log_probs") -> None:
    """Raises a ValueError naming ``op`` and the argument for a bad softcap, temperature or chunk size."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: softcap={softcap} must be positive or None")
    if not temperature > 0:
        raise ValueError(f"{op}: temperature={temperature} must be positive")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"{op}: chunk_size={chunk_size} must be a positive row count or None")


def linear_log_probs(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                     softcap: float | None = None, ignore_index: int = -100, temperature: float = 1.0,
                     return_entropy: bool = False, chunk_size: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log-probability of ``labels`` under ``softmax(softcap(hidden @ weight.T + bias) / temperature)``,
    computed chunk by chunk so that no (tokens, vocab) tensor is ever alive.

    Args:
        hidden: (..., H) activations.
        weight: (V, H) output projection (the lm_head weight).
        labels: (...) int64 token ids; ``ignore_index`` positions give 0.
        bias: optional (V,) bias.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` before the temperature (Gemma 2).
        ignore_index: label value to skip (result and gradient 0).
        temperature: divides the (softcapped) logits.
        return_entropy: also return the per-token entropy of the distribution (0 where ignored).
        chunk_size: rows per chunk; default from the fused cross-entropy's 256 MiB logits budget.

    Returns:
        ``logp`` of ``labels.shape`` (fp32, float64 for float64 inputs), or ``(logp, entropy)``. Differentiable
        wrt hidden, weight and bias; per-sequence sums are the caller's ``.sum(-1)``.

    Raises:
        ValueError: a bad option, or shapes that do not match.
        RuntimeError: a label outside [0, V) that is not ``ignore_index``.
    """
    check_options(softcap, temperature, chunk_size)
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"linear_log_probs: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must "
                         "share the last dim (H), weight being (V, H)")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"linear_log_probs: labels {tuple(labels.shape)} must have hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    logp, entropy, _, _ = _llp_op(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1).long(), bias,
                                  int(ignore_index), float(softcap or 0.0), 1.0 / float(temperature),
                                  int(chunk_size or 0), flce_compute_dtype(hidden, weight, bias), bool(return_entropy))
    logp = logp.view(labels.shape)
    return (logp, entropy.view(labels.shape)) if return_entropy else logp


def linear_log_probs_reference(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                               softcap: float | None = None, ignore_index: int = -100, temperature: float = 1.0,
                               return_entropy: bool = False, chunk_size: int | None = None
                               ) -> Tensor | tuple[Tensor, Tensor]:
    """The full-logits computation (log_softmax over the (N, V) logits, autograd): the oracle and the baseline.

    16-bit logits are upcast to fp32 first, as the op's row math is fp32. ``chunk_size`` is accepted and ignored.
    """
    del chunk_size
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if logits.dtype in _HALF:
        logits = logits.float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long()
    out = torch.where(valid, logprobs.gather(-1, safe.unsqueeze(-1)).squeeze(-1), torch.zeros((), dtype=logits.dtype))
    if not return_entropy:
        return out
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return out, torch.where(valid, entropy, torch.zeros((), dtype=logits.dtype))


def _example(device: str, dtype: torch.dtype, size: str) -> tuple:
    n, h, v = (2048, 2048, 32768) if size == "bench" else (7, 16, 37)
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, h, generator=gen) * 0.5).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(device, dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[1] = -100
    return hidden, weight, labels.to(device)


SPEC = register(OpSpec(
    name="linear_log_probs", function=linear_log_probs, reference=linear_log_probs_reference,
    csrc="linear_log_probs",
    # cpp/cuda run the whole chunk loop in C++ (the fused cross-entropy's, matmuls through MKL/cuBLAS); the others
    # run it here around their row pass
    kernels={"llp_fwd": {"reference": _forward_loop(_rows_forward_any), "triton": _forward_loop(rows_forward_triton),
                         **native("llp_fwd")},
             "llp_bwd": {"reference": _backward_loop(_rows_backward_any),
                         "triton": _backward_loop(rows_backward_triton), **native("llp_bwd")}},
    triton_checks="shardkit.kernels.linear_log_probs:compile_checks", example=_example))
