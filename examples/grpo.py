"""GRPO on a verifiable toy task, with a tiny model built here (no downloads): "a+b=" -> the sum.

    python examples/grpo.py --max_steps 40                                  # one process
    shardkit launch --num_processes 2 examples/grpo.py --strategy zero3     # 2 CPU ranks, ZeRO-3

The reward is checked, not learned: 0.5 for the format (the completion starts with a number) and 1.0 more when
that number is the sum. A random tiny Llama starts near 0; the logged ``reward`` (and
``rewards/format_reward/mean``, ``rewards/sum_reward/mean``) rises as it learns to answer with digits, and then
with the right ones. The rollouts are generated on the training model: under ZeRO-3 every rank decodes in lock
step on the partitioned weights, ranks whose completions end early keep joining the others' forwards.
"""

from __future__ import annotations

import argparse
import random
import re

import torch

from shardkit import seed_everything
from shardkit.rl import GRPOConfig, GRPOTrainer
from shardkit.sft import train_tokenizer
from shardkit.strategies import strategy_from_name

ANSWER = re.compile(r"^\s*(\d+)")  # the number the completion starts with


def format_reward(completions, **kwargs):
    return [0.5 if ANSWER.match(c) else 0.0 for c in completions]


def sum_reward(completions, total, **kwargs):
    out = []
    for c, t in zip(completions, total):
        match = ANSWER.match(c)
        out.append(1.0 if match and int(match.group(1)) == t else 0.0)
    return out


def problems(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{a}+{b}=", "total": a + b})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default=None, help="a registered strategy name (ddp, zero3, fsdp...)")
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--output_dir", default="runs/grpo-sum")
    parser.add_argument("--learning_rate", type=float, default=3e-2)
    cli = parser.parse_args()
    seed_everything(0)
    corpus = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
    tokenizer = train_tokenizer(texts=corpus, vocab_size=300, chat_template=None)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id))
    args = GRPOConfig(output_dir=cli.output_dir, max_steps=cli.max_steps, per_device_train_batch_size=16,
                      num_generations=8, max_completion_length=4, learning_rate=cli.learning_rate,
                      lr_scheduler_type="constant", loss_type="grpo", logging_steps=1, report_to="none",
                      save_strategy="no", disable_tqdm=True, seed=0, use_cpu=not torch.cuda.is_available())
    strategy = strategy_from_name(cli.strategy) if cli.strategy else None
    trainer = GRPOTrainer(model, [format_reward, sum_reward], args=args, train_dataset=problems(2000, 0),
                          processing_class=tokenizer, strategy=strategy)
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    if trainer.runner.is_main_process and rewards:
        k = max(1, len(rewards) // 5)
        print(f"mean reward: first {k} steps {sum(rewards[:k]) / k:.3f}, last {k} steps {sum(rewards[-k:]) / k:.3f}")


if __name__ == "__main__":
    main()
