"""save_model: the full weights in Hugging Face's format, streamed from whatever strategy shards them.

The main process receives one module at a time (``Runner.iter_full_state_dict``) and writes safetensors
shards as they arrive (``shardkit.checkpoint.hf.save_pretrained``): no rank ever holds the whole model, under
ZeRO-3 and FSDP as on one process. An HF model's ``config.json``, the processing class and
``training_args.json`` are written beside the weights, every file with a plain file's permissions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["save_full_model"]


def save_full_model(runner, model, output_dir: str | Path, processing_class: Any = None, args: Any = None,
                    data_collator: Any = None) -> None:
    """Write ``output_dir`` with the model's full weights (``model.safetensors``, or shards + index), its config,
    the processing_class and training_args.json. Call on every rank."""
    from shardkit.checkpoint.hf import save_pretrained
    from shardkit.trainer.hf_checkpoint import public_permissions, save_processing_class

    out = Path(output_dir)
    written = save_pretrained(runner, out, model)
    if runner.is_main_process:
        save_processing_class(out, processing_class, data_collator)
        if args is not None:
            (out / "training_args.json").write_text(args.to_json_string() + "\n")
        public_permissions(out, [p.name for p in written] + [p.name for p in out.iterdir()
                                                              if p.suffix in (".json", ".txt", ".model")])
    runner.barrier("trainer-save-model")
