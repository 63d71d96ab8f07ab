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


# A small Mixtral: 2 MoE layers of 8 experts (width 128, top-2), hidden 64, 4 heads of 16 (2 kv), vocabulary 1000.
#   attention per layer 64*4*16*2 + 64*2*16*2 = 12288; norms 2*64; router 64*8 = 512
#   routed experts per layer 8 * 3*64*128 = 196608 (E = 393216 for both); embedding and head 2 * 64000; final norm 64
#   total 128000 + 2 * (12288 + 128 + 512 + 196608) + 64 = 547136; dense D = 153920, of it tp splits 2 * 12288
SMALL = dict(model_type="mixtral", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
             tie_word_embeddings=False)


def _small_job(strategy, ranks=8, **sizes):
    from shardkit.memory import memory_job, spec_from_hf_config

    # fp32 on torch engines: 4 bytes of parameter, 4 of gradient, 8 of Adam states per parameter
    return memory_job(spec_from_hf_config(SMALL), strategy, num_gpus_per_node=ranks, precision="fp32", **sizes)


def test_small_moe_spec_counts_its_experts_apart():
    from shardkit.memory import spec_from_hf_config

    spec = spec_from_hf_config(SMALL)
    assert (spec.total_params, spec.expert_params, spec.expert_block_params) == (547136, 393216, 196608)
    assert spec.tp_params == 24576 and spec.largest_dense_params == 64000 and spec.largest_layer_params == 196608
    assert spec.active_params == 547136 - 2 * 6 * 24576  # 6 of the 8 experts idle per token


def _bytes(held):
    return held.params, held.grads, held.optimizer, held.working


@pytest.mark.parametrize("layout, expected", [
    # ep 8 on 8 ranks: experts 393216/8, dense 153920/8 -> 68392 parameters a rank; the embedding gathered (64000);
    # each ep rank holds its experts whole (no replicas to gather them over)
    ("ep 8", (273568, 273568, 547136, 256000)),
    # ep 2 on dp 8, experts FSDP2-sharded over their 4 replicas: the same 1/8 of everything; one layer's ep slice
    # (196608 / 2) gathered on top of the embedding
    ("ep 2 full", (273568, 273568, 547136, 256000 + 98304 * 4)),
    # ep 2 on dp 8, each ep slice whole: experts 393216/2 = 196608 a rank, dense 153920/8 = 19240
    ("ep 2 none", ((196608 + 19240) * 4, (196608 + 19240) * 4, (196608 + 19240) * 8, 256000)),
    # HSDP: dp_replicate 2 x dp_shard 4, ep 2 from dp_shard: dense and experts 1/4 each
    ("hsdp 2 ep 2", (547136, 547136, 2 * 547136, 256000 + 98304 * 4)),
    # ep 2 x tp 2 on 8: dense per tp rank 24576/2 + 129344 = 141632, sharded over dp_shard 4 -> 35408; experts from
    # dp_shard x tp = 8 ranks -> 49152; the embedding's tp half gathered (32000) and one layer's ep slice (98304)
    ("ep 2 x tp 2", ((35408 + 49152) * 4, (35408 + 49152) * 4, (35408 + 49152) * 8, (32000 + 98304) * 4)),
    # ep 4 x tp 2 with TP inside the experts: ep borrowed from dp_shard 4 only, each tp peer holding its half of its
    # ep slice (393216 / 4 / 2 = 49152), nothing of it gathered; the dense part as under ep 2 x tp 2
    ("ep 4 x etp 2", ((35408 + 49152) * 4, (35408 + 49152) * 4, (35408 + 49152) * 8, 32000 * 4)),
    # ep 2 x tp 2 inside the experts, each ep slice held by 2 replicas ("none"): 393216 / 2 / 2 = 98304 a rank
    ("ep 2 x etp 2 none", ((35408 + 98304) * 4, (35408 + 98304) * 4, (35408 + 98304) * 8, 32000 * 4)),
])
def test_expert_parallel_model_states_equal_a_hand_computation(layout, expected):
    from shardkit.strategies import ExpertParallel

    strategy = {"ep 8": ExpertParallel(ep_size=8), "ep 2 full": ExpertParallel(ep_size=2),
                "ep 2 none": ExpertParallel(ep_size=2, expert_sharding="none"),
                "hsdp 2 ep 2": ExpertParallel(ep_size=2, dp_replicate=2),
                "ep 2 x tp 2": ExpertParallel(ep_size=2, tp_size=2),
                "ep 4 x etp 2": ExpertParallel(ep_size=4, tp_size=2, expert_tp=True),
                "ep 2 x etp 2 none": ExpertParallel(ep_size=2, tp_size=2, expert_tp=True,
                                                    expert_sharding="none")}[layout]
    assert _bytes(strategy.model_state_memory(_small_job(strategy))) == expected


def test_pipeline_with_expert_parallel_model_states_equal_a_hand_computation():
    from shardkit.strategies import Pipeline

    strategy = Pipeline(pp_size=2, dp="fsdp", ep_size=2)
    # a stage holds half the model (273568), sharded over its dp_shard 4: 68392 a rank. Its units stay gathered through
    # the step: the stage's dense half (76960) less this rank's quarter, and the experts' ep slice (196608 / 2) less
    # this rank's half of it (the 2 ranks holding the same slice shard it)
    working = (76960 - 19240) * 4 + (98304 - 49152) * 4
    assert _bytes(strategy.model_state_memory(_small_job(strategy))) == (273568, 273568, 547136, working)
    # ep 4 = dp_shard: the slices are held whole, nothing of them gathered
    whole = Pipeline(pp_size=2, dp="fsdp", ep_size=4)
    assert whole.model_state_memory(_small_job(whole)).working == (76960 - 19240) * 4


def test_tensor_parallel_keeps_the_routed_experts_whole():
    from shardkit.strategies import TensorParallel

    strategy = TensorParallel(tp_size=2)
    # attention split (24576 / 2), router, norms, embeddings and every routed expert whole on each tp rank
    held = strategy.model_state_memory(_small_job(strategy, ranks=2))
    assert held.params == (547136 - 12288) * 4


def test_estimate_row_takes_the_cli_sizes(tmp_path):
    from shardkit.memory import estimate_model_states, spec_from_hf_config

    spec = spec_from_hf_config(SMALL)
    row = estimate_model_states(spec, "ep", num_gpus_per_node=8, precision="fp32", ep_size=2, tp_size=2)
    assert (row.params, row.working) == ((35408 + 49152) * 4, (32000 + 98304) * 4)
    with pytest.raises(ValueError, match=r"ep\(3\) does not divide the 8 ranks"):
        estimate_model_states(spec, "ep", num_gpus_per_node=8, ep_size=3)


def test_all_to_all_buffers_under_ep_with_tp_equal_a_hand_computation(tmp_path, capsys):
    from shardkit.memory import all_to_all_bytes, spec_from_hf_config

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    spec = spec_from_hf_config(tmp_path / "config.json")
    # 16384 tokens x top-8 = 131072 assignments; a tp rank of 2 sends and receives back its 65536, and receives every
    # peer's 65536 outputs in the all-gather: (2 + 2) x 65536 x 2048 x 2 bytes = 1 GiB; under tp 4: (2 + 4) x 32768
    assert all_to_all_bytes(spec, 4, 4096, ep_size=2, tp_size=2) == 4 * 65536 * 2048 * 2 == 2**30
    assert all_to_all_bytes(spec, 4, 4096, ep_size=4, tp_size=4) == 6 * 32768 * 2048 * 2
    assert cli_main(["estimate-memory", "--config", str(tmp_path / "config.json"), "--num-gpus", "8", "--strategy",
                     "ep", "--batch-size", "4", "--seq-len", "4096", "--ep-size", "4", "--tp-size", "4"]) == 0
    assert ("under ep 4 x tp 4 (dispatch + combine, one MoE layer in flight, balanced routing): 0.75 GiB = (2 + 4) x "
            "32768 assignments") in capsys.readouterr().out


def test_ep_with_cp_and_tp_gives_the_layouts_figure(tmp_path, capsys):
    from shardkit.memory import memory_job, spec_from_hf_config
    from shardkit.strategies import ExpertParallel

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    args = ["estimate-memory", "--config", str(tmp_path / "config.json"), "--num-gpus", "8", "--strategy", "ep",
            "--batch-size", "4", "--seq-len", "4096", "--cp-size", "2", "--tp-size", "2"]
    assert cli_main([*args, "--ep-size", "4"]) == 0
    out = capsys.readouterr().out
    # 4 x 4096 / cp 2 = 8192 tokens x top-8 = 65536 assignments; each tp rank sends and gets back its 32768 and
    # receives both peers' outputs: (2 + 2) x 32768 x 2048 x 2 bytes = 0.5 GiB
    assert ("under ep 4 x cp 2 x tp 2 (dispatch + combine, one MoE layer in flight, balanced routing): 0.50 GiB = "
            "(2 + 2) x 32768 assignments") in out
    both = ExpertParallel(ep_size=4, cp_size=2, tp_size=2)
    states = both.model_state_memory(memory_job(spec_from_hf_config(tmp_path / "config.json"), both,
                                                num_gpus_per_node=8))
    assert f"{'ep':<16}{states.params / 2**30:9.2f}" in out, out
    # ep borrows every cp and tp rank: a multiple of 4 (named, with the fix)
    assert cli_main([*args, "--ep-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "ep(2) with tp(2)" in err and "must be a multiple of 4" in err and "e.g. ep=4" in err
    assert "Traceback" not in err
    # ep x tp alone follows its rule: ep a multiple of tp
    assert cli_main(["estimate-memory", "--config", str(tmp_path / "config.json"), "--num-gpus", "8",
                     "--tp-size", "4", "--ep-size", "2"]) == 2
    assert "ep must be a multiple of 4" in capsys.readouterr().err


@pytest.mark.parametrize("options", [dict(ep_size=2), dict(ep_size=2, expert_sharding="none"),
                                     dict(ep_size=2, tp_size=2), dict(ep_size=4, tp_size=2, expert_tp=True),
                                     dict(ep_size=2, tp_size=2, expert_tp=True, expert_sharding="none"),
                                     dict(ep_size=4, cp_size=2, tp_size=2)],
                         ids=["full", "none", "tp", "etp", "etp_none", "cp_tp"])
def test_expert_parallel_formula_equals_the_tensors_a_rank_holds(monkeypatch, options):
    """Rank 0 of 8 under torch's fake process group: ExpertParallel shards a real MoE Llama, and the parameters it
    holds are what its model_state_memory counts, up to FSDP2's padding of each shard (one row a tensor at most)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardkit.memory import memory_job, spec_from_model
    from shardkit.models import Llama, LlamaConfig
    from shardkit.strategies import ExpertParallel

    for name, value in dict(RANK="0", WORLD_SIZE="8", LOCAL_RANK="0", LOCAL_WORLD_SIZE="8").items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        torch.manual_seed(0)
        model = Llama(LlamaConfig.small_moe())
        spec = spec_from_model(model)
        assert spec.expert_params == sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        padding = sum(p.numel() // p.shape[0] for p in model.parameters())
        strategy = ExpertParallel(**options)
        strategy.setup_environment()
        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                   for p in strategy.setup_module(model).parameters())
        counted = strategy.model_state_memory(memory_job(spec, strategy, num_gpus_per_node=8, precision="fp32"))
        assert counted.params % 4 == 0 and counted.params // 4 <= held <= counted.params // 4 + padding
        # and far from the dense count: the experts (61% of the model) are where the layouts differ
        assert abs(held - counted.params // 4) < 0.01 * spec.expert_params
    finally:
        dist.destroy_process_group()


def test_qwen3_30b_a3b_expert_parallel_states_equal_a_hand_computation(tmp_path):
    from shardkit.memory import memory_job, spec_from_hf_config
    from shardkit.strategies import ExpertParallel

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    spec = spec_from_hf_config(tmp_path / "config.json")
    # per layer: attention 2048*32*128*2 + 2048*4*128*2 = 18874368, norms 2*2048 + q/k norms 2*128, router 2048*128,
    # routed experts 128 * 3*2048*768 = 603979776; embedding and head 2 * 151936*2048; final norm 2048
    experts = 48 * 603979776
    assert spec.total_params == 2 * 311164928 + 48 * (18874368 + 4352 + 262144 + 603979776) + 2048 == 30532122624
    assert (spec.expert_params, spec.active_params) == (experts, 30532122624 - 48 * 120 * 3 * 2048 * 768)
    dense = 30532122624 - experts
    # bf16 mixed precision on FSDP2: 4-byte parameters. ep 8 on 8: experts and dense both 1/8 a rank
    ep8 = ExpertParallel(ep_size=8)
    assert ep8.model_state_memory(memory_job(spec, ep8, num_gpus_per_node=8)).params == dense * 4 // 8 + experts // 2
    # ep 2 on dp 8 with the slices whole: half of every routed expert on each rank (54 GiB of bf16-mixed parameters)
    none = ExpertParallel(ep_size=2, expert_sharding="none")
    held = none.model_state_memory(memory_job(spec, none, num_gpus_per_node=8)).params
    assert held == dense * 4 // 8 + experts * 4 // 2 == 58752605184


def test_expert_tp_is_estimated_with_its_all_to_all_buffers(tmp_path, capsys):
    from shardkit.memory import all_to_all_bytes, estimate_model_states, spec_from_hf_config

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    spec = spec_from_hf_config(tmp_path / "config.json")
    # 4 x 4096 tokens / cp 2 = 8192 x top-8 = 65536 assignments, a tp rank's share 32768: it receives its share over
    # ep and its outputs back (2 x 32768), and over tp both peers' dispatched rows (2 x 32768, the all-gather its
    # expert block runs on), both peers' partial outputs of its share (2 x 32768, the sum over tp as an all-to-all)
    # and both shares' outputs (2 x 32768): (2 + 3 x 2) x 32768 x hidden 2048 x 2 bytes = 1 GiB
    assert all_to_all_bytes(spec, 4, 2048, ep_size=2, tp_size=2, expert_tp=True) == 8 * 32768 * 2048 * 2 == 2**30
    # expert_tp=False: (2 + 2) x 32768 rows
    assert all_to_all_bytes(spec, 4, 2048, ep_size=2, tp_size=2) == 2**29
    args = ["estimate-memory", "--config", str(tmp_path / "config.json"), "--num-gpus", "8", "--strategy", "ep",
            "--batch-size", "4", "--seq-len", "4096", "--cp-size", "2", "--tp-size", "2", "--ep-size", "2"]
    assert cli_main([*args, "--expert-tp"]) == 0
    out = capsys.readouterr().out
    assert ("under ep 2 x cp 2 x tp 2 (expert_tp) (dispatch + combine, one MoE layer in flight, balanced routing): "
            "1.00 GiB = (2 + 3 x 2) x 32768 assignments") in out, out
    # the model states are ExpertParallel(ep_size=2, cp_size=2, tp_size=2, expert_tp=True)'s
    row = estimate_model_states(spec, "ep", num_gpus_per_node=8, ep_size=2, tp_size=2,
                                options={"expert_tp": True, "tp_size": 2})
    assert f"{'ep':<16}{row.params / 2**30:9.2f}{row.grads / 2**30:9.2f}{row.optimizer / 2**30:9.2f}" in out, out
    # without the flag the etp 1 rule refuses ep 2 (a multiple of cp x tp = 4) and names the flag
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "must be a multiple of 4" in err and "--expert-tp" in err, err
    # the flag without tensor parallelism, or for another strategy's row: refused by name
    assert cli_main([*args[:-6], "--ep-size", "2", "--expert-tp"]) == 2
    assert "--expert-tp is ExpertParallel's tensor parallelism inside the experts" in capsys.readouterr().err
    fsdp = [a if a != "ep" else "fsdp" for a in args]
    assert cli_main([*fsdp, "--expert-tp"]) == 2
    assert "give --tp-size > 1 and --strategy ep" in capsys.readouterr().err


def test_expert_tp_row_of_a_small_mixtral_equals_a_hand_computation():
    from shardkit.memory import estimate_model_states, spec_from_hf_config

    # 8 ranks, cp 2 x tp 2 (dp_shard 2), ep 2 inside dp_shard x cp with tp inside the experts: the dense part per tp
    # rank 24576 / 2 + 129344 = 141632 sharded over dp_shard x cp = 4 -> 35408; the experts 393216 / (ep 2 x tp 2)
    # = 98304 a rank; the embedding's tp half (32000) gathered, no expert slice (held whole)
    row = estimate_model_states(spec_from_hf_config(SMALL), "ep", num_gpus_per_node=8, precision="fp32", ep_size=2,
                                tp_size=2, options={"expert_tp": True, "tp_size": 2, "cp_size": 2})
    assert (row.params, row.grads, row.optimizer, row.working) == ((35408 + 98304) * 4, (35408 + 98304) * 4,
                                                                   (35408 + 98304) * 8, 32000 * 4)
