"""The errors a newcomer meets first (issue 30): names through the registries, a misspelt option's did-you-mean,
DeepSpeed missing named once with its extra, FSDP in a plain ``python train.py``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from shardkit import Runner, cli
from shardkit.precision import BF16, FP16
from shardkit.strategies import SingleDevice, strategy_from_name

CORPUS: list[str] = []


def test_runner_takes_registered_names():
    runner = Runner(strategy="single", precision="bf16")
    assert isinstance(runner.strategy, SingleDevice) and isinstance(runner.precision, BF16)
    assert isinstance(Runner(mixed_precision="fp16").precision, FP16)  # Accelerate's keyword
    with pytest.raises(ValueError, match="did you mean 'fsdp'"):
        Runner(strategy="fdsp")
    with pytest.raises(ValueError, match="pass one of them"):
        Runner(precision="bf16", mixed_precision="fp16")
    with pytest.raises(TypeError, match="strategy object such as DDP.*or a name among single, ddp"):
        Runner(strategy=3)
    CORPUS.extend(["Runner(strategy=name)", "Runner(precision=name)", "Runner(mixed_precision=)"])


def test_misspelt_strategy_option_gets_the_clis_did_you_mean():
    with pytest.raises(ValueError) as info:
        strategy_from_name("zero3", ofload="cpu")
    message = str(info.value)
    assert "did you mean 'offload'" in message and "ZeROSettings" not in message
    CORPUS.append("strategy_from_name typo")


def _without_deepspeed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))


def test_zero_without_deepspeed_names_the_extra(monkeypatch, tmp_path, capsys):
    _without_deepspeed(monkeypatch)
    with pytest.raises(ImportError, match=r"ZeRO3 runs on DeepSpeed.*pip install 'shardkit\[deepspeed\]'"):
        Runner(strategy="zero3")
    config = tmp_path / "ds.yaml"
    config.write_text("distributed_type: DEEPSPEED\nnum_processes: 1\ndeepspeed_config:\n  zero_stage: 3\n")
    script = tmp_path / "train.py"
    script.write_text("")
    assert cli.main(["launch", "--config_file", str(config), "--dry-run", str(script)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pip install 'shardkit[deepspeed]'" in err  # once, at launch
    CORPUS.extend(["ZeRO without DeepSpeed (Runner)", "ZeRO without DeepSpeed (launch, once)"])


@pytest.mark.timeout(300)
def test_every_mesh_strategy_in_a_plain_python_process_starts_its_own_group():
    # One mechanism for all (ProcessGroupStrategy.needs_group): ContextParallel, TP and PP failed here with torch's
    # "environment variable RANK expected" where FSDP got a private group.
    code = textwrap.dedent("""
        import os, torch
        from shardkit import Runner
        from shardkit.models import Llama, LlamaConfig
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
        config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                             max_position=16)
        x = torch.randint(0, 64, (2, 8))
        for name in ("fsdp", "tp", "cp", "pp"):
            runner = Runner(strategy=name)
            model = Llama(config)
            model, optimizer = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            runner.backward(model(x, labels=x))
            print("stepped", name, runner.step(), runner.world_size, flush=True)
            runner.teardown()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("fsdp", "tp", "cp", "pp"):
        assert f"stepped {name} True 1" in done.stdout, done.stdout
    CORPUS.append("FSDP, TP, CP and PP without a launcher")


def test_print_corpus_counts(capsys):
    with capsys.disabled():
        print(f"\nnewcomer-errors corpus: {len(CORPUS)} probes answered by name")
