"""GRPOTrainer on 2 real processes (gloo on CPU) under ZeRO-3 and then FSDP2 in the same workers: the ranks
generate completions of different lengths (rank 0 at most 3 tokens, rank 1 at most 6) on the partitioned training
model every round without hanging, the rewards of both ranks are gathered for the advantages, the loss is finite
and equal on both ranks, and the mean reward of the toy task rises."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import run_distributed  # noqa: E402

pytest.importorskip("deepspeed")
TEXT = Path(__file__).resolve().parents[2] / "examples" / "data" / "public_domain.txt"
STEPS = 10
STRATEGIES = ("zero3", "fsdp")


def _worker(out: str) -> dict:
    # one launch for every strategy: the process group is shared, each strategy trains a fresh model
    return {name: _train(str(Path(out) / name), name) for name in STRATEGIES}


def _train(out: str, strategy: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardkit.rl import GRPOConfig, GRPOTrainer
    from shardkit.sft import train_tokenizer
    from shardkit.strategies import strategy_from_name

    rank = int(os.environ["RANK"])  # set by the launcher before the process group exists
    tokenizer = train_tokenizer([TEXT], vocab_size=300)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=128))
    lengths = []

    def in_target(completion_ids, **kwargs):
        lengths.append(max(len(c) for c in completion_ids))
        return [sum(100 <= t < 130 for t in c) / max(len(c), 1) for c in completion_ids]

    args = GRPOConfig(output_dir=out, max_steps=STEPS, per_device_train_batch_size=8, num_generations=8,
                      max_completion_length=3 if rank == 0 else 6, learning_rate=5e-2, lr_scheduler_type="constant",
                      logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=0, use_cpu=True,
                      loss_type="grpo")
    prompts = [{"prompt": p} for p in ("The old house", "She opened", "In the morning", "He asked the way")] * 8
    trainer = GRPOTrainer(model, in_target, args=args, train_dataset=prompts, processing_class=tokenizer,
                          strategy=strategy_from_name(strategy))
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"rewards": rewards, "lengths": lengths, "loss": losses,
            "max_length": [h["completions/max_length"] for h in trainer.state.log_history if "reward" in h]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_worker, 2, args=(str(tmp_path_factory.mktemp("grpo")),), timeout=1200)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_different_lengths_reward_rises(runs, strategy):
    results = [rank[strategy] for rank in runs]
    losses = results[0]["loss"]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses), losses
    assert losses == results[1]["loss"]
    assert results[0]["rewards"] == results[1]["rewards"]  # every rank logs the whole generation batch's reward
    assert set(results[0]["lengths"]) == {3} and set(results[1]["lengths"]) == {6}  # no EOS within 6 here
    assert all(m == 6 for m in results[0]["max_length"])  # the lengths gathered from both ranks
    rewards = results[0]["rewards"]
    assert len(rewards) == STEPS
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards
