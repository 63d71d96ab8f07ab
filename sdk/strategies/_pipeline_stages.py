"""The stages of a pipeline-parallel model and the forward that runs a schedule over them (see pipeline.py).

Each rank keeps only its stages' parts of the user's model, under their own names: ``layers`` becomes an
``nn.ModuleDict`` keyed by the original indices (so ``layers.5.mlp...`` stays ``layers.5.mlp...``) and the
embedding, final norm and output head are ``None`` on the ranks that do not run them.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from shardkit.strategies.pipeline import SCHEDULES, PipelineSettings, stage_layers

__all__ = ["PipelineRunner", "StageModule"]


class StageModule(nn.Module):
    """One stage: the embedding on the first, a block of layers, the final norm on the last."""

    def __init__(self, embed: nn.Module | None, layers: list[nn.Module], norm: nn.Module | None,
                 head: nn.Module | None):
        super().__init__()
        self.embed, self.layers, self.norm, self.head = embed, nn.ModuleList(layers), norm, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x) if self.norm is not None else x


def _check_model(module: nn.Module, stages: int, split: tuple[int, ...] | None) -> None:
    missing = [n for n in ("embed_tokens", "layers", "norm", "lm_head") if not hasattr(module, n)]
    if missing:
        raise ValueError(f"Pipeline splits shardkit Llama-style models (embed_tokens, layers, norm, lm_head); "
                         f"{type(module).__name__} has no {missing}")
    if stages > 1 and module.lm_head.weight is module.embed_tokens.weight:
        raise ValueError("Pipeline: the output head is tied to the embedding, which live on the first and last "
                         "stages; build the model untied (LlamaConfig(tie_embeddings=False))")
    from shardkit.strategies.mesh import ParallelDims

    ParallelDims(pp=stages, dp_shard=1).validate(num_layers=len(module.layers), layer_split=split)


class PipelineRunner:
    """This rank's stages, the schedule over them, and the forward installed on the user's model."""

    def __init__(self, module: nn.Module, settings: PipelineSettings, mesh: Any, device: torch.device,
                 loss_scale: Callable[[], tuple[int, bool]]):
        import torch.distributed.pipelining as pipelining

        pp = settings.pp_size
        total = pp * settings.chunks
        _check_model(module, total, settings.layer_split)
        self.settings, self.loss_scale = settings, loss_scale
        self.pp_group, self.dp_group = mesh["pp"].get_group(), mesh["dp_shard"].get_group()
        self.pp_rank, self.pp = dist.get_rank(self.pp_group), pp
        ranges = stage_layers(len(module.layers), total, settings.layer_split)
        # Looped placement: rank r holds stages r, r + pp, ... (what torch's interleaved schedules expect).
        self.indices = [self.pp_rank + c * pp for c in range(settings.chunks)]
        first, last = 0 in self.indices, total - 1 in self.indices
        owned = {i for s in self.indices for i in ranges[s]}
        self.stages = []
        for s in self.indices:
            part = StageModule(module.embed_tokens if s == 0 else None, [module.layers[i] for i in ranges[s]],
                               module.norm if s == total - 1 else None, module.lm_head if s == total - 1 else None)
            self.stages.append(pipelining.PipelineStage(part, s, total, device, group=self.pp_group))
        module.layers = nn.ModuleDict({str(i): module.layers[i] for i in sorted(owned)})
        for name, keep in (("embed_tokens", first), ("norm", last), ("lm_head", last)):
            if not keep:
                setattr(module, name, None)
        self.first, self.last, self.module = first, last, module
        self.schedule_class = getattr(pipelining, SCHEDULES[settings.schedule])
        module.forward = types.MethodType(_pipeline_forward, module)

    def schedule(self, microbatches: int, loss_fn: Callable) -> Any:
        stage = self.stages if self.settings.chunks > 1 else self.stages[0]
        return self.schedule_class(stage, microbatches, loss_fn=loss_fn, scale_grads=False)

    def run(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch; the batch's token-weighted mean loss on every rank."""
        n = self.settings.microbatches or self.pp
        if input_ids.shape[0] % n:
            raise ValueError(f"Pipeline: batch size({input_ids.shape[0]}) % microbatches({n}) != 0; use a batch "
                             f"size that is a multiple of {n}, or Pipeline(microbatches=...) that divides it")
        accumulation, sync = self.loss_scale()
        tokens = (labels[:, 1:] != -100).sum().clamp(min=1).float()
        head = self.module.lm_head

        def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            shift = target[:, 1:].reshape(-1)
            count = (shift != -100).sum()
            if not int(count):
                return hidden.sum() * 0.0
            mean = head(hidden[:, :-1].reshape(-1, hidden.shape[-1]), shift)
            return mean * count / tokens / accumulation  # summed over micro-batches: the batch mean

        schedule = self.schedule(n, loss_fn)
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.first else ()
        kwargs = {"target": labels, "losses": losses} if self.last else {}
        schedule.step(*args, **kwargs)
        total = torch.stack([x.detach().float() for x in losses]).sum() * accumulation if self.last else \
            torch.zeros((), device=input_ids.device)
        last_rank = dist.get_global_rank(self.pp_group, self.pp - 1)
        dist.broadcast(total, src=last_rank, group=self.pp_group)
        if sync and dist.get_world_size(self.dp_group) > 1:
            self._all_reduce_gradients()
        total._shardkit_pipeline_backward_done = True
        return total

    def _all_reduce_gradients(self) -> None:
        size = dist.get_world_size(self.dp_group)
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.dp_group)
                p.grad.div_(size)


def _pipeline_forward(self: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                      **kwargs: Any) -> torch.Tensor:
    """The forward Pipeline installs: with labels, the schedule (forward and backward); else a refusal."""
    if labels is None or kwargs:
        raise NotImplementedError("Pipeline: a forward without labels (logits, generation) is not supported on a "
                                  "pipeline-split model; save a checkpoint and load it under a single-device or "
                                  "FSDP strategy for evaluation and generation")
    return self._shardkit_pipeline.run(input_ids, labels)
