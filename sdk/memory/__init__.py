"""Memory planning: per-device estimates of model states, activations and DeepSpeed's ZeRO tables.

    from shardkit.memory import spec_from_hf_config, estimate_model_states, recommend
    spec = spec_from_hf_config("path/to/config.json")
    estimate_model_states(spec, "zero3", num_gpus_per_node=8).device_total
    recommend(spec, 80 * 2**30, num_gpus_per_node=8, batch_size=4, seq_len=4096)

``shardkit estimate-memory`` is the command-line form.
"""

from .estimate import (
    LAYOUTS,
    Layout,
    ModelStates,
    activation_bytes,
    deepspeed_table,
    estimate_model_states,
    find_layout,
    recommend,
    zero2_mem_needs,
    zero3_mem_needs,
)
from .model_spec import ModelSpec, parse_count, spec_from_hf_config, spec_from_llama_config, spec_from_model

__all__ = [
    "LAYOUTS",
    "Layout",
    "ModelSpec",
    "ModelStates",
    "activation_bytes",
    "deepspeed_table",
    "estimate_model_states",
    "find_layout",
    "parse_count",
    "recommend",
    "spec_from_hf_config",
    "spec_from_llama_config",
    "spec_from_model",
    "zero2_mem_needs",
    "zero3_mem_needs",
]
