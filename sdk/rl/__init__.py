"""Online reinforcement learning: TRL's GRPOTrainer/GRPOConfig and RLOOTrainer/RLOOConfig on shardkit's Trainer,
with rollouts generated on the training model under the Runner's strategy.

    from shardkit.rl import GRPOConfig, GRPOTrainer
    trainer = GRPOTrainer(model, reward_funcs=my_reward, args=GRPOConfig(output_dir="out", num_generations=4),
                          train_dataset=prompts, processing_class=tokenizer)
    trainer.train()
"""

from shardkit.rl.config import GRPOConfig, OnlineRLConfig, RLOOConfig
from shardkit.rl.grpo import GRPOTrainer
from shardkit.rl.losses import (
                                GRPO_LOSS_TYPES,
                                PolicyLossSettings,
                                group_advantages,
                                policy_loss,
                                reduce_policy_loss,
                                rloo_advantages,
                                rloo_loss,
)
from shardkit.rl.rloo import RLOOTrainer
from shardkit.rl.trainer import OnlineRLTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "GRPO_LOSS_TYPES", "OnlineRLConfig", "OnlineRLTrainer", "PolicyLossSettings",
           "RLOOConfig", "RLOOTrainer", "group_advantages", "policy_loss", "reduce_policy_loss", "rloo_advantages",
           "rloo_loss"]
