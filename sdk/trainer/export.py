"""save_model: the full weights, gathered from whatever strategy shards them, in a format loaders read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = ["full_state_dict", "save_full_model"]


def full_state_dict(runner, model) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of ``model``'s state dict; a collective: call it on every rank."""
    module = runner.unwrap_model(model)
    out = {}
    # ZeRO-3 partitions parameters outside this context; FSDP2 holds DTensors (full_tensor gathers).
    with runner.gathered_parameters(list(module.parameters())):
        for key, value in module.state_dict().items():
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            out[key] = value.detach().cpu().clone()
    return out


def save_full_model(runner, model, output_dir: str | Path, processing_class: Any = None, args: Any = None) -> None:
    """Write ``output_dir`` with the model's full weights (HF ``save_pretrained`` for PreTrainedModels,
    ``model.safetensors`` otherwise), the processing_class, and training_args.json."""
    state = full_state_dict(runner, model)
    out = Path(output_dir)
    if runner.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        module = runner.unwrap_model(model)
        if hasattr(module, "save_pretrained"):
            module.save_pretrained(out, state_dict=state, safe_serialization=True)
        else:
            # safetensors refuses tensors that share storage (tied embeddings): save one copy of each.
            seen: dict[int, str] = {}
            unique = {}
            for key, value in state.items():
                ptr = value.untyped_storage().data_ptr()
                if ptr in seen:
                    continue
                seen[ptr] = key
                unique[key] = value.contiguous()
            save_file(unique, str(out / "model.safetensors"), metadata={"format": "pt"})
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(out)
        if args is not None:
            (out / "training_args.json").write_text(args.to_json_string() + "\n")
    runner.barrier("trainer-save-model")
