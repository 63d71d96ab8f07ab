"""Tensor parallelism inside the experts on 4 ranks against one process (called from ``ep_workers.ep_worker``):
``ExpertParallel(ep_size=2, tp_size=2, expert_tp=True)`` from ``--strategy-opt``. ep is borrowed from dp_shard (2),
so an ep group is the two data-parallel ranks of one tp coordinate, and each expert's gate/up columns and down rows
are split over the tp peers: each rank holds only its block of its experts (weights and AdamW moments 1/tp of its
ep slice, counted from its local shards and by estimate-memory). ``_case`` gives the initial weights' difference, the
loss, every whole gradient, the clipped norm and the weights after 3 AdamW steps, and the load of each step (the last
one with ep rank 1's experts empty); then its checkpoint is loaded in one process (ep 2 x etp 2 -> 1), saved there in
the one-device layout and loaded under ep 2 x etp 2 again (1 -> ep 2 x etp 2), which saves it whole
(``state_dict_type="full"``) for one process and for ep 2 x etp 2 again; and loaded under ep 4 and under ep 2 x tp 2
without tp inside the experts: all take the same next step."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ep_etp_case"]


def ep_etp_case(root: str, case: Any, ref: dict, init: dict, ref_balance: dict) -> dict[str, Any]:
    """``case`` is ep_workers' ``_case(strategy, ref, init)``: its figures, the layout facts, the aux-loss-free
    update's counts and router bias against ``ref_balance`` (one device's), and the resumed losses."""

    from ep_tp_workers import _expert_rows
    from ep_workers import CONFIG, GLOBAL_BATCH, SEQ, _adamw, bias_update_error

    from shardkit import Runner
    from shardkit.models import Llama
    from shardkit.models.moe import moe_layers
    from shardkit.strategies import SingleDevice
    from shardkit.strategies.registry import STRATEGIES

    opts = ["ep_size=2", "tp_size=2", "expert_tp=true"]
    got, runner, model, opt = case(STRATEGIES.build_from_cli("ep", opts), ref, init)
    s = runner.strategy
    experts = model.layers[0].mlp.experts
    got.update(tp=s.tp_size, expert_tp=s.dims.expert_tp, ep_group=[int(r) for r in s.expert_mesh["ep"].mesh.flatten()],
               mesh=list(experts.gate_up_proj.device_mesh.mesh_dim_names or ()),
               local=[list(experts.gate_up_proj.to_local().shape), list(experts.down_proj.to_local().shape)],
               tp_placements=[type(experts.gate_up_proj.placements[1]).__name__,
                              type(experts.down_proj.placements[1]).__name__])
    got["held"] = _expert_bytes(model, opt)
    # the whole ep slices (each rank's before the split over tp): 1/ep of every expert weight, with AdamW's 2 moments
    got["ep_slice"] = sum(p.numel() // s.ep_size * p.element_size() * 3 for n, p in model.named_parameters()
                          if ".experts." in n)
    got["estimated"] = _estimated_expert_bytes(s)
    got["counts"] = max((layer.tokens_per_expert - c).abs().max().item()
                        for layer, c in zip(moe_layers(model), ref_balance["counts"]))
    got["bias"], _ = bias_update_error(runner, model, ref_balance)
    got["expert_rows"] = _expert_rows(model, s)  # after the counts: a train-mode forward adds to them
    batch = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(9))
    per = GLOBAL_BATCH // s.data_parallel_size
    rows = slice(s.data_parallel_rank * per, (s.data_parallel_rank + 1) * per)

    def next_loss(r: Any, m: torch.nn.Module, part: slice) -> float:
        r.backward(m(batch[part], labels=batch[part]))
        r.step()
        return r.all_reduce(m(batch[part], labels=batch[part]).detach().clone(), "mean").item()

    runner.save(f"{root}/ep2etp2", {"model": model, "optimizer": opt})
    one = Runner(SingleDevice("cpu"), seed=0)  # every rank on its own: ep 2 x etp 2 -> 1
    resumed = Llama(CONFIG)
    resumed, resumed_opt = one.setup(resumed, _adamw(resumed))
    one.load(f"{root}/ep2etp2", {"model": resumed, "optimizer": resumed_opt})
    mine = f"{root}/etp_one{torch.distributed.get_rank()}/ckpt"  # the same one-device file on every rank
    one.save(mine, {"model": resumed, "optimizer": resumed_opt})
    # 1 -> ep 2 x etp 2, saving whole tensors (state_dict_type="full": gathered from the strided shards)
    back = Runner(STRATEGIES.build_from_cli("ep", [*opts, "state_dict_type=full"]), seed=0)
    again = Llama(CONFIG)
    again, again_opt = back.setup(again, _adamw(again))
    back.load(mine, {"model": again, "optimizer": again_opt})
    back.save(f"{root}/etp_full", {"model": again, "optimizer": again_opt})
    whole = Runner(SingleDevice("cpu"), seed=0)  # the full save -> 1
    whole_model = Llama(CONFIG)
    whole_model, whole_opt = whole.setup(whole_model, _adamw(whole_model))
    whole.load(f"{root}/etp_full", {"model": whole_model, "optimizer": whole_opt})
    split = Runner(STRATEGIES.build_from_cli("ep", opts), seed=0)  # the full save -> ep 2 x etp 2 (sliced to blocks)
    split_model = Llama(CONFIG)
    split_model, split_opt = split.setup(split_model, _adamw(split_model))
    split.load(f"{root}/etp_full", {"model": split_model, "optimizer": split_opt})
    after = next_loss(runner, model, rows)
    single = next_loss(one, resumed, slice(None))
    got["resumed_loss"] = abs(single - after)
    got["reloaded_loss"] = abs(next_loss(back, again, rows) - single)
    got["full_to_one"] = abs(next_loss(whole, whole_model, slice(None)) - single)
    got["full_to_etp"] = abs(next_loss(split, split_model, rows) - single)
    # ep 2 x etp 2 -> ep 4 (tp 1, dp 4) and -> ep 2 x tp 2 (the tp peers holding different experts, each whole)
    for key, other in (("to_ep4", ["ep_size=4"]), ("to_ep2tp2", ["ep_size=2", "tp_size=2"])):
        moved = Runner(STRATEGIES.build_from_cli("ep", other), seed=0)
        m = Llama(CONFIG)
        m, m_opt = moved.setup(m, _adamw(m))
        moved.load(f"{root}/ep2etp2", {"model": m, "optimizer": m_opt})
        per_other = GLOBAL_BATCH // moved.strategy.data_parallel_size
        dp_rank = moved.strategy.data_parallel_rank
        got[key] = abs(next_loss(moved, m, slice(dp_rank * per_other, (dp_rank + 1) * per_other)) - after)
    return got


def _expert_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the routed experts' parameters and AdamW moments this rank holds: its local shards' sizes."""
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            total += p.to_local().numel() * p.element_size()
            total += sum(v.to_local().numel() * v.element_size() for v in opt.state[p].values() if v.dim())
    return total


def _estimated_expert_bytes(strategy: Any) -> int:
    """estimate-memory's expert parameter + optimizer bytes a rank holds for this model under ``strategy``."""
    import dataclasses

    from ep_workers import CONFIG

    from shardkit.memory import memory_job, spec_from_model
    from shardkit.models import Llama

    spec = spec_from_model(Llama(CONFIG))
    job = memory_job(spec, strategy, num_gpus_per_node=strategy.world_size, precision="fp32")
    rest = spec.total_params - spec.expert_params  # the same model without its routed experts
    dense = memory_job(dataclasses.replace(spec, total_params=rest, expert_params=0, expert_block_params=0,
                                           active_params=None,
                                           largest_layer_params=min(spec.largest_layer_params, rest)),
                       strategy, num_gpus_per_node=strategy.world_size, precision="fp32")
    held, without = strategy.model_state_memory(job), strategy.model_state_memory(dense)
    return held.params + held.optimizer - without.params - without.optimizer
