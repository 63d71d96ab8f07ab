"""Seeding and rank-aware logging."""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch

__all__ = ["enable_determinism", "seed_everything", "rank_logger"]

# cuBLAS needs a fixed workspace to pick the same reduction order on every run (CUDA docs, "Results reproducibility").
CUBLAS_WORKSPACE = ":4096:8"


def seed_everything(seed: int) -> int:
    """Seed python ``random``, numpy, torch (CPU and every CUDA device) and ``PYTHONHASHSEED``."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} must be in [0, 2**32) (numpy's limit)")
    os.environ["PYTHONHASHSEED"] = str(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    return seed


def enable_determinism(seed: int) -> int:
    """Seed everything and make torch choose deterministic algorithms, as transformers' ``full_determinism``:
    ``torch.use_deterministic_algorithms(True)`` (an op without a deterministic kernel raises, naming itself),
    cuDNN deterministic and not benchmarking, ``CUBLAS_WORKSPACE_CONFIG`` set (unless already set), and freshly
    allocated memory filled, so that two runs with the same seed and data are bitwise equal. Data loader workers
    are seeded per sample by ``Runner.setup_dataloader``."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.utils.deterministic.fill_uninitialized_memory = True
    return seed_everything(seed)


class _RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"[rank {self.extra['rank']}] {msg}", kwargs


def rank_logger(name: str, rank: int) -> logging.LoggerAdapter:
    """A logger whose records start with ``[rank N]``."""
    return _RankAdapter(logging.getLogger(name), {"rank": rank})
