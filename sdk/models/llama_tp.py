"""The tensor-parallel plan of shardkit's :class:`~shardkit.models.llama.Llama` (``Llama.parallel_plan`` returns it;
also importable from :mod:`shardkit.models.llama`)."""

from __future__ import annotations

from torch import nn

from shardkit.models.moe import MoE

__all__ = ["llama_plan"]


def llama_plan(model: nn.Module, tp_size: int, sequence_parallel: bool = False) -> dict:
    """The tensor-parallel plan for :class:`Llama`: column-wise q/k/v/gate/up, row-wise o/down.

    Attention keeps ``num_heads / tp_size`` heads per rank (the model views its projections as
    ``(batch, seq, -1, head_dim)``, so local heads need no change). Embedding and the tied output head
    stay replicated. With ``sequence_parallel`` the norms and residual stream are sharded on the
    sequence dim between the blocks. In MoE layers the shared experts split as a dense MLP; the router and the
    routed experts are in no entry (no tensor parallelism inside the experts): whole on every rank under
    TensorParallel, split over the ep ranks under ``ExpertParallel(tp_size=...)``, whose tp ranks split the tokens.

    Returns:
        module name -> ``ParallelStyle`` (torch.distributed.tensor.parallel), as ``TensorParallel`` takes.

    Raises:
        ValueError: ``model`` is not a Llama, or the head counts are not divisible by ``tp_size``.
    """
    # Imported here so that building a Llama does not import the DTensor machinery.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "layers"):
        raise ValueError(f"llama_plan is shardkit Llama's plan; there is no built-in plan for {type(model).__name__}: "
                         "pass TensorParallel(plan={FQN pattern: ParallelStyle}), e.g. {'layers.*.mlp.up_proj': "
                         "ColwiseParallel()}, or give the model a parallel_plan(tp_size, sequence_parallel) method")
    for what, heads in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.kv_heads)):
        if heads % tp_size:
            raise ValueError(f"TensorParallel: {what}({heads}) % tp_size({tp_size}) != 0; each rank needs whole "
                             "attention heads")
    sp = sequence_parallel
    plan: dict = {}
    if sp:
        plan["embed_tokens"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                                   use_local_output=False)
        plan["norm"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                          use_local_output=True)
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}"
        # An MoE layer: the router and the routed experts stay whole on every tp rank (each rank routes the same
        # tokens the same way, so the auxiliary loss is each rank's one copy, not tp summed ones); its shared
        # experts split as a dense MLP.
        moe = isinstance(layer.mlp, MoE)
        mlp = f"{p}.mlp.shared_experts" if moe else f"{p}.mlp"
        split_mlp = not moe or layer.mlp.shared_experts is not None
        out = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[f"{p}.{name}"] = ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel(**out)
        if split_mlp:
            plan[f"{mlp}.gate_proj"] = ColwiseParallel()
            plan[f"{mlp}.up_proj"] = ColwiseParallel()
            # In an MoE layer the shared experts' sum joins the routed experts' whole one before any re-split.
            plan[f"{mlp}.down_proj"] = RowwiseParallel(**({} if moe else out))
        if sp:
            for norm in ("input_layernorm", "post_attention_layernorm"):
                plan[f"{p}.{norm}"] = SequenceParallel()
            plan[f"{p}.self_attn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                        use_local_output=True)
            if moe:  # whole tokens in (routing sees every token), the whole output split back on the sequence
                plan[f"{p}.mlp"] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                    output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=False)
            else:
                plan[f"{p}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                      use_local_output=True)
    return plan
