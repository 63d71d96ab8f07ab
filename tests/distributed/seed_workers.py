"""Worker for test_seed_configs.py (top level so the spawned rank imports it): the DeepSpeed seed's configs, as the
page writes them, through shardkit's Trainer with default TrainingArguments on a tiny Llama; after the ZeRO-3 run the
page's fp32 snippets (load_state_dict_from_zero_checkpoint, zero_to_fp32.py inside checkpoint-N) as it writes them."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from safetensors.torch import load_file
from trainer_fixtures import logged_losses, text_data

from shardkit.models.llama import Llama, LlamaConfig
from shardkit.observability import flops_per_token
from shardkit.trainer import Trainer, TrainingArguments

TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16)
PEAK = 123.0  # TrainingArguments(peak_tflops=...) for the ZeRO-3 run: the peak its mfu divides by


def seed_config_worker(configs: list[str], output_dir: str) -> dict:
    """Train 4 steps under each config (no warmup, as TrainingArguments defaults); each one's logged losses, and for
    the ZeRO-3 config what the page's fp32 snippets and the throughput meter gave."""
    out = {}
    for path in configs:
        torch.manual_seed(0)
        zero3 = path.endswith("zero3.json")
        args = TrainingArguments(output_dir=f"{output_dir}/{len(out)}", deepspeed=path, max_steps=4,
                                 per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
                                 report_to="none", save_strategy="steps" if zero3 else "no", save_steps=4,
                                 disable_tqdm=True, peak_tflops=PEAK if zero3 else None)
        trainer = Trainer(model=Llama(TINY), args=args, train_dataset=text_data(8))
        trainer.train()
        out[path] = logged_losses(trainer)
        if zero3:
            out["zero3"] = _fp32_snippets(trainer)
    return out


def _fp32_snippets(trainer: Trainer) -> dict:
    """The DeepSpeed page's "fp32 weights" snippets after a ZeRO-3 run (imports changed only), and the checks."""
    runner, model = trainer.runner, trainer.model
    ids = torch.stack([text_data(8)[i]["input_ids"] for i in range(2)])
    with torch.no_grad():
        loss_before = float(model(ids, labels=ids))
    with runner.gathered_parameters(list(model.parameters()), modifier_rank=0) as whole:  # scramble every weight
        for p in whole:
            p.data.fill_(0.5)

    from transformers.trainer_utils import get_last_checkpoint

    from shardkit.checkpoint.zero_to_fp32 import load_state_dict_from_zero_checkpoint

    checkpoint_dir = get_last_checkpoint(trainer.args.output_dir)
    fp32_model = load_state_dict_from_zero_checkpoint(trainer.model, checkpoint_dir)

    with torch.no_grad():
        loss_after = float(fp32_model(ids, labels=ids))  # still partitioned, still usable
    names = [n for n, _ in model.named_parameters()]
    with runner.gathered_parameters(list(model.parameters())) as whole:
        loaded = {n: p.detach().clone() for n, p in zip(names, whole)}
    # `cd checkpoint-N; python zero_to_fp32.py . pytorch_model.bin`, the script the checkpoint carries
    script = subprocess.run([sys.executable, "zero_to_fp32.py", ".", "pytorch_model.bin"], cwd=checkpoint_dir,
                            capture_output=True, text=True, timeout=600)
    exported = (load_file(os.path.join(checkpoint_dir, "pytorch_model.bin", "model.safetensors"))
                if script.returncode == 0 else {})
    seq = ids.shape[1]
    hf_name = runner.unwrap_model(model).hf_export().hf_name  # the export is transformers' LlamaForCausalLM
    return {"checkpoint": os.path.basename(checkpoint_dir), "same_model": fp32_model is model,
            "loss_before": loss_before, "loss_after": loss_after,
            "script": (script.returncode, script.stderr[-2000:]), "loaded_equals_export": sorted(exported) == sorted(
                map(hf_name, loaded)) and all(torch.equal(exported[hf_name(n)], loaded[n]) for n in loaded),
            "flops": runner.throughput.flops(seq).model, "single_device_flops": flops_per_token(Llama(TINY), seq).model,
            "peak": runner.throughput.peak}
