"""Issue 30: the JSON state files of a Runner checkpoint (runner.json, precision.json, entries.json) are
schema-checked on load, with errors naming the file and the field; optimizer state of the wrong shape fails at
load naming the parameter (torch would only fail at the first step, naming neither)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from ckpt_corpus import _rehash
from corpus_tools import outcome, report, verdict
from torch import nn

from shardkit import Runner
from shardkit.checkpoint import CheckpointError, load_optimizer_state_by_name, optimizer_state_by_name


def _edit(file: str, fn: Callable[[object], object]) -> Callable[[Path], None]:
    """Rewrites ``file`` of the checkpoint with ``fn(content)`` and keeps the manifest's hash in step, so the
    schema (not the hash) is what the load trips on."""
    def build(d: Path) -> None:
        obj = json.loads((d / file).read_text())
        (d / file).write_text(json.dumps(fn(obj)))
        _rehash(d, file)
    return build


def _without(key: str) -> Callable[[dict], dict]:
    return lambda o: {k: v for k, v in o.items() if k != key}


def _with(key: str, value: object) -> Callable[[dict], dict]:
    return lambda o: {**o, key: value}


_SCALER = {"scale": 65536.0, "hysteresis_left": 2, "good_steps": 0, "skipped_steps": 0}

# name -> (builder, texts the CheckpointError must contain: the file and the field)
CASES: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "runner_no_micro_step": (_edit("runner.json", _without("micro_step")), ("runner.json", "'micro_step'", "missing")),
    "runner_micro_step_string": (_edit("runner.json", _with("micro_step", "abc")), ("runner.json", "'micro_step'")),
    "runner_micro_step_negative": (_edit("runner.json", _with("micro_step", -1)), ("runner.json", "'micro_step'")),
    "runner_micro_step_past_window": (_edit("runner.json", _with("micro_step", 4)), ("runner.json", "in 0..1")),
    "runner_boundary_string": (_edit("runner.json", _with("boundary", "yes")), ("runner.json", "'boundary'")),
    "runner_steps_huge": (_edit("runner.json", _with("optimizer_steps", 10**20)), ("runner.json", "'optimizer_steps'")),
    "runner_steps_float": (_edit("runner.json", _with("optimizer_steps", 2.5)), ("runner.json", "'optimizer_steps'")),
    "runner_accumulation_zero": (_edit("runner.json", _with("gradient_accumulation_steps", 0)),
                                 ("runner.json", "'gradient_accumulation_steps'")),
    "runner_a_list": (_edit("runner.json", lambda o: [o]), ("runner.json", "must be an object")),
    "precision_a_list": (_edit("precision.json", lambda o: [1, 2]), ("precision.json", "must be an object")),
    "precision_scaler_list": (_edit("precision.json", lambda o: {"loss_scaler": [1]}),
                              ("precision.json", "'loss_scaler'")),
    "precision_scaler_unknown_field": (_edit("precision.json", lambda o: {"loss_scaler": {**_SCALER, "update": 1}}),
                                       ("precision.json", "'loss_scaler.update'")),
    "precision_scale_nan": (_edit("precision.json", lambda o: {"loss_scaler": {**_SCALER, "scale": math.nan}}),
                            ("precision.json", "'loss_scaler.scale'")),
    "precision_scale_string": (_edit("precision.json", lambda o: {"loss_scaler": {**_SCALER, "scale": "big"}}),
                               ("precision.json", "'loss_scaler.scale'")),
    "precision_no_good_steps": (_edit("precision.json", lambda o: {"loss_scaler": _without("good_steps")(_SCALER)}),
                                ("precision.json", "'loss_scaler.good_steps'")),
    "entries_a_list": (_edit("entries.json", lambda o: ["model"]), ("entries.json",)),
    "entries_kind_number": (_edit("entries.json", lambda o: {"model": 1}), ("entries.json",)),
}


def _save(path: Path) -> nn.Module:
    runner = Runner(seed=0, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = runner.setup(nn.Linear(4, 3))
    runner.save(path, {"model": model})
    return model


def test_every_tampered_state_file_gives_a_named_error(tmp_path, capsys):
    failures = {}
    for name, (build, texts) in CASES.items():
        _save(tmp_path / name / "step-1")
        build(tmp_path / name / "step-1")
        runner = Runner(seed=0, gradient_accumulation_steps=2)
        bad = verdict(outcome(lambda: runner.load(tmp_path / name, {"model": nn.Linear(4, 3)})), texts)
        if bad is not None:
            failures[name] = bad
    report(capsys, "state-file corpus", "tampered state files", len(CASES), failures)
    assert not failures, failures


def test_untampered_state_loads_the_accumulation_position(tmp_path):
    saved = _save(tmp_path / "ck" / "step-1")
    runner = Runner(seed=0, gradient_accumulation_steps=2)
    model = runner.setup(nn.Linear(4, 3))
    runner.load(tmp_path / "ck", {"model": model})
    assert torch.equal(model.weight, saved.weight) and runner.optimizer_steps == 0


def _stepped(shape_in: int = 4) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(shape_in, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, shape_in)).sum().backward()
    opt.step()
    return model, opt


def test_optimizer_state_of_the_wrong_shape_fails_at_load_naming_the_parameter():
    model, opt = _stepped()
    state = optimizer_state_by_name(opt, model)
    state["state"]["weight"]["exp_avg"] = torch.zeros(4, 3)  # transposed: as many elements, wrong layout
    fresh, fresh_opt = _stepped()
    with pytest.raises(CheckpointError, match=r"'exp_avg' of parameter 'weight' has shape \[4, 3\], but the "
                                              r"parameter has shape \[3, 4\]"):
        load_optimizer_state_by_name(fresh_opt, fresh, state)
    state["state"]["weight"]["exp_avg"] = torch.zeros(3, 4)
    load_optimizer_state_by_name(fresh_opt, fresh, state)  # the right shape loads
    assert torch.equal(fresh_opt.state[fresh.weight]["exp_avg"], torch.zeros(3, 4))
