"""Worker functions for test_hf_link.py (top level so spawned ranks import them): Hugging Face code run as an HF
user writes it (``model.generate``, ``from_pretrained``) inside shardkit's ZeRO-3, ZeROInfinity and FSDP runs."""

from __future__ import annotations

import gc

import generation_workers as gw
import torch
import torch.distributed as dist
from torch import nn

from shardkit import Runner
from shardkit.distributed.process_group import init_distributed
from shardkit.strategies import strategy_from_name

# ZeROInfinity with its parameters offloaded to host memory: the NVMe path (async_io, a 5-minute build) is the
# slow-marked test in test_generation.py; the registration is the same class's.
# "tp": no plan given, so the HF model's own (base_model_tp_plan); both TP ranks get rank 0's request.
HF_STRATEGIES = {"fsdp": {}, "zero3": {}, "zero_infinity": {"offload_params": "cpu", "offload_optimizer": None},
                 "tp": {"tp_size": 2}}


def _zero3_enabled() -> bool:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


def hf_generate_worker(names: list[str]) -> dict:
    """HF's own ``model.generate`` (no synced_gpus given) on a model set up by each strategy; rank 0 asks for 6
    new tokens on two 5-token prompts, rank 1 for 3 on one 3-token prompt. Returns this rank's tokens, the
    unsharded model's tokens, and whether transformers saw ZeRO-3 during and after each run."""
    init_distributed("cpu")
    rank = dist.get_rank()
    base = gw.hf_tiny()
    state = {k: v.clone() for k, v in base.state_dict().items()}
    out: dict = {}
    runner = None
    for name in names:
        ids, new = gw.requests(0 if name == "tp" else rank)
        want = gw.reference(base, ids, new, None, hf=True)
        model = gw.hf_tiny()
        model.load_state_dict(state)
        runner = Runner(strategy=strategy_from_name(name, **HF_STRATEGIES[name]), seed=0)
        model = runner.setup(model)
        got = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
        out[name] = {"got": got.cpu(), "want": want, "zero3_seen": _zero3_enabled()}
        if name == "tp":
            q = model.model.layers[0].self_attn.q_proj.weight
            out[name]["q_local_shape"] = tuple(getattr(q, "_local_tensor", q).shape)
    runner.teardown()
    out["zero3_seen_after_teardown"] = _zero3_enabled()
    return out


def _held_bytes(params: list[nn.Parameter]) -> int:
    """Parameter bytes this rank holds: a ZeRO-3 parameter's own partition, plus its whole tensor while gathered."""
    total = 0
    for p in params:
        partition = getattr(p, "ds_tensor", None)
        if partition is not None:
            total += partition.numel() * partition.element_size()
        total += p.data.numel() * p.data.element_size()  # empty (numel 0) while partitioned
    return total


def _live_parameters() -> list[nn.Parameter]:
    return [o for o in gc.get_objects() if isinstance(o, nn.Parameter)]


def from_pretrained_worker(path: str) -> dict:
    """``LlamaForCausalLM.from_pretrained`` inside a ZeRO-3 run. The peak is sampled each time DeepSpeed gathers
    parameters (transformers loads one module's parameters at a time) and once loaded; returns it, the bytes held
    after loading, the whole model's bytes, and whether every weight equals the saved one."""
    import deepspeed
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    init_distributed("cpu")
    runner = Runner(strategy=strategy_from_name("zero3"), seed=0)
    peak = [0]
    live: list[nn.Parameter] = []
    gathered = deepspeed.zero.GatheredParameters
    enter = gathered.__enter__

    def sampling_enter(self):
        result = enter(self)
        if not live:  # every parameter exists (partitioned) before the first module loads: scan once
            live.extend(_live_parameters())
        peak[0] = max(peak[0], _held_bytes(live))
        return result

    gathered.__enter__ = sampling_enter
    try:
        model = LlamaForCausalLM.from_pretrained(path)
    finally:
        gathered.__enter__ = enter
    params = list(model.parameters())
    held = _held_bytes(params)
    peak[0] = max(peak[0], held)
    saved = load_file(f"{path}/model.safetensors")
    whole = sum(t.numel() * t.element_size() for t in saved.values())
    names = [n for n, _ in model.named_parameters()]
    with runner.gathered_parameters(params) as full:
        equal = all(torch.equal(p.detach().cpu(), saved[n]) for n, p in zip(names, full))
    return {"peak": peak[0], "held": held, "whole": whole, "equal": equal, "partitioned": all(
        hasattr(p, "ds_tensor") for p in params)}
