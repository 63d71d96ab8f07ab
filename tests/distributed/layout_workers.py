"""Save under one parallel layout, resume under another, in one process group: the resumed losses must be the
uninterrupted run's. Layouts: context parallelism cp 2 <-> 1 (FSDP2 over the rest), pipeline pp 2 <-> 1 (DDP over
the rest), and with a tied embedding/head pp 2 <-> DDP, AdamW so that the optimizer state must come back too."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from cp_workers import CONFIG

from shardkit import Runner
from shardkit.models import Llama

__all__ = ["assert_resumed", "layout_worker", "resume_case"]

GLOBAL_BATCH, SEQ, STEPS, SAVE_AT = 4, 16, 4, 2
# Pipeline keeps a copy of a tied weight on the first stage and one on the last, but saves its optimizer state once,
# under the unsplit name, as DDP does: each side must load the other's save.
TIED = dataclasses.replace(CONFIG, tie_embeddings=True)


def _batches() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _build(strategy: Any, config: Any = CONFIG) -> tuple[Runner, Any, Any]:
    runner = Runner(strategy, seed=0)
    with runner.init_module():
        model = Llama(config)
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


def resume_case(first: Any, second: Any, root: Path, config: Any = CONFIG) -> dict:
    """Train, save mid-way and go on under ``first``; resume from the save under ``second``. ``tied``: the AdamW
    ``exp_avg`` of every copy of the tied embedding/head weight this rank holds, at the save and after the load."""
    runner, model, opt = _build(first, config)
    batches = _batches()
    losses = _train(runner, model, batches[:SAVE_AT])
    runner.save(root / "mid", {"model": model, "optimizer": opt})
    consolidated = _consolidated_matches(runner, model, root / "mid")
    saved = _tied_exp_avg(model, opt)
    losses += _train(runner, model, batches[SAVE_AT:])
    runner, model, opt = _build(second, config)
    runner.load(root / "mid", {"model": model, "optimizer": opt})
    tied = {"saved": saved, "loaded": _tied_exp_avg(model, opt)}
    return {"uninterrupted": losses[SAVE_AT:], "resumed": _train(runner, model, batches[SAVE_AT:]),
            "consolidated": consolidated, "tied": tied}


def _tied_exp_avg(model: Any, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``exp_avg`` by parameter name of the embedding/head weights this rank holds (one tensor when they are tied and
    on one rank; a pipeline's first and last stage each hold a copy)."""
    return {name: opt.state[p]["exp_avg"].detach().clone() for name, p in model.named_parameters()
            if name.endswith(("embed_tokens.weight", "lm_head.weight")) and p in opt.state}


def assert_resumed(results: list[dict], case: str) -> None:
    """Every rank's resumed losses of ``case`` are the uninterrupted ones; zero-to-fp32 reads the saved model."""
    for rank, per_rank in enumerate(results):
        got = per_rank[case]
        torch.testing.assert_close(torch.tensor(got["resumed"]), torch.tensor(got["uninterrupted"]), rtol=1e-5,
                                   atol=1e-5, msg=lambda m, r=rank: f"rank {r} {case}: resumed losses differ: {m}")
    assert results[0][case]["consolidated"], f"{case}: zero-to-fp32's reader does not give the saved model"
    if case.startswith("tied"):
        _assert_tied_state(results, case)


def _assert_tied_state(results: list[dict], case: str) -> None:
    """Every copy of the tied weight on every rank loads the ``exp_avg`` rank 0 saved (it holds the first stage's
    copy, or the whole model under DDP), each rank holds one, and the copies saved on other ranks were equal."""
    saved = results[0][case]["tied"]["saved"]
    assert len(saved) == 1, f"{case}: rank 0 should hold one tied embedding/head weight, got {sorted(saved)}"
    (reference,) = saved.values()
    for rank, per_rank in enumerate(results):
        saved_here, loaded = per_rank[case]["tied"]["saved"], per_rank[case]["tied"]["loaded"]
        assert loaded, f"{case}: rank {rank} holds no optimizer state for the tied embedding/head weight after load"
        for name, got in [*saved_here.items(), *loaded.items()]:
            torch.testing.assert_close(got, reference, rtol=0, atol=0,
                                       msg=lambda m, r=rank, n=name: f"rank {r} {case}: {n} exp_avg differs: {m}")


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
    from shardkit.strategies.ddp import DDP
    from shardkit.strategies.pipeline import Pipeline

    cases = {
        "cp2->cp1": (lambda: ContextParallel(cp_size=2), lambda: ContextParallel(cp_size=1)),
        "cp1->cp2": (lambda: ContextParallel(cp_size=1, cp_mode="ulysses"), lambda: ContextParallel(cp_size=2)),
        "pp2->pp1": (lambda: Pipeline(pp_size=2, schedule="1f1b"), lambda: Pipeline(pp_size=1)),
        "pp1->pp2": (lambda: Pipeline(pp_size=1), lambda: Pipeline(pp_size=2, schedule="gpipe")),
    }
    out = {name: resume_case(a(), b(), Path(root) / name) for name, (a, b) in cases.items()}
    tied = {"tied pp2->ddp": (lambda: Pipeline(pp_size=2, schedule="1f1b"), DDP),
            "tied ddp->pp2": (DDP, lambda: Pipeline(pp_size=2, schedule="gpipe"))}
    return out | {name: resume_case(a(), b(), Path(root) / name.replace(" ", "_"), TIED)
                  for name, (a, b) in tied.items()}
