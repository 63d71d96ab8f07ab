"""Expert parallelism inside a pipeline's stages on 4 ranks (pp 2 x ep 2: each stage's 2 ranks split its MoE layers'
experts, FSDP2 over them for the rest) against one process accumulating the same micro-batches. The models are built
in fp32 and trained in fp64 (FSDP2 reducing in fp64): in fp32 the pieces' sums in another order, amplified by AdamW's
division by the gradients' size over 3 steps, reach the tolerance in the dense weights (2.2e-5).

A pipeline cuts each data-parallel rank's batch into micro-batches; the stage's ranks run micro-batch j together, so
each micro-batch's routing statistics (and so its auxiliary loss) are those of the rows every data-parallel rank holds
at position j. The one-device reference accumulates exactly those pieces, each scaled by 1 / micro-batches.

- ``ep_pp_worker``'s 1f1b case: ``--strategy pp`` with ``--strategy-opt`` ``pp_size=2``, ``dp=fsdp``, ``ep_size=2``
  on the MoE Llama of ep_workers (2 layers, one per stage), 3 AdamW steps, the last one with every token routed to ep
  rank 0's experts: initial weights (bitwise), loss, every gradient, the clipped norm, the weights, each layer's load,
  the bias update's counts and the router bias after each step's update; its checkpoint loaded in one process (weights
  and AdamW moments).
- every other schedule (4 stages for the interleaved and V-shaped ones) on a 4-layer MoE Llama,
  one step of 4 micro-batches: loss and every gradient.
- ``hf``: Hugging Face's Qwen3-MoE with its router aux loss under ``Pipeline(pp_size=2)`` (pp 2 x ddp 2) and
  ``Pipeline(pp_size=2, dp="fsdp", ep_size=2)``, 3 AdamW steps against one process accumulating the same
  micro-batches with the model's own loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from shardkit import Runner
from shardkit.models import Llama, LlamaConfig
from shardkit.models.moe import MoE, update_router_biases

__all__ = ["ep_pp_worker", "hf_pp_cases"]

CONFIG = LlamaConfig.small_moe(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_position=32,
                               tie_embeddings=False, fused=False,
                               moe=dict(num_experts=4, top_k=2, intermediate_size=16, aux_loss_coef=0.05,
                                        first_dense_layers=0, bias_update_rate=1e-3))
DEEP = dataclasses.replace(CONFIG, num_layers=4)  # 4 stages: 2 per pipeline rank
SEQ, STEPS, CLIP = 12, 3, 0.5


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _batches(steps: int, rows: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (steps, rows, SEQ), generator=torch.Generator().manual_seed(5))


def _layers(model: torch.nn.Module) -> dict[str, MoE]:
    return {n: m for n, m in model.named_modules() if isinstance(m, MoE)}


def _starve_ep_rank1(model: torch.nn.Module) -> None:
    """Every token picks experts 0 and 1 (ep rank 0's): experts 2 and 3 get none."""
    for layer in _layers(model).values():
        layer.router.expert_bias.copy_(torch.tensor([1e4, 1e4, 0.0, 0.0]))


def _micro_rows(rows: int, micro: int, dp: int) -> list[list[int]]:
    """The global rows of each micro-batch: data-parallel rank r of ``dp`` holds rows [r * per, (r + 1) * per) and
    the schedule cuts them into ``micro`` consecutive pieces; piece j of every rank runs together."""
    per = rows // dp
    q = per // micro
    return [[r * per + j * q + k for r in range(dp) for k in range(q)] for j in range(micro)]


def _reference(config: LlamaConfig, batches: torch.Tensor, micro: int, starve: bool, dp: int = 2) -> dict[str, Any]:
    from shardkit.strategies import SingleDevice

    runner = Runner(SingleDevice("cpu"), seed=0)
    with runner.init_module():
        model = Llama(config)
    model = model.double()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    model, _ = runner.setup(model, _adamw(model))
    out: dict[str, Any] = {"init": init, "loss": [], "grad": [], "norm": [], "load": [], "counts": [], "bias": []}
    for step, batch in enumerate(batches):
        if starve and step == len(batches) - 1:
            _starve_ep_rank1(model)
        total = 0.0
        for rows in _micro_rows(batch.shape[0], micro, dp):
            piece = batch[rows]
            loss = model(piece, labels=piece) / micro
            runner.backward(loss)
            total += loss.item()
        out["loss"].append(total)
        out["grad"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        out["norm"].append(runner.clip_gradients(CLIP).item())
        out["load"].append({n: m.last_load.tolist() for n, m in _layers(model).items()})
        runner.step()
        out["counts"].append({n: m.tokens_per_expert.clone() for n, m in _layers(model).items()})
        update_router_biases(model)
        out["bias"].append({n: m.router.expert_bias.clone() for n, m in _layers(model).items()})
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _pipeline_run(strategy: Any, config: LlamaConfig, batches: torch.Tensor, micro: int, ref: dict[str, Any],
                  starve: bool, save: str | None = None) -> dict[str, Any]:
    """The same steps under ``strategy`` on this rank's rows, as differences from ``ref`` (own stages' names); with
    ``save``, the run's checkpoint loaded in one process: its weights' and AdamW moments' differences from the run's."""
    from shardkit.precision import FP32

    runner = Runner(strategy, precision=FP32(comm_dtype=torch.float64), seed=0)  # built in fp32, trained in fp64
    with runner.init_module():
        model = Llama(config)
    model, opt = runner.setup(model.double(), _adamw(model))
    s = runner.strategy
    own = dict(model.named_parameters())
    out: dict[str, Any] = {
        "ep": s.ep_size, "pp_rank": s.pp_rank,
        "init": max((_whole(p.detach()) - ref["init"][n]).abs().max().item() for n, p in own.items()),
        "experts": sorted({type(p).__name__ + str(p.placements) for n, p in own.items() if ".experts." in n}),
        "loss": [], "grad": [], "norm": [], "load": [], "counts": [], "bias": [], "layers": sorted(_layers(model))}
    per = batches.shape[1] // s.data_parallel_size
    rows = slice(s.data_parallel_rank * per, (s.data_parallel_rank + 1) * per)
    for step, batch in enumerate(batches):
        if starve and step == len(batches) - 1:
            _starve_ep_rank1(model)
        loss = model(batch[rows], labels=batch[rows])
        runner.backward(loss)
        got = runner.all_reduce(loss.detach().clone(), "mean").item()
        out["loss"].append(abs(got - ref["loss"][step]))
        out["grad"].append(max((_whole(p.grad) - ref["grad"][step][n]).abs().max().item() for n, p in own.items()))
        out["norm"].append(abs(runner.clip_gradients(CLIP).item() - ref["norm"][step]))
        out["load"].append({n: m.last_load.tolist() for n, m in _layers(model).items()} == {
            n: ref["load"][step][n] for n in _layers(model)})
        out["starved"] = [m.last_load[2:].tolist() for m in _layers(model).values()]
        runner.step()
        out["counts"].append(max((m.tokens_per_expert - ref["counts"][step][n]).abs().max().item()
                                 for n, m in _layers(model).items()))
        # the Trainer's call: each stage's counts are already its ranks' whole batch, never summed over other stages
        # (the second step's layers want opposite moves for 3 of the 4 experts: a sum over both would move them alike)
        update_router_biases(model, lambda t: runner.all_reduce(t, "sum"))
        out["bias"].append(max((m.router.expert_bias - ref["bias"][step][n]).abs().max().item()
                               for n, m in _layers(model).items()))
    out["weights"] = max((_whole(p.detach()) - ref["weights"][n]).abs().max().item() for n, p in own.items())
    if save is not None:
        out["saved"] = _loaded_in_one_process(runner, model, opt, config, save)
    return out


def _loaded_in_one_process(runner: Runner, model: torch.nn.Module, opt: torch.optim.Optimizer, config: LlamaConfig,
                           path: str) -> float:
    """pp x ep -> 1: the checkpoint (whole tensors by name, experts gathered from their ep shards) in one process."""
    from shardkit.strategies import SingleDevice

    runner.save(path, {"model": model, "optimizer": opt})
    one = Runner(SingleDevice("cpu"), seed=0)
    loaded = Llama(config).double()
    loaded, loaded_opt = one.setup(loaded, _adamw(loaded))
    one.load(path, {"model": loaded, "optimizer": loaded_opt})
    params = dict(loaded.named_parameters())
    diff = 0.0
    for name, p in model.named_parameters():
        theirs = params[name]
        pairs = [(p.detach(), theirs.detach())] + [(opt.state[p][k], loaded_opt.state[theirs][k])
                                                   for k in ("exp_avg", "exp_avg_sq")]
        diff = max(diff, *((_whole(a) - b).abs().max().item() for a, b in pairs))
    return diff


def ep_pp_worker(root: str) -> dict[str, Any]:
    """pp 2 x ep 2 with 1f1b (selected from the CLI's options, 3 steps), then one step of every other schedule."""
    from shardkit.strategies.pipeline import SCHEDULES, Pipeline
    from shardkit.strategies.registry import STRATEGIES

    batches = _batches(STEPS, 4)
    ref = _reference(CONFIG, batches, 2, starve=True)
    out: dict[str, Any] = {"moved": max((ref["weights"][n] - ref["init"][n]).abs().max().item() for n in ref["init"]),
                           "bias_moved": max(b.abs().max().item() for b in ref["bias"][0].values())}
    strategy = STRATEGIES.build_from_cli("pp", ["pp_size=2", "dp=fsdp", "ep_size=2", "microbatches=2"])
    out["1f1b"] = _pipeline_run(strategy, CONFIG, batches, 2, ref, starve=True, save=f"{root}/pp2-ep2")
    deep_batches = _batches(1, 8)
    deep_ref = _reference(DEEP, deep_batches, 4, starve=False)
    for schedule in sorted(set(SCHEDULES) - {"1f1b"}):
        out[schedule] = _pipeline_run(Pipeline(pp_size=2, dp="fsdp", ep_size=2, schedule=schedule, microbatches=4),
                                      DEEP, deep_batches, 4, deep_ref, starve=False)
    out["hf"] = hf_pp_cases(root)
    return out


def replicas_worker() -> dict[str, Any]:
    """By hand on 8 ranks, not in CI: pp 2 x dp_shard 4 with ep 2, so each expert is held by 2 ranks of its stage
    (FSDP2 over dp_shard_mod_ep), 1f1b, the same checks as the 4-rank case."""
    from shardkit.strategies.pipeline import Pipeline

    batches = _batches(STEPS, 8)
    ref = _reference(CONFIG, batches, 2, starve=True, dp=4)
    return _pipeline_run(Pipeline(pp_size=2, dp="fsdp", ep_size=2, microbatches=2), CONFIG, batches, 2, ref,
                         starve=True)


def _qwen3_moe(aux: bool = True) -> torch.nn.Module:
    import transformers

    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                                         output_router_logits=aux, router_aux_loss_coef=0.05)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).double()
    model.set_experts_implementation("eager")
    return model


def hf_pp_cases(root: str) -> dict[str, Any]:
    """Hugging Face's Qwen3-MoE (its router aux loss on) under ``Pipeline(pp_size=2)`` (pp 2 x ddp 2) and
    ``Pipeline(pp_size=2, dp="fsdp", ep_size=2)`` against one process accumulating the same micro-batches (its own
    ``model(...).loss``, the aux loss included): 3 AdamW steps, the initial weights, loss, every gradient, the clipped
    norm and the weights."""
    from shardkit.precision import FP32
    from shardkit.strategies import SingleDevice
    from shardkit.strategies.pipeline import Pipeline

    batches, micro = _batches(STEPS, 4), 2
    ref_model = _qwen3_moe()
    init = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    ref_runner = Runner(SingleDevice("cpu"), seed=0)
    ref_model, _ = ref_runner.setup(ref_model, _adamw(ref_model))
    ref: dict[str, list] = {"loss": [], "grad": [], "norm": [], "aux": []}
    for batch in batches:
        total, aux = 0.0, 0.0
        for rows in _micro_rows(batch.shape[0], micro, 2):
            out = ref_model(input_ids=batch[rows], labels=batch[rows])
            ref_runner.backward(out.loss / micro)
            total, aux = total + out.loss.item() / micro, aux + out.aux_loss.item() / micro
        ref["loss"].append(total)
        ref["aux"].append(aux)
        ref["grad"].append({n: p.grad.detach().clone() for n, p in ref_model.named_parameters()})
        ref["norm"].append(ref_runner.clip_gradients(CLIP).item())
        ref_runner.step()
    weights = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    out: dict[str, Any] = {"moved": max((weights[n] - init[n]).abs().max().item() for n in init),
                           "aux": min(ref["aux"])}
    for name, strategy in (("pp", Pipeline(pp_size=2, microbatches=micro)),
                           ("pp_ep", Pipeline(pp_size=2, dp="fsdp", ep_size=2, microbatches=micro))):
        runner = Runner(strategy, precision=FP32(comm_dtype=torch.float64), seed=0)
        model = _qwen3_moe()
        model, _ = runner.setup(model, _adamw(model))
        s = runner.strategy
        own = dict(model.named_parameters())
        got: dict[str, Any] = {
            "init": max((_whole(p.detach()) - init[n]).abs().max().item() for n, p in own.items()),
            "experts": sorted({type(p.data).__name__ for n, p in own.items() if ".experts." in n}),
            "layers": sorted(n for n in own if n.endswith("mlp.gate.weight")), "loss": [], "grad": [], "norm": []}
        per = 4 // s.data_parallel_size
        rows = slice(s.data_parallel_rank * per, (s.data_parallel_rank + 1) * per)
        for step, batch in enumerate(batches):
            loss = model(input_ids=batch[rows], labels=batch[rows]).loss
            runner.backward(loss)
            got["loss"].append(abs(runner.all_reduce(loss.detach().clone(), "mean").item() - ref["loss"][step]))
            got["grad"].append(max((_whole(p.grad) - ref["grad"][step][n]).abs().max().item()
                                   for n, p in own.items()))
            got["norm"].append(abs(runner.clip_gradients(CLIP).item() - ref["norm"][step]))
            runner.step()
        got["weights"] = max((_whole(p.detach()) - weights[n]).abs().max().item() for n, p in own.items())
        out[name] = got
    return out
