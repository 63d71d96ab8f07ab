"""The tensor-parallel plan of a Hugging Face MoE model under expert parallelism x tensor parallelism.

transformers' own plan (``base_model_tp_plan``) splits everything over tp, the routed experts included
(``packed_colwise`` ``gate_up_proj``, ``rowwise`` ``down_proj``, ``moe_tp_experts``). Under
:class:`~shardkit.strategies.ExpertParallel` the experts are split over ep instead and run through the dispatcher
(:class:`~shardkit.strategies.ep_tensor.TensorSplitDispatch`: each tp rank sends its share of the assignments), so the
plan here is transformers' plan without the expert blocks' entries: attention (colwise q/k/v, rowwise o, the
per-head norms replicated with their gradients summed), a dense MLP where the model has one, and the language-model
head. The router (``mlp.gate``) is in no plan: it stays whole on every tp rank, which route the same tokens the same
way (its input is the attention block's output, whole after the rowwise ``o_proj``).
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

from shardkit.strategies.tensor_parallel import hugging_face_plan, resolve_plan

__all__ = ["hf_dense_plan"]

_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def hf_dense_plan(module: nn.Module, blocks: list[nn.Module], tp_size: int, sequence_parallel: bool) -> dict[str, Any]:
    """``module``'s Hugging Face plan without its expert blocks (``blocks``), expanded to module names.

    Raises:
        ValueError: ``sequence_parallel`` (transformers' plan has no sequence-parallel form here), a model without a
            Hugging Face plan, or a style shardkit does not map (as :func:`~shardkit.strategies.tensor_parallel.
            hugging_face_plan`).
    """
    name = type(module).__name__
    if sequence_parallel:
        raise ValueError(f"ExpertParallel tp_size={tp_size} sequence_parallel=True: {name}'s own Hugging Face plan has "
                         "no sequence-parallel form here; use sequence_parallel=False")
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
    return resolve_plan(module, plan, tp_size)
