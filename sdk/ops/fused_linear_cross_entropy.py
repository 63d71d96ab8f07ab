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

Dtypes: the matmuls run in one compute dtype, autocast's when autocast is on for the device (as ``F.linear``
would), else the promotion of hidden/weight/bias (an fp32 lm_head under bf16 activations runs in fp32). The
row pass, the loss and ``grad_weight``'s accumulation are fp32 (float64 for the float64 oracle); the loss is
returned in that dtype, as Hugging Face's loss (which upcasts the logits). Gradients come back in each input's
own dtype. Until backward has applied the upstream gradient they are kept where they cannot underflow: fp16
keeps ``grad_weight`` in fp32 (see :func:`_saved_weight_dtype`) and defers the 1/n of "mean" to backward.

Math per row (``y = softcap * tanh(z / softcap)`` if a softcap is set, else ``y = z``; eps = label_smoothing,
as torch.nn.functional.cross_entropy defines it):
``loss = lse(y) - (1 - eps) * y[t] - eps * mean(y)``,
``dloss/dz = (softmax(y) - (1 - eps) * onehot(t) - eps / V) * (1 - (y / softcap)^2)``.
Rows labelled ``ignore_index`` contribute nothing; "mean" divides by the number of other rows (nan when there
are none, like torch, with zero gradients). Any other label outside [0, V) raises.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .registry import OpSpec, native, register

__all__ = [
    "SPEC",
    "accumulate_dtype",
    "check_label_range",
    "check_loss_options",
    "chunk_rows_for",
    "flce_compute_dtype",
    "flce_rows_reference",
    "fold_chunk_grads",
    "fused_linear_cross_entropy",
    "grad_weight_block_rows",
    "linear_cross_entropy_reference",
    "rows_triton",
]

_REDUCTIONS = ("mean", "sum", "none")
_HALF = (torch.float16, torch.bfloat16)
# NOTE: budget for one chunk's logits. At V=128256 (Llama 3) a row is 501 KiB in fp32, so 256 MiB gives
# 512-row chunks in fp32 (256 for bf16: see chunk_rows_for); at T=4096 the naive path holds the
# (4096, 128256) logits, their softmax and their gradient: 3 x 2.1 GB in fp32, against 256 MiB here.
# Smaller chunks only add matmul launches: at H=2048 a 256-row chunk is still a 256x2048x128256 GEMM.
_LOGITS_BUDGET_BYTES = 256 * 2**20

# NOTE: bound on the 16-bit temporary of one weight-gradient product (8192 vocab rows at H=2048), as in C++.
_GRAD_WEIGHT_BLOCK_BYTES = 32 * 2**20
RowsFn = Callable[[Tensor, Tensor, Tensor, int, float, float, bool], Tensor]


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the row pass, the loss and the accumulators: fp32, or float64 for the float64 oracle."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def flce_compute_dtype(hidden: Tensor, weight: Tensor, bias: Tensor | None = None) -> torch.dtype:
    """The dtype of the op's matmuls: autocast's when it is on for ``hidden``'s device, else the promoted dtype.

    Autocast leaves float64 alone (as it does for ``F.linear``), so float64 inputs always promote.
    """
    dtypes = [hidden.dtype, weight.dtype] + ([bias.dtype] if bias is not None else [])
    device = hidden.device.type
    if torch.float64 not in dtypes and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def _defers_mean(compute_dtype: torch.dtype, reduction: str) -> bool:
    """fp16 "mean": forward keeps the gradient of the sum, backward applies 1/n together with the upstream.

    The fp32 gradient is cast to fp16 for the grad_hidden matmul; at the 1/n scale of a mean its small entries
    underflow there (fp16's smallest subnormal is 6e-8: every probability below 2.4e-4 at n=4096). Unscaled,
    they are probabilities in [0, 1] and grad_hidden is bounded by 2 max|W|: no underflow, no overflow.
    """
    return reduction == "mean" and compute_dtype == torch.float16


def _saved_weight_dtype(compute_dtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
    """Dtype grad_weight is kept in between forward and backward (before the upstream gradient is applied).

    fp16 weights keep the fp32 accumulator, 2 bytes more a weight (501 MiB at V=128256, H=2048): at the 1/n
    scale of "mean" most entries of an fp16 grad_weight are subnormal, at the scale of "sum" the largest can
    overflow. bf16 has fp32's exponent range, and measured against the naive path with a 1/k upstream its
    second rounding stays within the 2x rule (1.0-1.4x of naive's error), so it keeps its own dtype.
    """
    acc = accumulate_dtype(compute_dtype)
    return weight_dtype if weight_dtype in (acc, torch.bfloat16) else acc


def chunk_rows_for(n: int, vocab: int, dtype: torch.dtype, budget_bytes: int = _LOGITS_BUDGET_BYTES) -> int:
    """Rows per chunk so that one chunk's logits stay within ``budget_bytes``.

    Rows are counted at 4 bytes a logit for fp32 inputs and 8 for bf16/fp16, although every loop (the Python one
    of the reference and Triton backends, the C++ one of cpp/cuda) now holds only the 16-bit chunk for 16-bit
    inputs (2 bytes a logit, the gradient written over it in place; it was 2 + 4 + 2 with an fp32 copy and a
    16-bit gradient). The row count is kept (256 at V=128256): halving it would cut the 16-bit chunk from 62.6 to
    31.3 MiB (Liger-Kernel's 128-row chunk) but make each chunk's three GEMMs memory-bound on reading the (V, H) weight.
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
    ``row_scale[i] * dloss_i/dz_i`` (0 on ignored rows). Labels must be in [0, V) or ``ignore_index``.
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


def _rows_reference_any(z: Tensor, labels: Tensor, row_scale: Tensor, ignore_index: int, label_smoothing: float,
                        softcap: float, write_grad: bool) -> Tensor:
    """:func:`flce_rows_reference` on logits of any float dtype: 16-bit ones a few rows at a time in fp32, the
    gradient written back over them rounded to their dtype (as the Triton row pass does)."""
    if z.dtype not in _HALF:
        return flce_rows_reference(z, labels, row_scale, ignore_index, label_smoothing, softcap, write_grad)
    # fp32 blocks of 1/32 of the chunk: the reference's ~4 fp32 temporaries stay at 1/4 of the 16-bit chunk
    step = max(1, z.shape[0] // 32)
    loss = z.new_empty(z.shape[0], dtype=torch.float32)
    for s in range(0, z.shape[0], step):
        block = z[s:s + step].float()
        loss[s:s + step] = flce_rows_reference(block, labels[s:s + step], row_scale[s:s + step], ignore_index,
                                               label_smoothing, softcap, write_grad)
        if write_grad:
            z[s:s + step].copy_(block)
    return loss


def rows_triton(z: Tensor, labels: Tensor, row_scale: Tensor, ignore_index: int, label_smoothing: float,
                softcap: float, write_grad: bool) -> Tensor:
    """:func:`flce_rows_reference` on the Triton row kernel (``sdk/kernels/fused_linear_cross_entropy.py``)."""
    from shardkit.kernels import fused_linear_cross_entropy as tk

    return tk.flce_rows_(z, labels, row_scale, ignore_index, label_smoothing, softcap, write_grad)


def _loop_with(rows_fn: RowsFn) -> Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]:
    """The Python chunk loop with ``rows_fn`` as its row pass, in the signature of ``shardkit_C::flce_chunked``."""
    def loop(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, row_scale: Tensor,
             ignore_index: int, label_smoothing: float, softcap: float, chunk_rows: int, need_hidden: bool,
             need_weight: bool, need_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return _chunked(hidden, weight, labels, bias, row_scale, ignore_index, label_smoothing, softcap, chunk_rows,
                        (need_hidden, need_weight, need_bias), rows_fn)

    return loop


def _chunked(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, row_scale: Tensor,
             ignore_index: int, label_smoothing: float, softcap: float, chunk_rows: int,
             need: tuple[bool, bool, bool], rows_fn: RowsFn) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The chunk loop of the reference and Triton backends (the cpp backend runs the same loop in C++).

    hidden, weight and bias share one dtype. Returns the fp32 (float64) per-row losses, grad_hidden in that
    dtype and grad_weight/grad_bias as the fp32 (float64) accumulators (grad_weight bf16 for bf16 weights): the
    caller picks what to keep them in.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    acc = accumulate_dtype(hidden.dtype)
    need_h, need_w, need_b = need
    write_grad = any(need)
    loss = hidden.new_empty(n, dtype=acc)
    gh = torch.empty_like(hidden) if need_h else hidden.new_empty(0)
    # fp32 accumulators, except grad_weight for bf16 weights: a bf16 one that each chunk's fp32 GEMM result is
    # folded into (addmm, beta=1: one bf16 rounding per chunk; see csrc/fused_linear_cross_entropy/flce_chunk_loop.h)
    fold_bf16 = weight.dtype == torch.bfloat16
    gw_dtype = torch.bfloat16 if fold_bf16 else acc
    gw = weight.new_zeros(weight.shape, dtype=gw_dtype) if need_w else weight.new_empty(0, dtype=acc)
    gb = weight.new_zeros(vocab, dtype=acc) if need_b else weight.new_empty(0, dtype=acc)
    wt = weight.t()
    block = grad_weight_block_rows(weight)
    for s in range(0, n, chunk_rows):
        e = min(n, s + chunk_rows)
        hc = hidden[s:e]
        # 16-bit inputs: the row pass reads the 16-bit logits and writes the gradient over them rounded to 16 bits
        # (fp32 math inside), the rounding the naive path's backward applies before its matmuls too, which then
        # run as 16-bit matmuls (an fp32 one is ~15x slower on tensor cores). No fp32 copy of the chunk: at
        # T=4096 H=2048 V=128256 bf16 the H200 peak was 705 MiB (cuda loop) / 768 MiB (this loop, which also
        # held the last chunk's two copies while making the next) against Liger's 548 MiB; here one 16-bit chunk
        # (62.6 MiB at 256 rows) is what the loop adds to grad_weight and grad_hidden.
        z = torch.addmm(bias, hc, wt) if bias is not None else hc @ wt  # chunk_rows x V
        loss[s:e] = rows_fn(z, labels[s:e], row_scale[s:e], ignore_index, label_smoothing, softcap, write_grad)
        if write_grad:
            fold_chunk_grads(z, hc, weight,
                             (gh[s:e] if need_h else None, gw if need_w else None, gb if need_b else None),
                             fold_bf16, block)
        del z  # before the next chunk's logits exist
    return loss, gh, gw, gb


def grad_weight_block_rows(weight: Tensor) -> int:
    """Vocab rows of one 16-bit grad_weight product in the fp16 fold (bounded by ``_GRAD_WEIGHT_BLOCK_BYTES``)."""
    return max(1, _GRAD_WEIGHT_BLOCK_BYTES // (weight.element_size() * max(1, weight.shape[1])))


def fold_chunk_grads(g: Tensor, hc: Tensor, weight: Tensor, outs: tuple[Tensor | None, Tensor | None, Tensor | None],
                fold_bf16: bool, block: int) -> None:
    """Adds one chunk's logits gradient ``g`` (rows, V; the input dtype) into grad_hidden rows, grad_weight and
    grad_bias (``outs``, None where not needed)."""
    gh, gw, gb = outs
    if gh is not None:
        torch.mm(g, weight, out=gh)
    if gw is not None and (g.dtype == gw.dtype or fold_bf16):
        gw.addmm_(g.t(), hc)
    elif gw is not None:  # fp16: 16-bit products, a block of vocab rows at a time, summed into the fp32 accumulator
        for v in range(0, g.shape[1], block):
            gw[v:v + block].add_(g[:, v:v + block].t() @ hc)
    if gb is not None:
        gb.add_(g.sum(0, dtype=gb.dtype))


def check_loss_options(op: str, reduction: str, label_smoothing: float, softcap_name: str,
                       softcap: float | None) -> None:
    """Raises a ValueError naming ``op`` and the argument for a bad reduction, label_smoothing or softcap."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction={reduction!r}; use one of {_REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing={label_smoothing} must be in [0, 1]")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"{op}: {softcap_name}={softcap} must be positive or None")


def check_label_range(labels: Tensor, vocab: int, ignore_index: int, op: str = "fused_linear_cross_entropy") -> None:
    """Raises naming the first label outside [0, V) that is not ``ignore_index`` (one host sync on GPU)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        row = int(bad.int().argmax())
        raise RuntimeError(f"{op}: label {int(labels[row])} at row {row} is outside "
                           f"[0, {vocab}) and is not ignore_index ({ignore_index})")


def _run(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, row_scale: Tensor, ignore_index: int,
         label_smoothing: float, softcap: float, chunk_rows: int, compute_dtype: torch.dtype,
         need: tuple[bool, bool, bool], check_labels: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Casts to ``compute_dtype`` and runs the chunk loop on the chosen backend; returns as :func:`_chunked`."""
    # One dtype for every matmul: the native kernels take a single storage dtype, and torch.mm two equal ones.
    hidden = hidden.to(compute_dtype).contiguous()
    weight = weight.to(compute_dtype).contiguous()
    bias = bias.to(compute_dtype) if bias is not None else None
    labels = labels.contiguous()
    # NOTE: the native kernels take fp32 logits from one storage dtype; float64 (the test oracle) goes through
    # the reference loop
    backend = "reference" if compute_dtype == torch.float64 else SPEC.select("flce_chunked", hidden.device)
    # NOTE: checked here for every backend, though the C++ ops check too (for direct callers): on an H100 machine
    # (torch 2.11+cu130) the CUDA binding's TORCH_CHECK segfaulted formatting its message (in libstdc++'s ostream,
    # seen under cuda-gdb), so a bad label must never reach it from Python. One host sync per call on GPU.
    if check_labels:
        check_label_range(labels, weight.shape[0], ignore_index)
    if chunk_rows <= 0:
        chunk_rows = chunk_rows_for(hidden.shape[0], weight.shape[0], compute_dtype)
    # the dtypes above are final: autocast (on around the op when the caller runs under it) must not recast them
    with torch.autocast(hidden.device.type, enabled=False):
        return SPEC.call("flce_chunked", backend, hidden, weight, labels, bias, row_scale, ignore_index,
                         label_smoothing, softcap, chunk_rows, *need)


def _reduce(loss_rows: Tensor, valid: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return loss_rows
    total = loss_rows.sum()
    if reduction == "mean":
        total = total / valid.sum()  # 0 / 0 = nan when every row is ignored, as torch
    return total


@torch.library.custom_op("shardkit::fused_linear_cross_entropy", mutates_args=())
def _flce_op(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, ignore_index: int, reduction: str,
             label_smoothing: float, softcap: float, chunk_rows: int, compute_dtype: torch.dtype, need_hidden: bool,
             need_weight: bool, need_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Loss (fp32) and the gradients backward will scale: grad_hidden in ``compute_dtype``, grad_weight in
    :func:`_saved_weight_dtype`, grad_bias in fp32 (empty where not needed)."""
    valid = labels != ignore_index
    acc = accumulate_dtype(compute_dtype)
    row_scale = valid.to(acc)
    if reduction == "mean" and not _defers_mean(compute_dtype, reduction):
        row_scale = row_scale / valid.sum().clamp(min=1).to(acc)
    # reduction="none": losses only here, gradients recomputed in backward with the per-row upstream gradient
    need = (need_hidden, need_weight, need_bias) if reduction != "none" else (False, False, False)
    loss_rows, gh, gw, gb = _run(hidden, weight, labels, bias, row_scale, ignore_index, label_smoothing, softcap,
                                 chunk_rows, compute_dtype, need)
    return _reduce(loss_rows, valid, reduction), gh, gw.to(_saved_weight_dtype(compute_dtype, weight.dtype)), gb


@_flce_op.register_fake
def _(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap, chunk_rows, compute_dtype,
      need_hidden, need_weight, need_bias):
    grads = reduction != "none"
    acc = accumulate_dtype(compute_dtype)
    loss = hidden.new_empty((hidden.shape[0],) if reduction == "none" else (), dtype=acc)
    gh = hidden.new_empty(hidden.shape if grads and need_hidden else (0,), dtype=compute_dtype)
    gw = weight.new_empty(weight.shape if grads and need_weight else (0,),
                          dtype=_saved_weight_dtype(compute_dtype, weight.dtype))
    gb = weight.new_empty((weight.shape[0],) if grads and need_bias else (0,), dtype=acc)
    return loss, gh, gw, gb


@torch.library.custom_op("shardkit::fused_linear_cross_entropy_backward", mutates_args=())
def _flce_backward_rows_op(grad_loss: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None,
                           ignore_index: int, label_smoothing: float, softcap: float, chunk_rows: int,
                           compute_dtype: torch.dtype, need_hidden: bool, need_weight: bool,
                           need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """reduction="none" backward: recompute each chunk with row scale ``grad_loss[i]`` (ignored rows: 0)."""
    valid = labels != ignore_index
    acc = accumulate_dtype(compute_dtype)
    row_scale = torch.where(valid, grad_loss.to(acc), torch.zeros((), dtype=acc, device=grad_loss.device))
    need = (need_hidden, need_weight, need_bias)
    # labels were checked by the forward pass
    _, gh, gw, gb = _run(hidden, weight, labels, bias, row_scale, ignore_index, label_smoothing, softcap, chunk_rows,
                         compute_dtype, need, check_labels=False)
    return gh.to(hidden.dtype), gw.to(weight.dtype), gb.to(bias.dtype if bias is not None else weight.dtype)


@_flce_backward_rows_op.register_fake
def _(grad_loss, hidden, weight, labels, bias, ignore_index, label_smoothing, softcap, chunk_rows, compute_dtype,
      need_hidden, need_weight, need_bias):
    b_dtype = bias.dtype if bias is not None else weight.dtype
    return (hidden.new_empty(hidden.shape if need_hidden else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,)),
            weight.new_empty((weight.shape[0],) if need_bias else (0,), dtype=b_dtype))


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, labels, bias, ignore_index, reduction, smoothing, softcap, chunk_rows, compute_dtype, *_ = inputs
    ctx.reduction = reduction
    ctx.has_bias = bias is not None
    ctx.args = (ignore_index, smoothing, softcap, chunk_rows, compute_dtype)
    ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else weight.dtype)
    ctx.defer_mean = _defers_mean(compute_dtype, reduction)
    # NOTE: the gradient outputs are never used downstream; without this autograd would materialise a zero
    # grad for each of them in backward: (T, H) + (V, H) more, 96 MiB at T=4096 H=2048 V=8192 fp32.
    ctx.set_materialize_grads(False)
    ctx.consumed = False
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, labels, bias)
    else:
        ctx.save_for_backward(*output[1:], labels)


def _scaled(g: Tensor, scale: Tensor | float, dtype: torch.dtype) -> Tensor:
    """``g * scale`` in ``dtype``, in place where the dtypes allow; the scale is never rounded to 16 bits."""
    if torch.finfo(g.dtype).bits < torch.finfo(dtype).bits:  # widen first: scale at the higher precision
        g = g.to(dtype)
    if not (isinstance(scale, float) and scale == 1.0):
        g = g.mul_(scale)
    return g.to(dtype)


def _scale_saved_(ctx, grad_loss: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Scales the gradients saved by forward IN PLACE by the upstream gradient, once, and casts them.

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
    *grads, labels = ctx.saved_tensors
    scale = grad_loss if torch.compiler.is_compiling() else grad_loss.double()
    if ctx.defer_mean:
        scale = scale / (labels != ctx.args[0]).sum().clamp(min=1)
    if not torch.compiler.is_compiling():
        # A Python float multiplies at fp32 math precision, never rounded to a 16-bit g's dtype (a 1/k upstream
        # rounded to bf16 biases every gradient by up to 0.4%). .item() is one host sync, and the common
        # grad_output == 1 (loss.backward()) then skips a full pass over (V, H) + (T, H). Compiled, the 0-d
        # tensor stays: inductor computes 16-bit pointwise ops in fp32.
        scale = scale.item()
    return tuple(_scaled(g, scale, dt) if g.numel() else g for g, dt in zip(grads, ctx.dtypes))


def _backward(ctx, grad_loss: Tensor | None, *_unused):
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = ctx.has_bias and ctx.needs_input_grad[3]
    if grad_loss is None:  # materialize_grads is off: the loss did not reach the output
        return (None,) * 13
    if ctx.reduction == "none":
        hidden, weight, labels, bias = ctx.saved_tensors
        gh, gw, gb = _flce_backward_rows_op(grad_loss, hidden, weight, labels, bias, *ctx.args, need_h, need_w, need_b)
    else:
        gh, gw, gb = _scale_saved_(ctx, grad_loss)
    return (gh if need_h else None, gw if need_w else None, None, gb if need_b else None) + (None,) * 9


_flce_op.register_autograd(_backward, setup_context=_setup_context)


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None,
                               ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                               logit_softcap: float | None = None, chunk_rows: int | None = None) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels`` without materialising the logits.

    Args:
        hidden: (N, H) activations (any leading dims are flattened into N).
        weight: (V, H) output projection (lm_head weight); may differ in dtype from ``hidden``.
        labels: (N,) int64 class indices; ``ignore_index`` rows contribute nothing.
        bias: optional (V,) bias.
        ignore_index: label value to skip.
        reduction: "mean" (over non-ignored rows), "sum" or "none" (per-row losses, 0 on ignored rows).
        label_smoothing: as in torch.nn.functional.cross_entropy.
        logit_softcap: if set, logits become ``softcap * tanh(logits / softcap)`` (Gemma 2).
        chunk_rows: rows per chunk; default from a 256 MiB logits budget (see :func:`chunk_rows_for`).

    Returns:
        The loss in fp32 (float64 for float64 inputs), whatever the input dtypes, as Hugging Face computes it:
        a scalar, or (N,) for reduction="none". The matmuls run in :func:`flce_compute_dtype` (autocast's dtype
        under autocast); gradients come back in each input's dtype.

    Raises:
        RuntimeError: a label outside [0, V) that is not ``ignore_index``; or, in backward, when a graph
            retained with ``retain_graph=True`` runs backward a second time with reduction "mean" or "sum" (the
            saved gradients were scaled in place by the first one).
    """
    check_loss_options("fused_linear_cross_entropy", reduction, label_smoothing, "logit_softcap", logit_softcap)
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
                        float(logit_softcap or 0.0), int(chunk_rows or 0), flce_compute_dtype(hidden, weight, bias),
                        *need)
    return loss.view(labels.shape) if reduction == "none" else loss


def linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None,
                                   ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                                   logit_softcap: float | None = None) -> Tensor:
    """The naive path (full logits + F.cross_entropy), differentiable by autograd: the oracle and the baseline.

    16-bit logits are upcast to fp32 before the softcap and the loss, as Hugging Face's causal-LM loss does, so
    the loss is fp32 like the fused op's.
    """
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if logits.dtype in _HALF:
        logits = logits.float()
    if logit_softcap:
        logits = torch.tanh(logits / logit_softcap) * logit_softcap
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=ignore_index, reduction=reduction,
                                             label_smoothing=label_smoothing)


def _example(device: str, dtype: torch.dtype, size: str) -> tuple:
    n, h, v = (4096, 2048, 8192) if size == "bench" else (7, 16, 37)
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, h, generator=gen) * 0.5).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(device, dtype).requires_grad_()
    return hidden, weight, torch.randint(0, v, (n,), generator=gen).to(device)


SPEC = register(OpSpec(
    name="fused_linear_cross_entropy", function=fused_linear_cross_entropy, reference=linear_cross_entropy_reference,
    csrc="fused_linear_cross_entropy",
    # cpp/cuda run the whole chunk loop in C++ (matmuls through MKL/cuBLAS); the others run it here around their
    # row pass
    kernels={"flce_chunked": {"reference": _loop_with(_rows_reference_any), "triton": _loop_with(rows_triton),
                              **native("flce_chunked")}},
    triton_checks="shardkit.kernels.fused_linear_cross_entropy:compile_checks", example=_example))
