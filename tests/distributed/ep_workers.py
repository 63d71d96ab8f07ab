"""Expert parallelism on 4 ranks against one process: the MoE Llama trained on the same global batches.

Each rank runs the one-device reference itself (no collectives), then the same steps under each layout on its
quarter of each batch, and returns the largest differences of the loss, every whole gradient, the clipped gradient
norm and the weights after the last AdamW step:

- ``fsdp``: ``--strategy ep --strategy-opt ep_size=2`` (ep 2 < dp 4): each expert on 2 ranks, FSDP2 over them;
- ``replicated``: ``ExpertParallel(ep_size=2, expert_sharding="none")``: each ep slice whole on 2 ranks, gradients
  all-reduced;
- ``hsdp``: ``ExpertParallel(ep_size=2, dp_replicate=2)``: dense parameters HSDP (2 replicas x 2 shards), experts
  split over the 2 dp_shard ranks and replicated across the replicas;
- ``cp``: ``ExpertParallel(ep_size=2, cp_size=2)``: each sequence split over 2 cp ranks (ring attention), the experts
  over the same 2 ranks (ep borrowed from dp_shard x cp), FSDP2 over dp_shard x cp, 2 data-parallel batches; also the
  counts and the router bias of the aux-loss-free update, an unsplit eval forward's logits and load, and its
  checkpoint continued in one process (ep 2 x cp 2 -> 1).

The last batch routes every token to experts 0 and 1 (the router bias steers the choice), so the ranks holding
experts 2 and 3 receive no token from anyone. Then the ``fsdp`` run's checkpoint loads into one process (EP 2 -> 1)
and its next step's loss must be the uninterrupted one-device run's. A Hugging Face Qwen3-MoE runs under ep 4 (every
rank its own expert).
"""

from __future__ import annotations

from typing import Any

import torch
from ep_cptp_workers import ep_cptp_cases
from ep_etp_workers import ep_etp_case
from ep_hf_workers import hf_cptp_case, hf_tp_case
from ep_more_workers import ep_more
from ep_pp_workers import ep_pp_worker
from ep_tp_workers import ep_tp_cases

from shardkit import Runner
from shardkit.models import Llama, LlamaConfig
from shardkit.models.moe import moe_layers

__all__ = ["CONFIG", "cp_case", "ep_worker", "hf_export_under_ep", "one_to_ep2"]

CONFIG = LlamaConfig.small_moe(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_position=32,
                               tie_embeddings=False, fused=False,
                               moe=dict(num_experts=4, top_k=2, intermediate_size=16, aux_loss_coef=0.05,
                                        first_dense_layers=0))
GLOBAL_BATCH, SEQ, STEPS, CLIP = 4, 12, 3, 0.5


def _batches() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _starve_rank1(model: torch.nn.Module) -> None:
    """Every token picks experts 0 and 1 (ep rank 0's): experts 2 and 3 get none."""
    for layer in moe_layers(model):
        layer.router.expert_bias.copy_(torch.tensor([1e4, 1e4, 0.0, 0.0]))


def _run(runner: Runner, model: torch.nn.Module, rows: slice) -> dict:
    out: dict = {"loss": [], "grad": [], "norm": [], "load": []}
    for step, batch in enumerate(_batches()):
        if step == STEPS - 1:
            _starve_rank1(model)
        local = batch[rows]
        loss = model(local, labels=local)
        runner.backward(loss)
        out["loss"].append(runner.all_reduce(loss.detach().clone(), "mean").item())
        out["grad"].append({n: _whole(p.grad).detach().clone() for n, p in model.named_parameters()})
        out["norm"].append(runner.clip_gradients(CLIP).item())
        out["load"].append([layer.last_load.tolist() for layer in moe_layers(model)])
        runner.step()
    out["weights"] = {n: _whole(p.detach()).clone() for n, p in model.named_parameters()}
    return out


def _next_loss(runner: Runner, model: torch.nn.Module) -> float:
    batch = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(9))
    loss = model(batch, labels=batch)
    runner.backward(loss)
    runner.step()
    return model(batch, labels=batch).item()


def _hf_case() -> dict[str, float]:
    """A Hugging Face Qwen3-MoE under ExpertParallel (ep 4: every rank its own expert) against the same model in this
    process (its own eager experts), one SGD step: the loss, whole-gradient and weight differences."""
    import copy

    import transformers

    from shardkit.strategies.expert_parallel import ExpertParallel

    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref_model = transformers.Qwen3MoeForCausalLM(config).float()
    ref_model.set_experts_implementation("eager")
    model = copy.deepcopy(ref_model)
    batch = _batches()[0]
    ref_loss = ref_model(input_ids=batch, labels=batch).loss
    ref_loss.backward()
    runner = Runner(ExpertParallel(ep_size=4), seed=0)
    model, _ = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    s = runner.strategy
    per = GLOBAL_BATCH // s.data_parallel_size
    local = batch[s.data_parallel_rank * per:(s.data_parallel_rank + 1) * per]
    loss = model(input_ids=local, labels=local).loss
    runner.backward(loss)
    total = runner.all_reduce(loss.detach().clone(), "mean")
    grads = dict(ref_model.named_parameters())
    out = {"loss": abs(total.item() - ref_loss.item()),
           "grad": max((_whole(p.grad) - grads[n].grad).abs().max().item() for n, p in model.named_parameters()),
           "sharded": float(type(model.model.layers[0].mlp.experts.gate_up_proj.data).__name__ == "DTensor")}
    runner.step()
    with torch.no_grad():
        for p in ref_model.parameters():
            p -= 0.5 * p.grad
    out["weights"] = max((_whole(p.detach()) - grads[n].detach()).abs().max().item()
                         for n, p in model.named_parameters())
    return out


def _case(strategy: Any, ref: dict, init: dict) -> tuple[dict[str, Any], Runner, torch.nn.Module, Any]:
    runner = Runner(strategy, seed=0)
    with runner.init_module():  # on the meta device, each parameter's init replayed into its shard in setup
        model = Llama(CONFIG)
    model, opt = runner.setup(model, _adamw(model))
    start = max((_whole(p.detach()) - init[n]).abs().max().item() for n, p in model.named_parameters())
    s = runner.strategy
    per = GLOBAL_BATCH // s.data_parallel_size
    got = _run(runner, model, slice(s.data_parallel_rank * per, (s.data_parallel_rank + 1) * per))
    experts = model.layers[0].mlp.experts.gate_up_proj
    return {
        "init": start, "ep": s.ep_size, "dp": s.data_parallel_size, "replicas": s.dims.expert_replicas,
        "placements": [type(p).__name__ for p in experts.placements],
        "loss": [abs(a - b) for a, b in zip(got["loss"], ref["loss"])],
        "grad": [max((g[n] - r[n]).abs().max().item() for n in r) for g, r in zip(got["grad"], ref["grad"])],
        "norm": [abs(a - b) for a, b in zip(got["norm"], ref["norm"])],
        "weights": max((got["weights"][n] - ref["weights"][n]).abs().max().item() for n in ref["weights"]),
        "load": got["load"],
    }, runner, model, opt


def _balancing(model: torch.nn.Module) -> dict[str, Any]:
    """Each MoE layer's counts since the last bias update, and an eval forward's logits and load on the batch."""
    batch = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    model.eval()
    with torch.no_grad():
        logits = model(batch)
    model.train()
    return {"counts": [layer.tokens_per_expert.clone() for layer in moe_layers(model)], "logits": logits,
            "eval_load": [layer.last_load.tolist() for layer in moe_layers(model)],
            "bias": [layer.router.expert_bias.clone() for layer in moe_layers(model)]}


def bias_update_error(runner: Runner, model: torch.nn.Module, ref_balance: dict) -> tuple[float, float]:
    """The aux-loss-free update (rate 1e-3) on the counts the ranks gathered: the largest difference of each router's
    bias from one device's update of ``ref_balance``'s counts, and how far that update moved the bias."""
    import dataclasses

    from shardkit.models.moe import update_router_biases

    rate = 1e-3
    for layer in moe_layers(model):
        layer.config = dataclasses.replace(layer.config, bias_update_rate=rate)
    update_router_biases(model, lambda counts: runner.all_reduce(counts, "sum"))
    expected = [b + rate * torch.sign(c.mean() - c).to(b.dtype) for b, c in zip(ref_balance["bias"],
                                                                                ref_balance["counts"])]
    error = max((layer.router.expert_bias - e).abs().max().item() for layer, e in zip(moe_layers(model), expected))
    return error, max((e - b).abs().max().item() for e, b in zip(expected, ref_balance["bias"]))


def cp_case(root: str, ref: dict, init: dict, ref_balance: dict) -> dict[str, Any]:
    """ep 2 x cp 2 against one device: ``_case``'s figures, then the aux-loss-free update's counts and bias (the
    Trainer's call), an eval forward (no labels: whole sequences on every cp rank, statistics over dp only), and its
    checkpoint loaded in one process, whose next step must be the ep 2 x cp 2 run's."""

    from shardkit.strategies import SingleDevice
    from shardkit.strategies.expert_parallel import ExpertParallel

    out, runner, model, opt = _case(ExpertParallel(ep_size=2, cp_size=2), ref, init)
    s = runner.strategy
    out["cp"] = s.cp_size
    rows = slice(s.data_parallel_rank * 2, s.data_parallel_rank * 2 + 2)
    batch = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    got: dict[str, Any] = {"counts": [layer.tokens_per_expert.clone() for layer in moe_layers(model)]}
    model.eval()
    with torch.no_grad():
        got["logits"] = model(batch[rows])
    got["eval_load"] = [layer.last_load.tolist() for layer in moe_layers(model)]
    model.train()
    out["counts"] = max((a - b).abs().max().item() for a, b in zip(got["counts"], ref_balance["counts"]))
    out["logits"] = (got["logits"] - ref_balance["logits"][rows]).abs().max().item()
    out["eval_load"] = got["eval_load"] == ref_balance["eval_load"]
    out["bias"], out["bias_moved"] = bias_update_error(runner, model, ref_balance)
    runner.save(f"{root}/ep2cp2", {"model": model, "optimizer": opt})
    one = Runner(SingleDevice("cpu"), seed=0)  # every rank on its own: ep 2 x cp 2 -> one device
    resumed = Llama(CONFIG)
    resumed, resumed_opt = one.setup(resumed, _adamw(resumed))
    one.load(f"{root}/ep2cp2", {"model": resumed, "optimizer": resumed_opt})
    batch = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(9))
    runner.backward(model(batch[rows], labels=batch[rows]))
    runner.step()
    after = runner.all_reduce(model(batch[rows], labels=batch[rows]).detach().clone(), "mean").item()
    out["resumed_loss"] = abs(_next_loss(one, resumed) - after)
    return out


def _selected_by_config(root: str) -> dict[str, Any]:
    """The Runner and the Trainer under `shardkit launch --config_file` with shardkit's parallelism_config_ep_size."""
    import os

    import yaml

    from shardkit.config import CONFIG_FILE_ENV
    from shardkit.trainer import Trainer, TrainingArguments

    path = f"{root}/acc-{torch.distributed.get_rank()}.yaml"
    with open(path, "w") as f:
        yaml.safe_dump({"distributed_type": "FSDP", "mixed_precision": "no", "num_processes": 4, "use_cpu": True,
                        "parallelism_config": {"parallelism_config_ep_size": 2}}, f)
    os.environ[CONFIG_FILE_ENV] = path
    try:
        runner = Runner()
        trainer = Trainer(model=Llama(CONFIG), args=TrainingArguments(output_dir=f"{root}/out", report_to=[]))
    finally:
        del os.environ[CONFIG_FILE_ENV]
    return {name: (type(s).__name__, s.ep_size, s.dims.expert_replicas)
            for name, s in (("runner", runner.strategy), ("trainer", trainer.runner.strategy))}


def one_to_ep2(root: str) -> dict[str, Any]:
    """1 -> EP 2: a one-device run saved by ``Runner.save`` after its first step, resumed under EP 2, against the
    uninterrupted one-device run: the losses of the remaining steps; and the two runs' final checkpoints (one
    device's full tensors, EP 2's DTensor shards) hold the same keys at the same global shapes, each expert weight
    whole in the stacked layout, and consolidate (zero-to-fp32) to the same tensors, which ``from_pretrained`` loads
    as the transformers model that gives the one-device model's logits."""
    from shardkit.checkpoint import CheckpointReader, consolidate
    from shardkit.strategies import SingleDevice
    from shardkit.strategies.expert_parallel import ExpertParallel

    runner = Runner(ExpertParallel(ep_size=2), seed=1)
    rank = runner.strategy.rank
    one = Runner(SingleDevice("cpu"), seed=0)
    with one.init_module():
        model = Llama(CONFIG)
    model, opt = one.setup(model, _adamw(model))
    ref = []
    for step, batch in enumerate(_batches()):
        if step == 1:  # each rank saves its own (identical) one-device run, in a folder of its own
            one.save(f"{root}/one-{rank}/step1", {"model": model, "optimizer": opt})
        loss = model(batch, labels=batch)
        one.backward(loss)
        one.clip_gradients(CLIP)
        one.step()
        ref.append(loss.item())
    one.save(f"{root}/one-{rank}/end", {"model": model, "optimizer": opt})
    with runner.init_module():
        resumed = Llama(CONFIG)
    resumed, resumed_opt = runner.setup(resumed, _adamw(resumed))
    runner.load(f"{root}/one-{rank}/step1", {"model": resumed, "optimizer": resumed_opt})
    per = GLOBAL_BATCH // runner.strategy.data_parallel_size
    rows = slice(runner.strategy.data_parallel_rank * per, (runner.strategy.data_parallel_rank + 1) * per)
    got = []
    for batch in _batches()[1:]:
        loss = resumed(batch[rows], labels=batch[rows])
        runner.backward(loss)
        runner.clip_gradients(CLIP)
        runner.step()
        got.append(runner.all_reduce(loss.detach().clone(), "mean").item())
    runner.save(f"{root}/ep2-end", {"model": resumed, "optimizer": resumed_opt})
    with CheckpointReader(f"{root}/one-{rank}/end") as a, CheckpointReader(f"{root}/ep2-end") as b:
        layouts = [r.sharded_keys("model") for r in (a, b)]
        kinds = [a.entries()["model"], b.entries()["model"]]
    out: dict[str, Any] = {"loss": [abs(x - y) for x, y in zip(got, ref[1:])], "kinds": kinds,
                           "same_layout": layouts[0] == layouts[1],
                           "experts": [list(layouts[1]["layers.0.mlp.experts.gate_up_proj"][0]),
                                       list(layouts[1]["layers.0.mlp.experts.down_proj"][0])]}
    if rank == 0:
        files = [consolidate(path, f"{root}/fp32-{i}")[0] for i, path in enumerate((f"{root}/one-0/end",
                                                                                   f"{root}/ep2-end"))]
        from safetensors.torch import load_file
        whole, sharded = (load_file(f) for f in files)
        out["consolidated_keys"] = sorted(whole) == sorted(sharded)
        out["consolidated"] = max((whole[k] - sharded[k]).abs().max().item() for k in whole)
        # the EP-2 checkpoint's export is the transformers model shardkit's Llama equals: its logits
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(f"{root}/fp32-1", dtype=torch.float32).eval()
        one.load(f"{root}/ep2-end", {"model": model}, runner_state=False)  # the EP-2 weights, one device
        model.eval()
        with torch.no_grad():
            batch = _batches()[0]
            out["hf_architecture"] = type(hf).__name__
            out["hf_logits"] = (hf(batch).logits - model(batch)).abs().max().item()
    runner.barrier()
    return out


def hf_export_under_ep(root: str) -> dict[str, Any]:
    """A Hugging Face Qwen3-MoE after one SGD step under EP 2, written by ``save_pretrained`` and by zero-to-fp32 from
    its ``Runner.save``: both outputs hold the Hub's per-expert names and ``from_pretrained`` of each gives the EP
    model's logits (on rank 0)."""
    import transformers
    from safetensors import safe_open

    from shardkit.checkpoint.hf import save_pretrained
    from shardkit.checkpoint.zero_to_fp32 import main as zero_to_fp32
    from shardkit.strategies.expert_parallel import ExpertParallel

    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).float()
    runner = Runner(ExpertParallel(ep_size=2), seed=0)
    model, opt = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    batch = _batches()[0]
    loss = model(input_ids=batch, labels=batch).loss
    runner.backward(loss)
    runner.step()
    with torch.no_grad():
        logits = model(input_ids=batch).logits
    save_pretrained(runner, f"{root}/hf-ep", model)
    runner.save(f"{root}/ckpt-ep", {"model": model, "optimizer": opt})
    out: dict[str, Any] = {}
    if runner.strategy.rank == 0:
        config.save_pretrained(f"{root}/ckpt-ep")  # zero-to-fp32 takes the model type from it
        out["zero_to_fp32_rc"] = zero_to_fp32([f"{root}/ckpt-ep", f"{root}/fp32-ep"])
        for name in ("hf-ep", "fp32-ep"):
            with safe_open(f"{root}/{name}/model.safetensors", "pt") as f:
                keys = set(f.keys())
            back = transformers.Qwen3MoeForCausalLM.from_pretrained(f"{root}/{name}")
            with torch.no_grad():
                out[name] = {"logits": (back(input_ids=batch).logits - logits).abs().max().item(),
                             "per_expert": "model.layers.1.mlp.experts.3.up_proj.weight" in keys,
                             "stacked": any(k.endswith("gate_up_proj") for k in keys)}
    runner.barrier()
    return out


def one_device_reference() -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    """The MoE Llama's run on one device: its Runner, model, initial weights and :func:`_run`'s record."""
    from shardkit.strategies import SingleDevice

    ref_runner = Runner(SingleDevice("cpu"), seed=0)
    with ref_runner.init_module():
        ref_model = Llama(CONFIG)
    init = {k: v.clone() for k, v in ref_model.state_dict().items()}
    ref_model, _ = ref_runner.setup(ref_model, _adamw(ref_model))
    return ref_runner, ref_model, init, _run(ref_runner, ref_model, slice(None))


def ep_worker(root: str) -> dict[str, Any]:
    from shardkit.strategies import SingleDevice
    from shardkit.strategies.expert_parallel import ExpertParallel
    from shardkit.strategies.registry import STRATEGIES

    ref_runner, ref_model, init, ref = one_device_reference()

    ref_balance = _balancing(ref_model)
    out: dict[str, Any] = {"ref_load": ref["load"],
                           "moved": max((ref["weights"][n] - init[n]).abs().max().item() for n in ref["weights"])}
    out["fsdp"], runner, model, opt = _case(STRATEGIES.build_from_cli("ep", ["ep_size=2"]), ref, init)
    runner.save(f"{root}/ep2", {"model": model, "optimizer": opt})
    one = Runner(SingleDevice("cpu"), seed=0)  # every rank on its own: EP 2 -> 1
    resumed = Llama(CONFIG)
    resumed, resumed_opt = one.setup(resumed, _adamw(resumed))
    one.load(f"{root}/ep2", {"model": resumed, "optimizer": resumed_opt})
    out["resumed_loss"] = abs(_next_loss(one, resumed) - _next_loss(ref_runner, ref_model))
    out["replicated"] = _case(ExpertParallel(ep_size=2, expert_sharding="none"), ref, init)[0]
    out["hsdp"] = _case(ExpertParallel(ep_size=2, dp_replicate=2), ref, init)[0]
    out["cp"] = cp_case(root, ref, init, ref_balance)
    out["hf"] = _hf_case()
    out["selected"] = _selected_by_config(root)
    out["one_to_ep2"] = one_to_ep2(root)
    out["hf_export"] = hf_export_under_ep(root)
    out.update(ep_tp_cases(root, _case, ref, init))  # ep 2 x tp 2, with and without sequence parallelism
    out["ep_pp"] = ep_pp_worker(root)  # expert parallelism inside a pipeline's stages: ep_pp_workers.py
    out["more"] = ep_more(root, ref, init, ref_balance)
    out["etp"] = ep_etp_case(root, _case, ref, init, ref_balance)  # ep 2 x tp 2, tp inside the experts
    out["cptp"] = ep_cptp_cases(root, _case, ref, init, ref_balance)  # ep x cp 2 x tp 2, both tp layouts
    out["hf_tp"] = hf_tp_case(root)  # Hugging Face's Qwen3-MoE under ep 2 x tp 2: ep_hf_workers.py
    out["hf_etp"] = hf_tp_case(root, expert_tp=True)  # and with tp inside its expert blocks
    out["hf_sp"] = hf_tp_case(root, sequence_parallel=True)  # and with transformers' plan in sequence-parallel form
    out["hf_cptp"] = hf_cptp_case()  # and under ep 4 x cp 2 x tp 2 together
    return out
