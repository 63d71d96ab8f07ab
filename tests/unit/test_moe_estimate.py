"""estimate-memory's all-to-all buffers under expert parallelism are in the run's activation dtype."""

from __future__ import annotations

import json

import pytest

from shardkit.cli import main as cli_main

# Qwen3-30B-A3B's shape: hidden 2048, top-8 of 128 experts
CONFIG = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
              num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
              num_experts_per_tok=8, moe_intermediate_size=768, tie_word_embeddings=False)


@pytest.mark.parametrize("precision, gib, size", [("fp32", "1.50", "4 bytes (float32)"),
                                                  ("bf16", "0.75", "2 bytes (bfloat16)"),
                                                  ("bf16-true", "0.75", "2 bytes (bfloat16)"),
                                                  ("fp16", "0.75", "2 bytes (float16)")])
def test_all_to_all_buffers_take_the_runs_activation_dtype(tmp_path, capsys, precision, gib, size):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert cli_main(["estimate-memory", "--config", str(tmp_path / "config.json"), "--num-gpus", "8",
                     "--strategy", "ep", "--batch-size", "4", "--seq-len", "3072", "--precision", precision]) == 0
    # 2 (dispatch + combine) x 12288 tokens x top_k 8 x hidden 2048 x the activation dtype's bytes
    assert (f"All-to-all buffers per rank under ep 8 (dispatch + combine, one MoE layer in flight, balanced routing): "
            f"{gib} GiB = 2 x 12288 tokens x top_k 8 x hidden 2048 x {size}") in capsys.readouterr().out
