"""transformers knows what shardkit runs (issue 23): on 2 CPU ranks, Hugging Face's own ``model.generate`` under
FSDP, ZeRO-3 and ZeROInfinity syncs the ranks by itself (different prompts and max_new_tokens per rank; it hung
under ZeRO-3) and equals the unsharded model's tokens, TensorParallel takes an HF model's own plan when given none,
and ``from_pretrained`` inside a ZeRO-3 run holds about 1/world of the parameters on each rank at its peak."""

from __future__ import annotations

import hf_link_workers as w
import pytest
import torch
from harness import run_distributed

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")


def test_hf_generate_syncs_ranks_by_itself_under_sharding_strategies():
    # FSDP and TP first: no ZeRO-3 registration may help them. TP is given no plan: the HF Llama's own is used.
    names = ["fsdp", "tp", "zero3", "zero_infinity"]
    results = run_distributed(w.hf_generate_worker, world_size=2, args=(names,), timeout=600)
    for rank, res in enumerate(results):
        for name in names:
            got, want = res[name]["got"], res[name]["want"]
            assert got.shape == want.shape and torch.equal(got, want), (
                f"rank {rank} under {name}: {got.tolist()} != the unsharded model's {want.tolist()}")
        assert res["fsdp"]["zero3_seen"] is False
        assert res["tp"]["q_local_shape"] == (16, 32)  # q_proj split on its output features (32 -> 16 per rank)
        assert res["zero3"]["zero3_seen"] and res["zero_infinity"]["zero3_seen"]
        assert res["zero3_seen_after_teardown"] is False  # deregistered at teardown
    assert results[0]["zero3"]["got"].shape == (2, 11) and results[1]["zero3"]["got"].shape == (1, 6)


def test_from_pretrained_inside_zero3_loads_each_ranks_partition_only(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    results = run_distributed(w.from_pretrained_worker, world_size=2, args=(str(tmp_path),), timeout=600)
    for rank, res in enumerate(results):
        assert res["partitioned"] and res["equal"], res
        # each rank's partitions: half the model (DeepSpeed pads each partition to the world size)
        assert 0.45 * res["whole"] <= res["held"] <= 0.55 * res["whole"], (rank, res)
        # the peak adds one module's parameters gathered while it loads (the largest: the 256x64 embedding)
        assert res["peak"] <= 0.62 * res["whole"], (rank, res)
