"""Automatic restart, in one process: which checkpoint a restarted job resumes from, the Runner's and the Trainer's
auto-resume, and when the launcher stops restarting (the launched job is tests/distributed/test_restart_launch.py)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardkit import Runner
from shardkit.checkpoint import CheckpointError, CheckpointWriter, newest_complete_checkpoint
from shardkit.cli import main as cli_main
from shardkit.distributed.restart import describe_attempt, should_stop
from shardkit.distributed.restart_records import (
    LAST_STEP_ENV,
    RESTART_COUNT_ENV,
    RESTART_DIR_ENV,
    read_progress,
    restart_facts,
)
from shardkit.trainer.checkpointing import Checkpointer, get_last_checkpoint


def _save(path: Path, step: int) -> Path:
    with CheckpointWriter(path) as writer:
        writer.write_tensors("model", {"w": torch.full((64,), float(step))})
        writer.write_json("step", step)
    return path


def _cut_short(checkpoint: Path) -> None:
    tensors = next(checkpoint.glob("*.safetensors"))
    tensors.write_bytes(tensors.read_bytes()[:-16])


def test_newest_complete_checkpoint_skips_partial_ones(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path / f"step-{step}", step)
    assert newest_complete_checkpoint(tmp_path) == tmp_path / "step-3"
    _cut_short(tmp_path / "step-3")  # published, then a file cut short
    (tmp_path / "step-4").mkdir()  # copied by hand without its manifest
    (tmp_path / "step-4" / "model.safetensors").write_bytes(b"\0" * 8)
    killed = tmp_path / ".step-5.tmp-0123456789abcdef"  # a save killed before its manifest
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"\0" * 8)
    assert newest_complete_checkpoint(tmp_path) == tmp_path / "step-2"
    assert newest_complete_checkpoint(tmp_path / "missing") is None
    assert newest_complete_checkpoint(tmp_path / "step-1") == tmp_path / "step-1"


def test_a_save_killed_between_its_renames_is_found_through_its_hidden_copy(tmp_path):
    _save(tmp_path / "step-1", 1)
    _save(tmp_path / "step-2", 2)
    (tmp_path / "step-2").rename(tmp_path / ".step-2.old")  # `latest` names step-2, which is missing
    assert (tmp_path / "latest").read_text().strip() == "step-2"
    assert newest_complete_checkpoint(tmp_path) == tmp_path / ".step-2.old"


def _restarted(monkeypatch, tmp_path: Path, attempt: int) -> Path:
    folder = tmp_path / "records"
    folder.mkdir(exist_ok=True)
    monkeypatch.setenv(RESTART_DIR_ENV, str(folder))
    monkeypatch.setenv(RESTART_COUNT_ENV, str(attempt))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the failure record's hook is this test's only
    return folder


def _runner_run(ckpt: Path, steps: int, resume_mode="auto"):
    runner = Runner("single", seed=0)
    model = nn.Linear(4, 1)
    model, optimizer = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state = {"model": model, "optimizer": optimizer}
    loaded = runner.resume(ckpt, state, mode=resume_mode)
    while runner.optimizer_steps < steps:
        runner.backward(model(torch.ones(2, 4)).pow(2).mean())
        runner.step()
        runner.save(ckpt / f"step-{runner.optimizer_steps}", state)
    return runner, model, loaded


def test_runner_resumes_by_itself_only_on_a_restart(monkeypatch, tmp_path):
    ckpt = tmp_path / "ckpt"
    full, full_model, _ = _runner_run(tmp_path / "full", 4)
    folder = _restarted(monkeypatch, tmp_path, 0)
    first, _, loaded = _runner_run(ckpt, 3)
    assert loaded is None and read_progress(folder, 0) == {"step": 3, "resumed": None, "saved": 3}
    _cut_short(ckpt / "step-3")  # the newest is partial: the restart takes step-2 and replays step 3
    again, _, loaded = _runner_run(ckpt, 4)  # still attempt 0: a first start trains from the start
    assert loaded is None and again.optimizer_steps == 4
    _cut_short(ckpt / "step-4")
    _cut_short(ckpt / "step-3")
    monkeypatch.setenv(RESTART_COUNT_ENV, "1")
    resumed, model, loaded = _runner_run(ckpt, 4)
    assert loaded == {} and read_progress(folder, 1) == {"step": 4, "resumed": 2, "saved": 4}
    assert torch.equal(model.weight, full_model.weight)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        _runner_run(tmp_path / "empty", 1, resume_mode=True)


def test_trainer_resumes_the_newest_complete_checkpoint_on_a_restart(tmp_path):
    for step in (2, 4):
        _save(tmp_path / f"checkpoint-{step}", step)
    _cut_short(tmp_path / "checkpoint-4")
    assert get_last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")

    def resolve(restart: bool, resume, rank0=None):
        # rank0: what rank 0 chose (a broadcast from another rank); None: this is rank 0
        runner = SimpleNamespace(observability=SimpleNamespace(recovery=SimpleNamespace(is_restart=restart)),
                                 broadcast=lambda obj, src: obj if rank0 is None else rank0)
        return Checkpointer(runner, SimpleNamespace(output_dir=str(tmp_path))).resolve(resume)

    assert resolve(False, None) is None
    assert resolve(True, None) == tmp_path / "checkpoint-2"
    assert resolve(True, False) is None  # an explicit "train from the start" stays explicit
    # another rank's view of the folder differs (not yet synced): it loads what rank 0 chose, not its own pick
    assert resolve(True, None, rank0=[str(tmp_path / "checkpoint-4"), None]) == tmp_path / "checkpoint-4"
    with pytest.raises(ValueError, match="rank 0 found none"):  # rank 0 failed: every rank fails with its error
        resolve(True, True, rank0=[None, "rank 0 found none"])


def test_a_restarted_trainer_resumes_the_newest_complete_checkpoint_by_itself(monkeypatch, tmp_path):
    from trainer_fixtures import StopAt, logged_losses, text_data

    from shardkit.models import Llama, LlamaConfig
    from shardkit.trainer import Trainer, TrainerCallback, TrainingArguments

    class Steps(TrainerCallback):
        done: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.done.append(state.global_step)

    def trainer(out: Path, *callbacks):
        torch.manual_seed(1)
        model = Llama(LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16,
                                  dropout=0.1))
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, learning_rate=1e-2, max_steps=8,
                                 logging_steps=1, save_strategy="steps", save_steps=2, disable_tqdm=True, seed=0,
                                 optim="adamw_torch", report_to="none")
        return Trainer(model, args, train_dataset=text_data(), callbacks=list(callbacks))

    full = trainer(tmp_path / "full")
    full.train()
    _restarted(monkeypatch, tmp_path, 0)
    trainer(tmp_path / "out", StopAt(5)).train()  # killed after step 5: checkpoints 2 and 4
    _cut_short(tmp_path / "out" / "checkpoint-4")
    monkeypatch.setenv(RESTART_COUNT_ENV, "1")
    torch.manual_seed(7)  # a new process: the checkpoint restores the RNG streams
    again = trainer(tmp_path / "out", Steps())
    again.train()  # no resume_from_checkpoint: the restart resumes from checkpoint-2 by itself
    assert Steps.done == [3, 4, 5, 6, 7, 8]  # not from the start, not from the cut checkpoint-4
    assert logged_losses(again)[2:] == logged_losses(full)[2:]
    for (name, a), b in zip(again.model.named_parameters(), full.model.parameters()):
        assert torch.equal(a, b), name


def _attempt(folder: Path, attempt: int, errors: dict[int, str], progress: dict | None = None,
             signals: dict[int, int] | None = None, best: int | None = None):
    for rank, line in errors.items():
        (folder / f"error.{attempt}.rank{rank}.json").write_text(json.dumps({"error": line, "time": 1.0}))
    if progress is not None:
        (folder / f"progress.{attempt}.json").write_text(json.dumps(progress))
    outcome = SimpleNamespace(signals=signals or {}, hung=[], first_exit=2.0)
    return describe_attempt(str(folder), attempt, 1, outcome, 3.0, best)


def test_the_same_failure_twice_without_progress_stops(tmp_path):
    boom = "RuntimeError: crash at step 0"
    first = _attempt(tmp_path, 0, {0: boom, 1: "RuntimeError: Connection reset by peer"})
    assert first.causes == [f"{boom} (rank 0)"] and first.failed_at == 1.0
    second = _attempt(tmp_path, 1, {0: boom, 1: boom})
    assert first.signature == second.signature == (boom,)
    assert not second.progressed and should_stop([first, second])
    other = _attempt(tmp_path, 2, {1: "ValueError: another bug"})
    assert not should_stop([second, other])
    # killed twice, but the second attempt went beyond every earlier step: a restart is worth it
    killed = [_attempt(tmp_path, 3 + i, {}, {"step": step, "resumed": 2, "saved": None},
                       {1: signal.SIGKILL, 0: signal.SIGTERM}, best) for i, (step, best) in enumerate([(5, 4), (7, 5)])]
    assert killed[0].causes == ["rank 1 killed by SIGKILL"] and not should_stop(killed)
    stuck = _attempt(tmp_path, 5, {}, {"step": 7, "resumed": 6, "saved": None}, {1: signal.SIGKILL}, 7)
    assert should_stop([killed[1], stuck])


def test_the_launchers_variables_are_read_exactly():
    assert restart_facts({}) is None
    facts = restart_facts({RESTART_DIR_ENV: "/r", RESTART_COUNT_ENV: "2", LAST_STEP_ENV: "0"})
    assert (facts.attempt, facts.last_step, facts.is_restart) == (2, 0, True)  # step 0 is a step, not "none"
    with pytest.raises(ValueError, match=f"{RESTART_COUNT_ENV}='two'"):
        restart_facts({RESTART_DIR_ENV: "/r", RESTART_COUNT_ENV: "two"})


def test_max_restarts_is_checked(capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    assert cli_main(["launch", "--max_restarts", "-1", str(script)]) == 2
    assert "--max-restarts(-1) must be >= 0" in capsys.readouterr().err


def test_notebook_launcher_restarts_a_failed_function(monkeypatch, capsys):
    """notebook_launcher(max_restarts=N) over shardkit.launch: a fake launch here (the loop is what is tested)."""
    from shardkit.accelerate_compat import notebook_launcher
    from shardkit.distributed import launcher

    calls = []

    def fake_launch(fn, args, env, in_process, **kwargs):
        calls.append(env[RESTART_COUNT_ENV])
        if fail[len(calls) - 1]:
            trace = f"Traceback (most recent call last):\n  File \"x.py\", line 1\n{fail[len(calls) - 1]}\n"
            raise launcher.LaunchError("failed", failed_ranks=[0], exitcodes={0: 1}, tracebacks={0: trace})
        return ["done"]

    import shardkit.distributed as package

    # the package's lazy export caches what it resolves: patch it too, so that the fake never outlives this test
    monkeypatch.setattr(package, "launch", fake_launch)
    monkeypatch.setattr(launcher, "launch", fake_launch)
    fail = ["OSError: flaky disk", "ValueError: bad row 3", None]
    assert notebook_launcher(print, num_processes=2, max_restarts=3) == ["done"] and calls == ["0", "1", "2"]
    calls.clear()
    fail = ["ValueError: bad row 3"] * 4
    with pytest.raises(launcher.LaunchError):
        notebook_launcher(print, num_processes=2, max_restarts=3)
    assert calls == ["0", "1"]  # the same error twice without progress: no third attempt
    assert "failed the same way as attempt 1 and made no progress" in capsys.readouterr().err


def _read_restart_count():
    import os

    return os.environ.get(RESTART_COUNT_ENV), os.environ.get(RESTART_DIR_ENV)


def test_a_launch_inside_a_restarted_job_is_a_first_start(monkeypatch, tmp_path):
    """A job that launches another (a script calling shardkit launch, notebook_launcher in a rank) must not pass its
    own restart variables on: the inner ranks would resume stale checkpoints and write over the outer records."""
    import argparse

    from shardkit.distributed import cli as launch_cli
    from shardkit.distributed.launcher import launch

    _restarted(monkeypatch, tmp_path, 2)
    env = launch_cli._child_env(argparse.Namespace(timeout=None, num_processes=1), {})
    assert RESTART_COUNT_ENV not in env and RESTART_DIR_ENV not in env
    assert launch(_read_restart_count, in_process=True) == [(None, None)]
