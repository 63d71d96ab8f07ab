"""Models, data and callbacks the Trainer's tests share (unit and distributed alike), kept in one place so the
copies cannot drift. ``tests/conftest.py`` puts this folder on ``sys.path``; spawned ranks inherit it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from shardkit.models import ByteTextDataset
from shardkit.trainer import TrainerCallback

__all__ = ["TEXT", "FixedRows", "GradCatcher", "LogitsOnly", "StopAt", "SumLossLM", "VarLen", "full_state_dict",
           "logged_losses", "pad_collate", "text_data"]

TEXT = Path(__file__).resolve().parents[1] / "examples" / "data" / "public_domain.txt"


def text_data(n: int = 64, seq_len: int = 16) -> Subset:
    """The first ``n`` rows of the public-domain text as byte tokens, ``seq_len`` each, not overlapping."""
    return Subset(ByteTextDataset(TEXT, seq_len=seq_len, stride=seq_len), range(n))


def logged_losses(trainer) -> list[float]:
    """The training losses the Trainer logged, in order."""
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


class SumLossLM(nn.Module):
    """A causal LM whose forward takes num_items_in_batch by name and returns sum / num_items_in_batch."""

    loss_type = "ForCausalLM"

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(32, 16)
        self.out = nn.Linear(16, 32)

    def forward(self, input_ids, labels=None, num_items_in_batch=None):
        logits = self.out(torch.tanh(self.emb(input_ids)))
        if labels is None:
            return logits
        total = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 32), labels[:, 1:].reshape(-1),
                                            ignore_index=-100, reduction="sum")
        return total / (num_items_in_batch if num_items_in_batch is not None else (labels[:, 1:] != -100).sum())


class LogitsOnly(SumLossLM):
    """No labels argument: the Trainer owns the loss and takes it from the logits."""

    def forward(self, input_ids):
        return super().forward(input_ids)


class VarLen(Dataset):
    """``n`` rows of 3 to 11 random tokens (seeded): padded batches whose item counts differ."""

    def __init__(self, n=16):
        g = torch.Generator().manual_seed(5)
        self.rows = [torch.randint(0, 32, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g)
                     for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


class FixedRows(torch.utils.data.IterableDataset):
    """A stream (no length) of ``n`` rows of 8 tokens, each row its own: every row weighs alike in a mean loss."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"input_ids": torch.tensor([(3 * t + 5 * i) % 31 + 1 for t in range(8)])}


def pad_collate(samples):
    """Right-pad ``input_ids`` with 0 and ``labels`` with -100."""
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), -100)
    for i, s in enumerate(samples):
        ids[i, : len(s["input_ids"])] = s["input_ids"]
        labels[i, : len(s["input_ids"])] = s["input_ids"]
    return {"input_ids": ids, "labels": labels}


class GradCatcher(TrainerCallback):
    """The gradients just before the optimizer step, by the user's parameter names (any wrapper's prefix off)."""

    grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters()}


class StopAt(TrainerCallback):
    """Stop training after global step ``step``, as a preempted job would."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def full_state_dict(runner, model) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of ``model``'s state dict on every rank; a collective. It holds the whole model
    on each rank at once, which suits comparisons of tiny models (``save_model`` streams instead)."""
    module = runner.unwrap_model(model)
    out = {}
    # ZeRO-3 partitions parameters outside this context; FSDP2 holds DTensors (full_tensor gathers).
    with runner.gathered_parameters(list(module.parameters())):
        for key, value in module.state_dict().items():
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            out[key] = value.detach().cpu().clone()
    return out
