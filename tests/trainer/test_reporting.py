"""report_to through observability.trackers: every tracker registered there is a reporter, with Hugging Face's tags."""

import json
from pathlib import Path

import pytest
from trainer_tiny import Line, Regression

from shardkit.observability.trackers import TRACKERS, Tracker
from shardkit.trainer import Trainer, TrainingArguments
from shardkit.trainer.reporting import available_reporters, reporter_names


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, learning_rate=0.1, optim="sgd",
                save_strategy="no", disable_tqdm=True, seed=0, num_train_epochs=1, logging_steps=2,
                eval_strategy="steps", eval_steps=4)
    return TrainingArguments(**{**base, **kw})


class Recorder(Tracker):
    """A tracker that keeps what it is given (the module-level list lets the test read it back)."""

    records: list = []

    def store_init_configuration(self, values):
        Recorder.records.append(("config", self.run_name, values))

    def log(self, values, step=None, **kwargs):
        Recorder.records.append(("log", step, values))

    def finish(self):
        Recorder.records.append(("finish",))


def test_a_tracker_registered_in_shardkit_tracking_is_a_reporter(tmp_path, monkeypatch):
    for table in ("_entries", "_keys"):  # the registration is undone with the test
        monkeypatch.setattr(TRACKERS, table, dict(getattr(TRACKERS, table)))
    TRACKERS.register("recorder_test", f"{__name__}:Recorder")
    assert "recorder_test" in reporter_names() and "recorder_test" in available_reporters()
    Recorder.records.clear()
    args = _args(tmp_path, report_to="recorder_test", run_name="runs/a")
    Trainer(Line(), args, train_dataset=Regression(16), eval_dataset=Regression(8)).train()
    kind, run, config = Recorder.records[0]
    assert (kind, run, config["learning_rate"]) == ("config", "runs_a", 0.1)  # a path becomes one name
    logs = [r for r in Recorder.records if r[0] == "log"]
    assert {"train/loss", "train/learning_rate"} <= set(logs[0][2]) and logs[0][1] == 2
    assert any("eval/loss" in values for _, _, values in logs)  # eval_loss -> eval/loss, as HF's reporters
    assert Recorder.records[-1] == ("finish",)


def test_jsonl_keeps_the_log_history_keys_after_the_arguments(tmp_path):
    args = _args(tmp_path, report_to="jsonl")
    trainer = Trainer(Line(), args, train_dataset=Regression(16), eval_dataset=Regression(8))
    trainer.train()
    (path,) = Path(args.logging_dir).glob("*.jsonl")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["config"]["output_dir"] == args.output_dir
    assert [{k: v for k, v in x.items() if k != "time"} for x in lines[1:]] == \
        [{"step": h["step"], **h} for h in trainer.state.log_history]


def test_tensorboard_scalars_carry_hf_tags(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = _args(tmp_path, report_to="tensorboard")
    Trainer(Line(), args, train_dataset=Regression(16), eval_dataset=Regression(8)).train()
    (run,) = [p for p in Path(args.logging_dir).iterdir() if p.is_dir()]
    events = EventAccumulator(str(run))
    events.Reload()
    assert {"train/loss", "eval/loss"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4]
