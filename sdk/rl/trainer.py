"""OnlineRLTrainer: what GRPO and RLOO share, on shardkit's Trainer through its public seams.

One *round* generates completions for a generation batch and scores them; its completions then feed
``steps_per_generation`` micro-batches, ``num_iterations`` times over (TRL's layout):

- a round's generation batch is laid out as TRL's ``RepeatSampler`` lays it out (:mod:`shardkit.rl.rounds`, which
  evaluation shares, and which carries an unfinished round through a checkpoint): the epoch's prompt order (a
  permutation drawn from a generator seeded with ``data_seed``, else ``seed``, one draw per epoch in turn, as TRL's
  sampler draws them),
  cut into rounds of ``generation_batch_size / num_generations`` prompts, each prompt repeated ``num_generations``
  times in a row, and the round's rows dealt to the data-parallel ranks in contiguous slices of
  ``per_device_train_batch_size x steps_per_generation`` (Accelerate's dealing of TRL's loader batches). A prompt's
  completions may thus be spread over ranks; only the whole generation batch holds whole groups;
- the train loader deals *slots*: slot ``k`` of data-parallel rank ``r`` is micro-step ``k`` of that rank, and
  names the round, the repetition and the rank it belongs to. The Runner deals the slots to ranks in order (no
  shuffle), so a resumed run restarts at its slot, and the step count is the Trainer's usual
  ``slots / gradient_accumulation_steps``;
- ``_prepare_inputs`` (the Trainer's seam, called at each micro-step, as in TRL) generates and scores a round on its
  first slot (the slot's rows resolved with the loader's epoch) and hands out the buffered micro-batches after;
- the rewards of every rank are gathered so that the advantages (group and batch statistics) and the metrics are
  those of the whole generation batch; each rank keeps its slice of the advantages.

A subclass implements :meth:`advantages` (from the gathered rewards) and :meth:`policy_objective` (a micro-batch's
loss and metrics).
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from shardkit.rl.config import OnlineRLConfig
from shardkit.rl.evaluation import OnlineRLEvaluation, check_eval_settings
from shardkit.rl.losses import nanstd
from shardkit.rl.rollout import (
    Completions,
    RewardFunctions,
    generate_completions,
    is_conversational,
    left_pad,
    right_pad,
    tokenize_prompts,
)
from shardkit.rl.rounds import Round, RoundCheckpointer, RoundSlots, check_prompt_rows, data_seed
from shardkit.rl.scoring import completion_log_probs
from shardkit.rl.vllm_correction import vllm_importance_metrics, vllm_importance_weights
from shardkit.rl.vllm_engine import ColocatedVLLM, require_vllm
from shardkit.trainer.frozen_model import frozen_model_context, set_up_frozen_model
from shardkit.trainer.peft_support import is_peft_model
from shardkit.trainer.router_aux_loss import refuse_dropped_router_aux_loss
from shardkit.trainer.trainer import Trainer

__all__ = ["OnlineRLTrainer", "RoundSlots", "Round"]

logger = logging.getLogger("shardkit.rl")


def _single(items: list[Any]) -> Any:
    return items[0]


class OnlineRLTrainer(OnlineRLEvaluation, Trainer):
    """The shared base of :class:`~shardkit.rl.GRPOTrainer` and :class:`~shardkit.rl.RLOOTrainer`.

    Args beyond :class:`~shardkit.trainer.Trainer`'s: ``reward_funcs`` (callables and/or sequence-classification
    models), ``reward_processing_classes`` (the reward models' tokenizers). ``processing_class`` (the policy's
    tokenizer) is required: nothing is downloaded.
    """

    loss_is_scaled_for_ga = False  # compute_loss returns a micro-batch's loss; the window averages them
    config_class: type = OnlineRLConfig
    always_old_logps = False  # RLOO's ratio always reads the log-probs at generation

    def __init__(self, model: Any, reward_funcs: Any, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Any = None, optimizers: tuple = (None, None), peft_config: Any = None, *,
                 strategy: Any = None, precision: Any = None):
        name = type(self).__name__
        if args is None:
            args = self.config_class(output_dir=f"{name.lower()}_output")
        if not isinstance(args, self.config_class):
            raise TypeError(f"{name} takes a {self.config_class.__name__} as args, got {type(args).__name__}")
        if args.use_vllm:
            require_vllm(name, args)  # before any model is built: a missing package fails first, by name
        if peft_config is not None:
            raise NotImplementedError(f"{name}: peft_config is not supported; wrap the model with peft yourself")
        if train_dataset is None:
            raise ValueError(f"{name} needs a train_dataset of rows with a 'prompt'")
        if processing_class is None:
            raise ValueError(f"{name} needs processing_class (the policy's tokenizer): nothing is downloaded")
        model = _load_model(model, args)
        refuse_dropped_router_aux_loss(model, name, args.router_aux_loss_coef)
        if processing_class.pad_token_id is None:
            processing_class.pad_token = processing_class.eos_token
        if args.disable_dropout:
            _disable_dropout(model)
        self.rewards = RewardFunctions(reward_funcs, reward_processing_classes, args.reward_weights)
        reference = None
        if args.beta != 0.0 and not is_peft_model(model):
            reference = copy.deepcopy(model)  # before the strategy takes the model
        super().__init__(model=model, args=args, data_collator=_single, train_dataset=list(train_dataset),
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         strategy=strategy, precision=precision, eval_dataset=eval_dataset)
        if self.get_cp_size() > 1:
            # Generation has no split form (every cp rank would decode the same whole sequences) and the rollout
            # batches are padded, which the split-sequence forward refuses: nothing would run context-parallel.
            raise NotImplementedError(
                f"{name} under ContextParallel (cp={self.get_cp_size()}): rollouts generate and score whole padded "
                "sequences, which ContextParallel cannot split over its cp ranks, so every cp rank would repeat the "
                "same work; train with --strategy fsdp (the same sharded weights, each rank its own prompts), zero3 "
                "or tp")
        self.args.resolve_generation_batch(self.runner.strategy.data_parallel_size)
        if getattr(self.args.eval_strategy, "value", self.args.eval_strategy) != "no":
            check_eval_settings(self.args, self.runner.strategy.data_parallel_size)  # before training, as TRL
        self.vllm = ColocatedVLLM(self.runner, self.model_wrapped, self.args, name) if args.use_vllm else None
        self.ref_model = self._ref_unwrapped = None
        if reference is not None:
            self._set_reference(reference)
        for reward_model in self.rewards.models():
            reward_model.to(self.runner.device).eval()
        eos = processing_class.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if not self.eos_token_ids:
            raise ValueError(f"{name}: the tokenizer has no eos_token_id; completions could never end")
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._round: Round | None = None
        self._resumed_round: Round | None = None  # an unfinished round a checkpoint held (RoundCheckpointer)
        self._slots: RoundSlots | None = None  # built with the train loader
        before_delete = self.checkpointer.before_delete
        self.checkpointer = RoundCheckpointer(self.runner, self.args, self)
        self.checkpointer.before_delete = before_delete

    @property
    def round_repeats(self) -> int:
        """Micro-steps one round feeds: ``steps_per_generation x num_iterations``."""
        return self.args.steps_per_generation * self.args.num_iterations

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; with ``use_vllm`` the engine gets the weights afresh: the optimizer step that names
        the pushed weights restarts (or resumes from a checkpoint) with every call."""
        if self.vllm is not None:
            self.vllm.pushed_version = None
        self._round = self._resumed_round = None  # a round of an earlier train() is not this one's
        return super().train(*args, **kwargs)

    # ---- the reference ---------------------------------------------------------------------------

    def _set_reference(self, ref_model: nn.Module) -> None:
        """Freeze the reference and hold it as the strategy holds models (``trainer.frozen_model``)."""
        self.ref_model, self._ref_unwrapped = set_up_frozen_model(self.runner, ref_model)

    @torch.no_grad()
    def reference_log_probs(self, batch: dict[str, Tensor], chunked: bool = True) -> Tensor:
        """The reference's per-token log-probs of the completions (a PEFT model's base: its adapter disabled)."""
        if self.ref_model is not None:
            context = frozen_model_context(self.runner)
            with context:
                return self._log_probs(self.ref_model, self._ref_unwrapped, batch, chunked=chunked)[0]
        unwrapped = self.runner.unwrap_model(self.model_wrapped)
        with unwrapped.disable_adapter():
            return self._log_probs(self.model_wrapped, unwrapped, batch, chunked=chunked)[0]

    def _log_probs(self, model: nn.Module, unwrapped: nn.Module, batch: dict[str, Tensor], entropy: bool = False,
                   chunked: bool = True) -> tuple[Tensor, Tensor | None]:
        return completion_log_probs(model, unwrapped, batch["prompt_ids"], batch["prompt_mask"],
                                    batch["completion_ids"], batch["completion_mask"], self.args.temperature,
                                    entropy=entropy,
                                    batch_size=self.args.per_device_train_batch_size if chunked else None)

    # ---- data ----------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader:
        """The slots of every rank (see :class:`RoundSlots`), one per loader batch, in order."""
        args = self.args
        rows = self.train_dataset
        check_prompt_rows(rows, "train_dataset")
        slots = RoundSlots(rows, args.num_generations, args.per_device_train_batch_size * args.steps_per_generation,
                           self.runner.strategy.data_parallel_size, self.round_repeats, data_seed(args),
                           bool(args.shuffle_dataset))
        if len(slots) == 0:
            raise ValueError(f"train_dataset has {len(rows)} prompts, fewer than one round needs "
                             f"(generation_batch_size {args.generation_batch_size} / num_generations "
                             f"{args.num_generations} = {slots.prompts_per_round})")
        if slots.left_out and self.runner.is_main_process:
            which = "a different" if args.shuffle_dataset else "the same (shuffle_dataset=False)"
            logger.warning(f"train_dataset has {len(rows)} prompts and a round takes {slots.prompts_per_round} "
                           f"(generation_batch_size {args.generation_batch_size} / num_generations "
                           f"{args.num_generations}): {slots.left_out} prompt(s) of each epoch, {which} set each "
                           "epoch, are not trained on (as TRL's sampler leaves them out)")
        self._slots = slots
        return DataLoader(slots, batch_size=1, shuffle=False, collate_fn=_single)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any = None) -> tuple[list[Any], Tensor]:
        """The window's slots; each becomes its micro-batch in :meth:`_prepare_inputs`."""
        import itertools

        return list(itertools.islice(epoch_iterator, num_batches)), torch.tensor(1)

    def _prepare_inputs(self, inputs: Any) -> dict[str, Any]:
        """A slot's micro-batch: the round is generated and scored on its first slot (or after a resume)."""
        if "round" not in inputs:
            return inputs
        if inputs["rank"] != self.runner.strategy.data_parallel_rank:  # the slots were dealt other than RoundSlots says
            raise RuntimeError(f"data-parallel rank {self.runner.strategy.data_parallel_rank} was handed rank "
                               f"{inputs['rank']}'s slot: the train loader must deal the slots in order, unshuffled")
        key, repeat = (self.prepared.train_loader.epoch if self.prepared.done else 0, inputs["round"]), inputs["repeat"]
        if self._round is None or self._round.key != key or repeat == 0:
            resumed, self._resumed_round = self._resumed_round, None
            if repeat and resumed is not None and resumed.key == key and resumed.used == repeat:
                self._round = resumed  # the round the checkpoint was saved in, generated before it
            else:
                if repeat:
                    logger.warning(f"resuming inside generation round {key[1]} (micro-step {repeat} of "
                                   f"{self.round_repeats}) without its buffered completions (a checkpoint written "
                                   "without round state, e.g. Hugging Face's, or by another number of ranks): the "
                                   "round is generated afresh from the resumed weights, as TRL does, so the run "
                                   "departs from the uninterrupted one")
                rows = self._slots.completion_rows(key[0], inputs["round"], inputs["rank"])
                self._round = Round(key, self.generate_and_score_share(rows), used=repeat)
        self._round.used += 1
        batch = self._round.batches[repeat % self.args.steps_per_generation]
        inputs.update(batch)  # the loop counts the window's tokens from input_ids
        return inputs

    # ---- a round ---------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[list[int]]) -> Completions:
        """Sample one completion per row on the training model (every rank together)."""
        args = self.args
        if self.vllm is not None:
            return self.vllm.generate(prompt_ids, max_new_tokens=args.max_completion_length,
                                      eos_token_ids=self.eos_token_ids, version=self.state.global_step)
        # top_k=0 is passed as is: None would let the model's generation_config add its default top-k of 50.
        sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                    "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
                    **(args.generation_kwargs or {})}
        return generate_completions(self.runner, self.model_wrapped, prompt_ids, pad_token_id=self._pad_id,
                                    eos_token_ids=self.eos_token_ids, max_new_tokens=args.max_completion_length,
                                    sampling=sampling,
                                    keep_unsharded=None if args.ds3_gather_for_generation else False)

    @property
    def _pad_id(self) -> int:
        return int(self.processing_class.pad_token_id)

    def generate_and_score(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Prompt rows, each given its ``num_generations`` completions on this rank -> the round's micro-batches."""
        return self.generate_and_score_share([row for row in rows for _ in range(self.args.num_generations)])

    def generate_and_score_share(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """This rank's share of a generation batch, one prompt row per completion in TRL's order (a prompt's rows
        consecutive; its group may continue on the next rank) -> the round's micro-batches (generation, rewards,
        advantages over every rank's rewards, log-probs)."""
        prompt_ids = self.prompt_ids(rows)
        completions = self.generate(prompt_ids)
        return self.micro_batches(self.score_completions(rows, prompt_ids, completions))

    def prompt_ids(self, rows: list[dict[str, Any]]) -> list[list[int]]:
        """The token ids of each row's prompt; a prompt's consecutive rows (one row repeated) are tokenized once."""
        starts = [i for i in range(len(rows)) if i == 0 or rows[i] is not rows[i - 1]]
        unique = tokenize_prompts(self.processing_class, [rows[i]["prompt"] for i in starts],
                                  self.args.chat_template_kwargs)
        ends = starts[1:] + [len(rows)]
        return [ids for ids, a, b in zip(unique, starts, ends) for _ in range(b - a)]

    def micro_batches(self, batch: dict[str, Tensor]) -> list[dict[str, Any]]:
        """A scored round shuffled (the global RNG) and split into ``steps_per_generation`` micro-batches."""
        rows = batch["completion_ids"].shape[0]
        order = torch.randperm(rows, device="cpu").to(batch["completion_ids"].device)
        size = self.args.per_device_train_batch_size
        out = []
        for i in range(0, rows, size):
            part = {k: v if k == "num_items_in_batch" else v[order[i:i + size]] for k, v in batch.items()}
            part["input_ids"] = torch.cat([part["prompt_ids"], part["completion_ids"]], 1)
            out.append(part)
        return out

    def score_completions(self, rows: list[dict[str, Any]], prompt_ids: list[list[int]], completions: Completions
                          ) -> dict[str, Tensor]:
        """Rewards, advantages and the no-grad log-probs of this rank's completions of a round, in order."""
        args, runner, device = self.args, self.runner, self.runner.device
        mode = "train" if self.model.training else "eval"
        prompts = [row["prompt"] for row in rows]
        texts = self.processing_class.batch_decode(completions.ids, skip_special_tokens=True)
        decoded = [[{"role": "assistant", "content": t}] for t in texts] if is_conversational(prompts[0]) else texts
        p_ids, p_mask = left_pad(prompt_ids, self._pad_id, device)
        c_ids, c_mask = right_pad(completions.ids, self._pad_id, device)
        truncated = torch.tensor(completions.truncated, dtype=torch.bool, device=device)
        if args.mask_truncated_completions:
            c_mask = c_mask * (~truncated).unsqueeze(1).long()
        batch = {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": c_ids, "completion_mask": c_mask}
        tokens = self._dp_sum(c_mask.sum().double())
        self._log_lengths(mode, prompt_ids, completions)
        with torch.no_grad():
            generate_every = args.steps_per_generation * args.num_iterations
            # with vLLM's correction the log-probs at generation are always needed (TRL's rule): they are both the
            # ratio's denominator and the numerator of the correction
            if self.always_old_logps or completions.logprobs is not None or \
                    args.gradient_accumulation_steps % generate_every != 0:
                batch["old_per_token_logps"] = self._log_probs(self.model_wrapped, self.model, batch)[0]
            if completions.logprobs is not None:
                self._vllm_correction(mode, batch, completions.logprobs)
            if args.beta != 0.0:
                batch["ref_per_token_logps"] = self.reference_log_probs(batch)
        local = self.rewards(prompts, decoded, completions.ids, rows, device, {"trainer_state": self.state})
        everyone = torch.tensor(runner.gather_object(local.tolist()), dtype=torch.float32, device=device)
        everyone = everyone.view(-1, len(self.rewards))
        unscorable = int(torch.isnan(everyone).all(dim=1).sum())
        if unscorable and runner.is_main_process:
            logger.warning(f"{unscorable} of {everyone.shape[0]} completions got None from every reward function: "
                           "they count as their group's mean (advantage 0) and teach nothing; make at least one "
                           "reward function score every completion")
        start = runner.strategy.data_parallel_rank * len(rows)
        advantages = self.advantages(everyone, batch, mode)[start:start + len(rows)]
        self._log_rewards(mode, everyone)
        batch["advantages"] = advantages
        batch["num_items_in_batch"] = tokens
        return batch

    def _vllm_correction(self, mode: str, batch: dict[str, Tensor], logprobs: list[list[float]],
                         filler: bool = False) -> None:
        """``batch["importance_sampling_ratio"]``: the weights of vLLM's samples, and TRL's metrics of them over the
        ranks (an eval step's filler rows count in none)."""
        args, old, mask = self.args, batch["old_per_token_logps"], batch["completion_mask"].float()
        sampling = torch.zeros_like(old)
        for i, row in enumerate(logprobs):
            sampling[i, :len(row)] = torch.tensor(row, dtype=old.dtype)
        weights = vllm_importance_weights(old, sampling, mask, args.vllm_importance_sampling_mode,
                                          args.vllm_importance_sampling_clip_min,
                                          args.vllm_importance_sampling_clip_max)
        batch["importance_sampling_ratio"] = weights
        for name, (how, value) in vllm_importance_metrics(old, sampling, mask, weights).items():
            values = [v for v in self.runner.gather_object([] if filler else [value]) if v == v]
            combined = (min if how == "min" else max if how == "max" else lambda v: sum(v) / len(v))(values) \
                if values else float("nan")
            self._metrics[mode][name].append(combined)

    def advantages(self, rewards_per_func: Tensor, batch: dict[str, Tensor], mode: str) -> Tensor:
        """Override: ``[N]`` advantages of the whole generation batch from every rank's rewards ``[N, F]``."""
        raise NotImplementedError(f"{type(self).__name__} must implement advantages")

    def policy_objective(self, batch: dict[str, Tensor], logps: Tensor, entropy: Tensor, mode: str) -> Tensor:
        """Override: a micro-batch's loss from the policy's per-token log-probs (with gradient)."""
        raise NotImplementedError(f"{type(self).__name__} must implement policy_objective")

    # ---- the Trainer's seams ------------------------------------------------------------------------

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Tensor | None = None):
        """The micro-batch's loss (TRL's value for the micro-batch; the window averages the micro-batches)."""
        if return_outputs:
            raise ValueError(f"{type(self).__name__} has no outputs to return")
        mode = "train" if self.model.training else "eval"
        logps, entropy = self._log_probs(model, self.runner.unwrap_model(model), inputs, entropy=True, chunked=False)
        return self.policy_objective(inputs, logps, entropy, mode)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the metrics gathered since the last log (TRL's names), averaged over the rounds and micro-batches."""
        mode = "train" if self.model.training else "eval"
        if self._evaluating:  # the evaluation loop returned its metrics, prefixed; the train ones wait for theirs
            return super().log(logs, start_time)
        for name, values in self._metrics[mode].items():
            finite = [v for v in values if v == v]
            if finite:
                logs[name] = sum(finite) / len(finite)
        self._metrics[mode].clear()
        super().log(logs, start_time)

    # ---- metrics ---------------------------------------------------------------------------------

    def _dp_sum(self, value: Tensor) -> Tensor:
        """``value`` summed over the data-parallel ranks (a tensor-parallel group counts once)."""
        runner = self.runner
        if runner.world_size == 1:
            return value
        dp = runner.strategy.data_parallel_size
        return runner.all_reduce(value.to(runner.device), "sum") * (dp / runner.world_size)

    def global_masked_mean(self, values: Tensor, mask: Tensor) -> float:
        """The mean of ``values`` over the masked tokens of every rank."""
        if values.shape[1] == 1:
            total, count = values.sum(), torch.tensor(float(values.shape[0]), device=values.device)
        else:
            total, count = (values * mask).sum(), mask.sum().float()
        both = self._dp_sum(torch.stack([total.double(), count.double()]))
        return float(both[0] / both[1].clamp(min=1.0))

    def _log_lengths(self, mode: str, prompt_ids: list[list[int]], completions: Completions) -> None:
        runner, metrics = self.runner, self._metrics[mode]
        lengths = torch.tensor(runner.gather_object([float(len(c)) for c in completions.ids]))
        truncated = torch.tensor(runner.gather_object([bool(t) for t in completions.truncated]))
        prompt_tokens = sum(runner.gather_object([len(p) for p in prompt_ids]))
        if mode == "train":
            self.state.num_input_tokens_seen += int(prompt_tokens + lengths.sum().item())
        metrics["num_tokens"] = [float(self.state.num_input_tokens_seen)]
        metrics["completions/mean_length"].append(lengths.mean().item())
        metrics["completions/min_length"].append(lengths.min().item())
        metrics["completions/max_length"].append(lengths.max().item())
        metrics["completions/clipped_ratio"].append(truncated.float().mean().item())
        ended = lengths[~truncated] if bool((~truncated).any()) else torch.zeros(1)
        metrics["completions/mean_terminated_length"].append(ended.mean().item())
        metrics["completions/min_terminated_length"].append(ended.min().item())
        metrics["completions/max_terminated_length"].append(ended.max().item())

    def _log_rewards(self, mode: str, rewards_per_func: Tensor) -> None:
        metrics = self._metrics[mode]
        for i, name in enumerate(self.rewards.names):
            metrics[f"rewards/{name}/mean"].append(torch.nanmean(rewards_per_func[:, i]).item())
            metrics[f"rewards/{name}/std"].append(nanstd(rewards_per_func[:, i]).item())
        unscorable = torch.isnan(rewards_per_func).all(dim=1)
        weights = self.rewards.weights.to(rewards_per_func.device)
        total = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        total[unscorable] = float("nan")
        metrics["reward"].append(torch.nanmean(total).item())
        metrics["reward_std"].append(nanstd(total).item())


def _load_model(model: Any, args: Any) -> nn.Module:
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model, **(args.model_init_kwargs or {}))
    if not isinstance(model, nn.Module):
        raise TypeError(f"an RL trainer needs a model (a torch module or a model path), got {type(model).__name__}")
    if args.model_init_kwargs is not None:
        raise ValueError(f"{type(args).__name__}.model_init_kwargs is set but the model is already built, so they "
                         "would do nothing: pass the model's path, or leave model_init_kwargs unset")
    return model


def _disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
