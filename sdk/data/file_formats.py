"""Readers of one data file each, for :mod:`shardkit.data.sharded_files`: JSON lines, Parquet, Arrow IPC and
WebDataset-style tar, opened through ``fsspec`` so that a URL (``file://``, ``memory://``, ``s3://`` ...) names it.

Every reader starts at a sample index and, where the format allows, at a byte offset, and yields
``(index, sample, end_offset)``: ``end_offset`` is where the next sample begins (JSON lines, tar), so that a resumed
reader seeks straight to it instead of reading the file again from its start. Parquet seeks by row group (its footer
holds the row counts); Arrow reads record batches up to the start. Every file is hostile input: an error names the
file and, where it can, the sample.
"""

from __future__ import annotations

import json
import os
import tarfile
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

__all__ = ["FORMATS", "format_of", "open_url", "read_samples", "require_fsspec"]

FORMATS = ("jsonl", "parquet", "arrow", "tar")
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".arrow": "arrow",
             ".feather": "arrow", ".tar": "tar"}
_ARROW_FILE_MAGIC = b"ARROW1"


def require_fsspec() -> Any:
    """The ``fsspec`` module, or an ImportError saying how to install it."""
    try:
        import fsspec
    except ImportError as err:  # an optional dependency: only file-sharded datasets read through it
        raise ImportError("shardkit.data.ShardedFiles reads files through fsspec, which is not installed: "
                          "pip install 'shardkit[data]' (or pip install fsspec; s3:// also needs s3fs)") from err
    return fsspec


def _require_pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as err:
        raise ImportError("reading Parquet or Arrow files needs pyarrow: pip install 'shardkit[data]' "
                          "(or pip install pyarrow)") from err
    return pyarrow


def format_of(url: str) -> str:
    """The format a file's name says (``.jsonl``, ``.parquet``, ``.arrow``, ``.tar`` ...).

    Raises:
        ValueError: naming the file and the suffixes known.
    """
    suffix = os.path.splitext(url.rstrip("/"))[1].lower()
    if suffix not in _SUFFIXES:
        raise ValueError(f"ShardedFiles: cannot tell the format of {url!r} from its suffix {suffix!r}; known: "
                         f"{sorted(_SUFFIXES)}. Pass format= one of {FORMATS}")
    return _SUFFIXES[suffix]


def open_url(url: str, storage_options: dict[str, Any] | None = None) -> BinaryIO:
    """``url`` opened for binary reading through fsspec.

    Raises:
        FileNotFoundError: naming the file, when it is listed but missing.
    """
    fsspec = require_fsspec()
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    try:
        return fs.open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"ShardedFiles: {url} is listed but missing (deleted or moved since the list was "
                                "made?): restore it, or build the dataset from the files that exist") from None


def read_samples(url: str, fmt: str, start: int = 0, offset: int = 0,
                 opener: Callable[[str], BinaryIO] | None = None) -> Iterator[tuple[int, Any, int]]:
    """``(index, sample, end_offset)`` of file ``url`` from sample ``start`` on (``offset``: its byte offset when
    known, else 0). Opens the file once and closes it when the iterator ends or is closed."""
    reader = {"jsonl": _jsonl, "parquet": _parquet, "arrow": _arrow, "tar": _tar}.get(fmt)
    if reader is None:
        raise ValueError(f"ShardedFiles: unknown format {fmt!r}; known: {FORMATS}")
    with (opener or open_url)(url) as f:
        yield from reader(f, url, start, offset)


def _jsonl(f: BinaryIO, url: str, start: int, offset: int) -> Iterator[tuple[int, Any, int]]:
    index = 0
    if offset:
        f.seek(offset)
        index = start
    position = offset
    for line in f:
        position += len(line)
        if not line.strip():
            continue
        if index >= start:
            try:
                sample = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"ShardedFiles: {url}: sample {index} (the line ending at byte {position}) is not "
                                 f"JSON ({err}); the file is corrupt or not JSON lines") from None
            yield index, sample, position
        index += 1


def _parquet(f: BinaryIO, url: str, start: int, offset: int) -> Iterator[tuple[int, Any, int]]:
    pa = _require_pyarrow()
    try:
        parquet = pa.parquet.ParquetFile(f)
    except (pa.ArrowInvalid, OSError) as err:
        raise ValueError(f"ShardedFiles: {url} is not a readable Parquet file ({err}); the file is corrupt") from None
    first = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if first + rows <= start:  # before the start: the footer's counts skip it unread
            first += rows
            continue
        try:
            table = parquet.read_row_group(group)
        except (pa.ArrowInvalid, OSError) as err:
            raise ValueError(f"ShardedFiles: {url}: row group {group} cannot be read ({err}); the file is corrupt"
                             ) from None
        for i, row in enumerate(table.to_pylist()):
            if first + i >= start:
                yield first + i, row, 0
        first += rows


def _arrow(f: BinaryIO, url: str, start: int, offset: int) -> Iterator[tuple[int, Any, int]]:
    pa = _require_pyarrow()
    magic = f.read(len(_ARROW_FILE_MAGIC))
    f.seek(0)
    try:
        if magic == _ARROW_FILE_MAGIC:
            random_access = pa.ipc.open_file(f)
            batches = (random_access.get_batch(i) for i in range(random_access.num_record_batches))
        else:  # the IPC stream format (Hugging Face's cache files)
            batches = iter(pa.ipc.open_stream(f))
        index = 0
        for batch in batches:
            if index + batch.num_rows <= start:
                index += batch.num_rows
                continue
            for row in batch.to_pylist():
                if index >= start:
                    yield index, row, 0
                index += 1
    except (pa.ArrowInvalid, OSError) as err:
        raise ValueError(f"ShardedFiles: {url} is not a readable Arrow IPC file ({err}); the file is corrupt") from None


def _tar(f: BinaryIO, url: str, start: int, offset: int) -> Iterator[tuple[int, Any, int]]:
    """WebDataset's layout: consecutive members ``<key>.<ext>`` make one sample ``{"__key__": key, ext: bytes}``;
    a sample's offset is its first member's header, where a resumed reader seeks."""
    index = start if offset else 0
    f.seek(offset)
    sample: dict[str, Any] | None = None
    try:
        with tarfile.open(fileobj=f, mode="r|") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                directory, name = os.path.split(member.name)
                key, dot, ext = name.partition(".")
                if not dot or not ext:
                    raise ValueError(f"ShardedFiles: {url}: member {member.name!r} has no extension; a "
                                     "WebDataset-style tar names each file <key>.<ext>")
                key = f"{directory}/{key}" if directory else key
                if sample is not None and sample["__key__"] != key:
                    if index >= start:
                        yield index, sample, offset + member.offset
                    index, sample = index + 1, None
                if sample is None:
                    sample = {"__key__": key}
                if ext in sample:
                    raise ValueError(f"ShardedFiles: {url}: sample {key!r} holds {ext!r} twice")
                data = archive.extractfile(member)
                sample[ext] = data.read() if data is not None else b""
    except (tarfile.TarError, EOFError) as err:
        raise ValueError(f"ShardedFiles: {url} is not a readable tar file ({err}); the file is corrupt") from None
    if sample is not None and index >= start:
        yield index, sample, -1
