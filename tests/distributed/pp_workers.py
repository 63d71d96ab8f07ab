"""Pipeline parallelism inside each rank: every schedule in one process group, compared with DDP's losses.

Each case trains the same untied tiny Llama on the same global batches (SGD, so a wrong gradient shows in the
next loss) and returns its losses and, for the stages this rank holds, the weights after training.
"""

from __future__ import annotations

from typing import Any

import torch

from shardkit import Runner
from shardkit.models import Llama, LlamaConfig

__all__ = ["CONFIG", "pp_worker"]

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, max_position=32,
                     tie_embeddings=False, fused=False)
GLOBAL_BATCH, SEQ, STEPS = 8, 12, 3


def batches() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def train(strategy: Any, accumulation: int = 1, window: int | None = None) -> dict:
    """``window``: every step a short accumulation window of that many micro-batches (``runner.begin_window``)."""
    runner = Runner(strategy, seed=0, gradient_accumulation_steps=accumulation)
    with runner.init_module():
        model = Llama(CONFIG)
    model, opt = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    s = runner.strategy
    per = GLOBAL_BATCH // s.data_parallel_size
    losses = []
    for x in batches():
        x = x[s.data_parallel_rank * per:(s.data_parallel_rank + 1) * per]
        if window is not None:
            runner.begin_window(window)
        for part in x.chunk(window or accumulation):
            loss = model(part, labels=part)
            runner.backward(loss)
            losses.append(runner.all_reduce(loss.detach().clone(), "mean").item())
        runner.step()
    weights = {k: v.detach().clone() for k, v in runner.unwrap_model(model).state_dict().items()}
    return {"losses": losses, "weights": weights}


def pp_worker(cases: list[dict]) -> dict:
    """DDP's run, then each case (Pipeline keyword arguments, ``accumulation`` and ``window`` apart) on the same
    batches; a case's name ends in the micro-batches per window (``accumulation=N``)."""
    from shardkit.strategies import DDP
    from shardkit.strategies.pipeline import Pipeline

    out = {"ddp": train(DDP()), "ddp_accumulation": train(DDP(), accumulation=2)}
    for kw in cases:
        kw = dict(kw)
        accumulation, window = kw.pop("accumulation", 1), kw.pop("window", None)
        name = repr(sorted(kw.items())) + (f" short window of ga={accumulation}," if window else "")
        out[name + f" accumulation={window or accumulation}"] = train(Pipeline(**kw), accumulation, window)
    return out
