"""GRPOTrainer: Group Relative Policy Optimization (TRL 1.x's ``GRPOTrainer`` API) on shardkit's Trainer.

    def correct(completions, answer, **kwargs):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    trainer = GRPOTrainer(model, reward_funcs=correct, args=GRPOConfig(output_dir="out", num_generations=4),
                          train_dataset=[{"prompt": "2+3=", "answer": "5"}, ...], processing_class=tokenizer)
    trainer.train()

The advantages and the per-loss-type objective are :mod:`shardkit.rl.losses`' pure functions; generation, rewards,
the reference and the slots are :class:`~shardkit.rl.trainer.OnlineRLTrainer`'s. Logged with TRL's names:
``reward``, ``reward_std``, ``rewards/<func>/mean`` and ``/std``, ``frac_reward_zero_std``, ``completions/*``
lengths and ``clipped_ratio``, ``kl`` (beta != 0), ``entropy``, ``clip_ratio/low_mean``, ``low_min``,
``high_mean``, ``high_max``, ``region_mean`` (clipped loss types), ``cispo_clip_ratio``, ``vespo/phi_seq_mean``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from shardkit.rl.config import GRPOConfig
from shardkit.rl.losses import CLIPPED_TYPES, group_advantages, policy_loss, reduce_policy_loss
from shardkit.rl.trainer import OnlineRLTrainer

__all__ = ["GRPOTrainer"]


class GRPOTrainer(OnlineRLTrainer):
    """GRPO with TRL's names (see :class:`~shardkit.rl.GRPOConfig`).

    Args:
        model: a Hugging Face causal LM (or a path to one, loaded with ``model_init_kwargs``).
        reward_funcs: a callable ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``, a
            sequence-classification model, or a list of them (weighted by ``reward_weights``).
        args: a :class:`GRPOConfig`.
        train_dataset: rows with a ``"prompt"`` (text or chat messages) and any columns the reward functions read.
        processing_class: the policy's tokenizer.
        reward_processing_classes: the reward models' tokenizers (one per reward function, None for callables).
        Other arguments: as :class:`shardkit.trainer.Trainer`.
    """

    config_class = GRPOConfig

    def __init__(self, model: Any, reward_funcs: Any, args: GRPOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Any = None, optimizers: tuple = (None, None), peft_config: Any = None, *,
                 strategy: Any = None, precision: Any = None):
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                         reward_processing_classes, callbacks, optimizers, peft_config, strategy=strategy,
                         precision=precision)
        self.loss_settings_ = self.args.loss_settings()

    def advantages(self, rewards_per_func: Tensor, batch: dict[str, Tensor], mode: str) -> Tensor:
        args = self.args
        advantages, _, zero_std = group_advantages(rewards_per_func, self.rewards.weights, args.num_generations,
                                                   args.scale_rewards, args.multi_objective_aggregation)
        self._metrics[mode]["frac_reward_zero_std"].append(zero_std.float().mean().item())
        return advantages

    def token_normalizer(self, batch: dict[str, Tensor]) -> Tensor:
        """dapo/cispo/vespo divide by the generation batch's tokens over every rank, per rank and per micro-batch
        it is split into (TRL's normaliser, times the accumulation the window averages over)."""
        ranks = self.runner.strategy.data_parallel_size
        return batch["num_items_in_batch"] / (ranks * self.args.steps_per_generation)

    def policy_objective(self, batch: dict[str, Tensor], logps: Tensor, entropy: Tensor, mode: str) -> Tensor:
        settings, mask = self.loss_settings_, batch["completion_mask"].float()
        # vLLM drew the tokens: its correction weighs each policy term by pi_train / pi_vllm
        result = policy_loss(logps, batch.get("old_per_token_logps"), batch["advantages"], mask, settings,
                             batch.get("ref_per_token_logps"), batch.get("importance_sampling_ratio"))
        loss = reduce_policy_loss(result.per_token, mask, settings.loss_type, self.args.max_completion_length,
                                  self.token_normalizer(batch))
        metrics = self._metrics[mode]
        if result.kl is not None:
            metrics["kl"].append(self.global_masked_mean(result.kl, mask))
        metrics["entropy"].append(self.global_masked_mean(entropy, mask))
        advantages = batch["advantages"].unsqueeze(1)
        ratio = result.ratio
        if settings.loss_type in CLIPPED_TYPES:
            low = ((ratio < 1 - settings.epsilon_low) & (advantages < 0)).float()
            high = ((ratio > 1 + settings.epsilon_high) & (advantages > 0)).float()
            metrics["clip_ratio/low_mean"].append(self.global_masked_mean(low, mask))
            metrics["clip_ratio/high_mean"].append(self.global_masked_mean(high, mask))
            metrics["clip_ratio/region_mean"].append(self.global_masked_mean(torch.maximum(low, high), mask))
            metrics["clip_ratio/low_min"].append(self._extreme(self._sequence_mean(low, mask), "min"))
            metrics["clip_ratio/high_max"].append(self._extreme(self._sequence_mean(high, mask), "max"))
        elif settings.loss_type == "cispo":
            clipped = ((ratio > settings.epsilon_high) & (advantages > 0)).float()
            metrics["cispo_clip_ratio"].append(self.global_masked_mean(clipped, mask))
        elif settings.loss_type == "vespo":
            metrics["vespo/phi_seq_mean"].append(self.global_masked_mean(result.phi, mask))
        return loss

    @staticmethod
    def _sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
        if values.shape[1] == 1:
            return values.squeeze(1)
        return (values * mask).sum(-1) / mask.sum(-1)

    def _extreme(self, values: Tensor, which: str) -> float:
        """The min or max over every rank's sequences, NaNs (empty sequences) left out."""
        finite = values[~torch.isnan(values)]
        local = (finite.min() if which == "min" else finite.max()) if finite.numel() else \
            torch.tensor(float("inf") if which == "min" else float("-inf"), device=values.device)
        if self.runner.world_size > 1:
            local = self.runner.all_reduce(local.reshape(1).to(self.runner.device), which).reshape(())
        value = float(local)
        return value if abs(value) != float("inf") else float("nan")
