"""Causal attention over a sequence split across the ranks of a context-parallel group.

The sequence is cut into ``2 * cp`` equal chunks and rank r holds chunks ``r`` and ``2*cp-1-r``
(:func:`load_balanced_positions`): under a causal mask the early chunks attend to few keys and the late
ones to many, so pairing them gives every rank the same work (a plain split gives the last rank
``2*cp-1`` times the first's score blocks).

Two ways to attend over the whole sequence from the local chunks, both differentiable end to end
(autograd runs through the communication, so gradients of q, k and v reach every rank):

- :class:`UlyssesAttention`: all-to-all from (local sequence, all heads) to (whole sequence, heads/cp),
  ordinary causal SDPA, and back. Two all-to-alls of q/k/v/out per layer; needs heads divisible by cp.
- :class:`RingAttention`: key/value blocks travel around the ring (cp - 1 shifts, each posted before the block
  in hand is computed, so the transfer overlaps it); each step runs one fused
  SDPA call (aten's flash op that returns the log-sum-exp: no score block is materialised) and merges it into
  the output by log-sum-exp. Any head count. Its backward is written out (ring-flash): the blocks go around the
  ring again with their gradients, each through the fused op's backward with the merged output and log-sum-exp,
  so a rank keeps only its own q/k/v, output and log-sum-exp. Where no fused op fits it falls back to an
  explicit fp32 online softmax (see :func:`_fused_ops`); with attention dropout it runs autograd through the
  shifts over that math path (each block recomputed in backward under its RNG state).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["RingAttention", "UlyssesAttention", "load_balanced_positions", "shard_sequence"]


def load_balanced_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Positions (in the whole sequence) of the tokens rank ``rank`` of ``cp`` holds: chunks r and 2cp-1-r.

    Raises:
        ValueError: ``seq_len`` is not a multiple of ``2 * cp`` (the message says what to pad to).
    """
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism: seq_len({seq_len}) % (2 * cp({cp})) != 0; causal load balancing "
                         f"splits each sequence into {2 * cp} equal chunks: pad sequences to a multiple of {2 * cp}")
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def shard_sequence(t: torch.Tensor, positions: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The part of ``t`` at ``positions`` along ``dim`` (the sequence dim)."""
    return t.index_select(dim, positions.to(t.device))


class _CPAttention:
    """What both ways share: the group, this rank's place in it, and the switch generation turns off."""

    def __init__(self, group: Any):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.seq_len: int | None = None  # the whole sequence's length, set by the forward that splits it

    def positions(self, rank: int, device: torch.device) -> torch.Tensor:
        if self.seq_len is None:
            raise RuntimeError("context-parallel attention ran outside a context-parallel forward (no seq_len set)")
        return load_balanced_positions(self.seq_len, self.size, rank, device)


class UlyssesAttention(_CPAttention):
    """Causal attention by all-to-all between sequence and heads (DeepSpeed-Ulysses).

    Args:
        group: the context-parallel process group.
    """

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
        heads = q.shape[1]
        if heads % self.size:
            raise ValueError(f"Ulysses context parallelism: heads({heads}) % cp({self.size}) != 0; use "
                             "cp_mode='ring' or a cp that divides the head count")
        order = torch.cat([self.positions(r, q.device) for r in range(self.size)])
        inverse = torch.argsort(order)
        q, k, v = (self._to_heads(t).index_select(2, inverse) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        return self._to_sequence(out.index_select(2, order))

    def _to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H, T/cp, D) local sequence -> (B, H/cp, T, D) whole sequence in rank order."""
        b, h, s, d = t.shape
        send = t.reshape(b, self.size, h // self.size, s, d).transpose(0, 1).contiguous()
        recv = _all_to_all(send, self.group)  # [j]: rank j's tokens
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // self.size, self.size * s, d)

    def _to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H/cp, T, D) in rank order -> (B, H, T/cp, D): this rank's tokens, every head."""
        b, hl, total, d = t.shape
        s = total // self.size
        send = t.reshape(b, hl, self.size, s, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = _all_to_all(send, self.group)  # [j]: head group j
        return recv.transpose(0, 1).reshape(b, self.size * hl, s, d)


def _all_to_all(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Block j of ``t``'s first dim to rank j, block j of the result from rank j; autograd runs the reverse."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(t, None, None, group))


class _RingShift(torch.autograd.Function):
    """Send a tensor to the next rank of the ring and receive the previous one's; backward the reverse."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, step: int) -> torch.Tensor:
        ctx.group, ctx.step = group, step
        return _shift(t, group, step)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _shift(grad, ctx.group, -ctx.step), None, None


def _shift(t: torch.Tensor, group: Any, step: int) -> torch.Tensor:
    """Rank r sends ``t`` to r + step and receives from r - step (within ``group``)."""
    return _post(t, group, step)()


def _post(t: torch.Tensor, group: Any, step: int) -> Callable[[], torch.Tensor]:
    """Starts :func:`_shift` and returns its wait, which gives the received tensor: the fused ring posts the next
    block before computing the current one, so the transfer runs under the compute (as torch's ring does)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size == 1 or step % size == 0:  # to itself: gloo has no pair to its own rank
        return lambda: t
    t = t.contiguous()
    out = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, (rank + step) % size), group),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(group, (rank - step) % size), group)]
    works = dist.batch_isend_irecv(ops)

    def wait(sent: torch.Tensor = t) -> torch.Tensor:  # holds the sent tensor until the transfer is done
        for work in works:
            work.wait()
        return out

    return wait


def _pack(*ts: torch.Tensor) -> torch.Tensor:
    """One flat buffer of ``ts`` (one message a ring step instead of one per tensor)."""
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(flat: torch.Tensor, *like: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as ``like``, in order (the inverse of :func:`_pack`)."""
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in like]), like)]


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, m: torch.Tensor,
           denom: torch.Tensor, acc: torch.Tensor, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One key/value block into the online softmax: new running max ``m``, sum ``denom`` and output ``acc``."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    # The result does not depend on the max chosen (it cancels), so it carries no gradient.
    m_new = torch.maximum(m, scores.amax(-1, keepdim=True)).detach()
    p = torch.exp(scores - m_new)
    alpha = torch.exp(m - m_new)
    # Dropout of the unnormalised probabilities: the sum is of the kept ones' originals, so the result is
    # dropout of the normalised ones (SDPA's). Backward recomputes this block under the same RNG state.
    dropped = F.dropout(p, dropout_p) if dropout_p else p
    return m_new, denom * alpha + p.sum(-1, keepdim=True), acc * alpha + dropped @ v.float()


class RingAttention(_CPAttention):
    """Causal attention by passing key/value blocks around the ring with an online softmax.

    Args:
        group: the context-parallel process group.
    """

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
        if not dropout_p:
            return _Ring.apply(q, k, v, self)
        return self._through_autograd(q, k, v, dropout_p)

    def visible(self, q_pos: torch.Tensor, step: int) -> torch.Tensor:
        """Which keys of the block held at ``step`` (from rank - step) each local query sees."""
        return self.positions((self.rank - step) % self.size, q_pos.device)[None, :] <= q_pos[:, None]

    def _through_autograd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """With dropout: autograd through the ring shifts, each block recomputed in backward under its RNG state
        (keeps every received key/value block until backward)."""
        q_pos = self.positions(self.rank, q.device)
        b, h, s, _ = q.shape
        # Own block first: every query sees at least itself there, so the running max is finite after it.
        m = torch.full((b, h, s, 1), float("-inf"), device=q.device)
        denom = torch.zeros((b, h, s, 1), device=q.device)
        acc = torch.zeros((b, h, s, v.shape[-1]), device=q.device)
        for step in range(self.size):
            if step:
                k, v = _RingShift.apply(k, self.group, 1), _RingShift.apply(v, self.group, 1)
            m, denom, acc = checkpoint(_block, q, k, v, self.visible(q_pos, step), m, denom, acc, dropout_p,
                                       use_reentrant=False)
        return (acc / denom).to(q.dtype)


class _Ring(torch.autograd.Function):
    """Ring attention with its own backward: saves only q, the local k/v, the output and the log-sum-exp; backward
    sends the key/value blocks around the ring again, their gradients travelling with them back to their owner."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingAttention) -> torch.Tensor:
        ctx.fused = _fused_ops(q)
        out, lse = _fused_forward(q, k, v, ring, ctx.fused) if ctx.fused else _math_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.fused:
            dq, dk, dv = _fused_backward(grad, q, k, v, out, lse, ctx.ring, ctx.fused)
        else:
            dq, dk, dv = _math_backward(grad, q, k, v, out, lse, ctx.ring)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _fused_ops(q: torch.Tensor) -> str | None:
    """Which fused per-block kernel runs the ring here: ``"cpu"``, ``"flash"`` (CUDA) or None (the math path).

    The math path materialises a (B, H, s, s) fp32 score block and its probabilities per step (4.3 GB each at
    seq 8192 on one GPU); the fused ops keep them in tiles. It stays where no fused op with a log-sum-exp output
    and a matching backward fits: CUDA fp32 (flash takes only fp16/bf16; the memory-efficient op pads its
    log-sum-exp to a multiple of 32 rows, a layout this ring has not been checked against on a GPU), head dims
    over 256 or not a multiple of 8, GPUs before sm80, and other devices. It warns once when it does.
    """
    aten = torch.ops.aten
    if q.device.type == "cpu" and hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return "cpu"
    if (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
            and q.shape[-1] % 8 == 0 and torch.cuda.get_device_capability(q.device) >= (8, 0)
            and hasattr(aten, "_scaled_dot_product_flash_attention")):
        return "flash"
    _warn_math_path(q)
    return None


@functools.lru_cache(maxsize=None)
def _warn_once(what: str) -> None:
    warnings.warn(f"ring attention: no fused attention kernel for {what}; using the math path, which holds a "
                  "full fp32 score block per ring step (fused: CPU any dtype, CUDA sm80+ fp16/bf16 with head "
                  "dim <= 256 and a multiple of 8)", stacklevel=4)


def _warn_math_path(q: torch.Tensor) -> None:
    _warn_once(f"{q.device.type} {q.dtype} head dim {q.shape[-1]}")


def _block_plan(ring: RingAttention, step: int) -> tuple[slice, slice, bool]:
    """The one attention call step ``step`` needs: (query rows, key rows, is_causal), from the chunk layout.

    Rank r holds chunks (r, 2cp-1-r); the block at ``step`` came from j = r - step. Step 0 is the diagonal
    (causal over both chunks, since r < 2cp-1-r); for j < r every query sees only the block's first chunk, in
    full; for j > r only the second query chunk sees anything, the whole block.
    """
    if ring.seq_len is None:
        raise RuntimeError("context-parallel attention ran outside a context-parallel forward (no seq_len set)")
    if step == 0:
        return slice(None), slice(None), True
    c = ring.seq_len // (2 * ring.size)
    src = (ring.rank - step) % ring.size
    return (slice(None), slice(0, c), False) if src < ring.rank else (slice(c, None), slice(None), False)


def _attend(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block through the fused op: its output and log-sum-exp (B, H, rows)."""
    if kind == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]


def _attend_backward(kind: str, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, causal: bool) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of one block, from the ring's merged output and log-sum-exp (the ring-flash backward)."""
    if kind == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal)
    # Dense (not varlen) and no dropout: no cumulative lengths, the philox state is unused.
    empty = torch.empty((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, empty, empty)[:3]


def _blocks(k: torch.Tensor, v: torch.Tensor, ring: RingAttention) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(step, key block, value block) around the ring: step 0 this rank's own k and v as they come (no copy: with a
    packed copy instead, cp=1's ring call measured 10-20% slower at 2 threads, seq 2048-4096, on a loaded 2-core
    machine), then the block from rank - step. Each next block is posted (one packed buffer) before the current
    one is yielded, so its transfer runs under the current block's compute, as torch's ring overlaps its
    all-gather."""
    kv = incoming = None
    for step in range(ring.size):
        if incoming is not None:
            kv = incoming()
        incoming = _post(_pack(k, v) if kv is None else kv, ring.group, 1) if step < ring.size - 1 else None
        yield (step, k, v) if kv is None else (step, *_unpack(kv, k, v))


def _fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingAttention,
                   kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each step's block through the fused op ``kind`` (:func:`_fused_ops`), merged by log-sum-exp; returns
    (out in q's dtype, lse)."""
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    acc = lse = None
    for step, kc, vc in _blocks(k, v, ring):
        rows, keys, causal = _block_plan(ring, step)
        blk_out, blk_lse = _attend(kind, q[:, :, rows], kc[:, :, keys], vc[:, :, keys], causal)
        blk_out, blk_lse = blk_out.to(acc_dtype), blk_lse.to(acc_dtype).unsqueeze(-1)
        if acc is None:  # step 0, the diagonal: every query sees itself, so the lse is finite from here on
            acc, lse = blk_out, blk_lse
            continue
        # Online softmax: each side weighted by its share of the merged normaliser.
        old_lse = lse[:, :, rows]
        new_lse = torch.logaddexp(old_lse, blk_lse)
        acc[:, :, rows] = acc[:, :, rows] * torch.exp(old_lse - new_lse) + blk_out * torch.exp(blk_lse - new_lse)
        lse[:, :, rows] = new_lse
    return acc.to(q.dtype), lse.squeeze(-1)


def _fused_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, ring: RingAttention,
                    kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block the fused op's backward with the merged output and lse; dk/dv travel with their block."""
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    grad = grad.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dkv = torch.zeros(k.numel() + v.numel(), dtype=acc_dtype, device=k.device)
    gradients = None
    for step, kc, vc in _blocks(k, v, ring):
        rows, keys, causal = _block_plan(ring, step)
        gq, gk, gv = _attend_backward(kind, grad[:, :, rows], q[:, :, rows], kc[:, :, keys], vc[:, :, keys],
                                      out[:, :, rows], lse[:, :, rows], causal)
        if gradients is not None:  # this block's gradients from the ranks it visited before, sent under the compute
            dkv = gradients()
        dq[:, :, rows] += gq
        dk, dv = _unpack(dkv, k, v)
        dk[:, :, keys] += gk
        dv[:, :, keys] += gv
        gradients = _post(dkv, ring.group, 1)  # on with the block; after the last step, home to its owner
    return (dq, *_unpack(gradients(), k, v))


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  ring: RingAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """The fallback: full fp32 score blocks per step into the online softmax; returns (out fp32, lse)."""
    q_pos = ring.positions(ring.rank, q.device)
    b, h, s, _ = q.shape
    m = torch.full((b, h, s, 1), float("-inf"), device=q.device)
    denom = torch.zeros((b, h, s, 1), device=q.device)
    acc = torch.zeros((b, h, s, v.shape[-1]), device=q.device)
    kc, vc = k, v
    for step in range(ring.size):
        if step:
            kc, vc = _shift(kc, ring.group, 1), _shift(vc, ring.group, 1)
        m, denom, acc = _block(q, kc, vc, ring.visible(q_pos, step), m, denom, acc, 0.0)
    return acc / denom, m + torch.log(denom)


def _math_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, ring: RingAttention) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fallback's backward, flash-attention style from the saved lse, one fp32 score block per step."""
    q_pos = ring.positions(ring.rank, q.device)
    scale = q.shape[-1] ** -0.5
    qf, grad = q.float(), grad.float()
    delta = (grad * out).sum(-1, keepdim=True)
    dq = torch.zeros_like(qf)
    kc, vc = k.float(), v.float()
    dk, dv = torch.zeros_like(kc), torch.zeros_like(vc)
    for step in range(ring.size):
        if step:
            kc, vc, dk, dv = (_shift(t, ring.group, 1) for t in (kc, vc, dk, dv))
        scores = (qf @ kc.transpose(-1, -2)) * scale
        p = torch.exp(scores.masked_fill(~ring.visible(q_pos, step), float("-inf")) - lse)
        dv += p.transpose(-1, -2) @ grad
        ds = p * (grad @ vc.transpose(-1, -2) - delta)
        dq += (ds @ kc) * scale
        dk += (ds.transpose(-1, -2) @ qf) * scale
    # The block held last came from rank + 1: one more shift takes its gradients home.
    return dq, _shift(dk, ring.group, 1), _shift(dv, ring.group, 1)
