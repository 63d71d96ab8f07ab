"""shardkit's CPOTrainer against TRL's (trl.experimental.cpo) on the same tiny Llama, rows and seed: SimPO (with
CPO's NLL term), AlphaPO (SimPO without it, shaped rewards) and CPO's sigmoid loss with label smoothing; per-step
loss, metrics, gradients and weights after 3 steps (CPU, fp32); bad rows named."""

from __future__ import annotations

import pytest

from tests.preference.conftest import rows
from tests.preference.family_runs import assert_same_runs, run

METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss"]


@pytest.mark.parametrize("settings", [dict(loss_type="simpo", simpo_gamma=0.3),
                                      dict(loss_type="alphapo", alpha=0.1),
                                      dict(loss_type="sigmoid", label_smoothing=0.1)],
                         ids=["simpo", "alphapo", "sigmoid"])
def test_cpo_matches_trl(model, tokenizer, tmp_path, settings):
    pytest.importorskip("datasets")
    cpo = pytest.importorskip("trl.experimental.cpo")
    from transformers import TrainerCallback

    from shardkit.preference import CPOConfig, CPOTrainer
    from shardkit.trainer.callbacks import TrainerCallback as OurCallback

    settings = dict(max_length=24, beta=2.0, **settings)
    theirs = run(cpo.CPOTrainer, cpo.CPOConfig, TrainerCallback, model, rows(), tokenizer, tmp_path, trl=True,
                 **settings)
    ours = run(CPOTrainer, CPOConfig, OurCallback, model, rows(), tokenizer, tmp_path, trl=False, **settings)
    assert_same_runs(ours, theirs, METRICS, model)


def test_bad_pairs_are_named(model, tokenizer, tmp_path):
    from shardkit.preference import CPOConfig, CPOTrainer

    args = CPOConfig(str(tmp_path), use_cpu=True, report_to="none", max_length=32)
    good = rows(2)
    cases = [
        ([*good, {"prompt": "The sky", "chosen": " is blue."}], "row 2, field 'rejected'.*no 'rejected'"),
        ([*good, {"prompt": "The sky", "chosen": " is blue.", "rejected": ""}], "row 2, field 'rejected'.*empty"),
        ([*good, {"prompt": "The sky " * 40, "chosen": " is blue.", "rejected": " red."}],
         "row 2, field 'prompt'.*max_length=32"),
        ([*good, {"prompt": "The sky", "chosen": [{"role": "assistant", "content": "blue"}], "rejected": " red."}],
         "row 2, field 'rejected'.*both be text or both message lists"),
    ]
    for data, message in cases:
        with pytest.raises(ValueError, match=message):
            CPOTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
