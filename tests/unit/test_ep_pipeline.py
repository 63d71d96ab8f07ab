"""Expert parallelism inside a pipeline's stages, without a process group: the sizes (ep borrowed from each stage's
dp_shard ranks), the named refusals, and the selection from ``--strategy-opt``, Accelerate's ``parallelism_config``
(shardkit's ``parallelism_config_pp_size`` with ``parallelism_config_ep_size``) and the launcher's config file. The
4-rank runs (pp 2 x ep 2 against one device, every schedule) are in tests/distributed/test_expert_parallel.py."""

from __future__ import annotations

import logging

import pytest
import yaml

from shardkit.config.accelerate import load_accelerate_config
from shardkit.models import Llama, LlamaConfig
from shardkit.strategies.ep_pipeline import check_model_experts
from shardkit.strategies.parallel_dims import ParallelDims
from shardkit.strategies.pipeline import Pipeline
from shardkit.strategies.registry import STRATEGIES

MOE = LlamaConfig.small_moe(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_position=32,
                            tie_embeddings=False, fused=False, moe=dict(num_experts=4, intermediate_size=16))


def _config(tmp_path, section, processes=4):
    path = tmp_path / "acc.yaml"
    path.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP",
                                    "mixed_precision": "no", "num_machines": 1, "num_processes": processes,
                                    "use_cpu": True, "parallelism_config": section}))
    return path


def test_sizes_ep_borrowed_from_each_stages_data_parallel_ranks():
    # pp 2 on 8 ranks: each stage has dp_shard 4; ep 2 of them split the experts, each expert on 2 of the 4
    dims = ParallelDims(pp=2, ep=2).resolve(8)
    assert (dims.dp_shard, dims.ep, dims.expert_replicas) == (4, 2, 2)
    assert ParallelDims(pp=2, ep=2).resolve(4).expert_replicas == 1
    with pytest.raises(ValueError, match=r"dp_shard\(2\) % ep\(4\) != 0.*choose an ep that divides 2"):
        ParallelDims(pp=2, ep=4).resolve(4)
    with pytest.raises(ValueError, match=r"num_experts\(4\) % ep\(3\) != 0"):
        check_model_experts(Llama(MOE), ParallelDims(pp=2, ep=3).resolve(12), is_main=False)


def test_cli_options_select_expert_parallel_inside_the_pipeline():
    pp = STRATEGIES.build_from_cli("pp", ["pp_size=2", "dp=fsdp", "ep_size=2", "schedule=zbv"])
    assert (pp.ep_size, pp.dims.pp, pp.settings.dp, pp.settings.schedule) == (2, 2, "fsdp", "zbv")
    assert "ep_size=2" in repr(pp)
    assert Pipeline(pp_size=2).ep_size == 1 and Pipeline(pp_size=2, ep_size=1).ep_size == 1
    assert "ep_size" not in repr(Pipeline(pp_size=2))


def test_named_refusals():
    with pytest.raises(ValueError, match=r"Pipeline ep_size=2 with dp='ddp': .*set dp='fsdp' "
                                         r"\(--strategy-opt dp=fsdp --strategy-opt ep_size=2\)"):
        Pipeline(pp_size=2, ep_size=2)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match=r"Pipeline ep_size=.* must be an int >= 1"):
            Pipeline(pp_size=2, dp="fsdp", ep_size=bad)


def test_a_model_without_moe_layers_is_said_once(caplog):
    dense = Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                              max_position=32, fused=False))
    with caplog.at_level(logging.WARNING, logger="shardkit.strategies.ep_pipeline"):
        check_model_experts(dense, ParallelDims(pp=2, ep=2).resolve(4), is_main=True)
        check_model_experts(Llama(MOE), ParallelDims(pp=2, ep=2).resolve(4), is_main=True)
    assert len(caplog.records) == 1 and "found no MoE layer in Llama" in caplog.records[0].getMessage()


@pytest.mark.parametrize("section, processes, spec", [
    ({"parallelism_config_pp_size": 2, "parallelism_config_ep_size": 2}, 4,
     ("pp", {"pp_size": 2, "dp": "fsdp", "ep_size": 2})),
    ({"parallelism_config_pp_size": 2, "parallelism_config_ep_size": 2}, 8,
     ("pp", {"pp_size": 2, "dp": "fsdp", "ep_size": 2})),
    ({"parallelism_config_pp_size": 2}, 4, ("pp", {"pp_size": 2, "dp": "fsdp"})),
    ({"parallelism_config_pp_size": 2}, 2, ("pp", {"pp_size": 2})),
])
def test_accelerate_parallelism_config_selects_the_pipeline(tmp_path, monkeypatch, section, processes, spec):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_accelerate_config(_config(tmp_path, section, processes))
    assert cfg.strategy == spec
    strategy = STRATEGIES.build(cfg.strategy[0], **cfg.strategy[1])
    assert (type(strategy).__name__, strategy.ep_size) == ("Pipeline", spec[1].get("ep_size", 1))


def test_accelerate_parallelism_config_refuses_what_the_pipeline_cannot_build(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for extra, named in (({"parallelism_config_cp_size": 2}, r"cp\(2\)"),
                         ({"parallelism_config_dp_replicate_size": 2}, r"dp_replicate\(2\)"),
                         ({"parallelism_config_tp_size": 2}, r"tp\(2\)")):
        with pytest.raises(ValueError, match=rf"pp\(2\) with {named} is not supported: a pipeline composes with "
                                             r"dp_shard .* and ep only"):
            load_accelerate_config(_config(tmp_path, {"parallelism_config_pp_size": 2, **extra}, 8))
    with pytest.raises(ValueError, match=r"dp_shard\(2\) % ep\(4\) != 0"):
        load_accelerate_config(_config(tmp_path, {"parallelism_config_pp_size": 2, "parallelism_config_ep_size": 4}))
    with pytest.raises(ValueError, match=r"parallelism_config_pp_sise .*did you mean 'parallelism_config_pp_size'"):
        load_accelerate_config(_config(tmp_path, {"parallelism_config_pp_sise": 2}))


def test_the_launchers_config_resolves_to_expert_parallel_inside_the_pipeline(tmp_path, monkeypatch):
    from shardkit.config import resolve_runner_config

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    resolved = resolve_runner_config(str(_config(tmp_path, {"parallelism_config_pp_size": 2,
                                                            "parallelism_config_ep_size": 2})))
    assert type(resolved.strategy).__name__ == "Pipeline"
    assert (resolved.strategy.ep_size, resolved.strategy.settings.dp) == (2, "fsdp")
