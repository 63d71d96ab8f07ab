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


def ep_cptp_cases(root: str, case: Any, ref: dict, init: dict, ref_balance: dict) -> dict[str, Any]:
    """``case`` is ep_workers' ``_case(strategy, ref, init)``: each layout's figures, its layout facts, the
    aux-loss-free update's counts and bias and an eval forward against ``ref_balance`` (one device's), the rows
    its experts compute, and its checkpoint's next step in one process and under ep 2 x tp 2 and ep 4 (tp 1, cp 1)
    against the run's own next step."""
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
        got.update(_resumed(f"{root}/cptp_{name}", runner, model, _opt))
        out[name] = got
    return out


def _resumed(path: str, runner: Any, model: torch.nn.Module, opt: Any) -> dict[str, float]:
    """Saves the run, then loads it in one process (every rank on its own) and under two other EP layouts of the
    same ranks: each one's next step's loss against the run's own next step (``to_one``, ``to_ep2tp2``,
    ``to_ep4``)."""
    from ep_workers import CONFIG, GLOBAL_BATCH, SEQ, _adamw

    from shardkit import Runner
    from shardkit.models import Llama
    from shardkit.strategies import SingleDevice
    from shardkit.strategies.registry import STRATEGIES

    batch = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(9))

    def next_loss(r: Any, m: torch.nn.Module) -> float:
        s = r.strategy
        per = GLOBAL_BATCH // s.data_parallel_size
        part = batch[s.data_parallel_rank * per:(s.data_parallel_rank + 1) * per]
        r.backward(m(part, labels=part))
        r.step()
        # the mean over the data-parallel batches; a cp rank's loss is its whole sequences'
        return r.all_reduce(m(part, labels=part).detach().clone(), "mean").item()

    runner.save(path, {"model": model, "optimizer": opt})
    runner.barrier()
    got: dict[str, float] = {}
    for key, strategy in (("to_one", SingleDevice("cpu")),
                          ("to_ep2tp2", STRATEGIES.build_from_cli("ep", ["ep_size=2", "tp_size=2"])),
                          ("to_ep4", STRATEGIES.build_from_cli("ep", ["ep_size=4"]))):
        other = Runner(strategy, seed=0)
        m = Llama(CONFIG)
        m, m_opt = other.setup(m, _adamw(m))
        other.load(path, {"model": m, "optimizer": m_opt})
        got[key] = next_loss(other, m)
    after = next_loss(runner, model)
    return {k: abs(v - after) for k, v in got.items()}


def ep_cptp_worker(root: str) -> dict[str, Any]:
    """The one-device reference, then :func:`ep_cptp_cases` (a launch of its own: 8 ranks give dp_shard 2)."""
    from ep_workers import _balancing, _case, one_device_reference

    _, ref_model, init, ref = one_device_reference()
    out: dict[str, Any] = {"ref_load": ref["load"],
                           "moved": max((ref["weights"][n] - init[n]).abs().max().item() for n in ref["weights"])}
    out.update(ep_cptp_cases(root, _case, ref, init, _balancing(ref_model)))
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
