"""Publishing an export directory (``save_pretrained``, ``zero-to-fp32``) so that nothing is lost.

Every file of a new export is written into a fresh staging directory beside the output and fsynced; only
when all of them are whole does the staging directory take the output's place (the previous export is
renamed aside, the staging directory renamed in, the old copy deleted). A full disk, a killed process or
a bad tensor half way leaves the previous export as it was. Files of the old directory that the export
does not write (a README, tokenizer files saved earlier) are carried over as hard links. Exports never
write a checkpoint's own files (a directory holding ``shardkit.json``, DCP's ``.metadata``, DeepSpeed rank files,
or a ``latest`` naming DeepSpeed's, or the checkpoint they read); a new directory inside a checkpoint is allowed.

When the output cannot be swapped (it is the current directory or holds it, it is a mount point, its
parent is read-only, or it holds directories: a training run's folder) the files are staged inside it and
renamed into place one by one, the index last: a failed write still leaves the previous export whole, only
a crash in the final renames can mix the two.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from .dcp_metadata import DCP_METADATA
from .deepspeed_reader import is_deepspeed_dir
from .format import MANIFEST, CheckpointError, fsync_dir, fsync_path, naming, write_failure
from .schema import read_latest
from .trust import open_regular, read_json_file

__all__ = ["EXPORT_RE", "MODEL_FILES", "Export", "check_output_dir", "copy_model_files", "export_error",
           "publish_export"]

# The weight files an export writes; older ones of these names are stale and never carried over.
EXPORT_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")
# What from_pretrained needs besides the weights (transformers' own file names).
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.json",
               "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json", "preprocessor_config.json")
_MAX_MODEL_FILE = 512 << 20  # the largest tokenizer.json on the Hub is ~35 MB
# A DCP directory's .metadata counts too: files written beside it would mix two checkpoints in one directory.
_CHECKPOINT_FILES = (MANIFEST, DCP_METADATA, "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt",
                     "zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
_STAGE = ".export-"
_OLD = ".export-old"


def _checkpoint_marker(d: Path, itself: bool) -> str | None:
    """The file that makes ``d`` a checkpoint, or None. ``latest`` counts only for ``d`` itself and only when it
    names a DeepSpeed tag (a Hugging Face Trainer's ``checkpoint-N``): a training run's output directory, whose
    ``latest`` names shardkit checkpoints, is where ``save_model`` exports go."""
    marker = next((m for m in _CHECKPOINT_FILES if (d / m).exists() or (d / m).is_symlink()), None)
    if marker is None and itself and (d / "latest").is_file():
        try:
            tag = read_latest(d)
        except CheckpointError:
            return None
        return "latest" if is_deepspeed_dir(d / tag) else None
    return marker


def check_output_dir(out_dir: str | os.PathLike, sources: Sequence[str | os.PathLike] = ()) -> Path:
    """The absolute output directory, after refusing one whose files could be taken for a checkpoint's or replace them:
    a checkpoint directory itself (the one read included), a directory holding checkpoint files, or one inside a
    DeepSpeed tag directory (``global_stepN/``, whose files DeepSpeed's loader globs).

    A directory of its own inside a checkpoint (``cd checkpoint-N; zero-to-fp32 . fp32``, as DeepSpeed's script is
    run) is allowed: it replaces nothing there, and no reader takes a subdirectory for checkpoint content (a
    shardkit manifest lists plain file names; a DeepSpeed checkpoint is its ``latest`` and tag directories).

    Raises:
        CheckpointError: naming the output, the checkpoint file found and what to do.
    """
    out = Path(os.path.abspath(out_dir))
    real = out.resolve()
    for src in sources:
        if real == Path(src).resolve():
            raise CheckpointError(f"{out}: is the checkpoint being read ({src}); an export never writes into a "
                                  "checkpoint's own files: choose another output directory (a new directory inside "
                                  "the checkpoint will do)")
    for d in (real, *real.parents):
        marker = _checkpoint_marker(d, d == real) if d.is_dir() else None
        # a directory of its own beside a shardkit or DCP checkpoint's files: their readers open only named files
        if marker is None or (d != real and marker in (MANIFEST, DCP_METADATA)):
            continue
        where = "is" if d == real else "lies inside"
        raise CheckpointError(f"{out}: {where} a checkpoint directory ({d / marker} exists); an export never writes "
                              "into a checkpoint's own files (it would replace or mix with them): choose another "
                              "output directory (a new directory inside the checkpoint will do)")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory; choose another output directory")
    return out


def export_error(out: Path, e: OSError) -> CheckpointError:
    """The error for an export whose write failed: the file, the reason, and that nothing was published."""
    if e.filename is None:
        e = OSError(e.errno, e.strerror or str(e), str(out))
    return write_failure(e, f"nothing was published: the previous export in {out}, if any, is unchanged")


@contextlib.contextmanager
def _undo_on_failure(out: Path, undo: Callable[[], None]) -> Iterator[None]:
    """Runs ``undo`` when the block fails; an ``OSError`` comes out as :func:`export_error`."""
    try:
        yield
    except OSError as e:
        undo()
        raise export_error(out, e) from None
    except BaseException:
        undo()
        raise


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _carry_over(old: Path, stage: Path, produced: set[str]) -> None:
    """Hard-links the files ``old`` holds besides the export's own into ``stage`` (copies across devices)."""
    for entry in old.iterdir():
        name = entry.name
        if not (name in produced or EXPORT_RE.match(name) or name.startswith(_STAGE) or (stage / name).exists()):
            _link_or_copy(str(entry), str(stage / name))


class Export:
    """One export into ``out_dir``: :attr:`stage` to write the files into, then :meth:`commit` or :meth:`abort`.

    Args:
        out_dir: the output directory (created with its parents).
        sources: checkpoint directories being read; the output may not lie inside them.
    """

    def __init__(self, out_dir: str | os.PathLike, sources: Sequence[str | os.PathLike] = ()) -> None:
        self.out = check_output_dir(out_dir, sources)
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"{self.out}: cannot create the output directory ({e.filename}: {e.strerror}); "
                                  "choose a directory you can write to") from None
        self._lock = os.open(self.out.parent, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # a second export beside this one waits; no lock file is left
        with _undo_on_failure(self.out, self._unlock):
            self._recover()
            self.in_place = self._must_stay()
            base = self.out if self.in_place else self.out.parent
            prefix = _STAGE if self.in_place else f".{self.out.name}{_STAGE}"
            self.stage = base / f"{prefix}{uuid.uuid4().hex[:12]}"
            self.stage.mkdir()  # 0777 minus the umask, like any directory the user makes

    def _must_stay(self) -> bool:
        """Whether the files are staged inside the output instead of swapping the directory: it is or holds the
        current directory, a mount point, its parent is read-only, or it holds directories or symlinks (a run's
        folder with checkpoints and live logs is never moved)."""
        if not self.out.exists():
            return False
        cwd = Path.cwd().resolve()
        real = self.out.resolve()
        if real == cwd or real in cwd.parents or os.path.ismount(real) or not os.access(self.out.parent, os.W_OK):
            return True
        return any(e.is_dir() or e.is_symlink() for e in self.out.iterdir())

    def _recover(self) -> None:
        """Cleans what a killed export left: staging directories, and an old copy whose swap did not finish."""
        parent, name = self.out.parent, self.out.name
        old = parent / f".{name}{_OLD}"
        if old.is_dir() and not old.is_symlink():
            if self.out.exists():
                shutil.rmtree(old)
            else:
                os.rename(old, self.out)  # killed between the two renames: the previous export comes back
        for d in parent.glob(f".{glob.escape(name)}{_STAGE}*"):
            if d.name != old.name and d.is_dir() and not d.is_symlink():
                shutil.rmtree(d, ignore_errors=True)
        if self.out.is_dir():
            for d in self.out.glob(f"{_STAGE}*"):
                if d.is_dir() and not d.is_symlink():
                    shutil.rmtree(d, ignore_errors=True)

    def commit(self, names: Sequence[str]) -> list[Path]:
        """Publishes the staged files ``names`` (fsynced here; the index, if any, last); returns their paths."""
        with _undo_on_failure(self.out, self.abort):
            for name in names:
                fsync_path(self.stage / name)
            fsync_dir(self.stage)
            if self.in_place:
                self._move_in(names)
            else:
                self._swap(set(names))
        self._unlock()
        return [self.out / n for n in names]

    def _swap(self, produced: set[str]) -> None:
        if not self.out.exists():
            os.rename(self.stage, self.out)
            fsync_dir(self.out.parent)
            return
        _carry_over(self.out, self.stage, produced)
        shutil.copymode(self.out, self.stage)
        old = self.out.parent / f".{self.out.name}{_OLD}"
        os.rename(self.out, old)
        try:
            os.rename(self.stage, self.out)
        except OSError:
            os.rename(old, self.out)
            raise
        fsync_dir(self.out.parent)
        shutil.rmtree(old, ignore_errors=True)  # published: a leftover is removed by the next export

    def _move_in(self, names: Sequence[str]) -> None:
        for name in names:
            os.replace(self.stage / name, self.out / name)
        for stale in self.out.iterdir():
            if EXPORT_RE.match(stale.name) and stale.name not in names:
                stale.unlink()
        os.rmdir(self.stage)
        fsync_dir(self.out)

    def abort(self) -> None:
        """Discards the staged files; the previous export stays as it was."""
        shutil.rmtree(self.stage, ignore_errors=True)
        self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def publish_export(out_dir: str | os.PathLike, write: Callable[[Path], list[str]],
                   sources: Sequence[str | os.PathLike] = ()) -> list[Path]:
    """Runs ``write(stage)`` (which writes files into ``stage`` and returns their names) and publishes them."""
    export = Export(out_dir, sources)
    with _undo_on_failure(export.out, export.abort):
        names = write(export.stage)
    return export.commit(names)


def copy_model_files(dirs: Sequence[Path], stage: Path) -> list[str]:
    """Copies ``config.json``, ``generation_config.json`` and tokenizer files from the first of ``dirs`` holding
    each into ``stage`` (regular files only, size-capped; JSON files must parse); returns the names copied."""
    copied = []
    for name in MODEL_FILES:
        src = next((d / name for d in dirs if (d / name).exists() or (d / name).is_symlink()), None)
        if src is None:
            continue
        if name.endswith(".json"):
            read_json_file(src, _MAX_MODEL_FILE, f"the model file {name}")  # garbage here would fail later, worse
        fd = open_regular(src, f"the model file {name}")
        with os.fdopen(fd, "rb") as f, naming(stage / name), open(stage / name, "wb") as out:
            if os.fstat(fd).st_size > _MAX_MODEL_FILE:
                raise CheckpointError(f"{src}: is larger than {_MAX_MODEL_FILE} bytes; not a model file")
            shutil.copyfileobj(f, out)
        copied.append(name)
    return copied
