"""PreferenceTrainer: what DPO and its family share, on shardkit's Trainer through its public seams.

- the data: prompt/chosen/rejected rows tokenized (:mod:`shardkit.preference.data`), one batch holding the chosen
  then the rejected sequences (padded, or padding-free through shardkit's varlen attention);
- one forward for chosen and rejected (:meth:`concatenated_forward`), scored by the chunked log-prob op so the
  ``[tokens, vocab]`` logits never exist;
- the reference: a frozen copy set up by the Runner (sharded like the policy under ZeRO-3/FSDP/TP, replicated
  otherwise), a PEFT model's base with its adapter disabled (no copy), or log-probs computed once before training
  (``precompute_ref_log_probs``); TR-DPO's ``sync_ref_model``;
- an exact loss under gradient accumulation and data parallelism: a subclass returns *summed* loss terms, each
  divided here by its count over the whole optimizer step (all micro-batches, all ranks): pairs, chosen tokens...;
- metrics summed with their counts over ranks and averaged at each log (TRL's names).

A subclass implements :meth:`preference_loss` (and may add counts in :meth:`count_items`).
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from shardkit.preference.data import DataCollatorForPreference, PreferenceTokenizer, tokenize_preference_dataset
from shardkit.preference.logps import SequenceLogps, sequence_log_probs
from shardkit.trainer.callbacks import TrainerCallback
from shardkit.trainer.frozen_model import frozen_model_context, set_up_frozen_model
from shardkit.trainer.peft_support import base_model_of, is_peft_model
from shardkit.trainer.router_aux_loss import refuse_dropped_router_aux_loss
from shardkit.trainer.trainer import Trainer

__all__ = ["PreferenceTrainer"]

logger = logging.getLogger("shardkit.preference")


def sequence_count(batch: dict[str, Tensor]) -> int:
    """Sequences in a collated batch (chosen + rejected)."""
    packed = batch.get("packed_sequences")
    return int(packed.numel()) if packed is not None else int(batch["input_ids"].shape[0])


def scored_tokens(batch: dict[str, Tensor]) -> Tensor:
    """Completion tokens scored per sequence (a completion token is scored from the position before it)."""
    mask = batch["completion_mask"].bool()[:, 1:]
    packed = batch.get("packed_sequences")
    if packed is None:
        return mask.sum(1)
    starts = batch["position_ids"] == 0
    sequence = (starts.reshape(-1).long().cumsum(0) - 1).reshape(starts.shape)[:, 1:]
    keep = mask & ~starts[:, 1:]
    return torch.bincount(sequence[keep], minlength=packed.numel())


class _SyncReference(TrainerCallback):
    """TR-DPO: every ``steps`` optimizer steps, reference <- alpha * policy + (1 - alpha) * reference."""

    def __init__(self, trainer: PreferenceTrainer, alpha: float, steps: int):
        self.trainer, self.alpha, self.steps = trainer, alpha, steps

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step % self.steps == 0:
            self.trainer.sync_reference(self.alpha)
        return control


class PreferenceTrainer(Trainer):
    """The shared base of the preference trainers (see the module docstring).

    Args beyond :class:`~shardkit.trainer.Trainer`'s: ``ref_model`` (a frozen reference; default a copy of the
    model, or none where the subclass needs none), ``peft_config`` (the model is wrapped with ``get_peft_model``;
    its reference is the base with the adapter disabled). ``args`` must carry the data fields of
    :class:`~shardkit.preference.DPOConfig` (``max_length``, ``truncation_mode``, ``padding_free``, ...).
    """

    running_total_metrics: tuple[str, ...] = ()
    """Metrics logged as a total since training started (TRL's ``num_tokens``), not as a window's mean."""

    loss_is_scaled_for_ga = True  # compute_loss returns this micro-batch's share of the step's loss
    uses_reference = True  # a subclass without a reference model (ORPO, SimPO) sets False

    def __init__(self, model: Any, ref_model: nn.Module | None = None, args: Any = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 compute_metrics: Any = None, callbacks: Any = None, optimizers: tuple = (None, None),
                 peft_config: Any = None, *, strategy: Any = None, precision: Any = None):
        if ref_model is not None and ref_model is model:
            raise ValueError(f"{type(self).__name__}: model and ref_model are the same object; omit ref_model (a "
                             "frozen copy of the model is made) or pass a separate model")
        model = _load_model(model, args)
        refuse_dropped_router_aux_loss(model, type(self).__name__, getattr(args, "router_aux_loss_coef", None),
                                       has_coef_field=hasattr(args, "router_aux_loss_coef"))
        tokenizer = _prepare_tokenizer(processing_class, model, args)
        if args.disable_dropout:
            _disable_dropout(model)
        if args.padding_free:
            _packed_attention(model)
        # precompute_ref_log_probs without a ref_model: a copy is made and freed around the precomputation.
        wants_reference = self.uses_reference and ref_model is None and peft_config is None and \
            not is_peft_model(model) and not getattr(args, "precompute_ref_log_probs", False)
        if wants_reference:  # copied before adapters are added or the strategy takes the model
            ref_model = copy.deepcopy(model)
        elif ref_model is not None and args.padding_free:
            _packed_attention(ref_model)
        model = _apply_peft(model, peft_config, args)
        tokenize = PreferenceTokenizer(tokenizer, args.max_length, args.truncation_mode)
        train_dataset = tokenize_preference_dataset(train_dataset, tokenize, args.dataset_num_proc, "train")
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: tokenize_preference_dataset(v, tokenize, args.dataset_num_proc, k)
                            for k, v in eval_dataset.items()}
        else:
            eval_dataset = tokenize_preference_dataset(eval_dataset, tokenize, args.dataset_num_proc, "eval")
        if data_collator is None:
            data_collator = DataCollatorForPreference(tokenizer.pad_token_id, args.max_length, args.truncation_mode,
                                                      args.padding_free, args.pad_to_multiple_of)
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=tokenizer, compute_metrics=compute_metrics,
                         callbacks=callbacks, optimizers=optimizers, strategy=strategy, precision=precision)
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(lambda: [0.0, 0.0]),
                                                            "eval": defaultdict(lambda: [0.0, 0.0])}
        self.window_counts: dict[str, float] = {}
        self.running_totals: dict[str, float] = {}
        self.ref_model = None
        self._ref_unwrapped = None
        if ref_model is not None and self.uses_reference:
            if args.disable_dropout:
                _disable_dropout(ref_model)
            self._set_reference(ref_model)
        if getattr(args, "precompute_ref_log_probs", False) and self.uses_reference:
            self._precompute_datasets()
        if getattr(args, "sync_ref_model", False):
            self._check_sync()
            self.add_callback(_SyncReference(self, args.ref_model_mixup_alpha, args.ref_model_sync_steps))

    # ---- the reference -----------------------------------------------------------------------------

    def _set_reference(self, ref_model: nn.Module) -> None:
        """Freeze the reference and hold it as the strategy holds models (``trainer.frozen_model``)."""
        self.ref_model, self._ref_unwrapped = set_up_frozen_model(self.runner, ref_model)

    def _reference_context(self):
        # A replicated reference is not wrapped by the Runner, so the precision's autocast is entered here.
        return frozen_model_context(self.runner)

    @torch.no_grad()
    def reference_logps(self, model: nn.Module, inputs: dict[str, Tensor], sequences: int) -> Tensor:
        """The reference's summed completion log-probs ``[sequences]`` (chosen, then rejected): precomputed ones
        from the batch, the reference model's, or the policy's with its adapter disabled."""
        if "ref_chosen_logps" in inputs:
            return torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]]).float()
        ld_alpha = getattr(self.args, "ld_alpha", None)
        if self.ref_model is not None:
            with self._reference_context():
                return sequence_log_probs(self.ref_model, self._ref_unwrapped, inputs, sequences,
                                          ld_alpha=ld_alpha, mean_logits=False).logps
        unwrapped = self.runner.unwrap_model(model)
        if not is_peft_model(unwrapped):
            raise RuntimeError(f"{type(self).__name__} has no reference: pass ref_model, a PEFT model, or "
                               "precompute_ref_log_probs=True")
        with unwrapped.disable_adapter():
            return sequence_log_probs(model, unwrapped, inputs, sequences, ld_alpha=ld_alpha, mean_logits=False).logps

    def _precompute_datasets(self) -> None:
        """Reference log-probs of every row, once, before training (each rank computes all rows in order)."""
        temporary = self.ref_model is None and not is_peft_model(self.model)
        if temporary:
            self._set_reference(copy.deepcopy(self.model))  # freed below: held only while computing
        batch = self.args.precompute_ref_batch_size
        self.train_dataset = self._with_reference(self.train_dataset, batch or self.args.per_device_train_batch_size)
        eval_batch = batch or self.args.per_device_eval_batch_size
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {k: self._with_reference(v, eval_batch) for k, v in self.eval_dataset.items()}
        else:
            self.eval_dataset = self._with_reference(self.eval_dataset, eval_batch)
        if temporary:
            self.ref_model = self._ref_unwrapped = None

    def _with_reference(self, dataset: Any, batch_size: int) -> Any:
        if dataset is None:
            return None
        collate = DataCollatorForPreference(self.processing_class.pad_token_id, self.args.max_length,
                                            self.args.truncation_mode, self.args.padding_free)
        chosen, rejected = [], []
        model = self.ref_model if self.ref_model is not None else self.model.to(self.runner.device)
        was_training = model.training
        model.eval()
        for start in range(0, len(dataset), batch_size):
            rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
            inputs = {k: v.to(self.runner.device) for k, v in collate(rows).items()}
            logps = self.reference_logps(model, inputs, sequence_count(inputs))
            chosen += logps[:len(rows)].tolist()
            rejected += logps[len(rows):].tolist()
        model.train(was_training)
        if hasattr(dataset, "add_column"):
            return dataset.add_column("ref_chosen_logps", chosen).add_column("ref_rejected_logps", rejected)
        return [{**row, "ref_chosen_logps": c, "ref_rejected_logps": r}
                for row, c, r in zip(dataset, chosen, rejected)]

    def _check_sync(self) -> None:
        if self.ref_model is None:
            raise ValueError("sync_ref_model=True needs a reference model to update: a PEFT model's reference is its "
                             "base with the adapter disabled, and precomputed log-probs cannot move; use neither")
        if self.runner.strategy.optimizer_parameters == "flat" and self.runner.strategy.partitions_parameters:
            raise NotImplementedError("sync_ref_model=True under ZeRO-3 is not supported: the engine holds the "
                                      "policy's and the reference's partitions apart; use FSDP or ZeRO-1/2")

    @torch.no_grad()
    def sync_reference(self, alpha: float) -> None:
        """reference <- alpha * policy + (1 - alpha) * reference (both held alike: whole, or the same shards)."""
        policy = dict(self.runner.unwrap_model(self.model_wrapped).named_parameters())
        for name, ref in self._ref_unwrapped.named_parameters():
            ref.mul_(1 - alpha).add_(policy[name].detach().to(ref.dtype), alpha=alpha)

    # ---- the forward --------------------------------------------------------------------------------

    def concatenated_forward(self, model: nn.Module, inputs: dict[str, Tensor], **options: Any) -> SequenceLogps:
        """Chosen and rejected in one forward: per-sequence log-probs (see :class:`SequenceLogps`); ``options``
        are :func:`~shardkit.preference.logps.sequence_log_probs`'s (``ld_alpha``, ``mean_logits``, ``wpo``)."""
        unwrapped = self.runner.unwrap_model(model)
        return sequence_log_probs(model, unwrapped, inputs, sequence_count(inputs), **options)

    def preference_loss(self, model: nn.Module, inputs: dict[str, Tensor]
                        ) -> tuple[dict[str, Tensor], dict[str, tuple[Tensor, float]]]:
        """Override: ({count name: summed loss term}, {metric name: (summed value, count)}) of a micro-batch.

        Each term is divided by its count over the whole optimizer step (see :meth:`count_items`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement preference_loss")

    def count_items(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """What the loss terms are divided by, counted in one micro-batch: ``pairs`` and ``chosen_tokens``."""
        sequences = sequence_count(batch)
        return {"pairs": float(sequences // 2), "chosen_tokens": float(scored_tokens(batch)[:sequences // 2].sum())}

    # ---- the Trainer's seams ------------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int,
                          device: Any = None) -> tuple[list[Any], Tensor]:
        """The step's micro-batches and their item counts over the step (summed over ranks when
        ``average_tokens_across_devices``, as the Trainer's token count)."""
        window = list(itertools.islice(epoch_iterator, num_batches))
        names: list[str] = []
        local: dict[str, float] = defaultdict(float)
        for batch in window:
            for name, value in self.count_items(batch).items():
                local[name] += value
        names = sorted(local)
        counts = torch.tensor([local[n] for n in names] or [0.0], dtype=torch.float64, device=self.runner.device)
        if self.args.average_tokens_across_devices and self.runner.world_size > 1:
            dp = self.runner.strategy.data_parallel_size
            counts = self.runner.all_reduce(counts, "sum") * (dp / self.runner.world_size)
        self.window_counts = {n: float(c) for n, c in zip(names, counts.tolist())}
        return window, torch.tensor(max(self.window_counts.get("pairs", 1.0), 1.0), device=self.runner.device)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Tensor], return_outputs: bool = False,
                     num_items_in_batch: Tensor | None = None):
        """This micro-batch's share of the step's loss (with ``num_items_in_batch``: the step's counts from
        :meth:`get_batch_samples`), else the micro-batch's own mean (evaluation)."""
        terms, metrics = self.preference_loss(model, inputs)
        counts = self.window_counts if num_items_in_batch is not None else self.count_items(inputs)
        loss = sum(term / max(counts.get(name, 0.0), 1.0) for name, term in terms.items())
        self._record(metrics)
        return (loss, {}) if return_outputs else loss

    def _record(self, metrics: dict[str, tuple[Tensor, float]]) -> None:
        if not metrics:
            return
        mode = "train" if self.model.training else "eval"
        names = sorted(metrics)
        values = torch.tensor([[float(metrics[n][0]), float(metrics[n][1])] for n in names], dtype=torch.float64,
                              device=self.runner.device)
        if self.runner.world_size > 1:
            values = self.runner.all_reduce(values, "sum")
        for name, (total, count) in zip(names, values.tolist()):
            slot = self._metrics[mode][name]
            slot[0] += total
            slot[1] += count

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the metrics gathered since the last log (averaged over every item and rank), TRL's names."""
        # An evaluation's log holds "<prefix>_loss" (eval_loss, test_loss...); the model may be back in train mode.
        evaluated = [k for k in logs if k.endswith("_loss") and k not in ("train_loss", "loss")]
        mode, prefix = ("eval", evaluated[0][:-len("loss")]) if evaluated else ("train", "")
        # running totals (running_total_metrics) add up the training windows since the start, summed over the
        # data-parallel ranks (tensor-parallel ranks see the same batch: counted once)
        repeats = self.runner.world_size / max(1, self.runner.strategy.data_parallel_size)
        for name in self.running_total_metrics:
            total, _ = self._metrics["train"].pop(name, (0.0, 0.0))
            self.running_totals[name] = self.running_totals.get(name, 0.0) + total / repeats
        for name, (total, count) in self._metrics[mode].items():
            if count > 0:
                logs[f"{prefix}{name}"] = total / count
        self._metrics[mode].clear()
        for name, value in self.running_totals.items():
            logs[f"{prefix}{name}"] = value
        super().log(logs, start_time)

    def prediction_step(self, model: nn.Module, inputs: dict[str, Tensor], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """The micro-batch's preference loss (there are no labels nor logits to return)."""
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def get_train_dataloader(self) -> DataLoader:
        """The tokenized rows through the preference collator (the columns are the collator's, none filtered)."""
        if self.train_dataset is None:
            raise ValueError(f"{type(self).__name__}: training requires a train_dataset")
        shuffle = self.args.train_sampling_strategy == "random"
        return DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size, shuffle=shuffle,
                          collate_fn=self.data_collator, drop_last=self.args.dataloader_drop_last)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str):
            dataset = self.eval_dataset[dataset]
        if dataset is None:
            raise ValueError(f"{type(self).__name__}: evaluation requires an eval_dataset")
        loader = DataLoader(dataset, batch_size=self.args.per_device_eval_batch_size, shuffle=False,
                            collate_fn=self.data_collator, drop_last=False)
        return self.runner.setup_dataloader(loader)


def _load_model(model: Any, args: Any) -> nn.Module:
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM

        kwargs = args.model_init_kwargs or {}
        if isinstance(kwargs, str):
            import json

            kwargs = json.loads(kwargs)
        return AutoModelForCausalLM.from_pretrained(model, **kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"a preference trainer needs a model (a torch module or a model path), got "
                        f"{type(model).__name__}")
    if hasattr(getattr(model, "config", None), "use_cache"):
        model.config.use_cache = False
    return model


def _prepare_tokenizer(tokenizer: Any, model: nn.Module, args: Any) -> Any:
    if tokenizer is None:
        path = getattr(getattr(model, "config", None), "_name_or_path", None)
        if not path:
            raise ValueError("a preference trainer needs a tokenizer: pass processing_class=tokenizer (nothing is "
                             "downloaded)")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    if getattr(args, "pad_token", None) is not None:
        if args.pad_token not in tokenizer.get_vocab():
            raise ValueError(f"pad_token={args.pad_token!r} is not in the tokenizer's vocabulary")
        tokenizer.pad_token = args.pad_token
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is never scored (completion_mask 0)
    return tokenizer


def _disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def _packed_attention(model: nn.Module) -> None:
    """padding_free rows hold many sequences: the attention must stay inside each."""
    from shardkit.models import Llama

    base = base_model_of(model)
    if isinstance(base, Llama):
        return  # reads the sequences from position_ids itself
    from shardkit.sft.hf_attention import use_varlen_attention

    implementation = str(getattr(getattr(base, "config", None), "_attn_implementation", ""))
    if not use_varlen_attention(base) and not implementation.startswith(("flash_attention", "shardkit_varlen")):
        raise ValueError(f"padding_free=True packs sequences into one row, but {type(base).__name__}'s attention "
                         f"({implementation or 'unknown'}) would attend across them: use shardkit's Llama, a Hugging "
                         "Face model on sdpa/eager/flash_attention_2, or padding_free=False")


def _apply_peft(model: nn.Module, peft_config: Any, args: Any) -> nn.Module:
    if peft_config is None:
        return model
    if is_peft_model(model):
        raise ValueError("got peft_config for a model that is already a PeftModel: pass the base model, or no "
                         "peft_config")
    import peft

    if args.gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()  # the frozen embeddings' output must carry gradients to the adapters
    return peft.get_peft_model(model, peft_config)
