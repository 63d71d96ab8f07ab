"""Save under one parallel layout, resume under another, in one process group: the resumed losses must be the
uninterrupted run's. Layouts: context parallelism cp 2 <-> 1 (FSDP2 over the rest) and pipeline pp 2 <-> 1
(DDP over the rest), AdamW so that the optimizer state must come back too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from cp_workers import CONFIG

from shardkit import Runner
from shardkit.models import Llama

__all__ = ["assert_resumed", "layout_worker", "resume_case"]

GLOBAL_BATCH, SEQ, STEPS, SAVE_AT = 4, 16, 4, 2


def _batches() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _build(strategy: Any) -> tuple[Runner, Any, Any]:
    runner = Runner(strategy, seed=0)
    with runner.init_module():
        model = Llama(CONFIG)
    model, opt = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return runner, model, opt


def _train(runner: Runner, model: Any, batches: torch.Tensor) -> list[float]:
    s = runner.strategy
    per = GLOBAL_BATCH // s.data_parallel_size
    losses = []
    for x in batches:
        x = x[s.data_parallel_rank * per:(s.data_parallel_rank + 1) * per]
        loss = model(x, labels=x)
        runner.backward(loss)
        runner.step()
        # cp/pp peers hold the same (whole-batch) loss: the mean over ranks is the global batch's.
        losses.append(runner.all_reduce(loss.detach().clone(), "mean").item())
    return losses


def resume_case(first: Any, second: Any, root: Path) -> dict:
    """Train, save mid-way and go on under ``first``; resume from the save under ``second``."""
    runner, model, opt = _build(first)
    batches = _batches()
    losses = _train(runner, model, batches[:SAVE_AT])
    runner.save(root / "mid", {"model": model, "optimizer": opt})
    consolidated = _consolidated_matches(runner, model, root / "mid")
    losses += _train(runner, model, batches[SAVE_AT:])
    runner, model, opt = _build(second)
    runner.load(root / "mid", {"model": model, "optimizer": opt})
    return {"uninterrupted": losses[SAVE_AT:], "resumed": _train(runner, model, batches[SAVE_AT:]),
            "consolidated": consolidated}


def assert_resumed(results: list[dict], case: str) -> None:
    """Every rank's resumed losses of ``case`` are the uninterrupted ones; zero-to-fp32 reads the saved model."""
    for rank, per_rank in enumerate(results):
        got = per_rank[case]
        torch.testing.assert_close(torch.tensor(got["resumed"]), torch.tensor(got["uninterrupted"]), rtol=1e-5,
                                   atol=1e-5, msg=lambda m, r=rank: f"rank {r} {case}: resumed losses differ: {m}")
    assert results[0][case]["consolidated"], f"{case}: zero-to-fp32's reader does not give the saved model"


def _consolidated_matches(runner: Runner, model: Any, path: Path) -> bool | None:
    """What ``shardkit zero-to-fp32`` reads from the checkpoint equals the whole model (rank 0; None elsewhere)."""
    from shardkit.checkpoint.consolidate import get_fp32_state_dict

    whole = dict(runner.iter_full_state_dict(model))
    if not runner.is_main_process:
        return None
    read = dict(get_fp32_state_dict(path))
    return read.keys() == whole.keys() and all(torch.equal(read[k], whole[k].float()) for k in whole)


def layout_worker(root: str) -> dict:
    from shardkit.strategies.context_parallel import ContextParallel
    from shardkit.strategies.pipeline import Pipeline

    cases = {
        "cp2->cp1": (lambda: ContextParallel(cp_size=2), lambda: ContextParallel(cp_size=1)),
        "cp1->cp2": (lambda: ContextParallel(cp_size=1, cp_mode="ulysses"), lambda: ContextParallel(cp_size=2)),
        "pp2->pp1": (lambda: Pipeline(pp_size=2, schedule="1f1b"), lambda: Pipeline(pp_size=1)),
        "pp1->pp2": (lambda: Pipeline(pp_size=1), lambda: Pipeline(pp_size=2, schedule="gpipe")),
    }
    return {name: resume_case(a(), b(), Path(root) / name) for name, (a, b) in cases.items()}
