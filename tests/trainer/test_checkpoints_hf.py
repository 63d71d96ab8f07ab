"""Checkpoints Hugging Face's tools read and write: from_pretrained on checkpoint-N, resuming a checkpoint HF's
Trainer wrote (weights from safetensors, optimizer and scheduler only through weights_only loading), and the
trainer state as hostile input (issue 23 item 1, issue 30)."""

import json
import logging
import os
import shutil
import stat

import pytest
import torch
from trainer_tiny import Line, Regression, Tokens, hf_trainer_checkpoint, logged_after, tiny_llama

from shardkit.checkpoint.format import CheckpointError
from shardkit.trainer import Trainer, TrainerCallback, TrainerState, TrainerStateError, TrainingArguments
from shardkit.trainer.loss_tracker import LossTracker


def _args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=4, learning_rate=1e-2, optim="adamw_torch",
                disable_tqdm=True, seed=0, max_steps=2, save_strategy="steps", save_steps=2, logging_steps=1)
    return TrainingArguments(**{**base, **kw})


def _plain_mode(path) -> bool:
    umask = os.umask(0)
    os.umask(umask)
    return stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask


def test_checkpoint_and_save_model_load_with_from_pretrained(tmp_path):
    from transformers import LlamaForCausalLM

    trainer = Trainer(tiny_llama(), _args(tmp_path / "out"), train_dataset=Tokens())
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    for name in ("config.json", "model.safetensors", "trainer_state.json", "shardkit.json"):
        assert (checkpoint / name).is_file(), name
    loaded = LlamaForCausalLM.from_pretrained(checkpoint)
    mine = trainer.model.state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in loaded.state_dict().items())
    trainer.save_model(str(tmp_path / "export"))
    again = LlamaForCausalLM.from_pretrained(tmp_path / "export")
    assert all(torch.equal(v, mine[k]) for k, v in again.state_dict().items())
    assert _plain_mode(tmp_path / "export" / "model.safetensors") and _plain_mode(checkpoint / "config.json")


class _AtStart(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        self.step = state.global_step
        self.weights = {k: v.clone() for k, v in model.state_dict().items()}
        self.exp_avg = {id(p): optimizer.state[p]["exp_avg"].clone() for g in optimizer.param_groups
                        for p in g["params"] if p in optimizer.state}
        self.last_epoch = lr_scheduler.last_epoch


def test_resume_from_a_checkpoint_hugging_faces_trainer_wrote(tmp_path, caplog):
    checkpoint, hf = hf_trainer_checkpoint(tmp_path)
    start = _AtStart()
    trainer = Trainer(tiny_llama(seed=1), _args(tmp_path / "out", max_steps=4), train_dataset=Tokens(),
                      callbacks=[start])
    with caplog.at_level(logging.INFO, logger="shardkit.trainer"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert start.step == 2 and start.last_epoch == 2 and trainer.state.global_step == 4
    hf_weights = hf.model.state_dict()
    assert all(torch.equal(v, hf_weights[k]) for k, v in start.weights.items())
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]
    names = [n for n, _ in trainer.model.named_parameters()]
    by_name = dict(zip(names, trainer.model.parameters()))
    # HF's group order: decayed weights first, then biases and norms; the same parameters, matched by name.
    order = trainer.get_decay_parameter_names(trainer.model)
    order += [n for n in names if n not in order]
    assert all(torch.equal(start.exp_avg[id(by_name[n])], saved[i]["exp_avg"]) for i, n in enumerate(order))
    assert f"resumed from {checkpoint} at step 2" in caplog.text


@pytest.mark.parametrize("schedule,rates", [("linear", [0.005, 0.0025]), ("constant", [0.01, 0.01])])
def test_resuming_a_hugging_face_checkpoint_continues_its_run_exactly(tmp_path, schedule, rates):
    """A 4-step run resumed at checkpoint-2: under the linear schedule step 3 runs at 0.005 (the rate the schedule
    reached, from the file's param groups and the loaded scheduler), not at the initial 0.01, and the remaining
    steps' losses and rates are those of Hugging Face's uninterrupted run. (Hugging Face's constant schedule is a
    plain function, shardkit's a partial: their saved states differ in form and load alike.)"""
    checkpoint, hf = hf_trainer_checkpoint(tmp_path, max_steps=4, schedule=schedule)
    trainer = Trainer(tiny_llama(seed=1), _args(tmp_path / "out", max_steps=4, save_strategy="no",
                                                lr_scheduler_type=schedule), train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=str(checkpoint))
    mine, theirs = logged_after(trainer.state.log_history, 2), logged_after(hf.state.log_history, 2)
    assert [(s, lr) for s, _, lr in mine] == [(s, lr) for s, _, lr in theirs] == [(3, rates[0]), (4, rates[1])]
    assert [loss for _, loss, _ in mine] == pytest.approx([loss for _, loss, _ in theirs], abs=2e-6)


def test_a_pickle_that_runs_code_is_never_loaded(tmp_path):
    checkpoint, _ = hf_trainer_checkpoint(tmp_path)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"state": Payload(), "param_groups": []}, checkpoint / "optimizer.pt")
    trainer = Trainer(tiny_llama(seed=1), _args(tmp_path / "out", max_steps=3), train_dataset=Tokens())
    with pytest.raises(CheckpointError, match="weights_only"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert not marker.exists()


@pytest.mark.parametrize("content,field", [
    ("{not json", "not valid JSON"), ("[1, 2]", "JSON object"), ('{"global_step": "abc"}', "'global_step'"),
    ('{"log_history": "text"}', "'log_history'"), ('{"global_step": -5}', "'global_step'"),
    ('{"global_step": 1000000000000, "max_steps": 10}', "past max_steps"),
])
def test_trainer_state_is_checked(tmp_path, content, field):
    path = tmp_path / "trainer_state.json"
    path.write_text(content)
    with pytest.raises(TrainerStateError, match=field) as err:
        TrainerState.load_from_json(path)
    assert str(path) in str(err.value)


def test_a_tampered_state_in_a_checkpoint_is_refused_naming_it(tmp_path):
    checkpoint, _ = hf_trainer_checkpoint(tmp_path)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["global_step"] = "abc"
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    trainer = Trainer(tiny_llama(seed=1), _args(tmp_path / "out", max_steps=3), train_dataset=Tokens())
    with pytest.raises(TrainerStateError, match="trainer_state.json: field 'global_step'"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    tracker = LossTracker(trainer.runner, True, True)
    for bad in ([1.0], {"pending": "x"}, {"total": [float("nan"), 1]}, {"total": [1.0, -2]}, {"last": "a"}):
        with pytest.raises(ValueError, match="tr_loss"):
            tracker.load_state_dict(bad, "ckpt")


def test_resuming_on_another_dataset_size_logs_and_continues(tmp_path, caplog):
    args = dict(per_device_train_batch_size=2, optim="sgd", max_steps=6, save_steps=3, learning_rate=0.1)
    Trainer(Line(), _args(tmp_path / "out", **args), train_dataset=Regression(16)).train()
    trainer = Trainer(Line(), _args(tmp_path / "out", **args), train_dataset=Regression(20))
    with caplog.at_level(logging.WARNING, logger="shardkit.trainer"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    assert "cannot be restored exactly" in caplog.text and "20" in caplog.text
    assert trainer.state.global_step == 6


def test_a_missing_checkpoint_is_named(tmp_path):
    trainer = Trainer(Line(), _args(tmp_path / "out", per_device_train_batch_size=2), train_dataset=Regression(8))
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        trainer.train(resume_from_checkpoint=True)
    shutil.rmtree(tmp_path / "out", ignore_errors=True)


def _fake_checkpoints(root, steps_and_ages):
    for step, age in steps_and_ages:
        path = root / f"checkpoint-{step}"
        path.mkdir(parents=True)
        (path / "shardkit.json").write_text("{}")
        os.utime(path, (1_000_000 - age, 1_000_000 - age))


@pytest.mark.parametrize(("limit", "best", "kept"), [
    # checkpoint-10 is an earlier run's; this run resumed from checkpoint-5 and wrote 6 and 7: by age, as
    # transformers orders them, 7 is the most recent (kept to resume from), 10 the oldest.
    (2, None, [6, 7]), (1, None, [7]), (1, 5, [5, 7]), (3, 10, [6, 7, 10]), (None, None, [5, 6, 7, 10]),
])
def test_rotation_orders_by_age_and_keeps_the_newest_and_the_best(tmp_path, limit, best, kept):
    from shardkit.trainer.checkpointing import Checkpointer

    _fake_checkpoints(tmp_path, [(10, 40), (5, 30), (6, 20), (7, 10)])
    args = TrainingArguments(output_dir=str(tmp_path), save_total_limit=limit)
    Checkpointer(None, args).rotate(str(tmp_path / f"checkpoint-{best}") if best else None)
    assert sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-*")) == kept


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    checkpoint, _ = hf_trainer_checkpoint(tmp_path_factory.mktemp("hf"))
    return checkpoint


def _refused_resume(tmp_path, checkpoint, name, content, match):
    """``content`` written as ``name`` into a copy of the checkpoint: the resume is refused naming the file and
    ``match``, and the model and optimizer are left as they were."""
    copy = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, copy)
    if isinstance(content, bytes):
        (copy / name).write_bytes(content)
    else:
        torch.save(content, copy / name)
    trainer = Trainer(tiny_llama(seed=1), _args(tmp_path / "out", max_steps=4), train_dataset=Tokens())
    with pytest.raises(CheckpointError, match=match) as err:
        trainer.train(resume_from_checkpoint=str(copy))
    assert str(copy / name) in str(err.value)
    fresh = tiny_llama(seed=1).state_dict()
    assert all(torch.equal(v, fresh[k]) for k, v in trainer.model.state_dict().items())
    optimizer = trainer.optimizer
    assert optimizer is None or (not optimizer.state and all(g["lr"] == 1e-2 for g in optimizer.param_groups))
    return str(err.value)


def _zip_bomb(inflated: int) -> bytes:
    """A torch.save-shaped zip whose deflated data.pkl (about a 1000th of its size) inflates to ``inflated``
    bytes."""
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as z:
        with z.open("archive/data.pkl", "w", force_zip64=True) as f:
            block = b"\0" * (1 << 20)
            for _ in range(inflated >> 20):
                f.write(block)
        z.writestr("archive/version", "3\n")
    return buffer.getvalue()


def test_a_zip_bomb_optimizer_file_is_refused_before_it_is_inflated(tmp_path, hf_checkpoint):
    bomb = _zip_bomb(64 << 20)  # under the pickle cap: the directory's ratio refuses it
    assert len(bomb) < 1 << 20
    _refused_resume(tmp_path, hf_checkpoint, "optimizer.pt", bomb,
                    r"'archive/data\.pkl' declares 67108864 bytes inflated from \d+, .*a compression bomb")


def _optimizer_with(change):
    def build(checkpoint):
        saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
        change(saved)
        return saved
    return build


def _set(path, value):
    def change(saved):
        *parents, last = path
        target = saved
        for key in parents:
            target = target[key]
        target[last] = value
    return change


def _as_sgd(saved):
    for group in saved["param_groups"]:
        del group["betas"]
        group.update(momentum=0.9, nesterov=False)


@pytest.mark.parametrize("change,match", [
    (_set(("evil",), 1), "the top level is .*'evil'.*not an optimizer state dict"),
    (_set(("param_groups",), "groups"), "param_groups is not a list of dicts"),
    (_set(("param_groups", 1, "params", 0), 0), r"param_groups index the parameters .* not 0\.\.20 once each"),
    (_set(("param_groups", 1, "params"), [16, 17]), "optimizer state for 18 parameters, the model trains 21"),
    (lambda saved: saved["param_groups"][0].pop("lr"), r"param_groups\[0\] has no 'lr'"),
    (_set(("param_groups", 0, "lr"), -1.0), r"param_groups\[0\]\.lr is -1\.0, below 0"),
    (_set(("param_groups", 0, "betas"), "fast"), r"param_groups\[0\]\.betas is 'fast', not 2 values"),
    (_set(("param_groups", 0, "weight_decay"), float("nan")), r"param_groups\[0\]\.weight_decay is nan"),
    (_set(("state", 0, "step"), torch.tensor(-5.0)), r"state\[0\] \(.*\)\['step'\] is .*not a step count >= 0"),
    (_set(("state", 0, "exp_avg"), torch.zeros(3)), r"\['exp_avg'\] has shape \[3\], the parameter \[64, 16\]"),
    (_set(("state", 0, "exp_avg_sq"), torch.full((64, 16), float("nan"))), "NaN or infinite"),
    (_set(("state", 0), "entry"), r"state\[0\] .* is 'entry', not a dict"),
    (_set(("state", 99), {}), r"state has entries \[99\] for no parameter"),
    (_as_sgd, r"param_groups\[0\] lacks 'betas' and has 'momentum', 'nesterov', fields this run's AdamW"),
])
def test_an_optimizer_file_of_the_wrong_structure_is_refused_by_field(tmp_path, hf_checkpoint, change, match):
    text = _refused_resume(tmp_path, hf_checkpoint, "optimizer.pt", _optimizer_with(change)(hf_checkpoint), match)
    assert "delete optimizer.pt" in text or "resume with the model it was saved with" in text


@pytest.mark.parametrize("change,match", [
    (lambda saved: saved.pop("base_lrs"), "the state lacks keys: 'base_lrs'"),
    (_set(("evil",), 1), "the state has keys this scheduler lacks: 'evil'"),
    (_set(("last_epoch",), "abc"), "'last_epoch' is 'abc', not an integer"),
    (_set(("last_epoch",), -5), "'last_epoch' is -5, below 0"),
    (_set(("_last_lr",), [0.005]), r"'_last_lr' is \[0\.005\], not 2 values"),
    (_set(("base_lrs",), [-1.0, 0.01]), "'base_lrs' is .*a learning rate below 0"),
    (_set(("lr_lambdas",), [{}, {"func": 1}]), r"'lr_lambdas'\[1\] has keys this scheduler lacks: 'func'"),
])
def test_a_scheduler_file_of_the_wrong_structure_is_refused_by_field(tmp_path, hf_checkpoint, change, match):
    saved = torch.load(hf_checkpoint / "scheduler.pt", weights_only=True)
    change(saved)
    text = _refused_resume(tmp_path, hf_checkpoint, "scheduler.pt", saved, match)
    assert "delete scheduler.pt" in text
