"""shardkit's DPOTrainer against TRL 1.x's on the same tiny Llama, rows and seed: per-step loss, rewards, logps,
mean logits, entropy, token accuracy, token count and gradients for every loss_type, three steps (CPU, fp32)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.preference.conftest import rows

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

LOSS_TYPES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]
METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy", "num_tokens"]
STEPS = 3
STEEP = {"sppo_hard", "discopop"}


def _settings(loss_type):
    extra = {"label_smoothing": 1e-3} if loss_type in ("exo_pair",) else {}
    if loss_type == "robust":
        extra = {"label_smoothing": 0.1}
    return dict(per_device_train_batch_size=8, max_steps=STEPS, learning_rate=2e-3, lr_scheduler_type="constant",
                optim="sgd",  # Adam (and big steps) would turn fp32 rounding into visible differences
                logging_steps=1, report_to="none", gradient_checkpointing=False, max_grad_norm=0.0, seed=0,
                max_length=64, beta=0.5, loss_type=[loss_type], save_strategy="no", disable_tqdm=True, **extra)


class _Record:
    """Per step: the loss and the gradients just before the optimizer step."""

    def __init__(self):
        self.losses, self.grads = [], []

    def callback(self, base):
        record = self

        class Grads(base):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                model = kwargs["model"]
                record.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                                     if p.grad is not None})
        return Grads()


def _run_trl(model, tokenizer, loss_type, tmp_path):
    record = _Record()

    class Trainer(trl.DPOTrainer):
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            record.losses.append(loss.detach().item())
            return loss

    from transformers import TrainerCallback

    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, **_settings(loss_type))
    trainer = Trainer(model=copy.deepcopy(model), ref_model=copy.deepcopy(model), args=args,
                      train_dataset=datasets.Dataset.from_list(rows()), processing_class=tokenizer,
                      callbacks=[record.callback(TrainerCallback)])
    trainer.train()
    return record, [h for h in trainer.state.log_history if "rewards/chosen" in h], trainer.model


def _run_shardkit(model, tokenizer, loss_type, tmp_path, **overrides):
    from shardkit.preference import DPOConfig, DPOTrainer
    from shardkit.trainer.callbacks import TrainerCallback

    record = _Record()

    class Trainer(DPOTrainer):
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            record.losses.append(loss.detach().item())
            return loss

    args = DPOConfig(output_dir=str(tmp_path / "shardkit"), use_cpu=True, **{**_settings(loss_type), **overrides})
    trainer = Trainer(copy.deepcopy(model), args=args, train_dataset=datasets.Dataset.from_list(rows()),
                      processing_class=tokenizer, callbacks=[record.callback(TrainerCallback)])
    trainer.train()
    return record, [h for h in trainer.state.log_history if "rewards/chosen" in h], trainer.model


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_dpo_matches_trl(model, tokenizer, loss_type, tmp_path):
    theirs, their_logs, their_model = _run_trl(model, tokenizer, loss_type, tmp_path)
    ours, our_logs, our_model = _run_shardkit(model, tokenizer, loss_type, tmp_path)
    assert len(ours.losses) == len(theirs.losses) == STEPS
    assert ours.losses == pytest.approx(theirs.losses, abs=1e-5, rel=1e-5)
    assert len(our_logs) == len(their_logs) == STEPS
    for mine, other in zip(our_logs, their_logs):
        for key in METRICS:
            assert mine[key] == pytest.approx(other[key], abs=1e-5, rel=1e-5), key
    assert len(ours.grads) == len(theirs.grads) == STEPS
    for step, (mine, other) in enumerate(zip(ours.grads, theirs.grads)):
        assert set(mine) == set(other)
        # Within 1e-5 of the gradient's scale. Once the policy has moved, log pi - log pi_ref cancels two fp32 sums
        # of ~-100 (an ulp of 8e-6 each): the losses whose gradient is steep in it (sppo_hard's square, discopop's
        # exponential) carry that into gradients 4-6e-5 of their scale apart, as any two fp32 implementations would.
        tolerance = 1e-4 if step > 0 and loss_type in STEEP else 1e-5
        for name in mine:
            scale = max(1.0, other[name].abs().max().item())
            diff = (mine[name] - other[name]).abs().max().item()
            assert diff <= tolerance * scale, f"step {step} {name}: max difference {diff:.3g}, scale {scale:.3g}"
    moved = max((p - q).abs().max().item() for p, q in zip(our_model.parameters(), model.parameters()))
    assert moved > 1e-4  # the steps did train
    for (name, p), q in zip(our_model.named_parameters(), their_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)
    assert all(math.isfinite(v) for v in ours.losses)
