"""Expert parallelism x tensor parallelism on 4 ranks against one process (called from ``ep_workers.ep_worker``):
``ExpertParallel(ep_size=2, tp_size=2)`` from ``--strategy-opt``, with and without sequence parallelism. The dense
layers are split over tp (llama_plan), FSDP2 over the 2 data-parallel batches, each pair of tp peers splits the
experts (ep borrowed from dp_shard x tp) and each expert is FSDP2-sharded over its 2 holders. ``_case`` gives the
initial weights' difference, the loss, every whole gradient, the clipped norm and the weights after 3 AdamW steps,
and the load of each step (the last one with ep rank 1's experts empty); and how many assignments the experts of all
ranks together compute in one forward of the global batch (one device's number: no expert work repeated on the tp
peers)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ep_tp_cases"]


def ep_tp_cases(root: str, case: Any, ref: dict, init: dict) -> dict[str, Any]:
    """``case`` is ep_workers' ``_case(strategy, ref, init)``; each EP x TP layout's figures and its layout facts, and
    (ep 2 x tp 2 -> 1) the next step's loss of its checkpoint loaded in one process against its own."""
    from shardkit.strategies.registry import STRATEGIES

    out: dict[str, Any] = {}
    for name, opts in (("tp", ["ep_size=2", "tp_size=2"]),
                       ("tp_sp", ["ep_size=2", "tp_size=2", "sequence_parallel=true"])):
        got, runner, model, opt = case(STRATEGIES.build_from_cli("ep", opts), ref, init)
        s = runner.strategy
        got["tp"] = s.tp_size
        # the dense layers are tensor-parallel DTensors, the routed experts whole per ep rank
        q = model.layers[0].self_attn.q_proj.weight
        got["dense_mesh"] = list(q.device_mesh.mesh_dim_names or ())
        got["ep_group"] = [int(r) for r in s.expert_mesh["ep"].mesh.flatten()]
        got["expert_rows"] = _expert_rows(model, s)
        if name == "tp":
            got["resumed_loss"] = _resumed(f"{root}/ep2tp2", runner, model, opt)
        out[name] = got
    return out


def _expert_rows(model: torch.nn.Module, strategy: Any) -> int:
    """Rows the local experts of every rank compute in one forward of the global batch, summed over the ranks."""
    from ep_workers import GLOBAL_BATCH, _batches

    from shardkit.models.moe import moe_layers

    rows = torch.zeros((), dtype=torch.int64)

    def count(module: torch.nn.Module, args: tuple) -> None:
        rows.add_(args[0].shape[0])

    hooks = [layer.experts.register_forward_pre_hook(count) for layer in moe_layers(model)]
    per = GLOBAL_BATCH // strategy.data_parallel_size
    batch = _batches()[0][strategy.data_parallel_rank * per:(strategy.data_parallel_rank + 1) * per]
    with torch.no_grad():
        model(batch)
    for hook in hooks:
        hook.remove()
    dist.all_reduce(rows)
    return int(rows)


def _resumed(path: str, runner: Any, model: torch.nn.Module, opt: Any) -> float:
    """Save the EP x TP run, load it into one process (every rank on its own) and take one AdamW step on the same
    global batch in both: the difference of the losses after it."""
    from ep_workers import CONFIG, GLOBAL_BATCH, SEQ, _adamw

    from shardkit import Runner
    from shardkit.models import Llama
    from shardkit.strategies import SingleDevice

    runner.save(path, {"model": model, "optimizer": opt})
    one = Runner(SingleDevice("cpu"), seed=0)
    resumed = Llama(CONFIG)
    resumed, resumed_opt = one.setup(resumed, _adamw(resumed))
    one.load(path, {"model": resumed, "optimizer": resumed_opt})
    batch = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(9))
    s = runner.strategy
    per = GLOBAL_BATCH // s.data_parallel_size
    rows = slice(s.data_parallel_rank * per, (s.data_parallel_rank + 1) * per)
    runner.backward(model(batch[rows], labels=batch[rows]))
    runner.step()
    after = runner.all_reduce(model(batch[rows], labels=batch[rows]).detach().clone(), "mean").item()
    one.backward(resumed(batch, labels=batch))
    one.step()
    return abs(resumed(batch, labels=batch).item() - after)
