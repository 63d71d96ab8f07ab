"""GRPO's and RLOO's advantages and policy losses as pure functions (TRL 1.x's formulas and names).

Every tensor is per completion ``[B]`` or per completion token ``[B, C]`` (``C`` the padded completion length) with
``mask`` marking the tokens that count. Nothing here knows about models, ranks or the Trainer: the trainers hand in
log-probabilities and rewards and get back a loss, so that the formulas can be tested against TRL on fixed numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["GRPO_LOSS_TYPES", "PolicyLoss", "PolicyLossSettings", "SCALE_REWARDS", "gamma_weights",
           "group_advantages", "nanstd", "policy_loss", "reduce_policy_loss", "rloo_advantages", "rloo_loss"]

# The loss types TRL 1.16's GRPOTrainer defines, with its meanings.
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
CLIPPED_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
# Added to the standard deviation before dividing, so that a group whose rewards are all equal gets advantage 0.
_STD_EPS = 1e-4


def nanstd(values: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """The sample standard deviation (Bessel-corrected) ignoring NaNs; NaN where fewer than two values remain."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = variance.sqrt()
    if keepdim:
        return std
    return std.squeeze() if dim is None else std.squeeze(dim)


def group_advantages(rewards_per_func: Tensor, weights: Tensor, num_generations: int, scale_rewards: str = "group",
                     aggregation: str = "sum_then_normalize") -> tuple[Tensor, Tensor, Tensor]:
    """GRPO's advantages of a whole generation batch (every rank's completions, groups of ``num_generations``
    consecutive rows).

    Args:
        rewards_per_func: ``[N, F]`` each reward function's reward (NaN where a function gave None).
        weights: ``[F]`` the reward weights.
        scale_rewards: divide by the group's std (``"group"``), the batch's (``"batch"``) or not (``"none"``).
        aggregation: ``"sum_then_normalize"`` (weighted sum, then the group baseline) or ``"normalize_then_sum"``.

    Returns:
        (advantages ``[N]`` (0 for a completion no function scored), the weighted rewards ``[N]`` (NaN where
        unscorable), whether the std used was zero ``[N]`` (TRL's ``frac_reward_zero_std``)).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} must be one of {SCALE_REWARDS}")
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    weights = weights.to(rewards_per_func.device, rewards_per_func.dtype)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = float("nan")
        grouped = rewards.view(-1, num_generations)
        mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
        if scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        elif num_generations > 1:
            std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
        else:
            std = torch.zeros_like(rewards)
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + _STD_EPS)
    elif aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
        normalized = ((grouped - mean_k) / (std_k + _STD_EPS)).view(-1, rewards_per_func.shape[1])
        rewards = (normalized * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = float("nan")
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + _STD_EPS)
    else:
        raise ValueError(f"multi_objective_aggregation={aggregation!r} must be one of {AGGREGATIONS}")
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), rewards, zero_std


def rloo_advantages(rewards: Tensor, num_generations: int, normalize: bool = False) -> tuple[Tensor, Tensor]:
    """RLOO's leave-one-out advantages: each reward minus the mean of its group's other (scorable) rewards.

    Args:
        rewards: ``[N]`` the weighted, clipped, KL-penalised rewards (NaN where unscorable).
        normalize: then standardise the advantages over the batch (``normalize_advantages``).

    Returns:
        (advantages ``[N]``, 0 where unscorable; whether each group's reward std is zero, per group).
    """
    grouped = rewards.view(-1, num_generations)
    std = nanstd(grouped, dim=1) if num_generations > 1 else torch.zeros(grouped.shape[0], device=rewards.device)
    if num_generations > 1:
        scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
        total = torch.nansum(grouped, dim=1, keepdim=True)
        advantages = rewards - ((total - grouped) / (scorable - 1)).view(-1)
    else:
        advantages = torch.zeros_like(rewards)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + _STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@dataclass(frozen=True)
class PolicyLossSettings:
    """The GRPOConfig fields the policy loss reads (TRL's names)."""

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    delta: float | None = None
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = True
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


@dataclass
class PolicyLoss:
    """The per-token loss of a micro-batch and what the metrics read from it.

    Attributes:
        per_token: ``[B, C]`` (or ``[B, 1]`` at sequence level) loss before masking and reduction.
        ratio: the importance ratio ``pi / pi_old`` (``coef_1``), detached.
        kl: ``[B, C]`` the per-token KL to the reference (``beta != 0``), else None.
        phi: VESPO's sequence weights ``[B, 1]``, else None.
    """

    per_token: Tensor
    ratio: Tensor
    kl: Tensor | None = None
    phi: Tensor | None = None


@torch.no_grad()
def gamma_weights(advantages: Tensor, log_ratio: Tensor, mask: Tensor, k_pos: float, lambda_pos: float,
                  k_neg: float, lambda_neg: float, importance_sampling_ratio: Tensor | None = None) -> Tensor:
    """VESPO's per-sequence weight ``phi(w) = e^lambda w^k e^(-lambda w)`` of the sequence ratio ``w`` (no gradient).

    With vLLM's token-level correction (``importance_sampling_ratio`` ``[B, C]``, ``pi_old / pi_vllm``), ``w`` is the
    ratio to the sampler, ``pi / pi_vllm``: the log of each token's correction (floored at ``log 1e-8``, so that a
    masked-out token's 0 stays finite) is added to the sequence's log-ratio, over every position as TRL sums it
    (a padded position's correction is 1)."""
    floor = math.log(1e-8)
    log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if importance_sampling_ratio is not None:
        log_w = log_w + torch.log(importance_sampling_ratio).clamp(floor, 20.0).sum(-1, keepdim=True)
    log_w = log_w.clamp(floor, 20.0)
    positive = advantages >= 0
    k = torch.where(positive, k_pos, k_neg)
    lam = torch.where(positive, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def policy_loss(logps: Tensor, old_logps: Tensor | None, advantages: Tensor, mask: Tensor,
                settings: PolicyLossSettings, ref_logps: Tensor | None = None,
                importance_sampling_ratio: Tensor | None = None) -> PolicyLoss:
    """GRPO's per-token objective for each ``loss_type`` (before the reduction of :func:`reduce_policy_loss`).

    Args:
        logps: ``[B, C]`` the policy's log-probs of the completion tokens (with gradient).
        old_logps: the log-probs when the completions were generated (None: the policy's, detached, so the ratio
            is 1: the first iteration on freshly generated completions).
        advantages: ``[B]`` (or ``[B, C]``).
        mask: ``[B, C]`` the tokens that count.
        ref_logps: ``[B, C]`` the reference's log-probs (needed when ``beta != 0``).
        importance_sampling_ratio: vLLM's correction weights (``[B, C]``, or ``[B, 1]`` per sequence) when vLLM drew
            the tokens: each token's policy term is multiplied by them (not the KL term), except VESPO's, whose
            sequence weight takes them in (token-level weights only, as TRL).
    """
    s = settings
    if s.loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type={s.loss_type!r} must be one of {GRPO_LOSS_TYPES}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old_logps = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old_logps
    if s.importance_sampling_level == "token":
        log_weights = log_ratio
    elif s.importance_sampling_level == "sequence":
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        raise ValueError(f"importance_sampling_level={s.importance_sampling_level!r} must be 'token' or 'sequence'")
    coef_1 = torch.exp(log_weights)
    kl = None
    if s.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs the reference's log-probs (ref_logps)")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if s.use_bias_correction_kl:
            kl = kl * coef_1
    phi = None
    if s.loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=s.epsilon_high).detach() * advantages * logps
    elif s.loss_type in CLIPPED_TYPES:
        coef_2 = torch.clamp(coef_1, 1 - s.epsilon_low, 1 + s.epsilon_high)
        unclipped = coef_1 if s.delta is None else torch.clamp(coef_1, max=s.delta)
        per_token = -torch.min(unclipped * advantages, coef_2 * advantages)
    elif s.loss_type == "sapo":
        temperature = torch.where(advantages > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
        per_token = -torch.sigmoid(temperature * (coef_1 - 1)) * 4 / temperature * advantages
    else:  # vespo
        if importance_sampling_ratio is not None and importance_sampling_ratio.shape[-1] != logps.shape[-1]:
            raise ValueError("loss_type='vespo' takes vLLM's correction per token (vllm_importance_sampling_mode "
                             "'token_truncate' or 'token_mask'), got one weight per sequence")
        phi = gamma_weights(advantages, log_ratio, mask, s.vespo_k_pos, s.vespo_lambda_pos, s.vespo_k_neg,
                            s.vespo_lambda_neg, importance_sampling_ratio)
        per_token = -phi * advantages * logps
    if importance_sampling_ratio is not None and s.loss_type != "vespo":
        per_token = per_token * importance_sampling_ratio
    if kl is not None:
        per_token = per_token + s.beta * kl
    return PolicyLoss(per_token, coef_1.detach(), None if kl is None else kl.detach(), phi)


def reduce_policy_loss(per_token: Tensor, mask: Tensor, loss_type: str, max_completion_length: int,
                       token_normalizer: float | Tensor | None = None) -> Tensor:
    """The micro-batch's loss from the per-token loss, as each ``loss_type`` reduces it:

    - ``grpo``, ``sapo``: each sequence's token mean, averaged over the sequences;
    - ``bnpo``: the token mean over the micro-batch;
    - ``dr_grpo``: the token sum over ``B * max_completion_length``;
    - ``dapo``, ``cispo``, ``vespo``: the token sum over ``token_normalizer`` (the tokens of the whole generation
      batch on every rank, divided by the ranks and by the micro-batches it is split into);
    - ``luspo``: each sequence's token sum, averaged over the sequences.
    """
    masked = per_token * mask
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token.size(0) * max_completion_length)
    if loss_type in ("dapo", "cispo", "vespo"):
        if token_normalizer is None:
            raise ValueError(f"loss_type={loss_type!r} divides by the generation batch's token count: pass "
                             "token_normalizer")
        normalizer = torch.as_tensor(token_normalizer, dtype=masked.dtype, device=masked.device)
        return masked.sum() / normalizer.clamp(min=1.0)
    if loss_type == "luspo":
        return masked.sum(-1).mean()
    raise ValueError(f"loss_type={loss_type!r} must be one of {GRPO_LOSS_TYPES}")


def rloo_loss(logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor, epsilon_low: float,
              epsilon_high: float) -> tuple[Tensor, Tensor]:
    """RLOO's clipped objective on whole sequences: ``-min(r A, clip(r) A)`` averaged over the sequences, ``r`` the
    ratio of the sequences' summed log-probs to those at generation. Returns (loss, the ratio detached)."""
    coef_1 = torch.exp((logps * mask).sum(1) - old_logps)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    return -torch.min(coef_1 * advantages, coef_2 * advantages).mean(), coef_1.detach()
