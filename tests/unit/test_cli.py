"""The `shardkit` command: subcommand registry, `shardkit env`, and `shardkit launch` argument handling."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from shardkit import cli
from shardkit.cli import env_info

SCRIPT = str(Path(__file__).resolve().parents[1] / "distributed" / "scripts" / "all_reduce.py")


def test_env_prints_versions_for_a_bug_report(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out

    assert out.startswith("### shardkit environment")
    assert "torch:" in out and torch.__version__ in out
    for name in ("Python:", "deepspeed:", "triton:", "numpy:", "C++ compiler:", "ninja:", "devices:", "CPUs:",
                 "$CUDA_VISIBLE_DEVICES:", "$TORCH_EXTENSIONS_DIR:"):
        assert name in out


def test_env_json_and_missing_packages(capsys, monkeypatch):
    monkeypatch.setattr(env_info, "_PACKAGES", ("numpy", "no-such-package-shardkit-test"))
    monkeypatch.setenv("SHARDKIT_SOMETHING", "7")

    assert cli.main(["env", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["torch"] == torch.__version__
    assert facts["no-such-package-shardkit-test"] == "not installed"
    assert facts["$SHARDKIT_SOMETHING"] == "7"


def test_console_command_runs_env():
    done = subprocess.run([sys.executable, "-m", "shardkit.cli", "env"], capture_output=True, text=True, timeout=60)

    assert done.returncode == 0, done.stderr
    assert torch.__version__ in done.stdout


def test_help_lists_subcommands_including_one_whose_module_is_missing(monkeypatch, capsys):
    missing = ("frobnicate", "no_such_module_for_shardkit", "frob")
    monkeypatch.setattr(cli.commands, "COMMANDS", [*cli.commands.COMMANDS, missing])
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "launch" in out and "env" in out and "frobnicate" in out and "unavailable" in out

    assert cli.main(["frobnicate", "--anything"]) == 2
    err = capsys.readouterr().err
    assert "shardkit frobnicate: cannot import no_such_module_for_shardkit" in err


def test_no_subcommand_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "launch" in capsys.readouterr().out


def _dry_run(capsys, *args: str) -> list[str]:
    assert cli.main(["launch", "--dry-run", *args]) == 0
    return shlex.split(capsys.readouterr().out)


def test_launch_single_machine_uses_torchrun_with_a_free_port(capsys):
    command = _dry_run(capsys, "--num-processes", "2", SCRIPT, "--lr", "3")

    assert command[:3] == [sys.executable, "-m", "shardkit.distributed._torchrun"]
    assert {"--nproc-per-node=2", "--nnodes=1", "--node-rank=0", "--master-addr=127.0.0.1"} <= set(command)
    port = int(next(arg for arg in command if arg.startswith("--master-port=")).split("=")[1])
    assert 0 < port < 65536
    assert command[-3:] == [SCRIPT, "--lr", "3"]


def test_launch_multi_machine_and_module_form(capsys):
    command = _dry_run(capsys, "--num_processes", "4", "--num-machines", "2", "--machine-rank", "1",
                       "--main-process-ip", "10.0.0.1", "-m", "mypkg.train", "--epochs", "1")

    assert {"--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1",
            "--master-port=29500"} <= set(command)
    assert command[-4:] == ["-m", "mypkg.train", "--epochs", "1"]


# A script's own arguments that look like launcher flags: abbreviations of them (--fsdp, --mixed, --num; of
# torchrun's --numa-binding too), launcher flags themselves, help and version switches, a "--".
SCRIPT_ARGS = ["--fsdp", "full_shard auto_wrap", "--mixed", "bf16", "--num", "3", "--mixed_precision", "fp16", "--cpu",
               "-m", "x", "--num_processes", "4", "--config_file", "a.yaml", "--log", "-h", "--version", "--", "--z"]


@pytest.mark.parametrize("form", [[SCRIPT], ["-m", "mypkg.train"]], ids=["script", "module"])
def test_launch_passes_every_argument_after_the_script_through(capsys, form):
    command = _dry_run(capsys, "--num_processes", "1", *form, *SCRIPT_ARGS)

    assert command[-len(SCRIPT_ARGS) - len(form):] == [*form, *SCRIPT_ARGS]
    assert "--nproc-per-node=1" in command
    # `shardkit launch` runs torchrun's parser on that command: it too leaves the script's arguments alone.
    from shardkit.distributed._torchrun import parse

    args = parse(command[3:])
    assert (args.training_script, args.module, args.nproc_per_node) == (form[-1], form[0] == "-m", "1")
    assert args.training_script_args == SCRIPT_ARGS


@pytest.mark.parametrize(("args", "needle"), [
    (["--num-machines", "2", SCRIPT], "needs --main-process-ip"),
    (["--num-machines", "2", "--machine-rank", "2", "--main-process-ip", "h", SCRIPT], "--machine-rank(2)"),
    (["--num-processes", "0", SCRIPT], "--num-processes(0) must be >= 1"),
    (["--timeout", "0", SCRIPT], "--timeout(0.0) must be > 0"),
    (["no_such_script.py"], "script 'no_such_script.py' not found"),
])
def test_launch_usage_errors_name_the_flag(capsys, args, needle):
    assert cli.main(["launch", *args]) == 2
    assert needle in capsys.readouterr().err


def test_launch_config_file_before_the_config_module_exists(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "shardkit.config.accelerate", None)  # import fails as if absent

    assert cli.main(["launch", "--config_file", "acc.yaml", SCRIPT]) == 2
    assert "config files arrive with the config module" in capsys.readouterr().err


def test_launch_config_file_fills_options_the_command_line_leaves_out(capsys, monkeypatch):
    fake = types.ModuleType("shardkit.config.accelerate")
    fake.launch_args_from_yaml = lambda path: {"num_processes": 3, "main_process_port": 1234, "env": {"X": "1"}}
    monkeypatch.setitem(sys.modules, "shardkit.config.accelerate", fake)

    command = _dry_run(capsys, "--config_file", "acc.yaml", "--num-processes", "2", SCRIPT)
    assert "--nproc-per-node=2" in command and "--master-port=1234" in command

    fake.launch_args_from_yaml = lambda path: {"num_procs": 3}
    assert cli.main(["launch", "--config_file", "acc.yaml", SCRIPT]) == 2
    assert "unknown keys ['num_procs']" in capsys.readouterr().err
