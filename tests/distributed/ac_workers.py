"""Activation checkpointing under every strategy, run inside each rank (tests/distributed/test_activation_
checkpointing_distributed.py): one 2-rank launch runs every strategy, each check guarded so one failure
reports instead of stopping the rest.

Per strategy and variant it trains a few steps on the same batches and returns each step's global loss and
gradient norm, the whole weights after, how often a block's MLP ran per step (1: no recompute, 2: recomputed in
backward) and the bytes autograd saved during the first forward (checkpointing keeps only block inputs).
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

import torch
from workloads import full_state

from shardkit import Runner
from shardkit.models import Llama, LlamaConfig
from shardkit.strategies.activation_checkpointing import ActivationCheckpointing

__all__ = ["CONFIG", "HF_SKIP", "SEQ", "STRATEGIES", "ac_worker"]

STRATEGIES = ("single", "ddp", "fsdp", "tp", "zero1", "zero2", "zero3", "zero_infinity")
SIZE_KWARGS: dict[str, dict[str, Any]] = {"zero_infinity": {"buffer_size": 100_000}}  # 5 x 1e8 swap: 2 GB/rank
CONFIG = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, max_position=32,
                     dropout=0.1)  # dropout: the recompute must replay the forward's RNG
GLOBAL_BATCH, SEQ, STEPS = 4, 12, 1
LLAMA_VARIANTS = {"off": None, "plain": True, "reentrant": ActivationCheckpointing(use_reentrant=True)}
# HF: its own checkpointing (the Trainer's path) both ways, and a DeepSpeed config's section (the Runner's path).
HF_VARIANTS = ("off", "hf", "hf_reentrant", "ds_section")
# ZeRO-Infinity runs HF models through ZeRO-3's code (NVMe only moves the partitions): its HF runs would repeat
# zero3's at ~3 s each on 2 cores.
HF_SKIP = ("zero_infinity",)
DS_SECTION = {"cpu_checkpointing": True, "synchronize_checkpoint_boundary": True, "profile": True}


def _strategy(name: str, hf: bool):
    from shardkit.strategies.registry import STRATEGIES as REGISTRY

    kwargs = dict(SIZE_KWARGS.get(name, {}))
    if name == "tp" and hf:  # shardkit's Llama brings its plan; HF's Llama gets the same split here
        kwargs["plan"] = _hf_plan()
    return REGISTRY.build(name, **kwargs)


def _batches() -> torch.Tensor:
    starts = torch.randint(0, 256, (STEPS, GLOBAL_BATCH, 1), generator=torch.Generator().manual_seed(1))
    return (starts + torch.arange(SEQ)) % 256


def _local(runner: Runner, x: torch.Tensor) -> torch.Tensor:
    s = runner.strategy
    per = x.shape[0] // s.data_parallel_size
    return x[s.data_parallel_rank * per:(s.data_parallel_rank + 1) * per].to(runner.device)


def _hf_model():
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(HFConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32))


def _hf_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {f"model.layers.*.{n}": ColwiseParallel() for n in ("self_attn.q_proj", "self_attn.k_proj",
                                                               "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    plan.update({"model.layers.*.self_attn.o_proj": RowwiseParallel(), "model.layers.*.mlp.down_proj":
                 RowwiseParallel()})
    return plan


def _runner(name: str, hf: bool, variant: str, ac: Any) -> Runner:
    strategy = _strategy(name, hf)
    if variant == "ds_section":
        return Runner(strategy, seed=0, config={"activation_checkpointing": DS_SECTION})
    return Runner(strategy, seed=0, activation_checkpointing=ac)


def train(name: str, hf: bool, variant: str, ac: Any = None) -> dict:
    """A few SGD steps; SGD so that the weights after are the gradients, scaled (no Adam normalisation)."""
    start = time.perf_counter()
    runner = _runner(name, hf, variant, ac)
    with runner.init_module():
        model = _hf_model() if hf else Llama(CONFIG)
    if variant in ("hf", "hf_reentrant"):  # HF's own checkpointing, as the Trainer enables it
        model.activation_checkpointing_enable({"use_reentrant": variant == "hf_reentrant"})
    block = (model.model.layers if hf else model.layers)[0]
    calls = [0]
    # A pre-hook: the recompute stops (early stop) once it has what backward needs, inside the last MLP.
    block.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2) if name == "zero_infinity" else \
        torch.optim.SGD(model.parameters(), lr=0.5)  # ZeRO-Infinity steps on the host: Adam only
    model, optimizer = runner.setup(model, optimizer)
    out: dict[str, Any] = {"losses": [], "norms": [], "calls": [], "saved": None}
    for i, x in enumerate(_batches()):
        x, calls[0] = _local(runner, x), 0
        loss = _forward(model, x, hf, out if i == 0 else None)
        runner.backward(loss)
        norm = runner.clip_gradients(1e9)
        runner.step()
        out["calls"].append(calls[0])
        out["losses"].append(runner.all_reduce(loss.detach().float().clone(), "mean").item())
        out["norms"].append(float(norm))
    out["weights"] = full_state(runner, model)
    if variant == "ds_section":
        from deepspeed.runtime.activation_checkpointing import checkpointing as ds

        out["deepspeed"] = {"configured": ds.is_configured(), "cpu": ds.CPU_CHECKPOINT, "sync": ds.SYNCHRONIZE,
                            "profile": ds.PROFILE_TIME, "settings": repr(runner.activation_checkpointing)}
    out["seconds"] = round(time.perf_counter() - start, 2)
    return out


def _forward(model, x: torch.Tensor, hf: bool, out: dict | None) -> torch.Tensor:
    if out is None:
        return model(input_ids=x, labels=x).loss if hf else model(x, labels=x)
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=x, labels=x).loss if hf else model(x, labels=x)
    out["saved"], out["rows"] = saved[0], x.shape[0]
    return loss


def _guarded(fn, *args) -> Any:
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - reported to the test, which fails that case with it
        return {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"}


def ac_worker(names: tuple[str, ...] = STRATEGIES) -> dict[str, dict]:
    """Every strategy's variants in this one process group: {strategy: {"llama": {...}, "hf": {...}}}."""
    start = time.perf_counter()
    import deepspeed  # noqa: F401 - as a model that calls deepspeed.checkpointing would have

    assert "deepspeed" in sys.modules
    results: dict[str, dict] = {}
    for name in names:
        results[name] = {"llama": {v: _guarded(train, name, False, v, ac) for v, ac in LLAMA_VARIANTS.items()}}
        if name not in HF_SKIP:
            results[name]["hf"] = {v: _guarded(train, name, True, v) for v in HF_VARIANTS}
    results["seconds"] = round(time.perf_counter() - start, 2)
    return results
