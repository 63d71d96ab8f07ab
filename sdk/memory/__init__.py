"""Memory planning: per-device estimates of model states, activations and DeepSpeed's ZeRO tables.

    from shardkit.memory import spec_from_hf_config, estimate_model_states, recommend
    spec = spec_from_hf_config("path/to/config.json")
    estimate_model_states(spec, "zero3", num_gpus_per_node=8).device_total
    recommend(spec, 80 * 2**30, num_gpus_per_node=8, batch_size=4, seq_len=4096)

``shardkit estimate-memory`` is the command-line form.
"""

from shardkit.utils.lazy import lazy_exports

__all__ = [
    "LAYOUTS",
    "Layout",
    "ModelSpec",
    "ModelStates",
    "activation_bytes",
    "activation_dtype",
    "all_to_all_bytes",
    "deepspeed_table",
    "estimate_model_states",
    "find_layout",
    "layouts",
    "listed_layouts",
    "memory_job",
    "parse_count",
    "recommend",
    "spec_from_hf_config",
    "spec_from_llama_config",
    "spec_from_model",
    "zero2_mem_needs",
    "zero3_mem_needs",
]

# NOTE: each name imports its module on first use, so that `shardkit <command> --help` does not import torch
# (see shardkit.utils.lazy).
_EXPORTS = {
    "LAYOUTS": "estimate", "Layout": "estimate", "layouts": "estimate", "listed_layouts": "estimate",
    "ModelStates": "estimate", "activation_bytes": "estimate", "activation_dtype": "estimate",
    "all_to_all_bytes": "estimate", "memory_job": "estimate",
    "deepspeed_table": "estimate", "estimate_model_states": "estimate", "find_layout": "estimate", "recommend":
    "estimate", "zero2_mem_needs": "estimate", "zero3_mem_needs": "estimate",
    "ModelSpec": "model_spec", "parse_count": "model_spec", "spec_from_hf_config": "model_spec",
    "spec_from_llama_config": "model_spec", "spec_from_model": "model_spec",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
