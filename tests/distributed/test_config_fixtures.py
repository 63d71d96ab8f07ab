"""Every DeepSpeed fixture config trains a few steps on 2 CPU processes through Runner(config=...)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from harness import run_distributed


def _fixtures() -> Path:
    # CI keeps shared/ beside the clone: <clone>/../shared/fixtures.
    return Path(os.environ.get("SHARDKIT_FIXTURES") or Path(__file__).resolve().parents[3] / "shared" / "fixtures")


DS = _fixtures() / "deepspeed"
NAMES = sorted(p.name for p in DS.glob("*.json")) if DS.is_dir() else []
STEPS = 4
HIDDEN = 16


def _config(name: str, nvme: Path) -> dict:
    raw = json.loads((DS / name).read_text())
    for key in ("offload_param", "offload_optimizer"):
        section = raw.get("zero_optimization", {}).get(key, {})
        if "nvme_path" in section:
            section["nvme_path"] = str(nvme)
    return raw


def _train(config: dict) -> dict:
    import torch
    import torch.nn.functional as F

    from shardkit import Runner
    from shardkit.config import resolve_runner_config
    from shardkit.config.optim import build_optimizer, build_scheduler

    runner = Runner(config=config, seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN))
    # The fixtures leave lr and warmup "auto": the values a Trainer would supply fill them.
    extra = resolve_runner_config(config, optimizer_params={"lr": 1e-2}, scheduler_params={"warmup_num_steps": 2})
    spec = extra.optimizer or {"type": "AdamW", "params": {"lr": 1e-2}}
    optimizer = build_optimizer(spec, model.parameters())
    scheduler = build_scheduler(extra.scheduler, optimizer) if extra.scheduler else None
    if scheduler is not None:
        model, optimizer, scheduler = runner.setup(model, optimizer, scheduler)
    else:
        model, optimizer = runner.setup(model, optimizer)
    g = torch.Generator().manual_seed(runner.rank)
    x = torch.randn(4, HIDDEN, generator=g)
    y = x.flip(-1) * 0.5
    losses = []
    for _ in range(STEPS * runner.gradient_accumulation_steps):
        loss = F.mse_loss(model(x.to(runner.device)).float(), y.to(runner.device))
        runner.backward(loss)
        if runner.config.max_grad_norm:
            runner.clip_gradients(runner.config.max_grad_norm)
        runner.step()
        losses.append(runner.all_reduce(loss.detach().float(), "mean").item())
    return {"strategy": type(runner.strategy).__name__, "precision": type(runner.precision).__name__,
            "losses": losses}


EXPECTED = {"precision_and_misc.json": "ZeRO2", "zero1.json": "ZeRO1", "zero2_offload.json": "ZeRO2",
            "zero3_inference.json": "ZeRO3", "zero3_infinity_nvme.json": "ZeROInfinity",
            "zero3_offload.json": "ZeRO3", "zero3_offload_cpu_full.json": "ZeRO3"}


def _train_each(configs: dict[str, dict]) -> dict[str, dict]:
    """:func:`_train` for every fixture, one after the other in these processes (each Runner and model is seeded):
    per fixture its result, or the traceback it raised, for that fixture's test."""
    import traceback

    out = {}
    for name, config in configs.items():
        try:
            out[name] = {"result": _train(config)}
        except Exception:  # noqa: BLE001 - reported by the fixture's own test
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, list]:
    """Every fixture trained in one 2-rank launch (one start-up and one process group for all): name -> each
    rank's result or traceback."""
    pytest.importorskip("deepspeed")
    nvme = tmp_path_factory.mktemp("fixtures") / "nvme"
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or
           str(Path(__file__).resolve().parents[2] / ".torch_extensions")}
    # NVMe offload JIT-builds DeepSpeed's async_io op on first use (about 5 min on 2 cores); CPU Adam ~90 s.
    results = run_distributed(_train_each, world_size=2, timeout=1100,
                              args=({name: _config(name, nvme / name) for name in NAMES},), env=env)
    return {name: [rank[name] for rank in results] for name in NAMES}


@pytest.mark.skipif(not DS.is_dir(), reason=f"fixture folder {DS} is absent (set SHARDKIT_FIXTURES)")
@pytest.mark.parametrize("name", NAMES)
def test_fixture_trains(name, trained):
    errors = [f"rank {rank}:\n{r['error']}" for rank, r in enumerate(trained[name]) if "error" in r]
    if errors:
        pytest.fail(f"{name} raised:\n" + "\n".join(errors), pytrace=False)
    results = [r["result"] for r in trained[name]]
    for result in results:
        assert result["strategy"] == EXPECTED.get(name, result["strategy"])
        assert all(loss == loss for loss in result["losses"]), result["losses"]  # no NaN
        assert result["losses"][-1] < result["losses"][0], result["losses"]
    assert results[0]["losses"] == results[1]["losses"]  # all-reduced: every rank saw the same numbers


_SCRIPT = """
from shardkit import Runner

runner = Runner()  # no arguments: the strategy and precision come from SHARDKIT_CONFIG_FILE
print(f"rank {runner.rank}/{runner.world_size}: {type(runner.strategy).__name__} {type(runner.precision).__name__}")
"""


def test_launch_config_file_reaches_runner(tmp_path):
    import subprocess
    import sys

    import yaml

    config = tmp_path / "fsdp.yaml"
    config.write_text(yaml.safe_dump({"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 2,
                                      "use_cpu": True, "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}}))
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "SHARDKIT_CONFIG_FILE")}
    done = subprocess.run([sys.executable, "-m", "shardkit.cli", "launch", "--config_file", str(config), str(script)],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0/2: FSDP BF16" in done.stdout and "rank 1/2: FSDP BF16" in done.stdout
