"""Pipeline parallelism inside each rank: every schedule in one process group, compared with DDP's losses.

Each case trains the same untied tiny Llama (or a tiny HF LlamaForCausalLM, built locally: ``model="hf"``, tied
embeddings with ``"hf_tied"``) on the same global batches (SGD, so a wrong gradient shows in the next loss) and
returns its losses, the micro-batch counts its schedules ran, for the stages this rank holds the weights after
training (FSDP shards gathered whole) and, under ``dp="fsdp"``, the reduce-scatters each FSDP unit ran.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from shardkit import Runner
from shardkit.models import Llama, LlamaConfig

__all__ = ["CONFIG", "pp_worker"]

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, max_position=32,
                     tie_embeddings=False, fused=False)
GLOBAL_BATCH, SEQ, STEPS = 8, 12, 3


def batches() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def build(model: str) -> torch.nn.Module:
    """shardkit's Llama ("llama"), or an HF LlamaForCausalLM of the same shape ("hf"; "hf_tied": tied head)."""
    if model == "llama":
        return Llama(CONFIG)
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    cfg = HFConfig(vocab_size=CONFIG.vocab_size, hidden_size=CONFIG.hidden_size, num_hidden_layers=CONFIG.num_layers,
                   intermediate_size=CONFIG.intermediate_size, num_attention_heads=CONFIG.num_heads,
                   num_key_value_heads=CONFIG.num_heads, max_position_embeddings=CONFIG.max_position,
                   tie_word_embeddings=model == "hf_tied", attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=x, labels=x)
    return out if isinstance(out, torch.Tensor) else out.loss


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def count_collectives(pipeline: Any) -> dict[str, dict[str, list[int]]]:
    """Count, from now on, the reduce-scatters and all-gathers of each FSDP unit of this rank's stages that owns
    parameters (kind -> a one-element list per unit, keyed by stage index and module name)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    counts: dict[str, dict[str, list[int]]] = {"reduce_scatters": {}, "all_gathers": {}}

    def counting(base: type, count: list[int]) -> Any:
        class Counting(base):
            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                count[0] += 1
                return super().__call__(*args, **kwargs)

        return Counting()

    for stage in pipeline.stages:
        for name, unit in stage.submod.named_modules():
            inner = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)
                     for p in m.parameters()}
            if isinstance(unit, FSDPModule) and any(id(p) not in inner for p in unit.parameters()):
                key = f"{stage.stage_index}:{name}"
                counts["reduce_scatters"][key], counts["all_gathers"][key] = [0], [0]
                unit.set_custom_reduce_scatter(counting(DefaultReduceScatter, counts["reduce_scatters"][key]))
                unit.set_custom_all_gather(counting(DefaultAllGather, counts["all_gathers"][key]))
    return counts


def train(strategy: Any, accumulation: int = 1, window: int | None = None, model: str = "llama",
          abandon: bool = False) -> dict:
    """``window``: every step a short accumulation window of that many micro-batches (``runner.begin_window``).
    ``abandon``: the first window is abandoned after one micro-batch (``runner.abandon_window``) and run again whole,
    so the run must equal one without the abandoned micro-batch."""
    runner = Runner(strategy, seed=0, gradient_accumulation_steps=accumulation)
    name = model
    with runner.init_module():
        model = build(name)
    model, opt = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    s = runner.strategy
    pipeline = getattr(s, "_runner", None)
    collectives = count_collectives(pipeline) if pipeline is not None and pipeline.sharded else {}
    per = GLOBAL_BATCH // s.data_parallel_size
    losses = []
    for step, x in enumerate(batches()):
        x = x[s.data_parallel_rank * per:(s.data_parallel_rank + 1) * per]
        if abandon and step == 0:
            runner.backward(_loss(model, x.chunk(accumulation)[1]))
            runner.abandon_window()
        if window is not None:
            runner.begin_window(window)
        for part in x.chunk(window or accumulation):
            loss = _loss(model, part)
            runner.backward(loss)
            losses.append(runner.all_reduce(loss.detach().clone(), "mean").item())
        runner.step()
    from torch.distributed.tensor import DTensor

    state = runner.unwrap_model(model).state_dict()
    weights = {k: _whole(v) for k, v in state.items()}
    sharded = sorted(k for k, v in state.items() if isinstance(v, DTensor))
    return {"losses": losses, "weights": weights, "microbatches": sorted(pipeline._schedules) if pipeline else [],
            "sharded": sharded, **{kind: {k: n for k, (n,) in c.items()} for kind, c in collectives.items()}}


def _reshard_after_forward() -> Any:
    """FSDP2 units that reshard after every forward, whatever the Pipeline asks (zero-bubble stages keep theirs
    whole): the stage must still find the graph's weights in its I and W passes."""
    from unittest import mock

    from shardkit.strategies import _dtensor

    shard = _dtensor.shard_bottom_up
    return mock.patch.object(_dtensor, "shard_bottom_up",
                             lambda *args, **kwargs: shard(*args, **{**kwargs, "reshard_after_forward": True}))


def refusal(strategy: Any, model: str) -> str:
    """The ValueError ``runner.setup`` raises for a layout it refuses ("" when it sets up)."""
    runner = Runner(strategy, seed=0)
    with runner.init_module():
        module = build(model)
    try:
        runner.setup(module, torch.optim.SGD(module.parameters(), lr=0.5))
    except ValueError as err:
        return str(err)
    return ""


def pp_worker(cases: list[dict], resumes: dict[str, tuple[dict, dict]], root: str,
              refusals: dict[str, tuple[dict, str, str]] | None = None) -> dict:
    """DDP's run, then each case (Pipeline keyword arguments, ``accumulation``, ``window`` and ``model`` apart) on
    the same batches; a case's name ends in the micro-batches per window (``accumulation=N``). Then each of
    ``resumes`` (name: the Pipeline arguments saving and those resuming, see layout_workers.resume_case), and
    each of ``refusals`` (name: Pipeline arguments, model, the words expected): the error its setup raised."""
    from layout_workers import resume_case

    from shardkit.strategies import DDP
    from shardkit.strategies.pipeline import Pipeline

    resumed = {name: resume_case(Pipeline(**a), Pipeline(**b), Path(root) / name) for name, (a, b) in resumes.items()}

    out = {"ddp": train(DDP()), "ddp_accumulation": train(DDP(), accumulation=2)}
    for model in sorted({kw["model"] for kw in cases if "model" in kw}):
        out[f"ddp {model}"] = train(DDP(), model=model)
    for kw in cases:
        kw = dict(kw)
        accumulation, window = kw.pop("accumulation", 1), kw.pop("window", None)
        model, abandon = kw.pop("model", "llama"), kw.pop("abandon", False)
        resharding = kw.pop("reshard_after_forward", False)
        name = f"{model} {sorted(kw.items())!r}" + (f" short window of ga={accumulation}," if window else "")
        name += " abandoned first window," if abandon else ""
        name += " units resharded after forward," if resharding else ""
        with _reshard_after_forward() if resharding else contextlib.nullcontext():
            out[name + f" accumulation={window or accumulation}"] = train(Pipeline(**kw), accumulation, window,
                                                                          model, abandon)
    refused = {name: refusal(Pipeline(**kw), model) for name, (kw, model, _) in (refusals or {}).items()}
    return {"cases": out, "resumed": resumed, "refused": refused}
