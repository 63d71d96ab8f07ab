"""What the estimator needs to know about a model, from a parameter count, a config, or the model itself."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ModelSpec", "parse_count", "spec_from_hf_config", "spec_from_llama_config", "spec_from_model"]

_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str | int | float) -> int:
    """``"2783M"``, ``"2.78B"``, ``"350k"``, ``"1e9"`` or a number -> an integer count."""
    if isinstance(text, (int, float)):
        text = repr(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
    if not m:
        raise ValueError(f"{text!r} is not a count; use e.g. 2783M, 2.78B, 350K or 1000000")
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if not math.isfinite(value) or value >= 2**63:
        raise ValueError(f"{str(text)[:40]!r} is too large a count; use e.g. 2783M, 2.78B or 70B")
    return int(round(value))


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a model. Only ``total_params`` is required; the rest sharpen the estimate.

    Attributes:
        total_params: parameters, tied ones counted once.
        largest_layer_params: parameters of the largest single module (what ZeRO-3 gathers at once).
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, vocab_size: a decoder's
            shape, for activations and for the tensor-parallel split.
        tp_params: parameters tensor parallelism splits (attention and MLP projections); the rest are
            replicated. None: assume all are split.
        active_params: parameters one token goes through (a mixture of experts: its top-k routed experts, not all
            of them); None: a dense model, all of them.
        moe_top_k: experts each token is routed to in a mixture of experts (for the all-to-all buffers under
            expert parallelism); None: a dense model.
        expert_params: of ``total_params``, the routed experts of every MoE layer (what expert parallelism splits
            over ep); 0: a dense model, or not known (a bare parameter count).
        expert_block_params: one MoE layer's routed experts, all of them (the unit FSDP2 gathers for the experts).
        largest_dense_params: the largest module outside the routed experts (None: ``largest_layer_params``).
    """

    total_params: int
    largest_layer_params: int = 0
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    tp_params: int | None = None
    active_params: int | None = None
    moe_top_k: int | None = None
    expert_params: int = 0
    expert_block_params: int = 0
    largest_dense_params: int | None = None

    def __post_init__(self) -> None:
        if self.total_params <= 0:
            raise ValueError(f"total_params must be positive, got {self.total_params}")
        if not 0 <= self.expert_block_params <= self.expert_params <= self.total_params:
            raise ValueError(f"expert_block_params({self.expert_block_params}) <= expert_params({self.expert_params}) "
                             f"<= total_params({self.total_params}) must hold")
        if self.largest_layer_params > self.total_params:
            raise ValueError(f"largest_layer_params({self.largest_layer_params}) > total_params({self.total_params})")

    @property
    def has_shape(self) -> bool:
        """True when the decoder shape needed for an activation estimate is known."""
        return None not in (self.hidden_size, self.num_layers, self.intermediate_size, self.vocab_size)


@dataclass(frozen=True)
class _Experts:
    """A decoder's MoE MLPs: ``layers`` of them, each ``num`` routed experts of width ``width`` (``top_k`` per token),
    shared experts of total width ``shared``."""

    num: int
    top_k: int
    width: int
    layers: int
    shared: int = 0


def _decoder_spec(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, tied: bool,
                  norm_bias: bool = False, head_dim: int | None = None, experts: _Experts | None = None,
                  qk_norm: bool = False) -> ModelSpec:
    head_dim = head_dim or hidden // heads
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o + k, v
    mlp = 3 * hidden * inter  # gate, up, down
    norms = 2 * hidden * (2 if norm_bias else 1) + (2 * head_dim if qk_norm else 0)  # Qwen3's q_norm, k_norm
    embed = vocab * hidden
    total = embed * (1 if tied else 2) + layers * (attn + mlp + norms) + hidden
    largest = max(embed, hidden * inter)  # nn.Embedding / lm_head vs one MLP projection
    active = None
    tp_params = layers * (attn + mlp)
    block = 0
    dense_largest = None
    if experts is not None and experts.layers:
        # an MoE layer: the router, the shared experts and the routed ones (all of them held, top_k of them run)
        routed = 3 * hidden * experts.width
        fixed = hidden * experts.num + 3 * hidden * experts.shared
        total += experts.layers * (fixed + experts.num * routed - mlp)
        active = total - experts.layers * (experts.num - experts.top_k) * routed
        dense_largest = max(embed, hidden * inter if experts.layers < layers else 0, hidden * experts.shared)
        block = routed * experts.num
        largest = max(dense_largest, block)
        # a tensor-parallel plan splits attention, dense MLPs and shared experts; router and routed experts stay whole
        tp_params += experts.layers * (3 * hidden * experts.shared - mlp)
    return ModelSpec(total_params=total, largest_layer_params=largest, hidden_size=hidden, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                     tp_params=tp_params, active_params=active, moe_top_k=experts.top_k if block else None,
                     expert_params=block * (experts.layers if block else 0), expert_block_params=block,
                     largest_dense_params=dense_largest)


def spec_from_llama_config(config: Any) -> ModelSpec:
    """From a ``shardkit.models.LlamaConfig``."""
    moe = getattr(config, "moe", None)
    experts = None
    if moe is not None:
        experts = _Experts(moe.num_experts, moe.top_k, moe.intermediate_size,
                           max(0, config.num_layers - moe.first_dense_layers),
                           (moe.shared_intermediate_size or moe.intermediate_size) * moe.num_shared_experts)
    return _decoder_spec(config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers,
                         config.num_heads, config.num_kv_heads or config.num_heads, config.tie_embeddings,
                         experts=experts)


def _hf_experts(config: dict, where: str) -> _Experts | None:
    """A Hugging Face MoE config's experts (Mixtral's num_local_experts, Qwen2/3-MoE's num_experts and
    moe_intermediate_size, DeepSeek's n_routed_experts); None for a dense one."""
    num = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts")
    if not num:
        return None
    top_k = config.get("num_experts_per_tok")
    width = config.get("moe_intermediate_size") or config.get("intermediate_size")
    if not isinstance(top_k, int) or not isinstance(width, int) or not isinstance(num, int):
        raise ValueError(f"{where}: a mixture of experts ({num} experts) needs integer num_experts_per_tok and "
                         "moe_intermediate_size (or intermediate_size)")
    layers = config["num_hidden_layers"]
    dense = set(config.get("mlp_only_layers") or ())
    dense |= set(range(config.get("first_k_dense_replace") or 0))
    shared = config.get("shared_expert_intermediate_size") or 0
    shared += (config.get("n_shared_experts") or 0) * width
    return _Experts(num, top_k, width, layers - len({i for i in dense if 0 <= i < layers}), shared)


def spec_from_hf_config(config: str | os.PathLike | dict) -> ModelSpec:
    """From a Hugging Face decoder ``config.json`` (a path, its directory, or the dict): Llama, Mistral, Qwen2, ..."""
    where = "config"
    if not isinstance(config, dict):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        where = str(path)
        from shardkit.config.common import load_mapping

        config = load_mapping(path)  # a regular, small, UTF-8 file with no duplicate keys (ConfigError)
    need = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
    missing = [k for k in need if k not in config]
    if missing:
        raise ValueError(f"{where}: lacks {missing}; pass --params and --largest-layer-params instead")
    heads = config["num_attention_heads"]
    return _decoder_spec(config["vocab_size"], config["hidden_size"], config["intermediate_size"],
                         config["num_hidden_layers"], heads, config.get("num_key_value_heads") or heads,
                         bool(config.get("tie_word_embeddings", False)), head_dim=config.get("head_dim"),
                         experts=_hf_experts(config, where),
                         qk_norm=str(config.get("model_type", "")).startswith("qwen3"))


def spec_from_model(model: nn.Module) -> ModelSpec:
    """From a model instance: parameters counted as DeepSpeed's estimators count them (tied once; largest module)."""
    total = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "num_layers") and hasattr(cfg, "tie_embeddings"):
        shape = spec_from_llama_config(cfg)
    elif cfg is not None and hasattr(cfg, "to_dict"):
        try:
            shape = spec_from_hf_config(cfg.to_dict())
        except ValueError:
            shape = None
    else:
        shape = None
    if shape is None:
        return ModelSpec(total_params=total, largest_layer_params=largest)
    active = None if shape.active_params is None else total - (shape.total_params - shape.active_params)
    return ModelSpec(total_params=total, largest_layer_params=largest, hidden_size=shape.hidden_size,
                     num_layers=shape.num_layers, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                     intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size, tp_params=shape.tp_params,
                     active_params=active, moe_top_k=shape.moe_top_k, expert_params=min(shape.expert_params, total),
                     expert_block_params=min(shape.expert_block_params, shape.expert_params, total),
                     largest_dense_params=shape.largest_dense_params)
