"""Selecting expert parallelism without a process group: Accelerate's ``parallelism_config`` (shardkit's
``parallelism_config_ep_size`` key), ``--strategy-opt``, the Runner and the Trainer under the launcher's config file,
ep with cp (ExpertParallel's cp_size; ContextParallel's ep_size refused by name, pointing to it), ep with cp and tp
together, and the refusals of what is not built (ep with pp; unknown layouts). The 4-rank runs are in
tests/distributed/test_expert_parallel.py."""

from __future__ import annotations

import pytest
import yaml

from shardkit.config.accelerate import load_accelerate_config
from shardkit.strategies.parallel_dims import ParallelDims
from shardkit.strategies.registry import STRATEGIES


def _config(tmp_path, section, processes=4):
    path = tmp_path / "acc.yaml"
    path.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP",
                                    "mixed_precision": "no", "num_machines": 1, "num_processes": processes,
                                    "use_cpu": True, "parallelism_config": section}))
    return path


@pytest.mark.parametrize("section, spec", [
    ({"parallelism_config_dp_shard_size": 4, "parallelism_config_ep_size": 2}, ("ep", {"ep_size": 2})),
    ({"parallelism_config_dp_replicate_size": 2, "parallelism_config_ep_size": 2},
     ("ep", {"ep_size": 2, "dp_replicate": 2})),
    ({"parallelism_config_cp_size": 2, "parallelism_config_ep_size": 2}, ("ep", {"ep_size": 2, "cp_size": 2})),
])
def test_accelerate_parallelism_config_selects_expert_parallel(tmp_path, monkeypatch, section, spec):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_accelerate_config(_config(tmp_path, section))
    assert cfg.strategy == spec
    strategy = STRATEGIES.build(cfg.strategy[0], **cfg.strategy[1])
    assert (strategy.ep_size, strategy.dims.dp_replicate) == (2, spec[1].get("dp_replicate", 1))
    assert strategy.cp_size == spec[1].get("cp_size", 1)


def test_accelerate_parallelism_config_refuses_ep_it_cannot_build(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # ep with cp and tp together: ExpertParallel with both, ep borrowing every cp and tp rank
    both = {"parallelism_config_tp_size": 2, "parallelism_config_cp_size": 2, "parallelism_config_ep_size": 4}
    spec = load_accelerate_config(_config(tmp_path, both, processes=8)).strategy
    assert spec == ("ep", {"ep_size": 4, "cp_size": 2, "tp_size": 2})
    strategy = STRATEGIES.build(spec[0], **spec[1])
    assert (strategy.ep_size, strategy.cp_size, strategy.tp_size) == (4, 2, 2)
    with pytest.raises(ValueError, match=r"ep\(2\) with tp\(2\): .*every tp and cp rank .*must be a multiple of 4 "
                                         r"that divides dp_shard \* cp \* tp = 8; e.g. ep=4"):
        load_accelerate_config(_config(tmp_path, {**both, "parallelism_config_ep_size": 2}, processes=8))
    # torchtitan's rule: ep takes every cp rank, so it is a multiple of cp dividing dp_shard * cp
    with pytest.raises(ValueError, match=r"ep\(2\) with cp\(4\): .*must be a multiple of cp\(4\) that divides "
                                         r"dp_shard \* cp = 4"):
        load_accelerate_config(_config(tmp_path, {"parallelism_config_cp_size": 4, "parallelism_config_ep_size": 2}))
    with pytest.raises(ValueError, match=r"dp_shard\(4\) % ep\(3\) != 0"):
        load_accelerate_config(_config(tmp_path, {"parallelism_config_ep_size": 3}))
    with pytest.raises(ValueError, match=r"parallelism_config_ep_sise .*did you mean 'parallelism_config_ep_size'"):
        load_accelerate_config(_config(tmp_path, {"parallelism_config_ep_sise": 2}))


def test_expert_replicas_and_cli_options():
    assert ParallelDims(ep=2).resolve(8).expert_replicas == 4
    assert ParallelDims(dp_replicate=2, ep=2).resolve(8).expert_replicas == 4
    ep = STRATEGIES.build_from_cli("ep", ["ep_size=2", "expert_sharding=none", "dp_replicate=2"])
    assert (ep.ep_size, ep.expert_sharding, ep.dims.dp_replicate) == (2, "none", 2)
    with pytest.raises(ValueError, match=r"expert_sharding='ful' is not one of .*did you mean 'full'"):
        STRATEGIES.build("ep", expert_sharding="ful")
    with pytest.raises(ValueError, match=r"sharding='hybrid': use 'full' or 'grad_op' .*dp_replicate=N"):
        STRATEGIES.build("ep", sharding="hybrid")
    with pytest.raises(ValueError, match=r"dp_replicate=0 must be an int >= 1"):
        STRATEGIES.build("ep", dp_replicate=0)


def test_expert_parallel_with_context_parallel_sizes_and_the_refusal_by_name():
    assert ParallelDims(cp=2, ep=2).resolve(8).expert_replicas == 4  # dp_shard 4 x cp 2 ranks, over ep 2
    assert ParallelDims(cp=2, ep=8).resolve(8).expert_replicas == 1
    with pytest.raises(ValueError, match=r"ep\(6\) with cp\(2\).*divides dp_shard \* cp = 8"):
        ParallelDims(cp=2, ep=6).resolve(8)
    ep = STRATEGIES.build_from_cli("ep", ["ep_size=2", "cp_size=2", "cp_mode=ulysses"])
    assert (ep.ep_size, ep.cp_size, ep.cp_mode) == (2, 2, "ulysses")
    with pytest.raises(ValueError, match=r"cp_mode='rign' is not one of .*did you mean 'ring'"):
        STRATEGIES.build("ep", cp_mode="rign")
    with pytest.raises(ValueError, match=r"cp_size=0 must be an int >= 1"):
        STRATEGIES.build("ep", cp_size=0)
    # one place selects ep x cp: ContextParallel names it
    with pytest.raises(ValueError, match=r"ContextParallel\(ep_size=2\): expert parallelism composed with context "
                                         r"parallelism is ExpertParallel\(ep_size=2, cp_size=2\)"):
        STRATEGIES.build_from_cli("cp", ["cp_size=2", "ep_size=2"])
    assert STRATEGIES.build("cp", cp_size=2, ep_size=1).cp_size == 2  # 1: no expert parallelism, nothing to refuse


def test_the_launchers_config_resolves_to_expert_parallel(tmp_path, monkeypatch):
    """What a Runner (and the Trainer's) builds under `shardkit launch --config_file`; the 4-rank worker builds both."""
    from shardkit.config import resolve_runner_config

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    resolved = resolve_runner_config(str(_config(tmp_path, {"parallelism_config_ep_size": 2})))
    assert resolved.strategy.ep_size == 2 and resolved.strategy.expert_sharding == "full"
