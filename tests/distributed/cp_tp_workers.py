"""Context parallelism x tensor parallelism (cp 2 x tp 2) on 4 ranks, every case in one process group.

Each training case runs shardkit's Llama (grouped-query attention: 4 heads, 2 key/value heads, so each tp rank
holds 2 query heads and 1 key/value head) under ``ContextParallel(cp_size=2, tp_size=2)`` and, in the same
process, on one device without collectives, on the same sequences with AdamW (cp_workers.py's loop). It returns
the largest differences of the loss and of every whole gradient at each step, and of every weight after the steps.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from cp_workers import CONFIG, batches, build, hf_case, reference, train_case, whole

from shardkit.models import Llama, LlamaConfig

__all__ = ["GQA", "cp_tp_worker"]

GQA = dataclasses.replace(CONFIG, num_kv_heads=2)
CLIP = 0.5  # below these steps' gradient norms (1.26, 1.28 measured), so clipping scales every update


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _tp_split(weight: torch.Tensor) -> bool:
    """The weight is split over the mesh's tp dimension (FSDP2 shards it over dp_shard x cp on top)."""
    mesh = getattr(weight, "device_mesh", None)
    return mesh is not None and "tp" in (mesh.mesh_dim_names or ())


def _train(mode: str, ref: dict, sequence_parallel: bool = False) -> dict:
    from shardkit.strategies.context_parallel import ContextParallel

    strategy = ContextParallel(cp_size=2, tp_size=2, cp_mode=mode, sequence_parallel=sequence_parallel)
    out, model = train_case(strategy, ref, GQA, _adamw, clip=CLIP)
    return {**out, "tp_split": _tp_split(model.layers[0].self_attn.q_proj.weight), **_inference(model, ref)}


def _inference(model: Any, ref: dict) -> dict:
    """Forwards without labels run the whole sequence (unsplit, still tensor-parallel): the logits and greedy
    generation (KV cache over each tp rank's heads) of one device with the trained weights."""
    one = Llama(GQA)
    one.load_state_dict(ref["weights"])
    prompt = batches()[0, :2, :6].clamp(min=0)
    with torch.no_grad():
        logits = (model(prompt) - one(prompt)).abs().max().item()
    return {"logits": [logits], "generated": torch.equal(model.generate(prompt, max_new_tokens=4),
                                                         one.generate(prompt, max_new_tokens=4))}


def _hf(kind: str, mode: str) -> dict:
    out, model = hf_case(kind, mode, cp_size=2, tp_size=2)
    return {**out, "tp_split": _tp_split(model.model.layers[0].self_attn.q_proj.weight)}


def _init(ref: dict) -> dict:
    """Largest difference from one device's initial weights (same seed) for each way of building the model:
    recorded on the meta device (the default), whole on rank 0 only (empty_init=True), whole everywhere."""
    from shardkit.strategies.context_parallel import ContextParallel

    out = {}
    for empty_init in (None, True, False):
        _, model = build(ContextParallel(cp_size=2, tp_size=2), GQA, _adamw, empty_init)
        out[str(empty_init)] = max((whole(p.detach()) - ref["init"][n]).abs().max().item()
                                   for n, p in model.named_parameters())
    return out


def _error(kwargs: dict, config: LlamaConfig) -> str:
    """The message setup raises for a layout the model's heads do not fit."""
    from shardkit.strategies.context_parallel import ContextParallel

    try:
        build(ContextParallel(**kwargs), config, _adamw)
    except ValueError as err:
        return str(err)
    return "no error"


def _errors() -> dict:
    return {
        "heads % tp": _error({"cp_size": 2, "tp_size": 2}, dataclasses.replace(
            CONFIG, hidden_size=24, num_heads=3, intermediate_size=48)),
        "local heads % cp (ulysses)": _error({"cp_size": 2, "tp_size": 2, "cp_mode": "ulysses"}, dataclasses.replace(
            CONFIG, num_heads=2)),
    }


def cp_tp_worker(root: str) -> dict:
    """Every cp 2 x tp 2 case: training against one device (ring, Ulysses, ring with TP's sequence parallelism,
    HF Llama and Qwen2), the named errors, the ways of building the model, and a checkpoint saved under cp 2 x tp 2
    resumed under cp 1 (FSDP2 over the 4 ranks) and back."""
    from layout_workers import resume_case

    from shardkit.strategies.context_parallel import ContextParallel

    ref = reference(GQA, _adamw, clip=CLIP)
    out: dict[str, Any] = {mode: _train(mode, ref) for mode in ("ring", "ulysses")}
    # The norms and the residual stream split over tp along each rank's chunk, gathered for attention and the MLP.
    out["ring sequence_parallel"] = _train("ring", ref, sequence_parallel=True)
    out["hf llama ring"] = _hf("llama", "ring")
    out["hf qwen2 ulysses"] = _hf("qwen2", "ulysses")  # q/k/v biases split with their columns
    out["errors"] = _errors()
    out["init"] = _init(ref)
    out["cp2xtp2->cp1"] = resume_case(ContextParallel(cp_size=2, tp_size=2), ContextParallel(cp_size=1),
                                      Path(root) / "to_cp1")
    out["cp1->cp2xtp2"] = resume_case(ContextParallel(cp_size=1),
                                      ContextParallel(cp_size=2, tp_size=2, cp_mode="ulysses"), Path(root) / "from_cp1")
    return out


def eight_rank_worker() -> dict:
    """dp_shard 2 x cp 2 x tp 2 (ring) and dp_replicate 2 x cp 2 x tp 2 (Ulysses) against one device: not in CI
    (8 processes on 2 cores, ~40 s); run ``python tests/distributed/cp_tp_workers.py``."""
    from shardkit.strategies.context_parallel import ContextParallel

    ref = reference(GQA, _adamw, clip=CLIP)
    layouts = {"dp_shard 2 x cp 2 x tp 2 ring": {"cp_size": 2, "tp_size": 2},
               "dp_replicate 2 x cp 2 x tp 2 ulysses": {"cp_size": 2, "tp_size": 2, "dp_replicate": 2,
                                                        "cp_mode": "ulysses"}}
    return {name: train_case(ContextParallel(**kw), ref, GQA, _adamw, clip=CLIP)[0] for name, kw in layouts.items()}


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cp_tp_workers import eight_rank_worker as _worker  # by module name, so that spawned ranks import it
    from harness import run_distributed

    for rank, per_rank in enumerate(run_distributed(_worker, world_size=8)):
        for name, got in per_rank.items():
            worst = {k: max(v) for k, v in got.items()}
            assert max(worst.values()) < 2e-4 and max(got["grad"]) < 2e-5, (rank, name, worst)
            print(f"rank {rank} {name}: largest differences from one device {worst}")
