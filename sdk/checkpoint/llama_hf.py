"""shardkit's Llama (dense or MoE) as the transformers architecture that computes the same function.

A shardkit Llama's parameter names are Hugging Face's ``LlamaForCausalLM`` names less the ``model.`` prefix, and its
attention is Llama's (rotate-half rotary embeddings over the whole head, grouped-query heads, no biases, RMSNorm), so
q/k need no permutation. What differs between the targets is the MLP:

* dense -> ``llama`` (``LlamaForCausalLM``);
* softmax routing, top-k weights normalised, no shared experts, every layer MoE -> ``mixtral``;
* any other softmax routing (shared experts, unnormalised top-k, dense first layers) -> ``qwen2_moe`` (no qkv bias,
  ``mlp_only_layers`` for the dense layers). Qwen2-MoE scales its shared expert by ``sigmoid(gate(x))``: the export
  writes that gate as zeros, so the factor is exactly 0.5, and the shared expert's ``down_proj`` times 2 (exact in
  binary floating point), which gives shardkit's unscaled shared experts;
* sigmoid routing -> ``glm4_moe``: DeepSeek-V3's router (the bias steers the choice only, ``routed_scaling_factor``,
  ``first_k_dense_replace``, shared experts) with Llama's attention (full rotary, no qk-norm, no bias); one expert
  group.

What no target computes exactly is refused by name (:class:`CheckpointError` naming the field and what would make it
exportable), never approximated: a capacity factor (every HF MoE is dropless), a softmax router with a bias
or a ``route_scale``, shared experts wider than the routed ones under sigmoid routing. Dropout, which acts in
training only, is left out of the config with a warning.

The mapping reads the config as ``LlamaConfig.to_dict()`` gives it (this package sits below ``shardkit.models``):
``shardkit.models.hf_export`` is its front for a model, and a checkpoint of a shardkit Llama records that dict
(:data:`MODEL_CONFIG_SUFFIX`) so that zero-to-fp32 and ``convert --to hf`` write the same export.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .expert_layout import ExpertLayout, layout_for, stacked_view
from .format import CheckpointError, naming

_log = logging.getLogger(__name__)

__all__ = ["MODEL_CONFIG_SUFFIX", "LlamaExport", "model_config_entry", "write_hf_config"]

# A checkpoint's module entry ``<key>`` of a shardkit Llama has its LlamaConfig fields in the JSON entry
# ``<key><suffix>``.
MODEL_CONFIG_SUFFIX = ".shardkit_llama_config"
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")


def model_config_entry(name: str) -> str:
    """The checkpoint entry holding the LlamaConfig fields of the module entry ``name``."""
    return f"{name}{MODEL_CONFIG_SUFFIX}"


def write_hf_config(out_dir: Path, config: dict[str, Any], dtype: torch.dtype | None = None) -> list[str]:
    """Writes ``config`` as ``out_dir/config.json``, its ``dtype`` the weights' (``from_pretrained``'s default);
    returns ``["config.json"]``."""
    path = out_dir / "config.json"
    if dtype is not None:
        config = {**config, "dtype": str(dtype).removeprefix("torch.")}
    with naming(path):
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return ["config.json"]


_COUNTS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "max_position")
_MOE_COUNTS = ("num_experts", "top_k", "intermediate_size")


def _count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _check_fields(f: dict[str, Any], moe: dict[str, Any] | None) -> None:
    """The recorded config is read from a file: every field the mapping uses is checked as LlamaConfig checks it."""
    bad = next((k for k in _COUNTS if not _count(f[k], 1)), None)
    if bad is None and not (f.get("num_kv_heads") is None or _count(f["num_kv_heads"], 1)):
        bad = "num_kv_heads"
    bad = bad or next((k for k in ("rope_theta", "rms_eps") if not _positive(f[k])), None)
    if bad is None and not isinstance(f["tie_embeddings"], bool):
        bad = "tie_embeddings"
    if bad is None and (f["hidden_size"] % f["num_heads"] or f["num_heads"] % (f.get("num_kv_heads") or 1)):
        bad = "num_heads"
    if bad is None and moe is not None:
        bad = next((f"moe.{k}" for k in _MOE_COUNTS if not _count(moe[k], 1)), None) or next(
            (f"moe.{k}" for k in ("num_shared_experts", "first_dense_layers") if not _count(moe[k], 0)), None)
        if bad is None and moe["score_func"] not in ("softmax", "sigmoid"):
            bad = "moe.score_func"
        if bad is None and not isinstance(moe["norm_topk_prob"], bool):
            bad = "moe.norm_topk_prob"
        if bad is None and not _positive(moe["route_scale"]):
            bad = "moe.route_scale"
        width = moe.get("shared_intermediate_size")
        if bad is None and not (width is None or _count(width, 1)):
            bad = "moe.shared_intermediate_size"
    if bad is not None:
        raise CheckpointError(f"a shardkit Llama config's {bad} is not a value LlamaConfig takes; the recorded config "
                              "is damaged or was edited")


def _refuse(field: str, value: Any, why: str, fix: str) -> CheckpointError:
    return CheckpointError(f"shardkit Llama -> Hugging Face: {field}={value!r} {why}; {fix}; or write shardkit's "
                           "own names (save_pretrained(..., as_transformers=False), zero-to-fp32 --shardkit-names)")


class LlamaExport:
    """The Hugging Face form of a shardkit Llama of config ``fields`` (``LlamaConfig.to_dict()``).

    ``config`` is the ``config.json`` to write, ``layout`` the on-disk expert layout of its ``model_type``,
    :meth:`tensors` the HF tensors of one shardkit tensor, :meth:`plan` a writer's keys and fetch in HF names.

    Raises:
        CheckpointError: the config has no exact transformers equivalent (naming the field and the fix).
    """

    def __init__(self, fields: dict[str, Any]) -> None:
        if not isinstance(fields, dict):
            raise CheckpointError(f"a shardkit Llama config must be a JSON object, not {type(fields).__name__}")
        self.fields = fields
        moe = fields.get("moe")
        self.moe = moe if isinstance(moe, dict) else None
        if moe is not None and self.moe is None:
            raise CheckpointError(f"a shardkit Llama config's moe must be an object or null, not {type(moe).__name__}")
        try:
            _check_fields(fields, self.moe)
            self.config = self._config()
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"a shardkit Llama config lacks or mistypes a field ({e!r}); it is not "
                                  "LlamaConfig.to_dict()'s") from None
        self.model_type = self.config["model_type"]
        self.layout: ExpertLayout | None = layout_for(self.model_type)

    # ---- config.json -------------------------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        f = self.fields
        if f.get("dropout", 0.0):
            # Dropout acts in training only: the exported model computes shardkit's eval-mode outputs exactly, so the
            # export goes ahead (refusing would cost a finished run its final save) and says what it leaves out.
            _log.warning("shardkit Llama dropout=%s is not carried into the transformers config (transformers' Llama "
                         "has no residual dropout): the exported weights and eval-mode outputs are exact; set the "
                         "dropout again if you train the exported model further", f["dropout"])
        heads, hidden = int(f["num_heads"]), int(f["hidden_size"])
        common = {
            "vocab_size": f["vocab_size"], "hidden_size": hidden, "intermediate_size": f["intermediate_size"],
            "num_hidden_layers": f["num_layers"], "num_attention_heads": heads,
            "num_key_value_heads": f.get("num_kv_heads") or heads, "head_dim": hidden // heads,
            "max_position_embeddings": f["max_position"], "rms_norm_eps": f["rms_eps"], "hidden_act": "silu",
            "tie_word_embeddings": bool(f["tie_embeddings"]), "initializer_range": f.get("init_std", 0.02),
            "attention_dropout": 0.0, "use_cache": True, "dtype": "float32",
            # transformers' defaults (1, 2) would make token 2 of a byte vocabulary a stop token
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(f["rope_theta"])},
        }
        if self.moe is None:
            return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **common, "attention_bias": False,
                    "mlp_bias": False, "pretraining_tp": 1}
        m = self.moe
        if m.get("capacity_factor") is not None:
            raise _refuse("moe.capacity_factor", m["capacity_factor"], "drops assignments over capacity; every "
                          "transformers MoE is dropless", "export a model configured with capacity_factor=None (the "
                          "weights do not change; its outputs then differ where tokens were dropped)")
        experts = {"num_experts_per_tok": m["top_k"], "moe_intermediate_size": m["intermediate_size"],
                   "norm_topk_prob": bool(m["norm_topk_prob"]), "output_router_logits": False,
                   "router_aux_loss_coef": m.get("aux_loss_coef", 0.0)}
        if m["score_func"] == "sigmoid":
            return self._glm4_moe(common, experts)
        if m.get("bias_update_rate", 0.0):
            raise _refuse("moe.bias_update_rate", m["bias_update_rate"], "moves a routing bias under softmax scores, "
                          "which no transformers architecture computes", "use score_func='sigmoid' (exported as "
                          "GLM4-MoE, whose router takes the bias) or bias_update_rate=0")
        if m["route_scale"] != 1:
            raise _refuse("moe.route_scale", m["route_scale"], "scales softmax routing weights, which no transformers "
                          "softmax router does", "use route_scale=1.0, or score_func='sigmoid' (GLM4-MoE's "
                          "routed_scaling_factor)")
        shared = m["num_shared_experts"] * (m.get("shared_intermediate_size") or m["intermediate_size"])
        if not shared and not m["first_dense_layers"] and m["norm_topk_prob"]:
            experts.pop("norm_topk_prob")  # Mixtral always normalises
            experts.pop("moe_intermediate_size")
            return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], **common,
                    "intermediate_size": m["intermediate_size"], "num_local_experts": m["num_experts"],
                    **experts, "sliding_window": None}
        return {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], **common,
                "num_experts": m["num_experts"], **experts, "shared_expert_intermediate_size": shared,
                "decoder_sparse_step": 1, "mlp_only_layers": list(range(min(m["first_dense_layers"],
                                                                                f["num_layers"]))),
                "qkv_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 0}

    def _glm4_moe(self, common: dict[str, Any], experts: dict[str, Any]) -> dict[str, Any]:
        m = self.moe
        if m["num_experts"] < 2:
            raise _refuse("moe.num_experts", m["num_experts"], "is below 2: GLM4-MoE's router ranks its one expert "
                          "group by its top two scores", "use num_experts >= 2")
        width = m.get("shared_intermediate_size")
        if m["num_shared_experts"] and width not in (None, m["intermediate_size"]):
            raise _refuse("moe.shared_intermediate_size", width, f"differs from intermediate_size "
                          f"({m['intermediate_size']}): GLM4-MoE's shared experts are num_shared_experts routed "
                          "experts wide", "use shared_intermediate_size=None, or a multiple of intermediate_size "
                          "through num_shared_experts")
        rope = {**common["rope_parameters"], "partial_rotary_factor": 1.0}
        return {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], **common, "rope_parameters": rope,
                "n_routed_experts": m["num_experts"], **experts, "n_shared_experts": m["num_shared_experts"],
                "routed_scaling_factor": float(m["route_scale"]), "n_group": 1, "topk_group": 1,
                "first_k_dense_replace": m["first_dense_layers"], "attention_bias": False, "use_qk_norm": False,
                "num_nextn_predict_layers": 0}

    # ---- tensors -----------------------------------------------------------------------------------------------

    def _moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe["first_dense_layers"]

    def _names(self, name: str) -> list[tuple[str, str]]:
        """(HF name, how) for the shardkit tensor ``name``; how: "" copy, "x2" doubled, "zero" must be all zeros and
        is dropped; written beside it from its last dimension (the hidden size): "gate" Qwen2-MoE's zero shared-expert
        gate, "rows0"/"cols0" a zero-width shared expert's weights."""
        if name == "lm_head.weight":
            return [(name, "")]
        m = _LAYER.match(name)
        if m is None or not self._moe_layer(int(m.group(1))):
            return [(f"model.{name}", "")]
        layer, rest = m.group(1), m.group(2)
        base = f"model.layers.{layer}."
        if rest == "mlp.router.weight":
            out = [(base + "mlp.gate.weight", "")]
            if not self.moe["num_shared_experts"] and self.model_type in ("qwen2_moe", "glm4_moe"):
                # both build a shared expert whatever its width: a zero-width one adds exactly 0, written so that
                # the files hold every tensor the model has
                shared = "mlp.shared_expert." if self.model_type == "qwen2_moe" else "mlp.shared_experts."
                out += [(base + shared + "gate_proj.weight", "rows0"), (base + shared + "up_proj.weight", "rows0"),
                        (base + shared + "down_proj.weight", "cols0")]
                if self.model_type == "qwen2_moe":
                    out.append((base + "mlp.shared_expert_gate.weight", "gate"))
            return out
        if rest == "mlp.router.expert_bias":
            if self.model_type == "glm4_moe":
                return [(base + "mlp.gate.e_score_correction_bias", "")]
            return [(base + "mlp.gate.e_score_correction_bias", "zero")]
        if rest.startswith("mlp.shared_experts.") and self.model_type == "qwen2_moe":
            proj = rest.removeprefix("mlp.shared_experts.")
            out = [(base + "mlp.shared_expert." + proj, "x2" if proj == "down_proj.weight" else "")]
            if proj == "gate_proj.weight":
                out.append((base + "mlp.shared_expert_gate.weight", "gate"))
            return out
        return [(base + rest, "")]

    def keeps_fp32(self, name: str) -> bool:
        """Whether the tensor ``name`` (shardkit's or HF's) stays fp32 in a 16-bit export: the routing bias, which
        shardkit holds in fp32 and transformers loads in fp32 (a bf16 copy would move the choices near a tie)."""
        return name.endswith(("router.expert_bias", "gate.e_score_correction_bias"))

    def hf_name(self, name: str) -> str:
        """The transformers (in-memory) name of shardkit's tensor ``name``."""
        return self._names(name)[0][0]

    def specs(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, tuple, torch.dtype]]:
        """(HF name, shape, dtype) of what :meth:`tensors` gives for a tensor of ``shape``."""
        out = []
        for hf, how in self._names(name):
            if how == "zero":
                continue
            shapes = {"gate": (1, shape[-1]), "rows0": (0, shape[-1]), "cols0": (shape[-1], 0)}
            out.append((hf, shapes.get(how, tuple(shape)), dtype))
        return out

    def tensors(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The HF tensors of shardkit's ``name``: renamed, and transformed where the target needs it (see the
        module docstring).

        Raises:
            CheckpointError: a softmax router's bias is not all zeros (it would steer a choice HF does not make).
        """
        out = []
        for hf, how in self._names(name):
            if how == "zero":
                if bool(tensor.detach().ne(0).any()):
                    raise _refuse(name, "non-zero", "is a routing bias under softmax scores, which no transformers "
                                  "architecture computes", "train with score_func='sigmoid' (GLM4-MoE), or without "
                                  "the bias (bias_update_rate=0)")
                continue
            if how == "x2":
                out.append((hf, tensor * 2))
            elif how in ("gate", "rows0", "cols0"):
                hidden = tensor.shape[-1]
                shape = {"gate": (1, hidden), "rows0": (0, hidden), "cols0": (hidden, 0)}[how]
                out.append((hf, tensor.new_zeros(shape)))
            else:
                out.append((hf, tensor))
        return out

    def on_disk(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The files' tensors for shardkit's ``name``: :meth:`tensors`, with stacked experts one per expert."""
        for hf, t in self.tensors(name, tensor):
            yield from (self.layout.split(hf, t) if self.layout is not None else [(hf, t)])

    def aliases(self, tied: dict[str, str], on_disk: bool = True) -> dict[str, str]:
        """``tied`` (alias -> kept, shardkit names) in the files' names (``on_disk``) or the in-memory HF ones."""
        def hf(name: str) -> str:
            out = self.hf_name(name)
            return self.layout.rename(out) if on_disk and self.layout is not None else out

        return {hf(a): hf(k) for a, k in tied.items()}

    def plan(self, keys: dict[str, tuple[tuple[int, ...], torch.dtype]], fetch: Callable[[str], torch.Tensor],
             ) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Callable[[str], torch.Tensor]]:
        """A writer's ``keys`` (shardkit name -> (shape, dtype)) and ``fetch`` in HF names (stacked experts; split
        them with :func:`.expert_layout.export_plan`). Each source tensor is read once for the HF tensors it gives."""
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        source: dict[str, str] = {}
        for name, (shape, dtype) in keys.items():
            for hf, hf_shape, hf_dtype in self.specs(name, tuple(shape), dtype):
                out[hf] = (hf_shape, hf_dtype)
                source[hf] = name
            if not self.specs(name, tuple(shape), dtype):  # a dropped softmax bias: still checked to be zeros
                self.tensors(name, fetch(name))
        last: dict[str, dict[str, torch.Tensor]] = {}

        def fetch_hf(hf: str) -> torch.Tensor:
            name = source[hf]
            if name not in last:
                last.clear()
                last[name] = dict(self.tensors(name, fetch(name)))
            return last[name][hf]

        return out, fetch_hf


    # ---- reading an export back ----------------------------------------------------------------------------------

    def files_view(self, weights: Any, model_keys: dict[str, tuple[int, ...]]) -> Any:
        """``weights`` (an :class:`~.hf_reader.HFWeights`) as a shardkit Llama holding ``model_keys`` (name ->
        shape) reads it: the files' HF names (per-expert or stacked) answer as shardkit's, with this export's
        transforms undone. ``weights`` itself when the files hold shardkit's names (an older export).

        Raises:
            CheckpointError: a tensor the export writes as a constant (Qwen2-MoE's shared-expert gate) is not that
                constant any more (the model was trained as Qwen2-MoE since): shardkit's Llama cannot hold it.
        """
        if not any(k.startswith("model.") for k in weights.weight_map):
            return weights
        hf_keys: dict[str, tuple[int, ...]] = {}
        for name, shape in model_keys.items():
            for hf, hf_shape, _ in self.specs(name, tuple(shape), torch.float32):
                hf_keys[hf] = hf_shape
        return _ShardkitView(self, stacked_view(weights, hf_keys), model_keys)


class _ShardkitView:
    """HF files of an exported shardkit Llama, answering under shardkit's names (see :meth:`LlamaExport.files_view`)."""

    def __init__(self, export: LlamaExport, weights: Any, model_keys: dict[str, tuple[int, ...]]) -> None:
        self._export = export
        self._weights = weights
        self.path = weights.path
        self._source: dict[str, tuple[str, str]] = {}  # shardkit name -> (HF name, how)
        self._zeros: dict[str, tuple[int, ...]] = {}  # a dropped softmax bias: zeros by definition
        written: set[str] = set()
        have = weights.weight_map
        for name, shape in model_keys.items():
            for hf, how in export._names(name):
                written.add(hf)
                if how == "zero":
                    self._zeros[name] = tuple(shape)
                elif how in ("", "x2") and hf in have:
                    self._source[name] = (hf, how)
                elif how and hf in have:
                    self._check_constant(hf, how)
        self.weight_map = {**{k: v for k, v in have.items() if k not in written},
                           **{n: have[hf] for n, (hf, _) in self._source.items()},
                           **{n: "(zeros)" for n in self._zeros}}

    def _check_constant(self, hf: str, how: str) -> None:
        t = self._weights.get(hf)
        if how == "gate" and bool(t.ne(0).any()):
            raise CheckpointError(f"{self._weights.file_path(hf)}: {hf} is not all zeros: this Qwen2-MoE gates its "
                                  "shared expert by input, which shardkit's Llama does not (it was trained as "
                                  "Qwen2-MoE after the export); load it as a transformers model instead")
        if how in ("rows0", "cols0") and t.numel():
            raise CheckpointError(f"{self._weights.file_path(hf)}: {hf} has shape {list(t.shape)}; the model has no "
                                  "shared experts")

    def file_path(self, key: str) -> Any:
        return self.path if key in self._zeros else self._weights.file_path(self._source[key][0]) \
            if key in self._source else self._weights.file_path(key)

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self._zeros:
            return self._zeros[key]
        return self._weights.shape(self._source[key][0] if key in self._source else key)

    def dtype(self, key: str) -> torch.dtype:
        if key in self._zeros:
            return torch.float32
        return self._weights.dtype(self._source[key][0] if key in self._source else key)

    def get(self, key: str) -> torch.Tensor:
        if key in self._zeros:
            return torch.zeros(self._zeros[key])
        if key not in self._source:
            return self._weights.get(key)
        hf, how = self._source[key]
        t = self._weights.get(hf)
        return t / 2 if how == "x2" else t

    def read_flat(self, key: str, start: int, count: int) -> torch.Tensor:
        if key in self._zeros or self._source.get(key, ("", ""))[1] == "x2":
            return self.get(key).reshape(-1)[start:start + count].clone()
        return self._weights.read_flat(self._source[key][0] if key in self._source else key, start, count)
