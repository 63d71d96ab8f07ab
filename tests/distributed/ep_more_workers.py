"""More expert-parallel cases for the 4-rank launch of test_expert_parallel.py (called once from ``ep_worker``):

- ``ac``: the MoE Llama under ep 2 x cp 2 with activation checkpointing against the one-device run without it: loss,
  whole gradients and weights after 3 AdamW steps, and the aux-loss-free update's counts (the recompute in backward,
  which repeats the routing statistics' collectives, must not count the tokens again);
- ``hf_cp``: Hugging Face's Qwen3-MoE under ep 2 x cp 2 (its expert blocks dispatched, each sequence split over the
  cp ranks) against the same model in one process: loss, whole gradients and weights after one SGD step;
- its checkpoint resumed in one process and under ep 2 alone (dp 4): the next step's loss is the ep 2 x cp 2 run's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from shardkit import Runner
from shardkit.models import Llama
from shardkit.models.moe import moe_layers

__all__ = ["ep_more"]


def _qwen3_moe() -> torch.nn.Module:
    import transformers

    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).float()
    model.set_experts_implementation("eager")
    return model


def _rows(runner: Runner, batch: torch.Tensor) -> torch.Tensor:
    s = runner.strategy
    per = batch.shape[0] // s.data_parallel_size
    return batch[s.data_parallel_rank * per:(s.data_parallel_rank + 1) * per]


def _ac_case(ref: dict, init: dict, ref_balance: dict) -> dict[str, Any]:
    from ep_workers import CONFIG, _adamw, _run, _whole

    from shardkit.strategies.expert_parallel import ExpertParallel

    runner = Runner(ExpertParallel(ep_size=2, cp_size=2), seed=0, activation_checkpointing=True)
    with runner.init_module():
        model = Llama(CONFIG)
    model, _ = runner.setup(model, _adamw(model))
    start = max((_whole(p.detach()) - init[n]).abs().max().item() for n, p in model.named_parameters())
    s = runner.strategy
    per = 4 // s.data_parallel_size
    got = _run(runner, model, slice(s.data_parallel_rank * per, (s.data_parallel_rank + 1) * per))
    return {
        "init": start,
        "checkpointed": sum("_shardkit_checkpointing" in m.__dict__ for m in model.modules()),
        "loss": max(abs(a - b) for a, b in zip(got["loss"], ref["loss"])),
        "grad": max(max((g[n] - r[n]).abs().max().item() for n in r) for g, r in zip(got["grad"], ref["grad"])),
        "weights": max((got["weights"][n] - ref["weights"][n]).abs().max().item() for n in ref["weights"]),
        "counts": max((layer.tokens_per_expert - c).abs().max().item()
                      for layer, c in zip(moe_layers(model), ref_balance["counts"])),
    }


def _next_step_loss(runner: Runner, model: torch.nn.Module, batch: torch.Tensor) -> float:
    """One SGD step on this rank's rows of ``batch``, then the loss on them (the mean over the data-parallel ranks)."""
    rows = _rows(runner, batch)
    runner.backward(model(input_ids=rows, labels=rows).loss)
    runner.step()
    with torch.no_grad():
        loss = model(input_ids=rows, labels=rows).loss
    return runner.all_reduce(loss.detach().clone(), "mean").item()


def _hf_cp_case(root: str) -> dict[str, Any]:
    from ep_workers import _batches, _whole

    from shardkit.strategies import SingleDevice
    from shardkit.strategies.expert_parallel import ExpertParallel

    ref_model = _qwen3_moe()
    model = copy.deepcopy(ref_model)
    batch = _batches()[0]
    ref_loss = ref_model(input_ids=batch, labels=batch).loss
    ref_loss.backward()
    runner = Runner(ExpertParallel(ep_size=2, cp_size=2), seed=0)
    model, opt = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    local = _rows(runner, batch)
    loss = model(input_ids=local, labels=local).loss
    runner.backward(loss)
    ref = dict(ref_model.named_parameters())
    out: dict[str, Any] = {
        "cp": runner.strategy.cp_size, "ep": runner.strategy.ep_size,
        "sharded": type(model.model.layers[0].mlp.experts.gate_up_proj.data).__name__ == "DTensor",
        "loss": abs(runner.all_reduce(loss.detach().clone(), "mean").item() - ref_loss.item()),
        "grad": max((_whole(p.grad) - ref[n].grad).abs().max().item() for n, p in model.named_parameters())}
    runner.step()
    with torch.no_grad():
        for p in ref_model.parameters():
            p -= 0.5 * p.grad
    out["weights"] = max((_whole(p.detach()) - ref[n].detach()).abs().max().item()
                         for n, p in model.named_parameters())
    runner.save(f"{root}/hf-ep2cp2", {"model": model, "optimizer": opt})
    following = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(9))
    after = _next_step_loss(runner, model, following)
    # ep 2 x cp 2 -> one device (each rank on its own) and -> ep 2 alone (dp 4, no cp)
    for name, strategy in (("to_one", SingleDevice("cpu")), ("to_ep2", ExpertParallel(ep_size=2))):
        resumed = _qwen3_moe()
        other = Runner(strategy, seed=3)
        resumed, resumed_opt = other.setup(resumed, torch.optim.SGD(resumed.parameters(), lr=0.5))
        other.load(f"{root}/hf-ep2cp2", {"model": resumed, "optimizer": resumed_opt})
        out[name] = abs(_next_step_loss(other, resumed, following) - after)
        out[f"{name}_dp"] = other.strategy.data_parallel_size if name == "to_ep2" else 1
    return out


def ep_more(root: str, ref: dict, init: dict, ref_balance: dict) -> dict[str, Any]:
    return {"ac": _ac_case(ref, init, ref_balance), "hf_cp": _hf_cp_case(root)}
