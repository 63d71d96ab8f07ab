"""Runs of TRL's KTO/ORPO/CPO trainers and shardkit's on the same tiny Llama, rows and settings, recording per step
the loss, the gradients before the optimizer step and the logged metrics (CPU, fp32)."""

from __future__ import annotations

import copy
import os

import torch

STEPS = 3
COMMON = dict(per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="constant",
              logging_steps=1, report_to="none", gradient_checkpointing=False, max_grad_norm=0.0, seed=0,
              save_strategy="no", disable_tqdm=True, train_sampling_strategy="sequential")


class Record:
    """Per step: the loss compute_loss returned and the gradients just before the optimizer step."""

    def __init__(self):
        self.losses, self.grads = [], []

    def trainer(self, base):
        record = self

        class Recording(base):
            def compute_loss(self, *args, **kwargs):
                loss = super().compute_loss(*args, **kwargs)
                record.losses.append(loss.detach().item())
                return loss

        return Recording

    def callback(self, base):
        record = self

        class Grads(base):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                record.grads.append({n: p.grad.detach().clone() for n, p in kwargs["model"].named_parameters()
                                     if p.grad is not None})

        return Grads()


def run(trainer_cls, config_cls, callback_base, model, rows, tokenizer, tmp_path, *, trl: bool,
        reference: bool = False, **settings):
    """Train ``STEPS`` steps (``reference``: pass a copy of the model as ``ref_model``); returns the record, the
    logged metrics per step and the trained model."""
    import datasets

    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    record = Record()
    place = dict(use_cpu=True, bf16=False) if trl else dict(use_cpu=True)
    args = config_cls(output_dir=str(tmp_path / ("trl" if trl else "shardkit")), **place, **{**COMMON, **settings})
    extra = {"ref_model": copy.deepcopy(model)} if reference else {}
    trainer = record.trainer(trainer_cls)(copy.deepcopy(model), args=args,
                                          train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
                                          callbacks=[record.callback(callback_base)], **extra)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return record, logs, trainer.model


def assert_same_runs(ours, theirs, metrics, model):
    """Losses, logged metrics, gradients and final weights equal within 1e-5."""
    (mine, my_logs, my_model), (other, their_logs, their_model) = ours, theirs
    import pytest

    assert len(mine.losses) == len(other.losses) == STEPS
    assert mine.losses == pytest.approx(other.losses, abs=1e-5, rel=1e-5)
    assert len(my_logs) == len(their_logs) == STEPS
    for step, (a, b) in enumerate(zip(my_logs, their_logs)):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5, rel=1e-5), f"step {step} loss"
        for key in metrics:
            assert (key in a) == (key in b), f"step {step}: {key} logged by one side only"
            if key in b:
                assert a[key] == pytest.approx(b[key], abs=1e-5, rel=1e-5), f"step {step} {key}"
    assert len(mine.grads) == len(other.grads) == STEPS
    for step, (a, b) in enumerate(zip(mine.grads, other.grads)):
        assert set(a) == set(b)
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4, msg=f"step {step} {name}")
    moved = max((p - q).abs().max().item() for p, q in zip(my_model.parameters(), model.parameters()))
    assert moved > 1e-4  # the steps did train
    # The last update: Adam moves a weight by about the learning rate (1e-2) whatever its gradient's size, so a
    # gradient near 0 that the two sides round apart (compared at 1e-5 above) can move a weight 1e-5..1e-4 apart.
    for (name, p), q in zip(my_model.named_parameters(), their_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-4, msg=name)
