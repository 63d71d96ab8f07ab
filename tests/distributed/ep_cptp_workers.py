"""Expert parallelism with context AND tensor parallelism against one process: the MoE Llama of ``ep_workers`` on
the same global batches, each sequence split over 2 cp ranks (ring attention over each tp rank's heads), the dense
layers over 2 tp ranks, the experts over ep:

- ``etp1``: ``--strategy-opt ep_size=4 cp_size=2 tp_size=2`` (torchtitan's etp=1, ring attention): ep borrows every
  cp and tp rank (ep = dp_shard_in_ep x cp x tp), each tp peer dispatching its share of its chunk's assignments;
- ``etp``: ``ep_size=2 ... expert_tp=true cp_mode=ulysses``: ep borrows the cp ranks (and dp_shard ranks) of one tp
  coordinate, the tp peers splitting each expert's matrices (``expert_sharding="none"`` when the experts have
  replicas).

On the EP launch's 4 ranks (:func:`ep_cptp_cases`) dp_shard is 1: one batch, every expert on one ep rank. On 8 ranks
(:func:`ep_cptp_worker`, a launch of its own, not in the suite) dp_shard is 2: two batches, each expert on 2 ranks
(FSDP2 over them for ``etp1``, whole for ``etp``).

Each case gives ``ep_workers._case``'s figures (initial weights, loss, every whole gradient, clipped norm and weights
after 3 AdamW steps, the load of each step, the last one with experts 2 and 3 empty), the layout facts, the
aux-loss-free update's counts and router bias against one device's, an unsplit eval forward's logits and load
(whole sequences on every cp rank: statistics over the data-parallel ranks only), and the rows the experts of all
ranks compute for one forward of the global batch."""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["ep_cptp_cases", "ep_cptp_worker"]


def _cases(world: int) -> dict[str, list[str]]:
    dp = world // 4  # dp_shard: cp 2 x tp 2 take the rest
    return {"etp1": ["ep_size=4", "cp_size=2", "tp_size=2"],
            "etp": ["ep_size=2", "cp_size=2", "tp_size=2", "expert_tp=true", "cp_mode=ulysses"]
            + (["expert_sharding=none"] if dp > 1 else [])}


def ep_cptp_cases(case: Any, ref: dict, init: dict, ref_balance: dict) -> dict[str, Any]:
    """``case`` is ep_workers' ``_case(strategy, ref, init)``: each layout's figures, its layout facts, the
    aux-loss-free update's counts and bias and an eval forward against ``ref_balance`` (one device's), and the rows
    its experts compute."""
    from ep_workers import CONFIG, GLOBAL_BATCH, SEQ, bias_update_error

    from shardkit.models.moe import moe_layers
    from shardkit.strategies.registry import STRATEGIES

    out: dict[str, Any] = {}
    batch = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    for name, opts in _cases(int(os.environ["WORLD_SIZE"])).items():
        got, runner, model, _opt = case(STRATEGIES.build_from_cli("ep", opts), ref, init)
        s = runner.strategy
        per = GLOBAL_BATCH // s.data_parallel_size
        rows = slice(s.data_parallel_rank * per, (s.data_parallel_rank + 1) * per)
        got.update(cp=s.cp_size, tp=s.tp_size, expert_tp=s.dims.expert_tp,
                   ep_group=[int(r) for r in s.expert_mesh["ep"].mesh.flatten()],
                   dense_mesh=list(model.layers[0].self_attn.q_proj.weight.device_mesh.mesh_dim_names or ()))
        got["counts"] = max((layer.tokens_per_expert - c).abs().max().item()
                            for layer, c in zip(moe_layers(model), ref_balance["counts"]))
        model.eval()
        with torch.no_grad():
            logits = model(batch[rows])
        got["eval_load"] = [layer.last_load.tolist() for layer in moe_layers(model)] == ref_balance["eval_load"]
        model.train()
        got["logits"] = (logits - ref_balance["logits"][rows]).abs().max().item()
        got["bias"], _ = bias_update_error(runner, model, ref_balance)
        got["expert_rows"] = _split_rows(model, batch[rows])
        out[name] = got
    return out


def ep_cptp_worker(root: str) -> dict[str, Any]:
    """The one-device reference, then :func:`ep_cptp_cases` (a launch of its own: 8 ranks give dp_shard 2)."""
    from ep_workers import CONFIG, _adamw, _balancing, _case, _run

    from shardkit import Runner
    from shardkit.models import Llama
    from shardkit.strategies import SingleDevice

    ref_runner = Runner(SingleDevice("cpu"), seed=0)
    with ref_runner.init_module():
        ref_model = Llama(CONFIG)
    init = {k: v.clone() for k, v in ref_model.state_dict().items()}
    ref_model, _ = ref_runner.setup(ref_model, _adamw(ref_model))
    ref = _run(ref_runner, ref_model, slice(None))
    out: dict[str, Any] = {"ref_load": ref["load"],
                           "moved": max((ref["weights"][n] - init[n]).abs().max().item() for n in ref["weights"])}
    out.update(ep_cptp_cases(_case, ref, init, _balancing(ref_model)))
    return out

def _split_rows(model: torch.nn.Module, local: torch.Tensor) -> int:
    """Rows the local experts of every rank compute in one split-sequence forward of the global batch (``local``:
    this rank's batch), summed over the ranks."""
    from shardkit.models.moe import moe_layers

    rows = torch.zeros((), dtype=torch.int64)

    def count(module: torch.nn.Module, args: tuple) -> None:
        rows.add_(args[0].shape[0])

    hooks = [layer.experts.register_forward_pre_hook(count) for layer in moe_layers(model)]
    with torch.no_grad():
        model(local, labels=local)
    for hook in hooks:
        hook.remove()
    torch.distributed.all_reduce(rows)
    return int(rows)
