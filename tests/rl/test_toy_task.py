"""GRPO and RLOO learn a verifiable toy task on one process: a tiny Llama is rewarded for the share of its
completion tokens drawn from a fixed set of 30 of its ~300 tokens (about 0.1 at random); after 15 steps
the mean reward is well above where it started (seeded, margin fixed here)."""

from __future__ import annotations

import pytest

from tests.rl.conftest import tiny_llama

TARGET = set(range(100, 130))
MARGIN = 0.4
LR = 5e-2


def in_target(completion_ids, **kwargs):
    return [sum(t in TARGET for t in c) / max(len(c), 1) for c in completion_ids]


def _train(trainer_cls, config_cls, tokenizer, tmp_path, steps=15, **extra):
    from shardkit.utils.seeding import seed_everything

    seed_everything(0)
    model = tiny_llama(len(tokenizer), seed=0, hidden=32)
    prompts = [{"prompt": p} for p in ("The old house", "She opened", "In the morning", "He asked the way")] * 16
    args = config_cls(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=16, num_generations=8,
                      max_completion_length=4, learning_rate=LR, lr_scheduler_type="constant", logging_steps=1,
                      report_to="none", save_strategy="no", disable_tqdm=True, seed=0, use_cpu=True, **extra)
    trainer = trainer_cls(model, in_target, args=args, train_dataset=prompts, processing_class=tokenizer)
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return rewards, trainer.state.log_history


@pytest.mark.parametrize("which", ["grpo", "rloo"])
def test_reward_rises(tokenizer, tmp_path, which):
    from shardkit.rl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    if which == "grpo":
        rewards, history = _train(GRPOTrainer, GRPOConfig, tokenizer, tmp_path, loss_type="grpo")
    else:
        rewards, history = _train(RLOOTrainer, RLOOConfig, tokenizer, tmp_path, beta=0.0)
    assert len(rewards) == 15
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert start < 0.25, rewards
    assert end > start + MARGIN, rewards
    logged = {k for h in history for k in h}
    for name in ("reward_std", "rewards/in_target/mean", "rewards/in_target/std", "completions/mean_length",
                 "completions/clipped_ratio", "entropy", "clip_ratio/region_mean", "frac_reward_zero_std", "loss"):
        assert name in logged, name
