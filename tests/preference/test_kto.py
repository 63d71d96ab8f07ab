"""shardkit's KTOTrainer against TRL's on the same tiny Llama, rows and seed: unpaired rows (weighted), paired rows
(unpaired as TRL orders them) and the KL-free apo_zero_unpaired loss; per-step loss, metrics (the KL reference point
included), gradients and weights after 3 steps (CPU, fp32). Bad rows are named; the KL pairs are the batch's own
completions."""

from __future__ import annotations

import math

import pytest
import torch

from tests.preference.conftest import ROWS, rows
from tests.preference.family_runs import assert_same_runs, run

METRICS = ["kl", "entropy", "num_tokens", "logits/chosen", "logits/rejected", "rewards/chosen", "logps/chosen",
           "rewards/rejected", "logps/rejected", "rewards/margins"]


def unpaired() -> list[dict]:
    """Eight rows, five desirable: batches of four hold both kinds."""
    return [{"prompt": p, "completion": c if i % 3 != 2 else r, "label": i % 3 != 2}
            for i, (p, c, r) in enumerate(ROWS)]


@pytest.mark.parametrize("data, settings", [(unpaired, dict(desirable_weight=1.5, undesirable_weight=0.8)),
                                            (rows, {}),
                                            (unpaired, dict(loss_type="apo_zero_unpaired"))],
                         ids=["unpaired", "paired", "apo_zero_unpaired"])
def test_kto_matches_trl(model, tokenizer, tmp_path, data, settings):
    pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    from transformers import TrainerCallback

    from shardkit.preference import KTOConfig, KTOTrainer
    from shardkit.trainer.callbacks import TrainerCallback as OurCallback

    # A smaller step than the other trainers' tests: Adam's first steps move every weight by about the learning
    # rate whatever the gradient's size, and the KL term then subtracts two log-prob sums of ~60 nats, so float32
    # rounding differences between the two implementations grow with the step (1e-2: 3e-5 on the KL).
    settings = dict(max_length=40, beta=0.5, learning_rate=3e-3, **settings)
    theirs = run(trl.KTOTrainer, trl.KTOConfig, TrainerCallback, model, data(), tokenizer, tmp_path, trl=True,
                 reference=True, **settings)
    ours = run(KTOTrainer, KTOConfig, OurCallback, model, data(), tokenizer, tmp_path, trl=False, **settings)
    assert_same_runs(ours, theirs, METRICS, model)
    if settings.get("loss_type") != "apo_zero_unpaired":
        assert any(log["kl"] > 0 for log in ours[1])  # the reference point was exercised, not only clamped


def test_the_kl_pairs_are_the_batchs_own_completions_with_other_prompts():
    from shardkit.preference.kto_data import DataCollatorForUnpairedPreference

    rows_ = [{"prompt_ids": [1, 2], "completion_ids": [3], "label": True},
             {"prompt_ids": [4], "completion_ids": [5, 6], "label": False},
             {"prompt_ids": [7, 8, 9], "completion_ids": [10], "label": True}]
    batch = DataCollatorForUnpairedPreference(pad_token_id=0, max_length=4)(rows_)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [4, 5, 6, 0], [7, 8, 9, 10]]
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 1, 0], [0, 0, 0, 1]]
    # each prompt with the previous row's completion (the first with the last's), cut to max_length
    assert batch["KL_input_ids"].tolist() == [[1, 2, 10, 0], [4, 3, 0, 0], [7, 8, 9, 5]]
    assert batch["KL_completion_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 1]]
    assert batch["label"].tolist() == [True, False, True]
    assert "KL_input_ids" not in DataCollatorForUnpairedPreference(0, kl=False)(rows_)
    assert torch.equal(batch["attention_mask"], (batch["input_ids"] != 0).long())


def test_bad_rows_are_named(model, tokenizer, tmp_path):
    from shardkit.preference import KTOConfig, KTOTrainer

    args = KTOConfig(str(tmp_path), use_cpu=True, report_to="none", max_length=32, per_device_train_batch_size=2)
    good = unpaired()[:2]
    cases = [
        ([*good, {"prompt": "The sky", "completion": " blue."}], "row 2, field 'label'.*no 'label'"),
        ([*good, {"prompt": "The sky", "completion": "", "label": True}], "row 2, field 'completion'.*empty"),
        ([*good, {"prompt": "The sky", "completion": " blue.", "label": "yes"}], "row 2, field 'label'.*True/False"),
        ([*good, {"prompt": "The sky " * 40, "completion": " blue.", "label": True}],
         "row 2, field 'prompt'.*max_length=32"),
        ([*rows(2), {"prompt": "The sky", "chosen": " blue."}], "row 2, field 'rejected'.*no 'rejected'"),
        ([*good, {"prompt": [{"role": "user", "content": "hi"}], "completion": " blue.", "label": True}],
         "row 2, field 'completion'.*both be text or both message lists"),
    ]
    for data, message in cases:
        with pytest.raises(ValueError, match=message):
            KTOTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
    with pytest.raises(ValueError, match="at least 2 rows"):
        KTOTrainer(model, args=KTOConfig(str(tmp_path), per_device_train_batch_size=1), train_dataset=good,
                   processing_class=tokenizer)


def test_evaluate_logs_the_metrics_under_the_eval_prefix(model, tokenizer, tmp_path):
    from shardkit.preference import KTOConfig, KTOTrainer

    args = KTOConfig(str(tmp_path), use_cpu=True, report_to="none", max_length=40, per_device_train_batch_size=4,
                     per_device_eval_batch_size=4, max_steps=1, learning_rate=1e-2)
    trainer = KTOTrainer(model, args=args, train_dataset=unpaired(), eval_dataset=unpaired()[:4],
                         processing_class=tokenizer)
    trainer.train()
    metrics = trainer.evaluate()
    for key in ("eval_loss", "eval_kl", "eval_rewards/chosen", "eval_logps/rejected", "eval_entropy"):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN
    assert metrics["eval_kl"] >= 0


def test_a_peft_model_is_its_own_reference_with_the_adapter_disabled(model, tokenizer, tmp_path):
    peft = pytest.importorskip("peft")
    from shardkit.preference import KTOConfig, KTOTrainer

    args = KTOConfig(str(tmp_path), use_cpu=True, report_to="none", max_length=40, per_device_train_batch_size=4,
                     max_steps=2, learning_rate=1e-2, logging_steps=1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=True)
    trainer = KTOTrainer(model, args=args, train_dataset=unpaired(), processing_class=tokenizer, peft_config=lora)
    assert trainer.ref_model is None  # no copy: the base with the adapter disabled
    trainer.train()
    logs = [h for h in trainer.state.log_history if "rewards/chosen" in h]
    assert logs[0]["rewards/chosen"] == 0.0 and logs[0]["kl"] == 0.0  # a fresh adapter changes nothing yet
    assert logs[1]["rewards/chosen"] != 0.0  # ... and the policy moved away from its reference after a step


def test_deepspeeds_auto_steps_count_the_rows_the_family_prepared(model, tokenizer, tmp_path):
    """The base Trainer is handed no rows (the family prepares its own): a DeepSpeed config's "auto" step counts must
    still come from the rows trained on, not from an empty dataset (None: DeepSpeed's schedule would go unbounded)."""
    from shardkit.preference import KTOConfig, KTOTrainer

    args = KTOConfig(str(tmp_path), use_cpu=True, report_to="none", max_length=40, per_device_train_batch_size=2,
                     num_train_epochs=3, warmup_steps=2)
    trainer = KTOTrainer(model, args=args, train_dataset=unpaired(), processing_class=tokenizer)
    max_steps, warmup = trainer.estimate_run_steps(args, None)
    assert max_steps == 3 * math.ceil(len(unpaired()) / 2) and warmup == 2
