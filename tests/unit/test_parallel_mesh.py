"""The one device mesh (ParallelDims): sizes, validation messages, Accelerate's parallelism_config, and the
pieces of context and pipeline parallelism that need no process group (load balancing, stage split, options)."""

from __future__ import annotations

import pytest
import torch
import yaml

from shardkit.config.accelerate import load_accelerate_config
from shardkit.strategies.cp_attention import load_balanced_positions
from shardkit.strategies.parallel_dims import ParallelDims
from shardkit.strategies.pipeline import PipelineSettings, bubble_fraction, stage_layers
from shardkit.strategies.registry import STRATEGIES


def test_sizes_fill_and_product_is_checked_with_every_factor():
    assert ParallelDims(cp=2).resolve(8).sizes == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 2, "tp": 1}
    assert ParallelDims(dp_replicate=2, cp=2, tp=2).resolve(8).dp == 2
    with pytest.raises(ValueError, match=r"dp_shard\(2\) \* cp\(3\) \* tp\(1\) = 6 != world_size\(4\)"):
        ParallelDims(dp_shard=2, cp=3).resolve(4)
    with pytest.raises(ValueError, match=r"world_size\(4\) is not divisible by .* cp\(3\)"):
        ParallelDims(cp=3).resolve(4)
    with pytest.raises(ValueError, match=r"ParallelDims cp=0 must be an int >= 1"):
        ParallelDims(cp=0)


@pytest.mark.parametrize("dims, kwargs, message", [
    (ParallelDims(dp_shard=1, tp=3), {"num_heads": 4}, r"num_heads\(4\) % tp\(3\) != 0"),
    (ParallelDims(dp_shard=1, tp=2), {"num_heads": 4, "num_kv_heads": 1}, r"num_kv_heads\(1\) % tp\(2\)"),
    (ParallelDims(dp_shard=1, cp=4), {"num_heads": 6, "cp_mode": "ulysses"}, r"num_heads\(6\) / tp\(1\) % cp\(4\)"),
    (ParallelDims(dp_shard=1, cp=2), {"seq_len": 10}, r"seq_len\(10\) % \(2 \* cp\(2\)\) != 0.*multiple of 4"),
    (ParallelDims(dp_shard=1, pp=3), {"num_layers": 4}, r"num_layers\(4\) % pp\(3\) != 0.*layer_split"),
    (ParallelDims(dp_shard=1, pp=2), {"num_layers": 4, "layer_split": (1, 2)}, r"sums to 3 != num_layers\(4\)"),
    (ParallelDims(dp_shard=1, cp=2), {"cp_mode": "ulyses"}, r"did you mean 'ulysses'"),
])
def test_validation_names_the_numbers_and_the_fix(dims, kwargs, message):
    with pytest.raises(ValueError, match=message):
        dims.validate(**kwargs)


def test_ring_allows_any_head_count_and_a_split_allows_uneven_layers():
    ParallelDims(dp_shard=1, cp=4).validate(num_heads=6, seq_len=16, cp_mode="ring")
    ParallelDims(dp_shard=1, pp=3).validate(num_layers=4, layer_split=(1, 2, 1))


def _accelerate(tmp_path, monkeypatch, section, processes=4, kind="FSDP"):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = tmp_path / "acc.yaml"
    path.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": kind,
                                    "mixed_precision": "no", "num_machines": 1, "num_processes": processes,
                                    "use_cpu": True, "parallelism_config": section}))
    return load_accelerate_config(path)


@pytest.mark.parametrize("section, spec", [
    ({"parallelism_config_dp_shard_size": 2, "parallelism_config_cp_size": 2},
     ("cp", {"cp_size": 2, "dp_replicate": 1})),
    ({"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2}, ("tp", {"tp_size": 2, "dp": "fsdp"})),
    ({"parallelism_config_cp_size": 2, "parallelism_config_tp_size": 2},
     ("cp", {"cp_size": 2, "dp_replicate": 1, "tp_size": 2})),
    ({"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2},
     ("fsdp", {"sharding": "hybrid", "hybrid_shard_size": 2})),
])
def test_accelerate_parallelism_config_reads_into_the_mesh(tmp_path, monkeypatch, section, spec):
    cfg = _accelerate(tmp_path, monkeypatch, section)
    assert cfg.strategy == spec
    STRATEGIES.build(*cfg.strategy[:1], **cfg.strategy[1])  # the spec builds


def test_accelerate_parallelism_config_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"dp_shard\(2\) \* cp\(3\) \* tp\(1\) = 6 != world_size\(4\)"):
        _accelerate(tmp_path, monkeypatch, {"parallelism_config_dp_shard_size": 2, "parallelism_config_cp_size": 3})
    with pytest.raises(ValueError, match=r"parallelism_config_cp_sise .*did you mean 'parallelism_config_cp_size'"):
        _accelerate(tmp_path, monkeypatch, {"parallelism_config_cp_sise": 2})


def test_load_balancing_pairs_chunks_from_both_ends():
    assert load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([load_balanced_positions(16, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))
    # Causal work per rank (keys each query sees) is equal: the point of the pairing.
    work = {sum(p + 1 for p in load_balanced_positions(16, 4, r).tolist()) for r in range(4)}
    assert len(work) == 1


def test_pipeline_stages_schedules_and_options():
    assert [list(r) for r in stage_layers(4, 2)] == [[0, 1], [2, 3]]
    assert [list(r) for r in stage_layers(4, 2, (1, 3))] == [[0], [1, 2, 3]]
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert PipelineSettings(schedule="interleaved_1f1b").chunks == 2
    with pytest.raises(ValueError, match=r"did you mean '1f1b'"):
        PipelineSettings(schedule="1f1")
    with pytest.raises(ValueError, match=r"stages_per_rank=2 needs an interleaved schedule"):
        PipelineSettings(schedule="gpipe", stages_per_rank=2)
    pp = STRATEGIES.build_from_cli("pp", ["schedule=gpipe", "microbatches=4"])
    assert (pp.settings.schedule, pp.settings.microbatches) == ("gpipe", 4)
    cp = STRATEGIES.build_from_cli("cp", ["cp_mode=ulysses", "cp_size=2"])
    assert (cp.cp_mode, cp.dims.cp) == ("ulysses", 2)
    cp_tp = STRATEGIES.build_from_cli("cp", ["cp_size=2", "tp_size=2"])
    assert (cp_tp.cp_size, cp_tp.tp_size) == (2, 2)
    with pytest.raises(ValueError, match=r"tp_plan=\.\.\. is a tensor-parallel plan: it needs tp_size > 1"):
        STRATEGIES.build("cp", tp_plan={})
    with pytest.raises(ValueError, match=r"tp_plan entry 'layers.\*.mlp.up_proj': str is not a ParallelStyle"):
        STRATEGIES.build_from_cli("cp", ["tp_size=2", 'tp_plan={"layers.*.mlp.up_proj": "colwise"}'])
    with pytest.raises(ValueError, match=r"sequence_parallel=True splits the model's own tensor-parallel plan: it "
                                         r"needs tp_size > 1"):
        STRATEGIES.build("cp", sequence_parallel=True)
    with pytest.raises(ValueError, match=r"ContextParallel tp_size=0 must be an int >= 1"):
        STRATEGIES.build("cp", tp_size=0)


@pytest.mark.parametrize(("name", "kwargs", "message"), [
    ("cp", {"cp_size": 0}, r"ContextParallel cp_size=0 must be an int >= 1"),
    ("cp", {"cp_size": -2}, r"ContextParallel cp_size=-2 must be an int >= 1"),
    ("cp", {"cp_size": 2.0}, r"ContextParallel cp_size=2.0 must be an int >= 1"),
    ("cp", {"dp_replicate": 0}, r"ContextParallel dp_replicate=0 must be an int >= 1"),
    ("tp", {"tp_size": 0}, r"TensorParallel tp_size=0 must be an int >= 1"),
    ("pp", {"pp_size": -1}, r"Pipeline pp_size=-1 must be an int >= 1"),
    ("fsdp", {"sharding": "hybrid", "hybrid_shard_size": 0}, r"FSDP hybrid_shard_size=0 must be an int >= 1"),
    ("fsdp", {"sharding": "hybrid", "hybrid_shard_size": "2"}, r"FSDP hybrid_shard_size='2' must be an int >= 1"),
])
def test_a_size_of_zero_or_less_is_refused_naming_the_argument(name, kwargs, message):
    # cp_size=0 was taken as "unset" (every rank) without a word.
    with pytest.raises(ValueError, match=message):
        STRATEGIES.build(name, **kwargs)


def test_memory_estimate_rows_for_context_and_pipeline_parallelism():
    from shardkit.memory.estimate import activation_bytes, estimate_model_states
    from shardkit.memory.model_spec import spec_from_llama_config
    from shardkit.models import LlamaConfig

    spec = spec_from_llama_config(LlamaConfig(hidden_size=256, intermediate_size=688, num_layers=8, num_heads=8,
                                              vocab_size=1000))
    one = activation_bytes(spec, 2, 1024)
    assert activation_bytes(spec, 2, 1024, cp_size=4) == pytest.approx(one / 4, rel=1e-6)
    # 1F1B keeps pp micro-batches of its layers in flight, GPipe all of them.
    assert activation_bytes(spec, 8, 256, pp_size=2, microbatches=8, schedule="1f1b") < \
        activation_bytes(spec, 8, 256, pp_size=2, microbatches=8, schedule="gpipe")
    fsdp, cp = (estimate_model_states(spec, n, num_gpus_per_node=4) for n in ("fsdp", "cp"))
    assert cp.device_total == fsdp.device_total
    ddp, pp = (estimate_model_states(spec, n, num_gpus_per_node=4, pp_size=4) for n in ("ddp", "pp"))
    assert pp.device_total == pytest.approx(ddp.device_total / 4, abs=64)


def test_estimate_memory_cli_prints_cp_activations_and_the_pipeline_bubble(tmp_path, capsys):
    import json

    from shardkit.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
                               "num_hidden_layers": 8, "num_attention_heads": 8, "vocab_size": 1000}))
    assert main(["estimate-memory", "--config", str(cfg), "--num-gpus", "4", "--batch-size", "8", "--seq-len", "1024",
                 "--cp-size", "4", "--pp-size", "4", "--microbatches", "8", "--strategy", "pp"]) == 0
    out = capsys.readouterr().out
    assert "Activations per rank under cp 4" in out
    assert "bubble (pp-1)/(m+pp-1) = 27% of a step" in out
    # no --microbatches: the accumulation window, as the Pipeline strategy takes it (else pp)
    for extra, m in ((["--gradient-accumulation-steps", "12"], 12), ([], 4)):
        assert main(["estimate-memory", "--config", str(cfg), "--num-gpus", "4", "--batch-size", "8", "--seq-len",
                     "1024", "--pp-size", "4", "--strategy", "pp", *extra]) == 0
        assert f"(pp 4, {m} micro-batches, 1f1b)" in capsys.readouterr().out


def test_estimate_memory_cli_knows_cp_x_tp(tmp_path, capsys):
    import json

    from shardkit.cli import main
    from shardkit.memory.estimate import activation_bytes
    from shardkit.memory.model_spec import spec_from_hf_config, spec_from_llama_config
    from shardkit.models import LlamaConfig

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
                               "num_hidden_layers": 8, "num_attention_heads": 8, "vocab_size": 1000}))
    args = ["estimate-memory", "--config", str(cfg), "--num-gpus", "4", "--batch-size", "8", "--seq-len", "1024",
            "--strategy", "cp"]
    assert main([*args, "--cp-size", "2", "--tp-size", "2"]) == 0
    both = activation_bytes(spec_from_hf_config(str(cfg)), 8, 1024, cp_size=2, tp_size=2)
    assert both < activation_bytes(spec_from_hf_config(str(cfg)), 8, 1024, cp_size=2)
    assert f"under cp 2 x tp 2 (sequence split, load-balanced, heads and MLP split): {both / 2**30:.2f} GiB" in \
        capsys.readouterr().out
    # benchmarks/context_parallel.py's model, fp32: cp 2 x tp 2 kept 0.35-0.37 of cp 1's saved bytes (~0.05 of them
    # unsplit weights); the estimate must not split what stays whole on tp ranks (it said 0.27 when it did).
    bench = spec_from_llama_config(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_layers=4,
                                               num_heads=4))
    ratio = activation_bytes(bench, 1, 2048, cp_size=2, tp_size=2, dtype_bytes=4) / \
        activation_bytes(bench, 1, 2048, dtype_bytes=4)
    assert 0.29 < ratio < 0.34, ratio
    assert main([*args, "--cp-size", "2", "--tp-size", "3"]) == 2
    assert "--cp-size 2 --tp-size 3 on 4 device(s)" in capsys.readouterr().err
    assert main([*args, "--num-gpus", "6", "--cp-size", "2", "--tp-size", "3"]) == 2
    assert "num_heads(8) % tp(3) != 0" in capsys.readouterr().err
