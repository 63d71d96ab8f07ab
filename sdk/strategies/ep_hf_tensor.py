"""The tensor-parallel plan of a Hugging Face MoE model under expert parallelism x tensor parallelism.

transformers' own plan (``base_model_tp_plan``) splits everything over tp, the routed experts included
(``packed_colwise`` ``gate_up_proj``, ``rowwise`` ``down_proj``, ``moe_tp_experts``). Under
:class:`~shardkit.strategies.ExpertParallel` the experts are split over ep instead and run through the dispatcher
(:class:`~shardkit.strategies.ep_tensor.TensorSplitDispatch`: each tp rank sends its share of the assignments), so the
plan here is transformers' plan without the expert blocks' entries: attention (colwise q/k/v, rowwise o, the
per-head norms replicated with their gradients summed), a dense MLP where the model has one, and the language-model
head. The router (``mlp.gate``) is in no plan: it stays whole on every tp rank, which route the same tokens the same
way (its input is the attention block's output, whole after the rowwise ``o_proj``, or gathered whole before the MoE
block in the sequence-parallel form).
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from shardkit.strategies.tensor_parallel import hugging_face_plan, resolve_plan

__all__ = ["hf_dense_plan"]

_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def hf_dense_plan(module: nn.Module, blocks: list[nn.Module], tp_size: int, sequence_parallel: bool) -> dict[str, Any]:
    """``module``'s Hugging Face plan without its expert blocks (``blocks``), expanded to module names.

    With ``sequence_parallel`` the plan's sequence-parallel form (:func:`_sequence_parallel_entries`).

    Raises:
        ValueError: a layout the sequence-parallel form does not map, a model without a Hugging Face plan, or a
            style shardkit does not map (as :func:`~shardkit.strategies.tensor_parallel.hugging_face_plan`).
    """
    name = type(module).__name__
    ids = {id(b) for b in blocks}
    expert_names = [n for n, m in module.named_modules() if id(m) in ids]
    targets = expert_names + [f"{n}.{w}" for n in expert_names for w in _EXPERT_WEIGHTS]
    names = [n for n, _ in module.named_modules() if n]

    def keep(key: str, style: str) -> bool:
        if any(fnmatch.fnmatchcase(t, key) for t in targets):
            return False  # the experts are split over ep, not tp
        # an entry for layers this model does not have (Qwen3-MoE's dense MLP when every layer is sparse) splits
        # nothing, as in transformers
        return any(fnmatch.fnmatchcase(n, key) for n in names)

    plan = hugging_face_plan(module, keep)
    if plan is None:
        raise ValueError(f"ExpertParallel tp_size={tp_size}: {name} holds Hugging Face expert blocks but has no "
                         "Hugging Face tensor-parallel plan (base_model_tp_plan) to split its other layers by; use "
                         "tp_size=1")
    plan = resolve_plan(module, plan, tp_size)
    if sequence_parallel:
        plan.update(_sequence_parallel_entries(module, ids, plan, tp_size))
    return plan


def _sequence_parallel_entries(module: nn.Module, ids: set[int], plan: dict[str, Any],
                               tp_size: int) -> dict[str, Any]:
    """The sequence-parallel form of the plan, by module name: between the decoder layers the residual stream is each
    tp rank's ``1 / tp`` of the sequence; the norms run on it (their weights replicated, their gradients summed); the
    attention and the MoE block gather it whole (the router and the dispatcher route every token on every tp rank, as
    without sequence parallelism) and give back their rank's part. The model computes its positions and its mask
    from the embedding's output, so the embedding stays whole and the first decoder layer takes its rank's part; the
    final norm's part is gathered by the head.

    Raises:
        ValueError: a layout this does not map: no ``layers`` under the base model, a decoder layer without
            ``input_layernorm``/``self_attn``/``post_attention_layernorm``/``mlp``, an ``mlp`` that is not the
            parent of an expert block (a dense MLP layer), or no final ``norm``, or no ``lm_head`` in the plan.
    """
    name = type(module).__name__
    prefix = getattr(module, "base_model_prefix", "")
    base = getattr(module, prefix, None) if prefix else None
    base, at = (base, f"{prefix}.") if isinstance(base, nn.Module) else (module, "")
    layers = getattr(base, "layers", None)
    norm = getattr(base, "norm", None)

    def refuse(what: str) -> ValueError:
        return ValueError(f"ExpertParallel tp_size={tp_size} sequence_parallel=True: {name} {what}; the sequence-"
                          "parallel form of a Hugging Face plan is built for decoders of MoE layers (Qwen3-MoE, "
                          "Mixtral); use sequence_parallel=False")

    if not isinstance(layers, nn.ModuleList) or not len(layers) or not isinstance(norm, nn.Module):
        raise refuse("has no `layers` and final `norm` under its base model")
    if "lm_head" not in plan:
        raise refuse("has no split `lm_head` in its plan")
    out: dict[str, Any] = {}
    for i, layer in enumerate(layers):
        parts = [getattr(layer, a, None) for a in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")]
        if not all(isinstance(p, nn.Module) for p in parts):
            raise refuse(f"layer {i} lacks input_layernorm, self_attn, post_attention_layernorm or mlp")
        if not any(id(child) in ids for child in parts[3].children()):
            raise refuse(f"layer {i}'s mlp ({type(parts[3]).__name__}) holds no expert block (a dense MLP layer)")
        pre = f"{at}layers.{i}"
        for norm_name in ("input_layernorm", "post_attention_layernorm"):
            out[f"{pre}.{norm_name}"] = SequenceParallel()
        out[f"{pre}.self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                     desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                     use_local_output=True)
        if f"{pre}.self_attn.o_proj" not in plan:
            raise refuse(f"layer {i}'s attention has no split o_proj in its plan")
        out[f"{pre}.self_attn.o_proj"] = RowwiseParallel(output_layouts=Shard(1))
        out[f"{pre}.mlp"] = _WholeTokens()
    out[f"{at}layers.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                              use_local_output=True)
    out[f"{at}norm"] = SequenceParallel(use_local_output=True)
    out["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return out


class _WholeTokens(ParallelStyle):
    """The MoE block's style: its rank's part of the sequence gathered whole going in (the tp peers route the same
    tokens), its whole output cut back to the rank's part coming out (the gradient gathered whole again)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                           use_local_output=True)._apply(module, device_mesh)
        PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                            use_local_output=True)._apply(module, device_mesh)
        return module
