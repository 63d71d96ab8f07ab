"""Evaluation of GRPOTrainer and RLOOTrainer on one process (tiny Llama, the repo's tokenizer text): the eval
metrics equal a hand computation from the eval completions and their rewards, num_generations_eval completions are
drawn for every eval prompt exactly once, and evaluating (at eval_steps, or called directly) changes neither the
training losses nor the random state nor the model's mode."""

from __future__ import annotations

import math

import pytest
import torch

from tests.rl.conftest import tiny_llama

EVAL = [{"prompt": p} for p in ("The old house", "She opened", "In the morning", "He asked the way", "When the")]
TRAIN = [{"prompt": p} for p in ("The old house", "She opened", "In the morning", "He asked the way")] * 4


def _reward(calls):
    def in_range(prompts, completion_ids, trainer_state, **kwargs):
        rewards = [sum(100 <= t < 150 for t in c) / len(c) for c in completion_ids]
        calls.append({"prompts": list(prompts), "ids": [list(c) for c in completion_ids], "rewards": rewards})
        return rewards
    return in_range


def _trainer(kind, tokenizer, tmp_path, calls, **extra):
    from shardkit.rl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    from shardkit.utils.seeding import seed_everything

    seed_everything(0)
    config, trainer_class = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
    settings = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                    num_generations_eval=3, per_device_eval_batch_size=6, max_completion_length=5,
                    learning_rate=5e-2, lr_scheduler_type="constant", logging_steps=1, report_to="none",
                    save_strategy="no", disable_tqdm=True, seed=0, use_cpu=True)
    settings.update(extra)
    if kind == "grpo":
        settings.setdefault("loss_type", "dapo")
    return trainer_class(tiny_llama(len(tokenizer), seed=0), _reward(calls), args=config(**settings),
                         train_dataset=TRAIN, eval_dataset=EVAL, processing_class=tokenizer)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_eval_metrics_equal_a_hand_computation(tokenizer, tmp_path, kind):
    """Before training: 5 eval prompts, 2 per step (6 completions / 3 per prompt): steps of 2, 2 and 1 prompts.
    eval_reward (and std, lengths) is the mean over the steps of each step's figure; eval_loss is the
    per-completion mean of the steps' losses (ratio 1: dapo's -sum(A_i |o_i|) / sum|o_i| for GRPO with TRL's
    group-scaled advantages, RLOO's -mean(A) = 0 for leave-one-out advantages)."""
    calls = []
    trainer = _trainer(kind, tokenizer, tmp_path, calls)
    metrics = trainer.evaluate()
    assert [len(c["ids"]) for c in calls] == [6, 6, 3]  # num_generations_eval=3, not num_generations=4
    seen = [p for c in calls for p in c["prompts"]]
    assert sorted(set(seen)) == sorted(r["prompt"] for r in EVAL) and len(seen) == 15  # each prompt once, 3 times
    for call in calls:
        assert all(len(set(call["prompts"][i:i + 3])) == 1 for i in range(0, len(call["prompts"]), 3))
    rewards = [torch.tensor(c["rewards"], dtype=torch.float64) for c in calls]
    lengths = [torch.tensor([len(i) for i in c["ids"]], dtype=torch.float64) for c in calls]
    losses = []
    for r, n in zip(rewards, lengths):
        groups = r.view(-1, 3)
        if kind == "grpo":
            advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
            losses.append(float(-(advantages * n).sum() / n.sum()))
        else:
            losses.append(0.0)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert metrics["eval_reward"] == pytest.approx(mean([float(r.mean()) for r in rewards]), abs=1e-6)
    assert metrics["eval_reward_std"] == pytest.approx(mean([float(r.std()) for r in rewards]), abs=1e-6)
    assert metrics["eval_rewards/in_range/mean"] == pytest.approx(metrics["eval_reward"], abs=1e-6)
    assert metrics["eval_completions/mean_length"] == pytest.approx(mean([float(n.mean()) for n in lengths]))
    assert metrics["eval_completions/max_length"] == pytest.approx(mean([float(n.max()) for n in lengths]))
    weights = [len(r) for r in rewards]
    expected_loss = sum(v * w for v, w in zip(losses, weights)) / sum(weights)
    assert metrics["eval_loss"] == pytest.approx(expected_loss, abs=1e-5)
    for name in ("eval_entropy", "eval_frac_reward_zero_std", "eval_clip_ratio/region_mean", "eval_num_tokens",
                 "eval_runtime"):
        assert name in metrics, name
    assert trainer.state.log_history[-1]["eval_reward"] == metrics["eval_reward"]
    assert not any(k in trainer.state.log_history[-1] for k in ("reward", "loss"))  # no train metric leaked in


def test_evaluating_changes_neither_training_nor_state(tokenizer, tmp_path):
    """A run evaluating at every step logs the same training losses and rewards as one that never evaluates; a
    direct evaluate() leaves the random state and the model's mode as it found them and repeats its figures."""
    plain = _trainer("grpo", tokenizer, tmp_path / "plain", [])
    plain.train()
    evaluated = _trainer("grpo", tokenizer, tmp_path / "eval", [], eval_strategy="steps", eval_steps=1)
    evaluated.train()

    def train_logs(trainer):
        return [(h["loss"], h["reward"], h["entropy"]) for h in trainer.state.log_history if "loss" in h]

    assert len(train_logs(plain)) == 2
    assert train_logs(evaluated) == train_logs(plain)
    evals = [h for h in evaluated.state.log_history if "eval_reward" in h]
    assert [h["step"] for h in evals] == [1, 2] and all(math.isfinite(h["eval_loss"]) for h in evals)

    model = evaluated.model
    model.train()
    state = torch.get_rng_state()
    first = evaluated.evaluate()
    assert torch.equal(torch.get_rng_state(), state) and model.training
    model.eval()
    second = evaluated.evaluate()
    assert not model.training
    for key in ("eval_reward", "eval_loss", "eval_completions/mean_length"):
        assert first[key] == second[key], key


def test_eval_settings_are_checked_by_name(tokenizer, tmp_path):
    """TRL's rule: the global eval batch (per device x data-parallel ranks) holds whole groups, checked when the
    trainer knows its ranks (at construction when evaluating during training, else at evaluate())."""
    from shardkit.rl import GRPOConfig

    with pytest.raises(ValueError, match="num_generations_eval=0"):
        GRPOConfig(output_dir=str(tmp_path), num_generations=4, num_generations_eval=0, report_to="none")
    message = (r"the global eval batch \(per_device_eval_batch_size 8 x 1 data-parallel ranks = 8\) must be "
               r"divisible by num_generations_eval \(3\)")
    with pytest.raises(ValueError, match=message):
        _trainer("grpo", tokenizer, tmp_path, [], num_generations_eval=3, per_device_eval_batch_size=8,
                 eval_strategy="steps", eval_steps=1)
    unchecked = _trainer("grpo", tokenizer, tmp_path, [], num_generations_eval=3, per_device_eval_batch_size=8)
    with pytest.raises(ValueError, match=message):
        unchecked.evaluate()
    trainer = _trainer("grpo", tokenizer, tmp_path, [])
    with pytest.raises(ValueError, match="eval_dataset row 1 has no 'prompt'"):
        trainer.evaluate([{"prompt": "a"}, {"text": "b"}])
    with pytest.raises(NotImplementedError, match="use evaluate"):
        trainer.predict(EVAL)


@pytest.mark.parametrize("per_device, group, ranks, fillers", [(3, 2, 2, 1), (2, 4, 2, 0), (4, 6, 3, 1),
                                                                (6, 3, 1, 0)])
def test_each_ranks_eval_rows_are_trls(per_device, group, ranks, fillers):
    """Every eval step's rows on every rank are TRL 1.16's: its eval sampler (each prompt num_generations_eval
    times in a row, shuffled with the seed) cut into batches of per_device_eval_batch_size that Accelerate deals to
    the ranks in turn; groups spread over ranks in the first three layouts. TRL pads the last step with rows from
    the start; here every prompt counts once: a rank's share of it is cut at the last prompt, and a rank left
    without a row generates one filler row that counts nowhere."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    from shardkit.rl.evaluation import EvalSteps

    rows = [{"prompt": f"p{i}"} for i in range(7)]
    stream = [rows[i]["prompt"] for i in trl_utils.RepeatSampler(rows, mini_repeat_count=group, seed=11)]
    steps = [EvalSteps(rows, group, per_device, rank, ranks, seed=11) for rank in range(ranks)]
    step_rows = per_device * ranks
    assert {len(s) for s in steps} == {-(-len(stream) // step_rows)}
    dealt, filled = [], 0
    for step in range(len(steps[0])):
        for rank in range(ranks):
            item = steps[rank][step]
            start = step * step_rows + rank * per_device
            expected = stream[start:start + per_device]
            if item["filler"]:
                assert expected == [] and len(item["rows"]) == 1
                filled += 1
            else:
                assert [r["prompt"] for r in item["rows"]] == expected, (step, rank)
                dealt += expected
    assert dealt == stream and filled == fillers
