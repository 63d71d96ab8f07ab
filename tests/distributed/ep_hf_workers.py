"""Hugging Face's Qwen3-MoE under ``ExpertParallel(ep_size=2, tp_size=2)`` on 4 ranks against the same model in one
process (called once from ``ep_workers.ep_worker``): attention split over tp by transformers' plan without its
expert entries, the expert blocks dispatched over ep (the tp peers splitting the assignments), the router whole on
every tp rank. 3 AdamW steps with clipping, the first with right padding in rows 0 and 2 (its tokens routed
nowhere): the initial weights, the loss, every whole gradient, the clipped norm and the weights after the steps; then
the checkpoint loaded into one process takes the same next step. The same with ``expert_tp=True`` (each tp peer its
block of the experts, ep over the data-parallel ranks of one tp coordinate), and with ``sequence_parallel=True`` (the
residual stream between the decoder layers split over tp along the sequence).

:func:`hf_cptp_case`: the same model under ``ExpertParallel(ep_size=4, cp_size=2, tp_size=2)`` (each sequence split
over cp, attention over tp, ep borrowing both) against one process over 3 clipped SGD steps without padding (the
context-parallel forward refuses padded rows). SGD, not AdamW: on this model and data one element of a layer-0 key
projection's gradient is ~5e-8, near AdamW's eps, where the update's sensitivity (about lr / eps) turns float32
rounding into 7e-5 of weight (one process in float32 against float64 differs as much), which would hide a real
error."""

from __future__ import annotations

import copy
from typing import Any

import torch

from shardkit import Runner

__all__ = ["hf_cptp_case", "hf_tp_case"]

PAD = 4  # the first step's rows 0 and 2 end with this many padding tokens (each data-parallel rank as many real ones,
# so that the mean of the ranks' mean losses is the global batch's)


def _steps(batches: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask, labels) per step."""
    out = []
    for step, ids in enumerate(batches):
        mask = torch.ones_like(ids)
        if step == 0:
            mask[0::2, -PAD:] = 0
        out.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    return out


def hf_tp_case(root: str, expert_tp: bool = False, sequence_parallel: bool = False) -> dict[str, Any]:
    """The figures of the module docstring; ``expert_tp``: ``ExpertParallel(ep_size=2, tp_size=2, expert_tp=True)``
    (ep from dp_shard, each tp peer holding its block of every local expert), with each expert weight's local
    shape."""
    from ep_more_workers import _next_step_loss, _qwen3_moe
    from ep_workers import CLIP, _adamw, _batches, _whole

    from shardkit.strategies import SingleDevice
    from shardkit.strategies.expert_parallel import ExpertParallel, hf_expert_blocks

    ref_model = _qwen3_moe()
    model = copy.deepcopy(ref_model)
    init = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    ref_opt = _adamw(ref_model)
    steps = _steps(_batches())
    ref: dict[str, list] = {"loss": [], "grad": [], "norm": []}
    for ids, mask, labels in steps:
        loss = ref_model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        ref["loss"].append(loss.item())
        ref["grad"].append({n: p.grad.clone() for n, p in ref_model.named_parameters()})
        ref["norm"].append(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), CLIP).item())
        ref_opt.step()
        ref_opt.zero_grad()

    runner = Runner(ExpertParallel(ep_size=2, tp_size=2, expert_tp=expert_tp, sequence_parallel=sequence_parallel),
                    seed=0)
    model, opt = runner.setup(model, _adamw(model))
    s = runner.strategy
    attn = model.model.layers[0].self_attn
    out: dict[str, Any] = {
        "ep": s.ep_size, "tp": s.tp_size, "dp": s.data_parallel_size,
        "q_mesh": list(attn.q_proj.weight.device_mesh.mesh_dim_names or ()),
        "q_norm": [type(p).__name__ for p in attn.q_norm.weight.placements],
        "experts": type(model.model.layers[0].mlp.experts.gate_up_proj.data).__name__,
        "local": [list(getattr(model.model.layers[0].mlp.experts, w).to_local().shape)
                  for w in ("gate_up_proj", "down_proj")],
        "ep_group": [int(r) for r in s.expert_mesh["ep"].mesh.flatten()],
        "init": max((_whole(p.detach()) - init[n]).abs().max().item() for n, p in model.named_parameters()),
        "loss": [], "grad": [], "norm": []}
    per = 4 // s.data_parallel_size
    rows = slice(s.data_parallel_rank * per, (s.data_parallel_rank + 1) * per)
    seen: list[int] = []  # the sequence length the second decoder layer gets: 12 / tp with sequence parallelism
    hook = model.model.layers[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    for step, (ids, mask, labels) in enumerate(steps):
        loss = model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows]).loss
        runner.backward(loss)
        if step == 0:  # padding runs no expert: each block's load is this rank's real tokens x top_k
            out["load"] = sorted({int(b.last_load.sum()) for b in hf_expert_blocks(model)})
            out["real"] = int(mask[rows].sum()) * 2
        out["loss"].append(abs(runner.all_reduce(loss.detach().clone(), "mean").item() - ref["loss"][step]))
        out["grad"].append(max((_whole(p.grad) - ref["grad"][step][n]).abs().max().item()
                               for n, p in model.named_parameters()))
        out["norm"].append(abs(runner.clip_gradients(CLIP).item() - ref["norm"][step]))
        runner.step()
    hook.remove()
    out["layer_seq"] = sorted(set(seen))
    want = dict(ref_model.named_parameters())
    out["weights"] = max((_whole(p.detach()) - want[n].detach()).abs().max().item()
                         for n, p in model.named_parameters())
    out["moved"] = max((want[n].detach() - init[n]).abs().max().item() for n in init)
    # ep 2 x tp 2 -> one process (each rank on its own): the checkpoint's next step is the ep 2 x tp 2 run's
    path = f"{root}/hf-ep2{'etp' if expert_tp else 'tp'}2{'sp' if sequence_parallel else ''}"
    runner.save(path, {"model": model, "optimizer": opt})
    following = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(9))
    after = _next_step_loss(runner, model, following)
    one = Runner(SingleDevice("cpu"), seed=3)
    resumed = _qwen3_moe()
    resumed, resumed_opt = one.setup(resumed, _adamw(resumed))
    one.load(path, {"model": resumed, "optimizer": resumed_opt})
    out["resumed"] = abs(_next_step_loss(one, resumed, following) - after)
    return out


def hf_cptp_case() -> dict[str, Any]:
    """Loss, every whole gradient, clipped norm and weights of each of 3 SGD steps under ep 4 x cp 2 x tp 2 against
    one process, with the layout facts."""
    from ep_more_workers import _qwen3_moe
    from ep_workers import CLIP, _batches, _whole

    from shardkit.strategies.expert_parallel import ExpertParallel

    def sgd(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.5)

    ref_model = _qwen3_moe()
    model = copy.deepcopy(ref_model)
    ref_opt = sgd(ref_model)
    runner = Runner(ExpertParallel(ep_size=4, cp_size=2, tp_size=2), seed=0)
    model, _ = runner.setup(model, sgd(model))
    s = runner.strategy
    attn = model.model.layers[0].self_attn
    out: dict[str, Any] = {
        "sizes": [s.ep_size, s.cp_size, s.tp_size, s.data_parallel_size],
        "q_norm": [type(p).__name__ for p in attn.q_norm.weight.placements],
        "ep_group": [int(r) for r in s.expert_mesh["ep"].mesh.flatten()],
        "loss": [], "grad": [], "norm": [], "weights": []}
    want = dict(ref_model.named_parameters())
    for ids in _batches():  # dp 1: every rank takes the whole batch, its cp chunk of each sequence
        ref_loss = ref_model(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        loss = model(input_ids=ids, labels=ids).loss
        runner.backward(loss)
        out["loss"].append(abs(runner.all_reduce(loss.detach().clone(), "mean").item() - ref_loss.item()))
        out["grad"].append(max((_whole(p.grad) - want[n].grad).abs().max().item() for n, p in model.named_parameters()))
        out["norm"].append(abs(runner.clip_gradients(CLIP).item()
                               - torch.nn.utils.clip_grad_norm_(ref_model.parameters(), CLIP).item()))
        runner.step()
        ref_opt.step()
        ref_opt.zero_grad()
        out["weights"].append(max((_whole(p.detach()) - want[n].detach()).abs().max().item()
                                  for n, p in model.named_parameters()))
    return out
