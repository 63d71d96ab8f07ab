"""What ``Accelerator.prepare`` hands back for an optimizer, a scheduler and a data loader.

Each wrapper keeps Accelerate's meaning and delegates the work: the optimizer's ``step()`` is the strategy's
step through the precision (``shardkit.Strategy.optimizer_step``: unscale, inf/NaN vote, step), the data
loader is the Runner's resumable, rank-sharded loader, and the scheduler steps the user's scheduler.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch
from typing_extensions import override

from shardkit.data.loader import ResumableSampler, RunnerDataLoader

__all__ = ["AcceleratedOptimizer", "AcceleratedScheduler", "PreparedDataLoader", "SkipBatches"]


class AcceleratedOptimizer(torch.optim.Optimizer):
    """The prepared optimizer: ``step()`` and ``zero_grad()`` act only when the window ends (``sync_gradients``).

    It is a ``torch.optim.Optimizer`` (schedulers built over it after ``prepare`` work), with the wrapped
    optimizer's ``param_groups``, ``state`` and ``defaults``.

    Attributes:
        optimizer: the user's optimizer (under ZeRO, the one inside DeepSpeed's wrapper).
        step_was_skipped: the last window's step was skipped for an fp16 overflow.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, stepper: Any) -> None:
        # NOTE: torch.optim.Optimizer.__init__ is not called: every attribute it would set is the wrapped one's.
        self.optimizer = optimizer
        self._stepper = stepper  # the Accelerator's training part: knows the window, the model and the strategy
        self._is_overflow = False

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    @override
    def step(self, closure: Any = None) -> None:
        """At the end of a window: the strategy's step (unscale, overflow vote, step); otherwise nothing."""
        if closure is not None:
            raise NotImplementedError("optimizer.step(closure) is not supported by the prepared optimizer; call "
                                      "step() after accelerator.backward(loss)")
        if self._stepper.sync_gradients:
            self._is_overflow = not self._stepper.optimizer_step(self)

    @override
    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """At the end of a window: clear the gradients (through the strategy); otherwise keep accumulating."""
        if not self._stepper.sync_gradients:
            return
        if set_to_none is False:
            accepts = "set_to_none" in inspect.signature(self.optimizer.zero_grad).parameters
            self.optimizer.zero_grad(set_to_none=False) if accepts else self.optimizer.zero_grad()
        else:
            self._stepper.zero_grad(self)

    def train(self) -> None:
        """Training mode of an optimizer that has one (schedule-free)."""
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()

    def eval(self) -> None:
        """Evaluation mode of an optimizer that has one (schedule-free: the averaged weights)."""
        if callable(getattr(self.optimizer, "eval", None)):
            self.optimizer.eval()

    @property
    def step_was_skipped(self) -> bool:
        return self._is_overflow

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


class AcceleratedScheduler:
    """The prepared scheduler: it steps only after an optimizer step that was taken, as Accelerate's does.

    Mid-window (``sync_gradients`` False) ``step()`` only counts (``adjust_scheduler``); after an fp16 overflow it
    does nothing; otherwise it steps once per process (``split_batches=False``: a schedule written for the
    single-process batch count then keeps its length) or once (``split_batches=True``).
    """

    def __init__(self, scheduler: Any, optimizers: list[AcceleratedOptimizer], accelerator: Any,
                 step_with_optimizer: bool = True, split_batches: bool = False) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self._accelerator = accelerator
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        gradient_state = self._accelerator.gradient_state
        if not gradient_state.sync_gradients:
            if gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(1 if self.split_batches else self._accelerator.num_processes):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR refuses a step past its end
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def get_lr(self) -> Any:
        return self.scheduler.get_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)


class PreparedDataLoader:
    """The prepared data loader: the Runner's resumable loader, sharded over the processes, that tells the
    Accelerator which loader is being iterated and when its last batch comes (``end_of_dataloader``).

    Attributes:
        base: the loader underneath (what checkpoints record): :class:`shardkit.data.loader.RunnerDataLoader` for a
            map-style dataset dealt per sample, :class:`shardkit.data.streaming.StreamingLoader` for an iterable one,
            :class:`shardkit.accelerate_compat.data_loader.BatchShardLoader` for a loader with its own batches.
    """

    def __init__(self, base: Any, gradient_state: Any, split_batches: bool = False) -> None:
        self.base = base
        self._gradient_state = gradient_state
        self.split_batches = split_batches
        self.end_of_dataloader = False
        self._iterated = False  # an iteration started since the last set_epoch / restored position
        self._restored = False  # a saved position waits for the next iteration
        self.before_epoch: Any = None  # called before each iteration (shares a DataLoader generator's state)

    @property
    def dataset(self) -> Any:
        return self.base.dataset

    @property
    def batch_size(self) -> int | None:
        return self.base.batch_size

    @property
    def num_processes(self) -> int:
        """The processes the batches are dealt over."""
        base = self.base
        if isinstance(base.sampler if hasattr(base, "sampler") else None, ResumableSampler):
            return base.sampler.num_replicas
        return base.num_processes if hasattr(base, "num_processes") else base.view.world

    @property
    def total_batch_size(self) -> int:
        """Samples per step over all processes."""
        return (self.base.batch_size or 1) * self.num_processes

    @property
    def sampler(self) -> Any:
        return getattr(self.base, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        """What makes the batches; for a map-style dataset it has Accelerate's ``even_batches`` switch."""
        if isinstance(self.sampler, ResumableSampler):
            return _SampleBatches(self.base)
        if hasattr(self.base, "batch_sampler"):
            return self.base.batch_sampler
        return self.base.loader.batch_sampler  # a stream: torch's, without even_batches

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def remainder(self) -> int:
        """Real samples in the epoch's last global batch (0 when it is full), as Accelerate counts them; -1 when
        the length is not known (a stream)."""
        if isinstance(self.sampler, ResumableSampler):
            return self.base.sampler.split_length % self.total_batch_size
        try:
            return len(self.dataset) % self.total_batch_size
        except TypeError:
            return -1

    def __len__(self) -> int:
        return len(self.base)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (its shuffle depends only on the seed and the epoch)."""
        self.base.set_epoch(epoch)
        self._iterated = False

    def state_dict(self) -> dict[str, Any]:
        """This process's position: epoch, batches seen (see :meth:`RunnerDataLoader.state_dict`)."""
        return self.base.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position at the next iteration."""
        self.base.load_state_dict(state)
        self.restored()

    def restored(self) -> None:
        """Note that the base loader's position was restored (the next iteration continues it)."""
        self._restored = True

    def skip(self, num_batches: int) -> None:
        """Start the next iteration at batch ``num_batches`` of the epoch it would run."""
        base = self.base
        position = base.state_dict()
        epoch = position["epoch"] if self._restored else base.epoch + 1 if self._iterated else base.epoch
        if not isinstance(self.sampler, ResumableSampler):
            if "stream" in position:
                raise NotImplementedError("skip_first_batches on a streamed dataset: save and load the loader's "
                                          "state (accelerator.save_state / load_state) to resume it exactly")
            position.update(epoch=epoch, batches_seen=num_batches)
            self.load_state_dict(position)
            return
        if not self._restored:  # the next iteration starts an epoch from its beginning
            position["offset"] = 0
        size = base.batch_size or 1
        position.update(epoch=epoch, batches_seen=num_batches,
                        samples_seen=min(num_batches * size, base.sampler.per_rank),
                        world_size=base.sampler.num_replicas)
        self.load_state_dict(position)

    def __iter__(self) -> Iterator[Any]:
        self.end_of_dataloader = False
        self._iterated, self._restored = True, False
        if self.before_epoch is not None:
            self.before_epoch()
        self._gradient_state._add_dataloader(self)
        try:
            yield from self._batches()
        finally:
            self.end_of_dataloader = False
            self._gradient_state._remove_dataloader(self)

    def _batches(self) -> Iterator[Any]:
        sized = _has_length(self.base)
        for batch in self.base:
            # NOTE: read after the batch came: by then the sampler dealt this epoch's split, and batches_seen
            # counts from the split's start (a resumed position included). A stream reads one batch ahead.
            self.end_of_dataloader = self.base.batches_seen >= len(self.base.loader) if sized else self.base.at_end
            yield batch

    def __repr__(self) -> str:
        try:
            batches = str(len(self))
        except TypeError:
            batches = "unknown (a stream)"
        return f"PreparedDataLoader(batch_size={self.batch_size}, batches={batches})"


class _SampleBatches:
    """Accelerate's ``prepared.batch_sampler`` for a loader dealt per sample: its batch size, and ``even_batches``
    (False: the samples of the epoch's last round are not repeated, so processes may get different counts)."""

    def __init__(self, base: RunnerDataLoader) -> None:
        self._base = base

    @property
    def batch_size(self) -> int | None:
        return self._base.batch_size

    @property
    def drop_last(self) -> bool:
        return self._base.sampler.drop_last

    @property
    def sampler(self) -> ResumableSampler:
        return self._base.sampler

    @property
    def even_batches(self) -> bool:
        return self._base.sampler.even

    @even_batches.setter
    def even_batches(self, even: bool) -> None:
        self._base.sampler.even = bool(even)

    def __len__(self) -> int:
        return len(self._base.loader)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._base.loader.batch_sampler)


def _has_length(base: Any) -> bool:
    try:
        len(base.loader)
    except TypeError:
        return False
    return True


class SkipBatches:
    """A plain loader (not prepared) without its first ``num_batches`` batches, each time it is iterated once."""

    def __init__(self, loader: Any, num_batches: int) -> None:
        self.loader = loader
        self.num_batches = num_batches

    def __len__(self) -> int:
        return max(len(self.loader) - self.num_batches, 0)

    def __iter__(self) -> Iterator[Any]:
        for index, batch in enumerate(self.loader):
            if index >= self.num_batches:
                yield batch
