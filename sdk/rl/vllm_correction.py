"""The importance-sampling correction for completions sampled by vLLM (TRL's ``vllm_importance_sampling_*``).

vLLM samples with its own kernels, so the probabilities it drew a token with differ from the training model's, even
with the same weights. GRPO's objective assumes the policy drew the tokens; each token's (or sequence's) loss is
weighted by ``pi_train(token) / pi_vllm(token)`` (truncated or masked outside ``[clip_min, clip_max]``) to correct
for that. The weights carry no gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["VLLM_IS_MODES", "vllm_importance_weights", "vllm_importance_metrics"]

VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@torch.no_grad()
def vllm_importance_weights(old_logps: Tensor, sampling_logps: Tensor, mask: Tensor, mode: str,
                            clip_min: float | None = None, clip_max: float | None = 3.0) -> Tensor:
    """The correction weights: ``[B, C]`` for the ``token_*`` modes, ``[B, 1]`` for the ``sequence_*`` ones.

    Args:
        old_logps: ``[B, C]`` the training model's log-probs of the sampled tokens at generation time.
        sampling_logps: ``[B, C]`` vLLM's log-probs of the same tokens; NaN where vLLM gave none (weight 1 there).
        mask: ``[B, C]`` the tokens that count (others contribute a log-ratio of 0).
        mode: ``*_truncate`` clamps the ratio to ``[clip_min, clip_max]``; ``*_mask`` sets ratios outside it to 0.
        clip_min, clip_max: the bounds (None: unbounded on that side; a truncate mode needs at least one).
    """
    if mode not in VLLM_IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r} is not one of {list(VLLM_IS_MODES)}")
    log_ratio = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(-1, keepdim=True)
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        if clip_min is None and clip_max is None:
            raise ValueError(f"vllm_importance_sampling_mode={mode!r} needs vllm_importance_sampling_clip_min or "
                             "vllm_importance_sampling_clip_max")
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@torch.no_grad()
def vllm_importance_metrics(old_logps: Tensor, sampling_logps: Tensor, mask: Tensor, weights: Tensor
                            ) -> dict[str, tuple[str, float]]:
    """One rank's ``{TRL metric name: (how ranks combine, value)}``: the absolute log-prob difference over the
    tokens vLLM scored (mean, max) and the weights over the masked tokens, or every sequence (min, mean, max).
    Empty selections give 0, as TRL logs them."""
    keep = mask.bool()
    delta = (old_logps - sampling_logps).abs()
    delta = delta[keep & ~torch.isnan(delta)]
    flat = weights.flatten() if weights.shape[1] == 1 else weights[keep]

    def stat(values: Tensor, fn: str) -> float:
        return float(getattr(values, fn)()) if values.numel() else 0.0

    return {"sampling/sampling_logp_difference/mean": ("mean", stat(delta, "mean")),
            "sampling/sampling_logp_difference/max": ("max", stat(delta, "max")),
            "sampling/importance_sampling_ratio/min": ("min", stat(flat, "min")),
            "sampling/importance_sampling_ratio/mean": ("mean", stat(flat, "mean")),
            "sampling/importance_sampling_ratio/max": ("max", stat(flat, "max"))}
