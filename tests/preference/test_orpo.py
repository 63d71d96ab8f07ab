"""shardkit's ORPOTrainer against TRL's (trl.experimental.orpo) on the same tiny Llama, rows and seed: per-step
loss, metrics, gradients and weights after 3 steps (CPU, fp32); bad rows named."""

from __future__ import annotations

import pytest

from tests.preference.conftest import rows
from tests.preference.family_runs import assert_same_runs, run

METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen"]


def test_orpo_matches_trl(model, tokenizer, tmp_path):
    pytest.importorskip("datasets")
    orpo = pytest.importorskip("trl.experimental.orpo")
    from transformers import TrainerCallback

    from shardkit.preference import ORPOConfig, ORPOTrainer
    from shardkit.trainer.callbacks import TrainerCallback as OurCallback

    settings = dict(max_length=24, beta=0.5)  # short enough that some answers are cut
    theirs = run(orpo.ORPOTrainer, orpo.ORPOConfig, TrainerCallback, model, rows(), tokenizer, tmp_path, trl=True,
                 **settings)
    ours = run(ORPOTrainer, ORPOConfig, OurCallback, model, rows(), tokenizer, tmp_path, trl=False, **settings)
    assert_same_runs(ours, theirs, METRICS, model)
