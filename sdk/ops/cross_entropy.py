"""Cross-entropy on given logits with the gradient computed in the forward pass (Liger-Kernel's form).

``cross_entropy(logits, target)`` equals ``F.cross_entropy(logits.float(), target)`` (the loss in fp32, as
Hugging Face's causal-LM loss upcasts the logits; fp64 for fp64 logits), with ``ignore_index``,
``label_smoothing`` and a logit ``softcap``. The forward runs the row pass of the fused linear cross-entropy
(``flce_rows_reference`` / the Triton row kernel) chunk by chunk and keeps only the gradient of each row's loss
wrt its logits, in the logits' dtype; backward is one in-place scale by the upstream gradient, and the buffer it
scaled is handed on as the gradient (a leaf's ``.grad`` takes it without a copy).

Where the gradient lives:

- ``overwrite_logits=True`` and the logits are an intermediate nothing reads afterwards (the condition: plain
  eager mode, a non-leaf that requires grad and is not a view of a leaf, contiguous; see ``_glu.can_overwrite``):
  the gradient is written over the logits themselves, as Liger-Kernel does, and forward+backward allocates
  nothing of the logits' size (fp32: the row pass runs on the logits' own rows; 16-bit: through one fp32 chunk
  of at most ``_CHUNK_BYTES``). The caller's logits then hold d loss / d logits.
- otherwise (the default, a leaf, a view of a leaf, a strided tensor, torch.compile): one new buffer of the
  logits' size, which becomes the gradient; the logits are untouched.

A second backward over a retained graph raises (the gradient was consumed by the first). Without a gradient to
compute (no_grad, or logits that do not require one) only the losses are computed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._glu import can_overwrite, plain_eager
from .fused_linear_cross_entropy import check_label_range, check_loss_options, flce_rows_reference, rows_triton
from .registry import OpSpec, direct_call_ok, register

__all__ = ["SPEC", "cross_entropy", "cross_entropy_reference"]

# NOTE: rows per fp32 chunk: 64 MiB of fp32 logits (128 rows at Llama 3's V=128256), the only temporary beyond
# the gradient itself (the bf16 logits' upcast is never materialised whole).
_CHUNK_BYTES = 64 * 2**20


def cross_entropy_reference(logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean",
                            label_smoothing: float = 0.0, softcap: float | None = None) -> Tensor:
    """Plain PyTorch: 16-bit logits upcast to fp32, optional softcap, then ``F.cross_entropy`` over the rows of
    the last dim ("none": losses shaped like ``target``)."""
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    loss = torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), target.reshape(-1),
                                             ignore_index=ignore_index, reduction=reduction,
                                             label_smoothing=label_smoothing)
    return loss.view(target.shape) if reduction == "none" else loss


def _acc(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _rows(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, softcap: float,
          with_grad: bool, grad: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-row losses and (``with_grad``) d loss_i / d logits_i in the logits' dtype, chunk by chunk, written into
    ``grad`` (a new buffer when None; ``logits`` itself to overwrite them)."""
    n, vocab = logits.shape
    acc = _acc(logits)
    backend = "reference" if acc == torch.float64 else SPEC.select("cross_entropy_rows", logits.device)
    loss = torch.empty(n, dtype=acc, device=logits.device)
    if with_grad and grad is None:
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    # fp32/fp64 gradients: the row pass runs on the gradient's own rows (no chunk copy); 16-bit: an fp32 chunk
    direct = with_grad and grad.dtype == acc
    ones = torch.ones(n, dtype=acc, device=logits.device)
    step = max(1, _CHUNK_BYTES // max(1, vocab * 4))
    for s in range(0, n, step):
        e = min(n, s + step)
        if direct:
            z = grad[s:e]
            if z.data_ptr() != logits[s:e].data_ptr():
                z.copy_(logits[s:e])
        elif logits.dtype == acc and not with_grad:
            z = logits[s:e]  # read only: the row pass writes nothing without a gradient
        else:
            z = torch.empty((e - s, vocab), dtype=acc, device=logits.device).copy_(logits[s:e])
        loss[s:e] = SPEC.call("cross_entropy_rows", backend, z, target[s:e], ones[s:e], ignore_index,
                              label_smoothing, softcap, with_grad)
        if with_grad and not direct:
            grad[s:e].copy_(z)
    return loss, grad if with_grad else logits.new_empty(0)


@torch.library.custom_op("shardkit::cross_entropy", mutates_args=())
def _ce_op(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, softcap: float,
           with_grad: bool) -> tuple[Tensor, Tensor]:
    return _rows(logits, target, ignore_index, label_smoothing, softcap, with_grad)


@_ce_op.register_fake
def _(logits, target, ignore_index, label_smoothing, softcap, with_grad):
    loss = logits.new_empty(logits.shape[0], dtype=_acc(logits))
    return loss, (logits.new_empty(logits.shape) if with_grad else logits.new_empty(0))


@torch.library.custom_op("shardkit::cross_entropy_backward_", mutates_args=("grad",))
def _scale_grad_(grad: Tensor, dloss: Tensor) -> None:
    _scale_rows_(grad, dloss)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dloss: Tensor, _dgrad: Tensor):
    (grad,) = ctx.saved_tensors
    if plain_eager(grad, dloss):
        _scale_grad_(grad, dloss)  # the buffer is this op's own: scaled where it lies
        return grad, None, None, None, None, None
    return grad * dloss.unsqueeze(1).to(grad.dtype), None, None, None, None, None


_ce_op.register_autograd(_backward, setup_context=_setup_context)


def _scale_rows_(grad: Tensor, dloss: Tensor) -> None:
    """``grad[i] *= dloss[i]`` in place, chunk by chunk: an fp32 scale on a 16-bit buffer is computed in fp32 and
    rounded once, and torch materialises that fp32 product before copying it back (2x the bf16 logits at once
    when done whole: 500 MiB at (4096, 32000)); per chunk it is at most ``_CHUNK_BYTES``."""
    step = max(1, _CHUNK_BYTES // max(1, grad.shape[1] * 4))
    for s in range(0, grad.shape[0], step):
        grad[s:s + step].mul_(dloss[s:s + step].unsqueeze(1))


class _EagerCrossEntropy(torch.autograd.Function):
    """Plain eager: the gradient buffer is kept on ``ctx`` (not saved), so that once backward hands it on nothing
    else holds it and a leaf's ``AccumulateGrad`` takes it as ``.grad`` instead of copying it (the custom op's
    saved output was copied: 2x the logits' size at the H200 run's peak; benchmarks/RESULTS.md, "why GeGLU/SwiGLU
    measured 3x Liger on the H200, and cross-entropy over its logits")."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, softcap: float,
                overwrite: bool) -> Tensor:
        loss, ctx.grad = _rows(logits, target, ignore_index, label_smoothing, softcap, True,
                               logits if overwrite else None)
        if overwrite:
            torch.autograd.graph.increment_version(logits)  # a backward that saved the logits raises, not misreads
        return loss

    @staticmethod
    def backward(ctx, dloss: Tensor):
        grad, ctx.grad = ctx.grad, None
        if grad is None:
            raise RuntimeError("cross_entropy: a second backward through the same loss (retain_graph=True) cannot "
                               "run: the gradient computed in the forward was consumed by the first backward; "
                               "compute the loss again for another backward")
        _scale_rows_(grad, dloss)
        return grad, None, None, None, None, None


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, softcap: float | None = None, *,
                  overwrite_logits: bool = False) -> Tensor:
    """Cross-entropy of ``logits`` (..., V) against ``target`` (...), gradient computed in the forward.

    Args:
        logits: unnormalised scores; the last dim is the vocabulary.
        target: class indices in [0, V), or ``ignore_index``.
        ignore_index: target value whose rows contribute nothing ("mean" divides by the other rows).
        reduction: "mean", "sum" or "none" (per-row losses, 0 on ignored rows, shaped like ``target``).
        label_smoothing: as in ``torch.nn.functional.cross_entropy``.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` first (Gemma 2).
        overwrite_logits: write the gradient over ``logits`` in the forward (Liger-Kernel's memory: nothing of
            their size allocated). Only for logits nothing reads afterwards; taken only where they are a
            contiguous non-leaf (not a view of a leaf) in eager mode, else a new buffer holds the gradient.

    Returns:
        The loss in fp32 (fp64 for fp64 logits).

    Raises:
        ValueError: a bad reduction, label_smoothing or softcap, or target/logits shapes that do not match.
        RuntimeError: a target outside [0, V) that is not ``ignore_index`` (one host sync on GPU).
    """
    check_loss_options("cross_entropy", reduction, label_smoothing, "softcap", softcap)
    z = logits.reshape(-1, logits.shape[-1])
    t = target.reshape(-1).long()
    if t.shape[0] != z.shape[0]:
        raise ValueError(f"cross_entropy: target of shape {tuple(target.shape)} does not match logits of shape "
                         f"{tuple(logits.shape)} (one target per row of the last dim)")
    check_label_range(t, z.shape[1], ignore_index, op="cross_entropy")
    args = (int(ignore_index), float(label_smoothing), float(softcap or 0.0))
    want_grad = torch.is_grad_enabled() and logits.requires_grad
    if direct_call_ok(logits):
        loss, _ = _rows(z, t, *args, False)
    elif want_grad and plain_eager(logits):
        loss = _EagerCrossEntropy.apply(z, t, *args, overwrite_logits and can_overwrite(logits))
    else:
        loss, _ = _ce_op(z, t, *args, want_grad)
    if reduction == "none":
        return loss.view(target.shape)
    total = loss.sum()
    return total / (t != ignore_index).sum() if reduction == "mean" else total


def _example(device: str, dtype: torch.dtype, size: str) -> tuple:
    n, v = (4096, 32000) if size == "bench" else (7, 37)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(n, v, generator=gen) * 2).to(device, dtype).requires_grad_()
    return logits, torch.randint(0, v, (n,), generator=gen).to(device)


SPEC = register(OpSpec(
    name="cross_entropy", function=cross_entropy, reference=cross_entropy_reference, csrc=None,
    kernels={"cross_entropy_rows": {"reference": flce_rows_reference, "triton": rows_triton}},
    example=_example))
