"""Reading a Hugging Face safetensors directory (``model.safetensors`` or an index + shards) as hostile input.

The index is read under the same rules as a shardkit manifest (:mod:`.trust`): at most 256 MiB, UTF-8
JSON, schema-checked (:func:`.schema.check_hf_index`); every shard it names must be a plain file of the
directory, a regular file and no symlink, opened through shardkit's own safetensors parser (every header
field checked, no second open by name). A key the index maps to a shard that lacks it is an error naming
both, found when the shard is first opened.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .format import CheckpointError, dtype_from_tag, flat_to_boxes
from .safefile import SafetensorsFile
from .schema import check_hf_index
from .trust import member_path, read_json_file

__all__ = ["INDEX", "SINGLE", "HFWeights"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_MAX_INDEX = 256 << 20  # the index of a 1T-parameter model is a few MB


class HFWeights:
    """The tensors of an HF checkpoint directory, opened lazily, one shard at a time.

    Args:
        path: the directory holding ``model.safetensors`` or ``model.safetensors.index.json`` + shards.

    Raises:
        CheckpointError: naming the file and the problem (no weights, a bad index, a shard outside the
            directory, a symlink, a FIFO, a malformed safetensors header).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._open: dict[str, SafetensorsFile] = {}
        self._by_file: dict[str, list[str]] = {}
        self.source = path / INDEX
        if self.source.exists() or self.source.is_symlink():
            member_path(path, INDEX, str(path))
            raw = read_json_file(self.source, _MAX_INDEX, "the safetensors index")
            self.weight_map: dict[str, str] = check_hf_index(raw, self.source)
        elif (path / SINGLE).exists() or (path / SINGLE).is_symlink():
            self.source = path / SINGLE
            self.weight_map = {k: SINGLE for k in self._shard(SINGLE).keys()}
        else:
            raise CheckpointError(f"{path}: has neither {SINGLE} nor {INDEX} (pytorch_model.bin pickles are not "
                                  "read: convert them to safetensors)")
        for key, file in self.weight_map.items():
            self._by_file.setdefault(file, []).append(key)

    def _shard(self, file: str) -> SafetensorsFile:
        h = self._open.get(file)
        if h is None:
            where = f"{self.source}: weight_map" if self.source.name == INDEX else str(self.path)
            p = member_path(self.path, file, where)
            h = SafetensorsFile(p, None, None, what="a weight file the index names")
            have = set(h.keys())
            wrong = [k for k in self._by_file.get(file, ()) if k not in have]
            if wrong:
                raise CheckpointError(f"{self.source}: maps {wrong[0]!r:.200} to {file}, which has no such tensor "
                                      f"({len(wrong)} of the keys it maps there are in the wrong shard); fix the index "
                                      "or export the model again")
            self._open[file] = h
        return h

    def file_path(self, key: str) -> Path:
        """The file holding ``key``."""
        return self.path / self.weight_map[key]

    def _file(self, key: str) -> SafetensorsFile:
        return self._shard(self.weight_map[key])

    def get(self, key: str) -> torch.Tensor:
        """The whole tensor."""
        return self._file(key).get_tensor(key)

    def shape(self, key: str) -> tuple[int, ...]:
        """The tensor's shape, read from the header only."""
        return tuple(self._file(key).get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        """The tensor's stored dtype, read from the header only."""
        return dtype_from_tag(self._file(key).get_slice(key).get_dtype(), str(self.path))

    def read_flat(self, key: str, start: int, count: int) -> torch.Tensor:
        """Elements ``[start, start + count)`` of the flattened tensor, reading only those bytes."""
        sl = self._file(key).get_slice(key)
        shape = tuple(sl.get_shape())
        if not shape:
            return self.get(key).reshape(-1)[start: start + count]
        parts = [sl[tuple(slice(o, o + n) for o, n in zip(offsets, box))].reshape(-1)
                 for offsets, box, _ in flat_to_boxes(start, start + count, shape)]
        return torch.cat(parts) if parts else torch.empty(0)
