"""Which checkpoint in a folder to resume from: the newest complete one.

A run killed at a random moment can leave, beside its good checkpoints, a save that never finished (a hidden
``.<name>.tmp-*`` directory), a folder someone copied by hand without its manifest, or a published checkpoint whose
files were cut short afterwards (a full disk, a copy interrupted). Resuming must skip all of them, not fail on the
first one nor load a half.
"""

from __future__ import annotations

import os
from pathlib import Path

from .format import LATEST, MANIFEST, CheckpointError
from .reader import CheckpointReader, hidden_copies
from .schema import read_latest

__all__ = ["complete_checkpoint_time", "newest_complete_checkpoint"]


def complete_checkpoint_time(path: str | os.PathLike) -> float | None:
    """When the checkpoint at ``path`` was published (its manifest's ``created``), or None when it is not a
    complete shardkit checkpoint: no manifest, a manifest that fails its schema, or a listed file missing or of
    another size than recorded. The hashes are not read here (a load checks them as it reads)."""
    path = Path(path)
    if path.is_symlink() or not (path / MANIFEST).is_file():
        return None
    try:
        reader = CheckpointReader(path, verify=False)
    except CheckpointError:
        return None
    reader.close()
    created = reader.manifest.get("created", 0.0)
    return float(created) if isinstance(created, (int, float)) else 0.0


def newest_complete_checkpoint(parent: str | os.PathLike) -> Path | None:
    """The most recently published complete checkpoint in ``parent`` (a folder of checkpoints, as
    ``Runner.save(f"{parent}/step-{n}", ...)`` fills it), or ``parent`` itself when it is one; None when there is none
    (or ``parent`` does not exist).

    Incomplete candidates are skipped (see :func:`complete_checkpoint_time`); a checkpoint whose save over the same
    name was killed between its two renames is found through its complete hidden copy, as a load finds it.
    """
    parent = Path(parent)
    if not parent.is_dir():
        return None
    if complete_checkpoint_time(parent) is not None:
        return parent
    found: list[tuple[float, str, Path]] = []
    for child in parent.iterdir():
        if child.name.startswith(".") or not child.is_dir():
            continue
        created = complete_checkpoint_time(child)
        if created is not None:
            found.append((created, child.name, child))
    if (parent / LATEST).is_file():
        try:
            target = read_latest(parent)
        except CheckpointError:
            target = None
        if target is not None and not (parent / target).exists():
            for copy in hidden_copies(parent, target):
                created = complete_checkpoint_time(copy)
                if created is not None:
                    found.append((created, target, copy))
    return max(found)[2] if found else None
