"""Parameter lists shaped like a model's, for the optimizer benchmarks (kernels.py, gpu_tune.py)."""

from __future__ import annotations

__all__ = ["llama_like_sizes"]


def llama_like_sizes(hidden: int, inter: int, vocab: int, layers: int) -> list[int]:
    """Parameter sizes of a Llama-style model: embedding, per layer q/k/v/o, gate/up/down and two norms, head."""
    layer = [hidden * hidden] * 4 + [hidden * inter] * 3 + [hidden] * 2
    return [vocab * hidden] + layer * layers + [hidden, vocab * hidden]
