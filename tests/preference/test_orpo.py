"""shardkit's ORPOTrainer against TRL's (trl.experimental.orpo) on the same tiny Llama, rows and seed: per-step
loss, metrics, gradients and weights after 3 steps (CPU, fp32); bad rows named."""

from __future__ import annotations

import pytest

from tests.preference.conftest import rows
from tests.preference.family_runs import assert_same_runs, run

METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen"]


def conversations() -> list[dict]:
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows()]


@pytest.mark.parametrize("data", [rows, conversations], ids=["text", "conversational"])
def test_orpo_matches_trl(model, tokenizer, tmp_path, data):
    pytest.importorskip("datasets")
    orpo = pytest.importorskip("trl.experimental.orpo")
    from transformers import TrainerCallback

    from shardkit.preference import ORPOConfig, ORPOTrainer
    from shardkit.trainer.callbacks import TrainerCallback as OurCallback

    settings = dict(max_length=24, beta=0.5)  # short enough that some answers are cut
    if data is conversations:
        settings["max_length"] = 40  # the chat template's tokens
    theirs = run(orpo.ORPOTrainer, orpo.ORPOConfig, TrainerCallback, model, data(), tokenizer, tmp_path, trl=True,
                 **settings)
    ours = run(ORPOTrainer, ORPOConfig, OurCallback, model, data(), tokenizer, tmp_path, trl=False, **settings)
    assert_same_runs(ours, theirs, METRICS, model)


def test_pairs_take_an_implicit_prompt_and_bad_rows_are_named(model, tokenizer, tmp_path):
    from shardkit.preference import ORPOConfig, ORPOTrainer
    from shardkit.preference.pair_tokens import PairTokenizer

    tokenize = PairTokenizer(tokenizer, max_length=64)
    explicit = tokenize({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}, 0)
    implicit = tokenize({"chosen": "The sky is blue.", "rejected": "The sky is green."}, 0)
    assert explicit == implicit  # the prompt is what chosen and rejected share, the space left to the answers
    assert explicit["chosen_input_ids"][0] == tokenizer.bos_token_id
    assert explicit["chosen_input_ids"][-1] == tokenizer.eos_token_id
    prompt = len(explicit["chosen_labels"]) - sum(t != -100 for t in explicit["chosen_labels"])
    assert explicit["chosen_input_ids"][:prompt] == explicit["rejected_input_ids"][:prompt]

    args = ORPOConfig(str(tmp_path), use_cpu=True, report_to="none", max_length=32)
    cases = [([*rows(2), {"prompt": "The sky", "rejected": " red."}], "ORPO data, train row 2, field 'chosen'"),
             ([*rows(2), 7], "ORPO data, train row 2: a row is a dict"),
             ([*rows(2), {"prompt": [{"role": "user"}], "chosen": [{"role": "assistant", "content": "a"}],
                          "rejected": [{"role": "assistant", "content": "b"}]}], "row 2, field 'prompt'.*content")]
    for data, message in cases:
        with pytest.raises(ValueError, match=message):
            ORPOTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
    with pytest.raises(NotImplementedError, match="model_init"):
        ORPOTrainer(model, args=args, train_dataset=rows(2), processing_class=tokenizer, model_init=lambda: model)
