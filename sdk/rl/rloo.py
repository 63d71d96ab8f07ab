"""RLOOTrainer: REINFORCE Leave-One-Out (TRL 1.x's ``RLOOTrainer`` API) on the same machinery as GRPO.

Each completion's advantage is its reward minus the mean reward of the other completions of its prompt; the KL to the
reference (``beta``, default 0.05) is a penalty on the reward, ``sum_t (log pi_old - log pi_ref)`` over the sequence;
the objective is PPO's clipped ratio of whole sequences, averaged over the micro-batch's sequences. Logged with TRL's
names: ``reward``, ``reward_std``, ``rewards/<func>/mean`` and ``/std``, ``frac_reward_zero_std``, ``completions/*``,
``kl``, ``entropy``, ``clip_ratio/low_mean``, ``low_min``, ``high_mean``, ``high_max``, ``region_mean``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardkit.rl.config import RLOOConfig
from shardkit.rl.losses import rloo_advantages, rloo_loss
from shardkit.rl.trainer import OnlineRLTrainer

__all__ = ["RLOOTrainer"]


class RLOOTrainer(OnlineRLTrainer):
    """RLOO with TRL's names (see :class:`~shardkit.rl.RLOOConfig`; arguments as :class:`~shardkit.rl.GRPOTrainer`)."""

    config_class = RLOOConfig
    always_old_logps = True

    def advantages(self, rewards_per_func: Tensor, batch: dict[str, Tensor], mode: str) -> Tensor:
        args = self.args
        unscorable = torch.isnan(rewards_per_func).all(dim=1)
        rewards = (rewards_per_func * self.rewards.weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = float("nan")
        if args.reward_clip_range:
            rewards = rewards.clamp(min=args.reward_clip_range[0], max=args.reward_clip_range[1])
        if args.beta != 0.0:
            mask = batch["completion_mask"]
            per_token = batch["old_per_token_logps"] - batch["ref_per_token_logps"]
            kl = (per_token * mask).sum(-1)
            rewards = rewards - args.beta * torch.tensor(self.runner.gather_object(kl.tolist()),
                                                         dtype=rewards.dtype, device=rewards.device)
            self._metrics[mode]["kl"].append(self.global_masked_mean(per_token, mask.float()))
        advantages, zero_std = rloo_advantages(rewards, args.num_generations, args.normalize_advantages)
        self._metrics[mode]["frac_reward_zero_std"].append(zero_std.float().mean().item())
        return advantages

    def policy_objective(self, batch: dict[str, Tensor], logps: Tensor, entropy: Tensor, mode: str) -> Tensor:
        args, mask = self.args, batch["completion_mask"].float()
        old = (batch["old_per_token_logps"] * mask).sum(1)
        loss, ratio = rloo_loss(logps, old, batch["advantages"], mask, args.epsilon, args.epsilon_upper)
        metrics = self._metrics[mode]
        metrics["entropy"].append(self.global_masked_mean(entropy, mask))
        advantages = batch["advantages"]
        low = ((ratio < 1 - args.epsilon) & (advantages < 0)).float()
        high = ((ratio > 1 + args.epsilon_upper) & (advantages > 0)).float()
        everyone = torch.stack([low, high, torch.maximum(low, high)], 1)
        gathered = torch.tensor(self.runner.gather_object(everyone.tolist())).view(-1, 3)
        metrics["clip_ratio/low_mean"].append(gathered[:, 0].mean().item())
        metrics["clip_ratio/low_min"].append(gathered[:, 0].min().item())
        metrics["clip_ratio/high_mean"].append(gathered[:, 1].mean().item())
        metrics["clip_ratio/high_max"].append(gathered[:, 1].max().item())
        metrics["clip_ratio/region_mean"].append(gathered[:, 2].mean().item())
        return loss
