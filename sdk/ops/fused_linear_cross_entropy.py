"""Fused linear cross-entropy: ``cross_entropy(hidden @ weight.T + bias, labels)`` without the (N, V) logits.

Rows are processed in chunks: for each chunk the logits are one matmul, a fused row pass turns them in place
into the loss and the gradient of the loss wrt the logits, and two more matmuls fold that gradient into
``grad_hidden`` (rows of the chunk) and ``grad_weight`` (an fp32 accumulator). So the forward pass already
holds every gradient and backward only scales them by the upstream gradient, in place (skipped when it is 1):
no second (V, H) copy, so "mean"/"sum" allow one backward per forward (a second over a retained graph raises).

reduction="none" is the exception (and the known bug class of other fused implementations, which precompute
the gradients assuming a scalar upstream gradient): ``grad_weight = sum_i grad_out[i] * g_i^T h_i`` depends on
the per-row upstream gradient, so the forward pass computes only the losses and backward recomputes the chunks
with the row scale ``grad_out[i]``.

Math per row (``y = softcap * tanh(z / softcap)`` if a softcap is set, else ``y = z``; eps = label_smoothing,
as torch.nn.functional.cross_entropy defines it):
``loss = lse(y) - (1 - eps) * y[t] - eps * mean(y)``,
``dloss/dz = (softmax(y) - (1 - eps) * onehot(t) - eps / V) * (1 - (y / softcap)^2)``.
Rows labelled ``ignore_index`` contribute nothing; "mean" divides by the number of other rows (nan when there
are none, like torch, with zero gradients).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._dispatch import select_backend

__all__ = [
    "chunk_rows_for",
    "flce_benchmark_case",
    "flce_rows_reference",
    "fused_linear_cross_entropy",
    "linear_cross_entropy_reference",
]

_SUPPORTED = ("reference", "cpp", "triton", "cuda")
_REDUCTIONS = ("mean", "sum", "none")
# NOTE: budget for one chunk's logits. At V=128256 (Llama 3) a row is 501 KiB in fp32, so 256 MiB gives
# 512-row chunks in fp32 (256 for bf16, which also holds a 16-bit copy); at T=4096 the naive path holds the
# (4096, 128256) logits, their softmax and their gradient: 3 x 2.1 GB in fp32, against 256 MiB here.
# Smaller chunks only add matmul launches: at H=2048 a 256-row chunk is still a 256x2048x128256 GEMM.
_LOGITS_BUDGET_BYTES = 256 * 2**20

RowsFn = Callable[[Tensor, Tensor, Tensor, int, float, float, bool], Tensor]


def chunk_rows_for(n: int, vocab: int, dtype: torch.dtype, budget_bytes: int = _LOGITS_BUDGET_BYTES) -> int:
    """Rows per chunk so that one chunk's logits stay within ``budget_bytes``.

    Bytes per logit in flight: 4 for the fp32 logits/gradient (updated in place), plus 2 + 2 for the 16-bit
    matmul output and the 16-bit copy of the gradient fed to the next matmul when the inputs are bf16/fp16.
    """
    per_logit = 4 if dtype == torch.float32 else 8  # float64 (the test oracle): 8 bytes a logit
    rows = max(1, budget_bytes // max(1, vocab * per_logit))
    if rows >= 16:  # a power of two keeps GEMM tiles whole
        rows = 1 << (rows.bit_length() - 1)
    return max(1, min(n, rows))


def flce_rows_reference(z: Tensor, labels: Tensor, row_scale: Tensor, ignore_index: int, label_smoothing: float,
                        softcap: float, write_grad: bool) -> Tensor:
    """Row pass in plain PyTorch on a chunk of fp32/fp64 logits ``z`` (rows, V).

    Returns the per-row loss (0 on ignored rows); with ``write_grad`` overwrites ``z`` with
    ``row_scale[i] * dloss_i/dz_i`` (0 on ignored rows).
    """
    vocab = z.shape[1]
    y = torch.tanh(z / softcap) * softcap if softcap > 0 else z
    lse = torch.logsumexp(y, dim=1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels)).unsqueeze(1)
    yt = y.gather(1, safe).squeeze(1)
    loss = lse - (1.0 - label_smoothing) * yt
    if label_smoothing > 0:
        loss = loss - label_smoothing * y.mean(dim=1)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if write_grad:
        g = torch.exp(y - lse.unsqueeze(1))
        if label_smoothing > 0:
            g.sub_(label_smoothing / vocab)
        g.scatter_add_(1, safe, torch.full_like(yt, -(1.0 - label_smoothing)).unsqueeze(1))
        if softcap > 0:
            g.mul_(1.0 - (y / softcap).square())
        scale = torch.where(valid, row_scale.to(g.dtype), torch.zeros_like(lse))
        z.copy_(g.mul_(scale.unsqueeze(1)))
    return loss


def _rows_triton(z: Tensor, labels: Tensor, row_scale: Tensor, ignore_index: int, label_smoothing: float,
                 softcap: float, write_grad: bool) -> Tensor:
    from shardkit.kernels import fused_linear_cross_entropy as tk

    return tk.flce_rows_(z, labels, row_scale, ignore_index, label_smoothing, softcap, write_grad)


def _chunked(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, row_scale: Tensor,
             ignore_index: int, label_smoothing: float, softcap: float, chunk_rows: int,
             need: tuple[bool, bool, bool], rows_fn: RowsFn) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The chunk loop of the reference and Triton backends (the cpp backend runs the same loop in C++)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    need_h, need_w, need_b = need
    write_grad = any(need)
    loss = hidden.new_empty(n, dtype=acc)
    gh = torch.empty_like(hidden) if need_h else hidden.new_empty(0)
    # fp32 accumulators: exact enough across chunks for 16-bit weights, and fed by fp32 operands
    gw = weight.new_zeros(weight.shape, dtype=acc) if need_w else weight.new_empty(0, dtype=acc)
    gb = weight.new_zeros(vocab, dtype=acc) if need_b else weight.new_empty(0, dtype=acc)
    wt = weight.t()
    for s in range(0, n, chunk_rows):
        e = min(n, s + chunk_rows)
        hc = hidden[s:e]
        z = torch.addmm(bias.to(weight.dtype), hc, wt) if bias is not None else hc @ wt  # chunk_rows x V
        z = z.to(acc)
        loss[s:e] = rows_fn(z, labels[s:e], row_scale[s:e], ignore_index, label_smoothing, softcap, write_grad)
        if not write_grad:
            continue
        if need_h:
            torch.mm(z.to(weight.dtype), weight, out=gh[s:e])
        if need_w:
            gw.addmm_(z.t(), hc.to(acc))
        if need_b:
            gb.add_(z.sum(0))
    out_b = bias.dtype if bias is not None else weight.dtype
    return loss, gh, gw.to(weight.dtype), gb.to(out_b)


def _backend(hidden: Tensor, weight: Tensor) -> str:
    # NOTE: the native kernels take fp32 logits from one storage dtype; float64 (the test oracle) and mixed
    # hidden/weight dtypes go through the reference loop, which upcasts.
    if hidden.dtype == torch.float64 or hidden.dtype != weight.dtype:
        return "reference"
    return select_backend("flce_chunked", hidden.device, _SUPPORTED)


def _run(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, row_scale: Tensor, ignore_index: int,
         label_smoothing: float, softcap: float, chunk_rows: int,
         need: tuple[bool, bool, bool]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    hidden, weight, labels = hidden.contiguous(), weight.contiguous(), labels.contiguous()
    backend = _backend(hidden, weight)
    if chunk_rows <= 0:
        chunk_rows = chunk_rows_for(hidden.shape[0], weight.shape[0], hidden.dtype)
    if backend in ("cpp", "cuda"):  # one op, a CPU and a CUDA kernel: the chunk loop runs in C++
        return torch.ops.shardkit_C.flce_chunked(hidden, weight, labels, bias, row_scale, ignore_index,
                                                 label_smoothing, softcap, chunk_rows, *need)
    rows_fn = {"reference": flce_rows_reference, "triton": _rows_triton}[backend]
    return _chunked(hidden, weight, labels, bias, row_scale, ignore_index, label_smoothing, softcap, chunk_rows,
                    need, rows_fn)


def _reduce(loss_rows: Tensor, valid: Tensor, reduction: str, dtype: torch.dtype) -> Tensor:
    if reduction == "none":
        return loss_rows.to(dtype)
    total = loss_rows.sum()
    if reduction == "mean":
        total = total / valid.sum()  # 0 / 0 = nan when every row is ignored, as torch
    return total.to(dtype)


@torch.library.custom_op("shardkit::fused_linear_cross_entropy", mutates_args=())
def _flce_op(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, ignore_index: int, reduction: str,
             label_smoothing: float, softcap: float, chunk_rows: int, need_hidden: bool, need_weight: bool,
             need_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    valid = labels != ignore_index
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    row_scale = valid.to(acc)
    if reduction == "mean":
        row_scale = row_scale / valid.sum().clamp(min=1).to(acc)
    # reduction="none": losses only here, gradients recomputed in backward with the per-row upstream gradient
    need = (need_hidden, need_weight, need_bias) if reduction != "none" else (False, False, False)
    loss_rows, gh, gw, gb = _run(hidden, weight, labels, bias, row_scale, ignore_index, label_smoothing, softcap,
                                 chunk_rows, need)
    return _reduce(loss_rows, valid, reduction, hidden.dtype), gh, gw, gb


@_flce_op.register_fake
def _(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap, chunk_rows, need_hidden,
      need_weight, need_bias):
    grads = reduction != "none"
    loss = hidden.new_empty((hidden.shape[0],) if reduction == "none" else ())
    gh = hidden.new_empty(hidden.shape if grads and need_hidden else (0,))
    gw = weight.new_empty(weight.shape if grads and need_weight else (0,))
    b_dtype = bias.dtype if bias is not None else weight.dtype
    gb = weight.new_empty((weight.shape[0],) if grads and need_bias else (0,), dtype=b_dtype)
    return loss, gh, gw, gb


@torch.library.custom_op("shardkit::fused_linear_cross_entropy_backward", mutates_args=())
def _flce_backward_rows_op(grad_loss: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None,
                           ignore_index: int, label_smoothing: float, softcap: float, chunk_rows: int,
                           need_hidden: bool, need_weight: bool, need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """reduction="none" backward: recompute each chunk with row scale ``grad_loss[i]`` (ignored rows: 0)."""
    valid = labels != ignore_index
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    row_scale = torch.where(valid, grad_loss.to(acc), torch.zeros((), dtype=acc, device=grad_loss.device))
    need = (need_hidden, need_weight, need_bias)
    _, gh, gw, gb = _run(hidden, weight, labels, bias, row_scale, ignore_index, label_smoothing, softcap, chunk_rows,
                         need)
    return gh, gw, gb


@_flce_backward_rows_op.register_fake
def _(grad_loss, hidden, weight, labels, bias, ignore_index, label_smoothing, softcap, chunk_rows, need_hidden,
      need_weight, need_bias):
    b_dtype = bias.dtype if bias is not None else weight.dtype
    return (hidden.new_empty(hidden.shape if need_hidden else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,)),
            weight.new_empty((weight.shape[0],) if need_bias else (0,), dtype=b_dtype))


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, labels, bias, ignore_index, reduction, smoothing, softcap, chunk_rows, *_ = inputs
    ctx.reduction = reduction
    ctx.has_bias = bias is not None
    ctx.args = (ignore_index, smoothing, softcap, chunk_rows)
    # NOTE: the gradient outputs are never used downstream; without this autograd would materialise a zero
    # grad for each of them in backward: (T, H) + (V, H) more, 96 MiB at T=4096 H=2048 V=8192 fp32.
    ctx.set_materialize_grads(False)
    ctx.consumed = False
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, labels, bias)
    else:
        ctx.save_for_backward(*output[1:])


def _scale_saved_(ctx, grad_loss: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Scales the gradients saved by forward IN PLACE by the upstream gradient, once.

    Out of place would hold a second (V, H) fp32 grad_weight: 2 GiB more at V=128256 H=4096. The price is that a
    retained graph cannot run backward twice (the saved gradients are already scaled): that raises.
    """
    if ctx.consumed:
        raise RuntimeError(
            "fused_linear_cross_entropy: backward ran a second time over the same graph (retain_graph=True). With "
            "reduction='mean' or 'sum' the gradients are computed in forward and scaled in place by the first "
            "backward, so a second one would return wrong values. Call fused_linear_cross_entropy again for each "
            "backward, or use reduction='none' (its backward recomputes the chunks) and reduce the losses yourself.")
    ctx.consumed = True
    grads = ctx.saved_tensors
    # grad_output == 1 (loss.backward()) is the common case: skip a full pass over (V, H) + (T, H). .item()
    # is a host sync on GPU, and data-dependent under torch.compile: always multiply there.
    if not torch.compiler.is_compiling() and grad_loss.numel() == 1 and grad_loss.item() == 1.0:
        return grads
    for g in grads:
        if g.numel():
            g.mul_(grad_loss.to(g.dtype))
    return grads


def _backward(ctx, grad_loss: Tensor | None, *_unused):
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = ctx.has_bias and ctx.needs_input_grad[3]
    if grad_loss is None:  # materialize_grads is off: the loss did not reach the output
        return (None,) * 12
    if ctx.reduction == "none":
        hidden, weight, labels, bias = ctx.saved_tensors
        gh, gw, gb = _flce_backward_rows_op(grad_loss, hidden, weight, labels, bias, *ctx.args, need_h, need_w, need_b)
    else:
        gh, gw, gb = _scale_saved_(ctx, grad_loss)
    return (gh if need_h else None, gw if need_w else None, None, gb if need_b else None,
            None, None, None, None, None, None, None, None)


_flce_op.register_autograd(_backward, setup_context=_setup_context)


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None,
                               ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                               logit_softcap: float | None = None, chunk_rows: int | None = None) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels`` without materialising the logits.

    Args:
        hidden: (N, H) activations (any leading dims are flattened into N).
        weight: (V, H) output projection (lm_head weight).
        labels: (N,) int64 class indices; ``ignore_index`` rows contribute nothing.
        bias: optional (V,) bias.
        ignore_index: label value to skip.
        reduction: "mean" (over non-ignored rows), "sum" or "none" (per-row losses, 0 on ignored rows).
        label_smoothing: as in torch.nn.functional.cross_entropy.
        logit_softcap: if set, logits become ``softcap * tanh(logits / softcap)`` (Gemma 2).
        chunk_rows: rows per chunk; default from a 256 MiB logits budget (see :func:`chunk_rows_for`).

    Returns:
        The loss in ``hidden``'s dtype (computed in fp32): a scalar, or (N,) for reduction="none".

    Raises:
        RuntimeError: in backward, when a graph retained with ``retain_graph=True`` runs backward a second time
            with reduction "mean" or "sum" (the saved gradients were scaled in place by the first one).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"fused_linear_cross_entropy: reduction={reduction!r}; use one of {_REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"fused_linear_cross_entropy: label_smoothing={label_smoothing} must be in [0, 1]")
    if logit_softcap is not None and logit_softcap <= 0:
        raise ValueError(f"fused_linear_cross_entropy: logit_softcap={logit_softcap} must be positive or None")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)} and weight "
                         f"{tuple(weight.shape)} must share the last dim (H)")
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    labels2 = labels.reshape(-1)
    if labels2.shape[0] != hidden2.shape[0]:
        raise ValueError(f"fused_linear_cross_entropy: {labels2.shape[0]} labels for {hidden2.shape[0]} rows")
    grad = torch.is_grad_enabled()
    need = (grad and hidden.requires_grad, grad and weight.requires_grad,
            grad and bias is not None and bias.requires_grad)
    loss, *_ = _flce_op(hidden2, weight, labels2.long(), bias, int(ignore_index), reduction, float(label_smoothing),
                        float(logit_softcap or 0.0), int(chunk_rows or 0), *need)
    return loss.view(labels.shape) if reduction == "none" else loss


def linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None,
                                   ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                                   logit_softcap: float | None = None) -> Tensor:
    """The naive path (full logits + F.cross_entropy), differentiable by autograd: the oracle and the baseline."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if logit_softcap:
        logits = torch.tanh(logits / logit_softcap) * logit_softcap
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=ignore_index, reduction=reduction,
                                             label_smoothing=label_smoothing)


def flce_benchmark_case(n: int, hidden_size: int, vocab: int, dtype: torch.dtype = torch.float32,
                        device: str = "cpu", seed: int = 0, **kwargs) -> dict[str, Callable[[], None]]:
    """Forward+backward closures over one random problem, for benchmarks: {"fused": ..., "naive": ...}.

    Each call zeroes the gradients, runs the loss and its backward; ``kwargs`` go to both losses.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h = (torch.randn(n, hidden_size, generator=gen) * 0.5).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).to(device, dtype).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=gen).to(device)

    def step(fn: Callable[..., Tensor]) -> Callable[[], None]:
        def run() -> None:
            h.grad = w.grad = None
            fn(h, w, y, **kwargs).backward()

        return run

    return {"fused": step(fused_linear_cross_entropy), "naive": step(linear_cross_entropy_reference)}
