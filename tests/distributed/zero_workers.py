"""Worker functions for the ZeRO tests; top level so that spawned ranks import them by name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN = 32
STRATEGIES = {
    "single": lambda: _cls("shardkit.strategies.single", "SingleDevice")(),
    "ddp": lambda: _cls("shardkit.strategies.ddp", "DDP")(),
    "zero1": lambda: _cls("shardkit.strategies.zero", "ZeRO1")(),
    "zero2": lambda: _cls("shardkit.strategies.zero", "ZeRO2")(),
    "zero3": lambda: _cls("shardkit.strategies.zero", "ZeRO3")(),
    "zero2_cpu": lambda: _cls("shardkit.strategies.zero", "ZeRO2")(offload_optimizer="cpu"),
    "zero3_cpu": lambda: _cls("shardkit.strategies.zero", "ZeRO3")(offload="cpu"),
}


def _cls(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(module), name)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, HIDDEN, generator=g)
    return x, x.flip(-1) * 0.5


def make_runner(name: str, precision: str, gas: int = 1, strategy=None):
    from shardkit import Runner
    from shardkit.precision import precision_from_name

    strategy = strategy if strategy is not None else STRATEGIES[name]()
    return Runner(strategy=strategy, precision=precision_from_name(precision), seed=0,
                  gradient_accumulation_steps=gas)


def train(runner, model, optimizer, start: int, steps: int, gas: int, clip: float | None):
    """``steps`` optimizer steps of ``gas`` micro-batches each; returns (micro-batch losses, clip norms)."""
    losses, norms = [], []
    for step in range(start, start + steps):
        for micro in range(gas):
            x, y = batch(step * gas + micro, runner.rank)
            loss = F.mse_loss(model(x.to(runner.device)).float(), y)
            runner.backward(loss)
            losses.append(loss.item())
        norm = runner.clip_gradients(clip) if clip else None
        runner.step()
        if norm is not None:
            norms.append(float(norm))
    return losses, norms


def full_params(runner, model) -> list[torch.Tensor]:
    """Every parameter whole (gathered under ZeRO-3), in the dtype the model computes with."""
    params = list(runner.unwrap_model(model).parameters())
    gather = getattr(runner.strategy, "gathered_parameters", None)
    ctx = gather(params) if gather is not None else _null()
    with ctx:
        return [p.detach().float().clone().cpu() for p in params]


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def make_optimizer(params, kind: str = "torch") -> torch.optim.Optimizer:
    """AdamW(lr=1e-2, weight_decay=0.01): torch's ("torch") or shardkit's FusedAdamW ("fused")."""
    if kind == "fused":
        from shardkit.optim import FusedAdamW

        return FusedAdamW(params, lr=1e-2, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def compare_worker(names: list[str], precision: str, steps: int, gas: int, clip: float | None,
                   optimizer_kind: str = "torch"):
    """Train each strategy in ``names`` from the same seed and data; per strategy: losses, norms, params,
    and the class of the optimizer that stepped (under offload DeepSpeed's wrapper holds it)."""
    out = {}
    for name in names:
        runner = make_runner(name, precision, gas)
        model = make_model()
        model, optimizer = runner.setup(model, make_optimizer(model.parameters(), optimizer_kind))
        losses, norms = train(runner, model, optimizer, 0, steps, gas, clip)
        out[name] = {"losses": losses, "norms": norms, "params": full_params(runner, model),
                     "optimizer": type(optimizer).__name__}
    return out


def compare_runs(configs: list[tuple[list[str], str, str]], steps: int, gas: int, clip: float | None) -> list[dict]:
    """:func:`compare_worker` for each (names, precision, optimizer kind), one after the other in these processes
    (every Runner and model is seeded, so a run does not depend on the ones before it)."""
    return [compare_worker(names, precision, steps, gas, clip, kind) for names, precision, kind in configs]


def resume_worker(name: str, precision: str, path: str, phase: str, steps: int):
    """phase "full": 2*steps straight; "first": steps then save; "second": load then steps more."""
    runner = make_runner(name, precision)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, optimizer = runner.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer}
    if phase == "full":
        return train(runner, model, optimizer, 0, 2 * steps, 1, None)[0]
    if phase == "first":
        losses = train(runner, model, optimizer, 0, steps, 1, None)[0]
        runner.save(path, state)
        return losses
    runner.load(path, state)
    return train(runner, model, optimizer, steps, steps, 1, None)[0]


def save_and_predict_worker(name: str, path: str, steps: int):
    """Train, save, and return the model's output on a fixed input (for the consolidate test)."""
    runner = make_runner(name, "fp32")
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = runner.setup(model, optimizer)
    train(runner, model, optimizer, 0, steps, 1, None)
    runner.save(path, {"model": model, "optimizer": optimizer})
    with torch.no_grad():
        return model(batch(999, 0)[0]).float()


def load_params_worker(name: str, path: str):
    """Load a checkpoint into a fresh strategy; return the full parameters and the restored Adam step."""
    runner = make_runner(name, "fp32")
    model = make_model(seed=123)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = runner.setup(model, optimizer)
    runner.load(path, {"model": model, "optimizer": optimizer})
    params = full_params(runner, model)
    # one rank holds every fragment: each parameter's exp_avg, whole
    exp_avg = [p._hp_mapping.get_hp_fragment("exp_avg").clone().view(p.shape)
               for p in runner.unwrap_model(model).parameters()]
    runner.teardown()
    return {"params": params, "exp_avg": exp_avg}


def failing_worker(name: str):
    """Rank 1 raises in the middle of training; rank 0 is left waiting in a collective."""
    runner = make_runner(name, "fp32")
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = runner.setup(model, optimizer)
    train(runner, model, optimizer, 0, 2, 1, None)
    if runner.rank == 1:
        raise RuntimeError("rank 1 fails on purpose mid-training")
    train(runner, model, optimizer, 2, 5, 1, None)


def init_module_worker():
    """zero.Init builds the model partitioned; gathered_parameters makes it whole and keeps rank 0's edit."""
    from shardkit.strategies.zero import ZeRO3

    runner = make_runner("zero3", "fp32", strategy=ZeRO3())
    with runner.init_module():
        model = make_model()
    local = [p.ds_tensor.numel() for p in model.parameters()]
    weight = model[0].weight
    with runner.gathered_parameters([weight], modifier_rank=0):
        shape = tuple(weight.shape)
        if runner.rank == 0:
            weight.data.fill_(0.25)
    with runner.gathered_parameters([weight]):
        value = weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = runner.setup(model, optimizer)
    x, y = batch(999, 0)  # a fixed held-out batch: the loss on it before and after training
    with torch.no_grad():
        before = F.mse_loss(model(x), y).item()
    train(runner, model, optimizer, 0, 6, 1, None)
    with torch.no_grad():
        after = F.mse_loss(model(x), y).item()
    return {"local_numels": local, "shape": shape, "value": value, "losses": [before, after],
            "bytes": runner.strategy.model_state_bytes(model, optimizer)}


def nvme_worker(nvme_path: str, precision: str, optimizer_kind: str = "torch"):
    from shardkit.strategies.zero import ZeROInfinity

    # The default 5 swap buffers of 1e8 elements would take 2 GB of host memory per rank; the largest
    # parameter here has 32*32 elements.
    runner = make_runner("zero3", precision, strategy=ZeROInfinity(nvme_path=nvme_path, buffer_size=100_000))
    model = make_model()
    model, optimizer = runner.setup(model, make_optimizer(model.parameters(), optimizer_kind))
    losses = train(runner, model, optimizer, 0, 6, 1, None)[0]
    return {"losses": losses, "params": full_params(runner, model), "optimizer": type(optimizer).__name__}


def nvme_runs(cases: list[tuple[str, str, str]]) -> list[dict]:
    """:func:`nvme_worker` for each (NVMe folder, precision, optimizer kind), one after the other."""
    return [nvme_worker(path, precision, kind) for path, precision, kind in cases]


def memory_worker(names: list[str], precision: str):
    """Per strategy: this rank's model-state bytes in the middle of an accumulation window (two steps of
    two micro-batches done, then one more backward: optimizer state exists and gradients are held, whole
    under DDP and ZeRO-1, which reduce only at the window's end), and the parameter count Ψ."""
    out = {}
    for name in names:
        # A 64-element reduction bucket: "auto" (hidden² = 1024 elements, 4 KiB) is as large as this
        # 2112-parameter model's whole gradient partition and would hide the sharding.
        strategy = _cls("shardkit.strategies.zero", name.replace("zero", "ZeRO"))(reduce_bucket_size=64) \
            if name.startswith("zero") else None
        runner = make_runner(name, precision, gas=2, strategy=strategy)
        model = make_model()
        numel = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = runner.setup(model, optimizer)
        train(runner, model, optimizer, 0, 2, 2, None)
        for micro in range(2):
            x, y = batch(100 + micro, runner.rank)
            runner.backward(F.mse_loss(model(x.to(runner.device)).float(), y))
            if micro == 0:
                out[name] = {"psi": numel, **runner.strategy.model_state_bytes(model, optimizer)}
        runner.step()
    return out


def load_model_worker(name: str, path: str):
    """Load a checkpoint (model and optimizer) into a fresh replicated strategy through the base hooks;
    return the output on a fixed input, the parameters and the Adam state by parameter."""
    runner = make_runner(name, "fp32")
    model = make_model(seed=123)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = runner.setup(model, optimizer)
    runner.load(path, {"model": model, "optimizer": optimizer})
    with torch.no_grad():
        out = model(batch(999, 0)[0].to(runner.device)).float()
    state = [optimizer.state[p] for p in runner.unwrap_model(model).parameters()]
    return {"output": out, "params": full_params(runner, model), "steps": [float(s["step"]) for s in state],
            "exp_avg": [s["exp_avg"].clone() for s in state]}


def resume_phase(strategy: str, precision: str, ckpt: str | None, phase: str, steps: int, accum: int = 2,
                 teardown: bool = True):
    """workloads.resume_run's protocol (same build, data, train loop and save/load), returning the
    parameters gathered whole (ZeRO-3's module state_dict holds empty partitions) and this rank's fp32
    master partitions and Adam moments, so that the comparison sees every number the resume restores.
    ``teardown=False`` keeps the process group for a next phase in this process (see :func:`resume_phases`)."""
    from pathlib import Path

    from workloads import build
    from workloads import train as train_llama

    runner, model, optimizer, scheduler, loader = build(strategy, precision, accum=accum)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "step": 0}
    if phase == "second":
        assert runner.load(ckpt, state)["step"] == steps
    losses = train_llama(runner, model, loader, 2 * steps if phase == "full" else steps)
    if phase == "first":
        state["step"] = steps
        runner.save(Path(ckpt) / "step-1", state)
    zero = model.optimizer
    masters = getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat
    moments = [v.detach().clone() for s in zero.optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor)]
    result = {"losses": losses, "params": full_params(runner, model), "steps": runner.optimizer_steps,
              "masters": [m.detach().clone() for m in masters], "moments": moments}
    if teardown:
        runner.teardown()
    return result


def resume_phases(runs: list[tuple[str, str, str | None, str]], steps: int) -> list[dict]:
    """:func:`resume_phase` for each ``(strategy, precision, ckpt, phase)`` in turn, each in a fresh engine and
    all in this launch's process group, which is released once, after the last. (Released between phases, the
    next phase's rendezvous on the same port could meet a peer's store not yet closed: a gloo connect timeout.)"""
    return [resume_phase(*run, steps, teardown=i == len(runs) - 1) for i, run in enumerate(runs)]


def make_grouped_optimizer(model: nn.Module, groups: int) -> torch.optim.Optimizer:
    """AdamW as HF-style scripts build it: with ``groups=2`` the matrices decay and the biases and the
    model's ``unused`` parameter (no gradient ever) do not; ``groups=1`` puts everything in one group."""
    params = list(model.named_parameters())
    if groups == 1:
        return torch.optim.AdamW([p for _, p in params], lr=1e-2, weight_decay=0.01)
    return torch.optim.AdamW([
        {"params": [p for _, p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for _, p in params if p.ndim < 2], "weight_decay": 0.0},
    ], lr=1e-2)


def _grouped_run(name: str, groups: int, path: str, phase: str, steps: int) -> list[float]:
    """One phase of the exact-resume protocol in a fresh engine ("full", "first" saves, "second" loads)."""
    runner = make_runner(name, "fp32")
    model = make_model()
    # Listed last in the no-decay group and as large as its two biases together, so that on 2 ranks
    # the second rank's partition of that group holds only this parameter: no gradient, no Adam update.
    model.register_parameter("unused", nn.Parameter(torch.zeros(2 * HIDDEN)))
    model, optimizer = runner.setup(model, make_grouped_optimizer(model, groups))
    state = {"model": model, "optimizer": optimizer}
    if phase == "full":
        return train(runner, model, optimizer, 0, 2 * steps, 1, None)[0]
    if phase == "first":
        losses = train(runner, model, optimizer, 0, steps, 1, None)[0]
        runner.save(path, state)
        return losses
    runner.load(path, state)
    return train(runner, model, optimizer, steps, steps, 1, None)[0]


def grouped_resume_worker(names: list[str], groups: list[int], root: str, steps: int):
    """Per (strategy, number of param groups): the losses of an uninterrupted run and of the same run
    saved after ``steps`` steps and resumed in a fresh engine; every engine shares this process group."""
    out = {}
    for name in names:
        for count in groups:
            path = f"{root}/{name}-{count}"
            full = _grouped_run(name, count, path, "full", steps)
            first = _grouped_run(name, count, path, "first", steps)
            out[(name, count)] = {"full": full, "resumed": first + _grouped_run(name, count, path, "second", steps)}
    return out


def _starving_qwen3_moe():
    """A tiny Hugging Face Qwen3-MoE whose routing follows the token: ids below 32 carry +5 in embedding dimension 0,
    the others -5, and every router scores experts 0 and 1 by +dim 0 and experts 2 and 3 by -dim 0. A batch of low
    ids sends no token to experts 2 and 3."""
    import transformers

    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).float()
    model.set_experts_implementation("eager")  # transformers' loop over the experts that were hit
    with torch.no_grad():
        model.model.embed_tokens.weight[:32, 0] = 5.0
        model.model.embed_tokens.weight[32:, 0] = -5.0
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
            layer.mlp.gate.weight[:, 0] = torch.tensor([10.0, 9.0, -9.0, -10.0])
    return model


def _moe_batch(rank: int, step: int) -> torch.Tensor:
    high = 64 if rank == 0 else 32  # rank 1: low ids only, so its experts 2 and 3 receive nothing
    return torch.randint(0, high, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))


def zero3_moe_worker(steps: int) -> dict:
    """Two AdamW steps of the starving Qwen3-MoE under ZeRO-3. Returns: the experts each rank's batches hit (per
    layer, from the unsharded model), the reference losses of this rank's batches, the engine's losses and their
    mean over the ranks, and the classes ZeRO3 flagged as leaf modules."""
    model = _starving_qwen3_moe()
    hit: list[list[int]] = []

    def record(_module, _inputs, output):
        hit.append(sorted(set(output[2].flatten().tolist())))

    hooks = [layer.mlp.gate.register_forward_hook(record) for layer in model.model.layers]
    # DeepSpeed (0.18+) flags these three transformers classes itself unless its config says otherwise; emptied here so
    # that what keeps the ranks in step is ZeRO3's own marking (without both, DeepSpeed stops on the ranks' different
    # module traces: the expert loop calls act_fn once per expert hit).
    no_defaults = {"zero_optimization": {"leaf_module": {"classes": []}}}
    runner = make_runner("zero3", "fp32", strategy=_cls("shardkit.strategies.zero", "ZeRO3")(extra=no_defaults))
    with torch.no_grad():
        ref = [model(input_ids=_moe_batch(runner.rank, s), labels=_moe_batch(runner.rank, s)).loss.item()
               for s in range(steps)]
    experts_hit = hit[:len(model.model.layers)]
    for h in hooks:
        h.remove()
    model, optimizer = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses, means = [], []
    for s in range(steps):
        ids = _moe_batch(runner.rank, s).to(runner.device)
        loss = model(input_ids=ids, labels=ids).loss
        runner.backward(loss)
        runner.step()
        losses.append(loss.item())
        means.append(runner.all_reduce(loss.detach().clone(), "mean").item())
    leaves = sorted({type(m).__name__ for m in runner.unwrap_model(model).modules() if getattr(m, "_z3_leaf", False)})
    return {"hit": experts_hit, "ref": ref, "losses": losses, "means": means, "leaves": leaves,
            "export": _moe_export(runner, model)}


def _moe_export(runner, model) -> dict:
    """save_pretrained of the trained ZeRO-3 Qwen3-MoE: on rank 0, whether the files hold the Hub's per-expert names
    and how far from_pretrained's logits (outside ZeRO-3) are from the engine's on this rank's batch."""
    import shutil
    import tempfile

    import transformers
    from harness import transformers_without_zero3
    from safetensors import safe_open

    from shardkit.checkpoint.hf import save_pretrained

    out_dir = runner.broadcast(tempfile.mkdtemp() if runner.rank == 0 else None)
    ids = _moe_batch(runner.rank, 0).to(runner.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().cpu()
    save_pretrained(runner, out_dir, model)
    if runner.rank != 0:
        return {}
    with safe_open(f"{out_dir}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    with transformers_without_zero3():
        back = transformers.Qwen3MoeForCausalLM.from_pretrained(out_dir).float()
    back.set_experts_implementation("eager")
    with torch.no_grad():
        diff = (back(input_ids=ids.cpu()).logits - logits).abs().max().item()
    shutil.rmtree(out_dir)
    return {"per_expert": "model.layers.1.mlp.experts.3.down_proj.weight" in keys,
            "stacked": any(k.endswith("gate_up_proj") for k in keys), "logits": diff}
