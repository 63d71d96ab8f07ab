"""Pipeline parallelism: step time of shardkit's Pipeline strategy against torch.distributed.pipelining driven by
hand (same split, same schedule), round by round in the same processes; and the bubble each schedule leaves,
measured against (pp - 1) / (microbatches + pp - 1).

    .venv/bin/python benchmarks/pipeline.py --pp 2 --microbatches 4 --rounds 5
    .venv/bin/python benchmarks/pipeline.py --pp 2 --dp-size 2 --dp fsdp --schedules 1f1b zero_bubble --rounds 15
    .venv/bin/python benchmarks/pipeline.py --mode bubble --microbatches 2 4 8 --rounds 3
    .venv/bin/python benchmarks/pipeline.py --mode bubble --dp ddp fsdp --dp-size 2 --schedules zero_bubble

Speed mode with ``--dp-size N --dp ddp|fsdp`` runs pp x N ranks: ours is ``Pipeline(dp=...)``; the direct side puts
each stage module under DDP or FSDP2 over the dp dimension of a (pp, dp) mesh as torchtitan does (FSDP2 per decoder
layer, the head and the stage, not resharded after forward), the same schedule class and stage indices. Ratio =
median ours / median direct; "median round ratio" = the median of each round's ours / direct (the two steps run
seconds apart, so a load that drifts over the run moves it less). Every rank reports its slowest rank's time.

Bubble measured = 1 - microbatches * (one micro-batch's forward + backward through this rank's stage, timed
alone, no communication) / (the schedule's step time). Interleaved schedules run 2 stages per rank.

``--mode bubble``: the layers' work is a fixed sleep per micro-batch (forward F ms; backward B ms on the input
path and W ms on the weight path, so zero-bubble's split backward has a W to move), on tiny tensors, so CPU load
on shared cores barely moves it. The bubble-free step is microbatches x (this rank's layers x (F + B + W)); the
measured bubble is 1 - that / the step time, printed against (pp - 1) / (microbatches x stages per rank + pp - 1).
``--dp-size N --dp ddp fsdp``: pp x N ranks, each stage replicated, then sharded with FSDP2, over N; the stage-alone
reference then includes the FSDP all-gathers and reduce-scatter of one micro-batch over the N ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))

from harness import run_distributed  # noqa: E402

from shardkit import Runner  # noqa: E402
from shardkit.models import Llama, LlamaConfig  # noqa: E402

CONFIG = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_layers=8, num_heads=4,
                     max_position=512, tie_embeddings=False, fused=False)
BATCH, SEQ = 8, 128
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
BUBBLE_SCHEDULES = SCHEDULES[:-1]  # dualpipev needs 2 x pp micro-batches: the bubble default starts at 2


def _ours(schedule: str, microbatches: int, pp: int, dp: str):
    from shardkit.strategies.pipeline import Pipeline

    runner = Runner(Pipeline(pp_size=pp, schedule=schedule, microbatches=microbatches, dp=dp), seed=0)
    with runner.init_module():
        model = Llama(CONFIG)
    model, opt = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(x: torch.Tensor) -> None:
        loss = model(x, labels=x)
        runner.backward(loss)
        runner.step()

    return step, runner.strategy._runner


def _direct(schedule: str, microbatches: int, pp: int, dp: str):
    """torch.distributed.pipelining as its docs and torchtitan drive it: stages by hand (the V schedules' stages
    placed as torch's schedule classes expect, the same indices as ours), each stage module under DDP or FSDP2 over
    the dp mesh dimension when the world is over ``pp``, the schedule, the optimizer."""
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.strategies._pipeline_stages import StageModule
    from shardkit.strategies.pipeline import SCHEDULES as NAMES
    from shardkit.strategies.pipeline import PipelineSettings, stage_layers

    torch.manual_seed(0)
    model = Llama(CONFIG)
    dp_size = dist.get_world_size() // pp
    mesh = init_device_mesh("cpu", (pp, dp_size), mesh_dim_names=("pp", "dp"))
    pp_rank = dist.get_rank() // dp_size
    settings = PipelineSettings(pp_size=pp, schedule=schedule)
    chunks, indices = settings.chunks, settings.stage_indices(pp_rank)
    total = pp * chunks
    ranges = stage_layers(CONFIG.num_layers, total)
    stages, params = [], []
    for s in indices:
        part = StageModule(model.embed_tokens if s == 0 else None, [model.layers[i] for i in ranges[s]],
                           model.norm if s == total - 1 else None, model.lm_head if s == total - 1 else None)
        part = _data_parallel(part, mesh["dp"], dp) if dp_size > 1 else part
        params += list(part.parameters())
        stages.append(pipelining.PipelineStage(part, s, total, torch.device("cpu"), group=mesh["pp"].get_group()))
    head, first, last = model.lm_head, 0 in indices, total - 1 in indices

    def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return head(hidden[:, :-1].reshape(-1, hidden.shape[-1]), target[:, 1:].reshape(-1)) / microbatches

    sched = getattr(pipelining, NAMES[schedule])(stages if chunks > 1 else stages[0], microbatches, loss_fn=loss_fn,
                                                 scale_grads=False)
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step(x: torch.Tensor) -> None:
        sched.step(*((x,) if first else ()), **({"target": x, "losses": []} if last else {}))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _data_parallel(part: torch.nn.Module, mesh, dp: str) -> torch.nn.Module:
    """torchtitan's recipe for a pipeline stage: FSDP2 per decoder layer (and the output head, whose loss runs
    outside the stage's forward) then the stage, not resharded after forward (torchtitan's default under pipeline
    parallelism: no all-gather per micro-batch). ``dp="ddp"``: the same units under torch's FSDP-based
    ``replicate``, the data parallelism torch's ``PipelineStage`` drives (``DistributedDataParallel`` around a
    stage fails in torch 2.13's reducer on its first step here: "rebuilt parameter indices size is not same as
    original model parameters size", 37 vs 74, every schedule)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    wrap = (lambda m: replicate(m, mesh=mesh)) if dp == "ddp" else \
        (lambda m: fully_shard(m, mesh=mesh, reshard_after_forward=False))
    for unit in [*part.layers, *([part.head] if part.head is not None else [])]:
        wrap(unit)
    return wrap(part)


def _stage_alone(runner, microbatches: int) -> float:
    """Forward + backward of one micro-batch through this rank's stages, no communication (median of 3)."""
    mb = BATCH // microbatches
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for stage in runner.stages:
            part = stage.submod
            ids = torch.randint(0, CONFIG.vocab_size, (mb, SEQ))
            out = part(ids if part.embed is not None else torch.randn(mb, SEQ, CONFIG.hidden_size, requires_grad=True))
            (out.float().pow(2).mean() if part.head is None else part.head(out[:, :-1].reshape(-1, out.shape[-1]),
                                                                          ids[:, 1:].reshape(-1))).backward()
        times.append(time.perf_counter() - start)
        for p in runner.module.parameters():
            p.grad = None
    return sorted(times)[1]


def worker(microbatches: int, rounds: int, schedules: tuple[str, ...] = SCHEDULES, pp: int | None = None,
           dp: str = "ddp") -> dict:
    """Each schedule's step through the Pipeline strategy and driven directly, alternating round by round."""
    import torch.distributed as dist

    from shardkit.strategies.pipeline import bubble_fraction

    pp = pp or int(os.environ["WORLD_SIZE"])
    x = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    out = {}
    for schedule in schedules:
        ours, runner = _ours(schedule, microbatches, pp, dp)
        direct = _direct(schedule, microbatches, pp, dp)
        times = {"ours": [], "direct": []}
        for r in range(rounds + 1):  # round 0 warms up (shape inference, allocations)
            for name, fn in (("ours", ours), ("direct", direct)) if r % 2 else (("direct", direct), ("ours", ours)):
                dist.barrier()
                start = time.perf_counter()
                fn(x)
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if r:
                    times[name].append(elapsed.item())
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        # Each round's ours / direct, taken seconds apart: less moved by the shared machine's load drifting.
        paired = sorted(o / d for o, d in zip(times["ours"], times["direct"]))
        chunks = len(runner.stages)
        row = {**med, "ratio": med["ours"] / med["direct"], "paired": paired[len(paired) // 2],
               "theory": bubble_fraction(pp, microbatches * chunks)}
        if dist.get_world_size() == pp:  # the stage-alone reference runs FSDP/DDP collectives outside the schedule
            alone = torch.tensor(_stage_alone(runner, microbatches))
            dist.all_reduce(alone, op=dist.ReduceOp.MAX)
            row["bubble"] = 1 - microbatches * alone.item() / med["ours"]
        out[schedule] = row
    return out


SLEEP_MS = {"forward": 10.0, "input_grad": 10.0, "weight_grad": 10.0}
SLEEP_LAYERS, SLEEP_HIDDEN = 4, 8


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``ms_forward`` in forward and ``ms_backward`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ms_forward: float, ms_backward: float) -> torch.Tensor:
        ctx.ms_backward = ms_backward
        time.sleep(ms_forward / 1000)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.ms_backward / 1000)
        return grad, None, None


class SleepBlock(torch.nn.Module):
    """A decoder layer whose cost is fixed sleeps: F in forward, B on the input's gradient, W on the weight's."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.eye(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _Sleep.apply(x, SLEEP_MS["forward"], SLEEP_MS["input_grad"])
        return x @ _Sleep.apply(self.weight, 0.0, SLEEP_MS["weight_grad"])


def bubble_worker(microbatches: list[int], rounds: int, schedules: tuple[str, ...] = BUBBLE_SCHEDULES,
                  pp: int | None = None, dps: tuple[str, ...] = ("ddp",)) -> dict:
    """Each schedule (under each of ``dps`` when the world is over ``pp``) at each micro-batch count."""
    world = int(os.environ["WORLD_SIZE"])  # the process group is the Runner's, made inside each run
    pp = pp or world
    out = {}
    for dp in dps:
        for schedule in schedules:
            name = f"{schedule} x {dp}" if world > pp else schedule
            out.update({(name, m): r for m, r in _bubble_runs(schedule, microbatches, rounds, pp, dp).items()})
    return out


def _bubble_runs(schedule: str, microbatches: list[int], rounds: int, pp: int, dp: str) -> dict:
    import torch.distributed as dist

    from shardkit.strategies.pipeline import Pipeline, bubble_fraction

    cfg = LlamaConfig(vocab_size=16, hidden_size=SLEEP_HIDDEN, intermediate_size=16, num_layers=SLEEP_LAYERS,
                      num_heads=2, max_position=8, tie_embeddings=False, fused=False)
    x = torch.randint(0, cfg.vocab_size, (max(microbatches), 4), generator=torch.Generator().manual_seed(0))
    out = {}
    for m in microbatches:
        runner = Runner(Pipeline(pp_size=pp, schedule=schedule, microbatches=m, dp=dp), seed=0)
        per_microbatch = SLEEP_LAYERS // pp * sum(SLEEP_MS.values()) / 1000  # this rank's layers, all chunks
        model = Llama(cfg)
        model.layers = torch.nn.ModuleList(SleepBlock(SLEEP_HIDDEN) for _ in range(SLEEP_LAYERS))
        model, opt = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
        times = []
        for r in range(rounds + 1):  # round 0 warms up (shape inference)
            dist.barrier()
            start = time.perf_counter()
            runner.backward(model(x[:m], labels=x[:m]))
            runner.step()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(elapsed.item())
        step = sorted(times[1:])[len(times[1:]) // 2]
        alone = torch.tensor(_sleep_stage_alone(runner.strategy._runner, cfg.vocab_size))
        dist.all_reduce(alone, op=dist.ReduceOp.MAX)
        chunks = len(runner.strategy._runner.stages)
        out[m] = {"step": step, "ideal": m * per_microbatch, "bubble": 1 - m * per_microbatch / step,
                  "alone": alone.item(), "bubble_alone": 1 - m * alone.item() / step,
                  "theory": bubble_fraction(pp, m * chunks)}
    return out


def _sleep_stage_alone(pipeline, vocab: int) -> float:
    """One micro-batch's forward + backward through this rank's stages, no pipeline communication (median of 3):
    the sleeps plus what they cost on this machine (oversleep under load, the embedding, head and Python around,
    and under dp="fsdp" the stage's all-gathers and reduce-scatters over its dp ranks)."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for stage in pipeline.stages:
            part = stage.submod
            ids = torch.randint(0, vocab, (1, 4))
            out = part(ids if part.embed is not None else torch.randn(1, 4, SLEEP_HIDDEN, requires_grad=True))
            (out.pow(2).mean() if part.head is None else part.head(out[:, :-1].reshape(-1, out.shape[-1]),
                                                                    ids[:, 1:].reshape(-1))).backward()
        times.append(time.perf_counter() - start)
    return sorted(times)[1]


def _print_bubble(pp: int, rounds: int, res: dict, dp: str = "") -> None:
    print(f"pp {pp}{dp}, {SLEEP_LAYERS} sleep layers (F/B/W = {SLEEP_MS['forward']:g}/{SLEEP_MS['input_grad']:g}/"
          f"{SLEEP_MS['weight_grad']:g} ms per micro-batch), median of {rounds} rounds")
    print("| schedule | m | step s | m x sleeps s | bubble vs sleeps | m x stage alone s | bubble vs alone | "
          "(pp-1)/(m*v+pp-1) |")
    print("|---|---|---|---|---|---|---|---|")
    for (schedule, m), r in res.items():
        print(f"| {schedule} | {m} | {r['step']:.3f} | {r['ideal']:.3f} | {r['bubble']:.3f} | {m * r['alone']:.3f} | "
              f"{r['bubble_alone']:.3f} | {r['theory']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("speed", "bubble"), default="speed")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=None,
                        help=f"default: all (bubble mode: {' '.join(BUBBLE_SCHEDULES)})")
    parser.add_argument("--dp", nargs="+", choices=("ddp", "fsdp"), default=["ddp"],
                        help="the data parallelism over --dp-size ranks (bubble mode: each given is run; speed: one)")
    parser.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks per stage")
    args = parser.parse_args()
    if min(args.pp, args.dp_size, args.rounds, *args.microbatches) < 1:
        parser.error("--pp, --dp-size, --rounds and --microbatches must be >= 1")
    if args.dp_size == 1 and (len(args.dp) > 1 or args.dp != ["ddp"]):
        parser.error("--dp applies over --dp-size ranks: give --dp-size 2 or more (at 1, ours would shard over one "
                     "rank while the direct side has no data parallelism)")
    world, dp_label = args.pp * args.dp_size, f" x dp {args.dp_size}" if args.dp_size > 1 else ""
    print(f"load average {os.getloadavg()[0]:.1f} at start", flush=True)
    if args.mode == "bubble":
        res = run_distributed(bubble_worker, world_size=world, timeout=3000,
                              args=(args.microbatches, args.rounds, tuple(args.schedules or BUBBLE_SCHEDULES),
                                    args.pp, tuple(args.dp)))
        _print_bubble(args.pp, args.rounds, res[0], dp_label)
    else:
        if len(args.dp) > 1:
            parser.error("--mode speed runs one --dp at a time")
        dp_label += f" ({args.dp[0]})" if args.dp_size > 1 else ""
        res = run_distributed(worker, world_size=world, timeout=3000, args=(
            args.microbatches[0], args.rounds, tuple(args.schedules or SCHEDULES), args.pp, args.dp[0]))[0]
        _print_speed(args, dp_label, res)
    print(f"load average {os.getloadavg()[0]:.1f} at end")


def _print_speed(args: argparse.Namespace, dp_label: str, res: dict) -> None:
    print(f"Llama hidden {CONFIG.hidden_size}, {CONFIG.num_layers} layers, batch {BATCH} x seq {SEQ}, fp32 AdamW, "
          f"pp {args.pp}{dp_label}, {args.microbatches[0]} micro-batches, median of {args.rounds} rounds")
    print("| schedule | Pipeline strategy step s | torch pipelining direct s | ratio | median round ratio | "
          "bubble measured | (pp-1)/(m*v+pp-1) |")
    print("|---|---|---|---|---|---|---|")
    for schedule, r in res.items():
        bubble = f"{r['bubble']:.2f}" if "bubble" in r else "-"
        print(f"| {schedule} | {r['ours']:.3f} | {r['direct']:.3f} | {r['ratio']:.3f} | {r['paired']:.3f} | {bubble} | "
              f"{r['theory']:.2f} |")


if __name__ == "__main__":
    main()
