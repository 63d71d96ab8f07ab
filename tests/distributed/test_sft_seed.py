"""The FSDP seed's SFT command line (PEFT's examples/sft flow, /work/shared/seeds/002_*) through `shardkit launch
--config_file fsdp_config.yaml` on 2 CPU processes, with LoRA and with 4-bit QLoRA, on a tiny local model.

Changed from the seed, and why: the launcher's name; `--eval_strategy` for `--evaluation_strategy` and
`--warmup_steps 0` for `--warmup_ratio 0.0` (transformers 5 removed both old names); no `--push_to_hub
--hub_private_repo --hub_strategy` (nothing reaches the Hub from a test); sizes (`--max_seq_len 128`, batch 2,
accumulation 2) scaled to a 40-conversation set so that a 2-rank epoch has steps.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("datasets")
pytest.importorskip("bitsandbytes")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sft.py"

# The seed's fsdp_config.yaml, with num_processes 8 -> 2, as shipped for examples/sft.py.
FSDP_CONFIG = ROOT / "examples" / "configs" / "sft_fsdp.yaml"

SEED_FLAGS = """--seed 100 --model_name_or_path {model} --dataset_name {model}/chat --chat_template_format chatml
--add_special_tokens False --append_concat_token False --splits train,test --max_seq_len 128 --num_train_epochs 1
--logging_steps 1 --log_level info --logging_strategy steps --eval_strategy epoch --save_strategy epoch --bf16 True
--packing True --learning_rate 1e-4 --lr_scheduler_type cosine --weight_decay 1e-4 --warmup_steps 0
--max_grad_norm 1.0 --output_dir {out} --per_device_train_batch_size 2 --per_device_eval_batch_size 2
--gradient_accumulation_steps 2 --gradient_checkpointing True --use_reentrant {reentrant} --dataset_text_field content
--use_flash_attn True --use_peft_lora True --lora_r 8 --lora_alpha 16 --lora_dropout 0.1
--lora_target_modules all-linear"""
LORA = "--use_4bit_quantization False"
QLORA = ("--use_4bit_quantization True --use_nested_quant True --bnb_4bit_compute_dtype bfloat16 "
         "--bnb_4bit_quant_storage_dtype bfloat16")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed")
    subprocess.run([sys.executable, str(EXAMPLE), "--make_tiny", str(root / "tiny")], check=True, cwd=ROOT,
                   capture_output=True, timeout=300)
    return root


def _launch(root: Path, name: str, extra: str, reentrant: str) -> subprocess.CompletedProcess:
    flags = SEED_FLAGS.format(model=root / "tiny", out=root / name, reentrant=reentrant).split() + extra.split()
    command = [sys.executable, "-m", "shardkit.cli", "launch", "--config_file", str(FSDP_CONFIG),
               str(EXAMPLE), *flags]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "SHARDKIT_COLLECTIVE_TIMEOUT": "120"})


@pytest.mark.parametrize("name,extra,reentrant", [("lora", LORA, "False"), ("qlora", QLORA, "True")])
def test_seed_sft_command_line_trains_lora_under_fsdp(tiny, name, extra, reentrant):
    from safetensors.torch import load_file

    run = _launch(tiny, name, extra, reentrant)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    out = tiny / name
    adapters = load_file(str(out / "adapter_model.safetensors"))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16
    lora_b = [t for k, t in adapters.items() if "lora_B" in k]
    assert len(lora_b) == 2 * 7  # all-linear: q, k, v, o, gate, up, down in each of 2 blocks
    assert all(torch.count_nonzero(t) > 0 for t in lora_b)  # lora_B starts at zero: every adapter trained
    assert "trainable params" in run.stdout  # trainer.model.print_trainable_parameters()
