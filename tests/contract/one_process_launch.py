"""Run by a launcher (``torchrun --nproc_per_node 1``, ``shardkit launch --num_processes 1``): every registered
strategy, one after the other in this one process, sets up the contract's tiny Llama, takes a few optimizer steps
on one batch and tears its process group down, so that the next strategy makes its own group the way a fresh
script would. Writes ``{name: result}`` as JSON to the path given as the first argument; a strategy that raises
reports its traceback there and the others still run. Names after the path run only those strategies.

    python -m torch.distributed.run --nproc_per_node 1 tests/contract/one_process_launch.py out.json [zero2 ...]
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "distributed")]  # contract_workers and the helpers it imports

import torch.distributed as dist  # noqa: E402
from contract_workers import batches, build_strategy, global_mean, setup_training, strategy_names  # noqa: E402

from shardkit import Runner  # noqa: E402
from shardkit.strategies.parallel import ProcessGroupStrategy  # noqa: E402

STEPS = 4


def one_strategy(name: str) -> dict:
    runner = Runner(build_strategy(name), seed=0)
    try:
        model, _ = setup_training(runner)
        x = batches(1)[0].to(runner.device)  # every rank takes the whole batch: the world is one process
        losses = []
        for _ in range(STEPS):
            loss = model(x, labels=x)
            runner.backward(loss)
            runner.step()
            losses.append(global_mean(runner, loss))
        group = dist.is_initialized()
        return {"losses": losses, "world_size": runner.world_size, "group": group,
                "group_size": dist.get_world_size() if group else None,
                "process_group_strategy": isinstance(runner.strategy, ProcessGroupStrategy)}
    finally:
        runner.teardown()


def main(out: str, names: list[str]) -> None:
    results = {}
    for name in names or strategy_names():
        try:
            results[name] = one_strategy(name)
        except Exception as err:  # noqa: BLE001 - reported to the test, which names the strategy
            results[name] = {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"}
        print(f"one_process_launch: {name}: {'error' if 'error' in results[name] else 'ok'}", flush=True)
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
