"""Evaluation of the online RL trainers: TRL's ``eval_dataset``, ``num_generations_eval`` and eval strategies.

Each evaluation step generates ``num_generations_eval`` completions (default ``num_generations``) for each of
``per_device_eval_batch_size x data-parallel ranks / num_generations_eval`` prompts, laid out as training lays out a
generation round (TRL's layout, :class:`~shardkit.rl.rounds.RoundSlots`: each rank generates its contiguous slice of
``per_device_eval_batch_size`` completions, so a prompt's completions may be spread over ranks; the rewards are
gathered and the advantages computed over the whole step, each rank its slice), through the same synced
rollout path as training (the same sampling settings, vLLM when ``use_vllm``), scores them and computes the loss a
training step would on them (TRL's ``prediction_step``: the importance ratio is 1, the KL is to the reference,
dapo/cispo/vespo divide by the step's tokens over the ranks, nothing is accumulated). The per-step metrics are
TRL's (``reward``, ``reward_std``, ``rewards/<func>/mean`` and ``/std``, ``frac_reward_zero_std``,
``completions/*``, ``entropy``, ``kl``, clip ratios, ``num_tokens``), averaged over the steps and returned with
the evaluation's prefix (``eval_reward``, ...), beside ``eval_loss``: the per-completion mean of the steps' losses.

Differences from TRL, each on purpose:

- every eval prompt is counted once. The last step may hold fewer prompts; a rank left without a completion to
  generate in it generates one for a filler prompt so that every collective still runs on every rank, and the filler
  counts nowhere (TRL pads the last batch with prompts from the start and counts them);
- evaluation samples from its own random stream, seeded with ``args.seed`` and run inside a saved-and-restored
  random state (torch's, the device's, Python's and numpy's), and puts the model back in the mode it found it in:
  a run with evaluations trains exactly as one without, every evaluation of the same weights gives the same
  figures, and a checkpoint saved after an evaluation resumes as one saved without it. TRL's evaluation draws from
  the training stream, so evaluating changes the completions sampled afterwards.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from shardkit.rl.rollout import Completions, is_conversational, left_pad, right_pad
from shardkit.rl.rounds import RoundSlots, check_prompt_rows, data_seed
from shardkit.trainer.evaluation import EvalLoopOutput

__all__ = ["EvalSteps", "OnlineRLEvaluation", "check_eval_settings", "eval_group_size"]


def eval_group_size(args: Any) -> int:
    """Completions per eval prompt: ``num_generations_eval``, else ``num_generations`` (TRL's rule)."""
    return args.num_generations_eval or args.num_generations


def check_eval_settings(args: Any, data_parallel_size: int | None = None) -> int:
    """Check ``num_generations_eval``; with ``data_parallel_size``, also TRL's rule that the global eval batch
    (``per_device_eval_batch_size`` x the data-parallel ranks) holds whole prompt groups. Returns the prompts per
    eval step (0 without ``data_parallel_size``), or raises naming the setting to change."""
    name, value = type(args).__name__, args.num_generations_eval
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name}.num_generations_eval={value!r} must be an integer >= 1, or None (num_generations)")
    if data_parallel_size is None:
        return 0
    group, per_device = eval_group_size(args), args.per_device_eval_batch_size
    if not isinstance(per_device, int) or per_device < 1:
        raise ValueError(f"{name}.per_device_eval_batch_size={per_device!r} must be an integer >= 1")
    if per_device * data_parallel_size % group:
        raise ValueError(f"{name}: the global eval batch (per_device_eval_batch_size {per_device} x "
                         f"{data_parallel_size} data-parallel ranks = {per_device * data_parallel_size}) must be "
                         f"divisible by num_generations_eval ({group}): an eval step holds whole prompt groups. "
                         "Change either")
    return per_device * data_parallel_size // group


class EvalSteps(Dataset):
    """One data-parallel rank's eval steps, dealt as training deals its rounds (:class:`RoundSlots`, one repetition,
    the prompts shuffled with ``data_seed``, else ``seed``, as TRL's eval sampler shuffles them with ``seed``): step
    ``s`` is a round of the global eval batch, this rank its contiguous slice of ``per_device_eval_batch_size`` rows,
    a prompt's completions possibly spread over ranks. The last step may hold fewer prompts; a rank whose slice of it
    is empty gets one row of the first prompt as a filler (``"filler": True``): it keeps the rank in the collectives
    and counts nowhere."""

    def __init__(self, rows: list[dict[str, Any]], group: int, per_rank: int, rank: int, ranks: int, seed: int):
        self.slots = RoundSlots(rows, group, per_rank, ranks, 1, seed, shuffle=True, partial=True)
        self.rank = rank

    def __len__(self) -> int:
        return self.slots.rounds

    def __getitem__(self, step: int) -> dict[str, Any]:
        if not 0 <= step < len(self):
            raise IndexError(step)
        rows = self.slots.completion_rows(0, step, self.rank)
        return {"rows": rows or [self.slots.rows[self.slots.order(0)[0]]], "filler": not rows}


def _first(items: list[Any]) -> Any:
    return items[0]


@contextmanager
def _isolated_rng(device: torch.device, seed: int) -> Iterator[None]:
    """Run on a random stream seeded with ``seed`` (the same on every rank, as tensor-parallel sampling needs) and
    put back every random state the body may draw from."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    accelerated = device.type not in ("cpu", "meta")
    with torch.random.fork_rng(devices=[device] if accelerated else [],
                               device_type=device.type if accelerated else "cuda"):
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)  # this rank's device only: fork_rng restores only that one
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


@contextmanager
def _eval_settings(args: Any, group: int) -> Iterator[None]:
    """The settings the advantages and loss read, as an eval step has them: groups of ``group`` completions, and one
    batch per step (TRL's eval neither splits the batch across steps nor accumulates). Restored after."""
    saved = args.num_generations, args.steps_per_generation
    args.num_generations, args.steps_per_generation = group, 1
    try:
        yield
    finally:
        args.num_generations, args.steps_per_generation = saved


class OnlineRLEvaluation:
    """The evaluation half of :class:`~shardkit.rl.trainer.OnlineRLTrainer` (mixed in before the Trainer):
    ``evaluate()`` (in training at ``eval_strategy``, or called directly) runs the steps of :class:`EvalSteps`."""

    _evaluating = False  # the Trainer's evaluate() logs its metrics: the trainer's log() must not add train metrics

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """The Trainer's ``evaluate``: metrics named ``<prefix>_reward``, ``<prefix>_loss``, ... (see the module)."""
        outer, self._evaluating = self._evaluating, True
        try:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            self._evaluating = outer

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test",
                output_dir: Any = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.predict: an RL trainer has no predictions to return (its "
                                  "outputs are sampled completions); use evaluate(dataset) for the rewards and loss")

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        raise NotImplementedError(f"{type(self).__name__}: prediction_step is not used; evaluate() generates and "
                                  "scores each eval step itself")

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """This rank's eval steps (:class:`EvalSteps`) over ``eval_dataset`` (default ``self.eval_dataset``; a key
        of it when it is a dict)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str):
            dataset = self.eval_dataset[dataset]
        if dataset is None:
            raise ValueError(f"{type(self).__name__}: evaluation needs an eval_dataset of rows with a 'prompt'")
        rows = list(dataset)
        check_prompt_rows(rows, "eval_dataset")
        if not rows:
            raise ValueError(f"{type(self).__name__}: eval_dataset is empty")
        strategy, args = self.runner.strategy, self.args
        check_eval_settings(args, strategy.data_parallel_size)
        steps = EvalSteps(rows, eval_group_size(args), args.per_device_eval_batch_size, strategy.data_parallel_rank,
                          strategy.data_parallel_size, data_seed(args))
        return DataLoader(steps, batch_size=1, shuffle=False, collate_fn=_first)

    def evaluation_loop(self, loader: Any, description: str, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval",
                        stream_to: Any = None) -> EvalLoopOutput:
        """Every eval step on every rank; the metrics of :attr:`_metrics` ``["eval"]`` averaged over the steps."""
        model, args = self.model_wrapped, self.args
        was_training = model.training
        model.eval()
        self.callback_handler.eval_dataloader = loader
        self._metrics["eval"].clear()
        weighted_loss, counted, steps = 0.0, 0, 0
        try:
            with _isolated_rng(self.runner.device, args.seed), _eval_settings(args, eval_group_size(args)):
                for inputs in itertools.islice(loader, args.fast_dev_run or None):
                    loss, rows = self._eval_step(inputs["rows"], inputs["filler"])
                    for value, count in self.runner.gather_object([(loss, rows)]):
                        if count:
                            weighted_loss, counted = weighted_loss + value * count, counted + count
                    steps += 1
                    self.control = self.callback_handler.on_prediction_step(args, self.state, self.control)
        finally:
            model.train(was_training)
        metrics: dict[str, float] = {}
        for name, values in self._metrics["eval"].items():
            finite = [v for v in values if v == v]
            if finite:
                metrics[name] = sum(finite) / len(finite)
        self._metrics["eval"].clear()
        if counted:
            metrics["loss"] = weighted_loss / counted
        return EvalLoopOutput(None, None, metrics, counted, steps)

    def _eval_step(self, rows: list[dict[str, Any]], filler: bool) -> tuple[float, int]:
        """Generate, score and compute the loss of one eval step on this rank: ``(loss, completions counted)``.

        Every rank runs the same collectives in the same order whatever its share (a filler rank passes empty
        tensors and lists to the reductions); the model's forwards run once per step on every rank."""
        args, runner, mode, device = self.args, self.runner, "eval", self.runner.device
        prompts = [row["prompt"] for row in rows]
        prompt_ids = self.prompt_ids(rows)
        completions = self.generate(prompt_ids)
        real = 0 if filler else len(rows)
        p_ids, p_mask = left_pad(prompt_ids, self._pad_id, device)
        c_ids, c_mask = right_pad(completions.ids, self._pad_id, device)
        if args.mask_truncated_completions:
            truncated = torch.tensor(completions.truncated, dtype=torch.bool, device=device)
            c_mask = c_mask * (~truncated).unsqueeze(1).long()
        batch = {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": c_ids, "completion_mask": c_mask}
        self._log_lengths(mode, prompt_ids[:real], Completions(completions.ids[:real], completions.truncated[:real]))
        with torch.no_grad():
            # one forward for every rank's rows (the eval batch is sized by per_device_eval_batch_size); the model
            # does not change within the step, so these are the log-probs at generation and the ratio is 1
            logps, entropy = self._log_probs(self.model_wrapped, self.model, batch, entropy=True, chunked=False)
            batch["old_per_token_logps"] = logps
            if completions.logprobs is not None:
                self._vllm_correction("eval", batch, completions.logprobs, filler)
            if args.beta != 0.0:
                batch["ref_per_token_logps"] = self.reference_log_probs(batch, chunked=False)
        # a filler rank's rows ran the forwards with the others' and stop here: it keeps no row of its own
        mine = {k: v[:real] for k, v in batch.items()}
        mine["num_items_in_batch"] = self._dp_sum(c_mask[:real].sum().double())
        local = torch.zeros(0, len(self.rewards), device=device)
        if real:
            texts = self.processing_class.batch_decode(completions.ids, skip_special_tokens=True)
            decoded = [[{"role": "assistant", "content": t}] for t in texts] if is_conversational(prompts[0]) \
                else texts
            local = self.rewards(prompts, decoded, completions.ids, rows, device, {"trainer_state": self.state})
        everyone = torch.tensor(runner.gather_object(local.tolist()), dtype=torch.float32, device=device)
        everyone = everyone.view(-1, len(self.rewards))
        start = sum(runner.gather_object([real])[:runner.strategy.data_parallel_rank])
        mine["advantages"] = self.advantages(everyone, mine, mode)[start:start + real]
        self._log_rewards(mode, everyone)
        with torch.no_grad():
            loss = self.policy_objective(mine, logps[:real], entropy[:real], mode)
        return float(loss), real
