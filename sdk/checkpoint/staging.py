"""Staging a save: the writer's calls recorded with copies of their tensors, to be written later by another thread.

:class:`StagingWriter` has the writing methods of :class:`~shardkit.checkpoint.CheckpointWriter`, so a strategy's
``save_module``/``save_optimizer`` (which gather on the main thread where the strategy shards) write into it
unchanged. Each call keeps a copy of its tensors, taken at once, so that training may change the originals while
:meth:`StagingWriter.replay` writes the copies into a real writer on a background thread. Copies go to host memory
(pinned when the source is on a GPU, copied without blocking the host; :meth:`StagingWriter.ready` waits for them).
Buffers are reused by the next save of the same shapes (:class:`StagingBuffers`): a fresh 1 GiB host buffer costs
its page faults on every save, which was ~40% of the copy's time on this machine.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .format import CheckpointError
from .writer import ShardPiece

__all__ = ["StagingBuffers", "StagingWriter"]


class StagingBuffers:
    """Host buffers reused from one save to the next: the i-th tensor staged takes the i-th buffer when its
    shape and dtype match (a save of the same state stages its tensors in the same order)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._next = 0

    def start(self) -> None:
        """Begin a save: buffers are handed out from the first again."""
        self._next = 0

    def take(self, like: torch.Tensor, pin: bool) -> torch.Tensor:
        """A contiguous host tensor of ``like``'s shape and dtype (pinned when ``pin``)."""
        i = self._next
        self._next += 1
        if i < len(self._buffers):
            buf = self._buffers[i]
            if buf.shape == like.shape and buf.dtype == like.dtype and buf.is_pinned() == pin:
                return buf
        buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
        if i < len(self._buffers):
            self._buffers[i] = buf
        else:
            self._buffers.append(buf)
        return buf

    def release(self) -> None:
        """Free every buffer (teardown)."""
        self._buffers.clear()
        self._next = 0

    @property
    def nbytes(self) -> int:
        """Bytes held between saves."""
        return sum(b.numel() * b.element_size() for b in self._buffers)


class StagingWriter:
    """Records a save's writes with copies of their tensors; :meth:`replay` makes them on a real writer.

    Args:
        path: the checkpoint being saved (for messages; the real writer owns the directory).
        rank: this process's rank.
        world_size: the ranks taking part.
        buffers: host buffers to copy into (reused across saves); a fresh set when None.
    """

    def __init__(self, path: str | Path, rank: int, world_size: int, buffers: StagingBuffers | None = None) -> None:
        self.path, self.rank, self.world_size = Path(path), rank, world_size
        self._buffers = buffers if buffers is not None else StagingBuffers()
        self._buffers.start()
        self._calls: list[tuple[str, tuple[Any, ...]]] = []
        # One copy per (storage, view) within one call: tied weights stay tied. NOTE: per call only: a strategy's
        # temporaries (ZeRO's fragments) are freed between calls and the allocator hands their addresses to the
        # next ones, so an address seen in an earlier call may hold another tensor now (ZeRO-3's resume broke).
        self._memo: dict[tuple, torch.Tensor] = {}
        self._event: Any = None  # a CUDA event after the last device-to-host copy
        self.nbytes = 0

    # ---- the writer's methods, recorded ------------------------------------------------------------

    def write_tensors(self, name: str, tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None) -> None:
        """As :meth:`CheckpointWriter.write_tensors`, with the tensors copied now."""
        self._memo.clear()
        staged = {key: self._copy(t, f"{name}: {key}") if isinstance(t, torch.Tensor) else t
                  for key, t in tensors.items()}
        self._calls.append(("write_tensors", (name, staged, dict(metadata) if metadata else None)))

    def write_json(self, name: str, obj: Any) -> None:
        """As :meth:`CheckpointWriter.write_json`, with ``obj`` deep-copied now."""
        self._calls.append(("write_json", (name, copy.deepcopy(obj))))

    def write_state(self, name: str, nested: Any) -> None:
        """As :meth:`CheckpointWriter.write_state`: tensors copied now (the same object once), the rest deep-copied."""
        self._memo.clear()
        memo: dict[int, Any] = {}
        for path, t in _tensors_in(nested, name):
            if id(t) not in memo:
                memo[id(t)] = self._copy(t, path)
        self._calls.append(("write_state", (name, copy.deepcopy(nested, memo))))

    def write_shard(self, name: str, pieces: Mapping[str, ShardPiece | Sequence[ShardPiece]]) -> None:
        """As :meth:`CheckpointWriter.write_shard`, with each piece's tensor copied now."""
        self._memo.clear()
        staged: dict[str, Any] = {}
        for key, value in pieces.items():
            plist = [value] if isinstance(value, ShardPiece) else list(value)
            out = [ShardPiece(self._copy(p.tensor, f"{name}: {key}"), p.global_shape, p.offsets, p.flat_range)
                   if isinstance(p, ShardPiece) else p for p in plist]
            staged[key] = out[0] if isinstance(value, ShardPiece) else out
        self._calls.append(("write_shard", (name, staged)))

    # ---- handing over ------------------------------------------------------------------------------

    def ready(self) -> None:
        """Block until every copy has landed in host memory (GPU copies run without blocking the host)."""
        if self._event is not None:
            self._event.synchronize()

    def replay(self, writer: Any, on_call: Callable[[], None] | None = None) -> None:
        """Make the recorded calls on ``writer`` (a :class:`CheckpointWriter` opened for this save)."""
        self.ready()
        for method, args in self._calls:
            getattr(writer, method)(*args)
            if on_call is not None:
                on_call()

    def _copy(self, t: torch.Tensor, where: str) -> torch.Tensor:
        if t.device.type == "meta":
            raise CheckpointError(f"{self.path}: {where} is on the meta device and has no data to save")
        if t.is_sparse or t.layout != torch.strided:
            return t.detach().clone()  # write_state refuses it with its own message
        ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and ident in self._memo:
            return self._memo[ident]
        device = t.device.type != "cpu"
        pin = device and t.device.type == "cuda"
        buf = self._buffers.take(t, pin)
        with torch.no_grad():
            buf.copy_(t.detach(), non_blocking=pin)
        if pin:
            self._event = torch.cuda.Event()
            self._event.record()
        if t.numel():
            self._memo[ident] = buf
        self.nbytes += buf.numel() * buf.element_size()
        return buf


def _tensors_in(obj: Any, path: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in nested dicts, lists and tuples, with where it is."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, Mapping):
        return [found for k, v in obj.items() for found in _tensors_in(v, f"{path}.{k}")]
    if isinstance(obj, (list, tuple)):
        return [found for i, v in enumerate(obj) for found in _tensors_in(v, f"{path}[{i}]")]
    return []
