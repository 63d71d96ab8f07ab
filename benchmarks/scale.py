"""How big a model trains on this machine: the ZeRO-Infinity proof run, DeepSpeed side by side, the limits table.

    python benchmarks/scale.py --smoke                                  # tiny, for CI (seconds)
    python benchmarks/scale.py --proof --params 3.22e9 --ranks 1        # the proof: states >= 2 x RAM on NVMe
    python benchmarks/scale.py --compare --params 2e8 --ranks 2 --rounds 2  # shardkit / DeepSpeed, interleaved
    python benchmarks/scale.py --limits                                 # largest model per strategy, 2 ranks
    python benchmarks/scale.py --aio-tune                               # pick DeepSpeed's aio settings here

Every run is a child process watched from here (scale_watch.py): the memory of its whole process
tree (PSS, so that pages shared by forked ranks count once) and the bytes under its NVMe directory
are sampled, and the run is killed with "exceeded the memory budget" (or the disk budget) before it
can take the machine down; the NVMe directory is removed afterwards. The model is shardkit's
byte-level Llama (vocabulary 256, the tokenizer the examples use) on examples/data/public_domain.txt,
built inside ``runner.init_module()`` so that no rank ever holds it whole, trained with BF16
(DeepSpeed's bf16 section: bf16 weights, fp32 master weights and Adam state).

NOTE on CPUs without bf16 arithmetic (no AVX512-BF16/AMX; this machine has AVX2 only): torch's bf16
matmul there runs ~300x slower than fp32 (0.2 vs 60 GFLOP/s measured), so ``--linear-math fp32``
(default) computes each Linear in fp32 from the bf16 weights and returns bf16. The state, its bytes
and what goes to NVMe are unchanged; pass ``--linear-math native`` on hardware with bf16 units.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import types
from pathlib import Path

import torch
from scale_watch import GIB, Budget, _dir_bytes, aio_tune, libaio_available, watched_run
from torch import nn

__all__ = ["model_config", "train_rank", "main", "Budget", "watched_run", "libaio_available"]

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data" / "public_domain.txt"
# Chosen by `--aio-tune` on this machine (2-core VM, virtio disk): see the README's "How big can I train here?".
TUNED_AIO = {"block_size": 1_048_576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
             "overlap_events": True}
LIMIT_STRATEGIES = ("ddp", "fsdp", "fsdp_offload", "zero2_offload", "zero3_offload", "zero_infinity")


# ---- the model --------------------------------------------------------------------------------


def model_config(params: float, seq_len: int):
    """A Llama shape of about ``params`` parameters: depth ~ hidden/128, MLP 8/3 hidden, head dim 64."""
    from shardkit.models import LlamaConfig

    if params < 2e7:  # the smoke size: 3.7M, with MLP weights of 512K elements, the least DeepSpeed swaps (1 MiB)
        return LlamaConfig(hidden_size=256, intermediate_size=2048, num_layers=2, num_heads=4, max_position=seq_len)
    hidden = max(128, 128 * round((params * 120 / 12.4) ** (1 / 3) / 128))
    inter = int(hidden * 8 / 3 // 64 * 64)
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - 256 * hidden) / per_layer))
    return LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=hidden // 64,
                       max_position=seq_len)


def count_params(config) -> int:
    h, i = config.hidden_size, config.intermediate_size
    return config.num_layers * (4 * h * h + 3 * h * i + 2 * h) + config.vocab_size * h + h


class _Fp32MathLinear(torch.autograd.Function):
    """y = x W^T computed in fp32 from 16-bit x and W, in forward and backward.

    Saves the parameter itself, not an fp32 copy (as DeepSpeed's own ZeRO-3 linear does): under ZeRO-3 the
    weight is released after forward and gathered again for backward, so no rank ever holds the model whole.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        # matmul, not F.linear: DeepSpeed's ZeRO-3 leaves F.linear replaced by its own autograd wrapper;
        # autocast (the torch engines' BF16) off, or it would cast the fp32 operands back to bf16
        with torch.autocast("cpu", enabled=False):
            return (x.float() @ weight.float().t()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.float()
        with torch.autocast("cpu", enabled=False):
            grad_x = (g @ weight.float()).to(x.dtype)
            grad_w = (g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        return grad_x, grad_w


def _fp32_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = _Fp32MathLinear.apply(x, self.weight)
    return out if self.bias is None else out + self.bias


def use_fp32_linear_math(model: nn.Module) -> None:
    """Compute every plain nn.Linear in fp32 from its (bf16) weight; see the module NOTE. The LM head keeps
    its fused loss (vocabulary 256: small)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = types.MethodType(_fp32_linear, module)


def _batch(dataset, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Consecutive, rank-interleaved windows of the text: both drivers (shardkit, DeepSpeed) see the same tokens.
    item = dataset[((step * world + rank) * 7) % len(dataset)]
    return item["input_ids"][None], item["labels"][None]


# ---- one rank of a run ------------------------------------------------------------------------


def _strategy(cfg: dict):
    from shardkit.strategies import strategy_from_name

    name, path = cfg["strategy"], cfg.get("nvme_path")
    extra = {"zero_optimization": {"sub_group_size": int(cfg["sub_group_size"])}}
    # Gathered parameters kept live at most (elements): DeepSpeed's 1e9 would let a model of 1B parameters or
    # less stay gathered whole through forward and backward.
    live = {"max_live_parameters": int(cfg["max_live"]), "max_reuse_distance": int(cfg["max_live"])}
    if name == "zero_infinity":
        # NOTE: DeepSpeed 0.19.8 reads the aio thread count as "intra_op_parallelism"; the "thread_count"
        # key shardkit writes is ignored there, so it is passed under DeepSpeed's own name too.
        extra["aio"] = {"intra_op_parallelism": int(cfg["aio"]["thread_count"])}
        # DeepSpeed keeps up to offload_param.max_in_cpu (1e9) 16-bit parameter elements in host memory even
        # with parameters on NVMe: 2 GB that is not needed when the point is to stay small.
        extra["zero_optimization"]["offload_param"] = {"max_in_cpu": int(cfg["max_in_cpu"])}
        rank_dir = os.path.join(path, f"rank{int(os.environ.get('RANK', '0'))}")
        return strategy_from_name("zero_infinity", nvme_path=rank_dir, aio=cfg["aio"],
                                  buffer_size=int(cfg["buffer_size"]), extra=extra, **live)
    if name == "zero3_offload":
        return strategy_from_name("zero3", offload="cpu", extra=extra, **live)
    if name == "zero2_offload":
        return strategy_from_name("zero2", offload_optimizer="cpu")
    if name == "fsdp_offload":
        return strategy_from_name("fsdp", cpu_offload=True)
    return strategy_from_name(name)


def _deepspeed_engine(cfg: dict, config, world: int):
    """The same model and engine config driven through DeepSpeed directly (no Runner)."""
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from shardkit.precision import BF16
    from shardkit.strategies.zero.config import precision_section
    from shardkit.strategies.zero.strategy import prepare_deepspeed

    strategy = _strategy(cfg)
    prepare_deepspeed(strategy.settings)  # builds/loads the C++ ops, as a DeepSpeed user's first run would
    ds_config = strategy.settings.engine_config(config.hidden_size, precision_section(BF16()), micro_batch_size=1,
                                                gradient_accumulation_steps=1, world_size=world,
                                                gradient_clipping=0.0, on_gpu=False)
    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, dist_init_required=False,
                                    verbose=False)
    from shardkit.models import Llama

    torch.manual_seed(0)  # as Runner(seed=0): the two drivers train the same weights on the same tokens
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = Llama(config)
    for module in model.modules():  # the same init as shardkit's build (normal(0, 0.02)), on the gathered weight
        if isinstance(module, (nn.Linear, nn.Embedding)):
            with deepspeed.zero.GatheredParameters(module.weight, modifier_rank=0):
                nn.init.normal_(module.weight, std=config.init_std)
    if cfg["linear_math"] == "fp32":
        use_fp32_linear_math(model)
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=cfg["lr"], weight_decay=0.0, adamw_mode=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, dist_init_required=False)
    return engine, ds_config


def _steps(cfg: dict, step_fn, world: int, rank: int, model_for_bytes=None) -> dict:
    import torch.distributed as dist

    from shardkit.models import ByteTextDataset

    dataset = ByteTextDataset(DATA, seq_len=cfg["seq_len"], stride=cfg["seq_len"])
    losses, times, state_bytes = [], [], None
    for step in range(cfg["steps"]):
        # repeat_batch (the smoke test): the same batch every step, so a working step must lower its loss
        ids, labels = _batch(dataset, 0 if cfg.get("repeat_batch") else step, rank, world)
        dist.barrier()
        start = time.perf_counter()
        loss, measured = step_fn(ids, labels, step == 0 and model_for_bytes is not None)
        loss = loss.detach().float().reshape(1)
        dist.all_reduce(loss)
        times.append(time.perf_counter() - start)
        losses.append(loss.item() / world)
        state_bytes = state_bytes or measured
        if rank == 0:
            print(f"[scale] step {step + 1}/{cfg['steps']}: loss {losses[-1]:.4f}, {times[-1]:.1f} s", flush=True)
    return {"losses": losses, "step_times": times, "model_state_bytes": state_bytes}


def _train_shardkit(cfg: dict, world: int) -> tuple[dict, object, object]:
    from shardkit import Runner
    from shardkit.models import Llama
    from shardkit.precision import BF16

    runner = Runner(_strategy(cfg), BF16(), seed=0)
    config = model_config(cfg["params"], cfg["seq_len"])
    with runner.init_module():
        model = Llama(config)
    if cfg["linear_math"] == "fp32":
        use_fp32_linear_math(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    model, optimizer = runner.setup(model, optimizer)

    def step_fn(ids, labels, measure):
        loss = model(ids, labels)
        runner.backward(loss)
        before = runner.strategy.model_state_bytes(model, optimizer) if measure else None
        runner.step()
        if measure:  # params and grads at their peak (after backward), optimizer state once created
            after = runner.strategy.model_state_bytes(model, optimizer)
            before = {**before, "optimizer": after["optimizer"]}
        return loss, before

    out = _steps(cfg, step_fn, world, runner.rank, model_for_bytes=model)
    return out, runner, model


def train_rank(cfg: dict) -> dict:
    """One rank of a run: build, train ``cfg['steps']`` steps, (shardkit) generate; rank 0 returns the figures."""
    import torch.distributed as dist

    torch.set_num_threads(int(cfg["threads"]))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    t0 = time.perf_counter()
    if cfg["driver"] == "deepspeed":
        from shardkit.distributed.process_group import init_distributed

        init_distributed("cpu")
        engine, _ = _deepspeed_engine(cfg, model_config(cfg["params"], cfg["seq_len"]), world)

        def step_fn(ids, labels, measure):
            loss = engine(ids, labels)
            engine.backward(loss)
            engine.step()
            return loss, None

        out = _steps(cfg, step_fn, world, dist.get_rank())
        out["generated"] = None
        engine.destroy()
    else:
        out, runner, model = _train_shardkit(cfg, world)
        out["nvme_bytes_after_steps"] = _dir_bytes(Path(cfg["nvme_path"])) if cfg["strategy"] == "zero_infinity" else 0
        out["generated"] = _generate(cfg, runner, model)
        runner.teardown()
    out["params"] = count_params(model_config(cfg["params"], cfg["seq_len"]))
    out["total_s"] = time.perf_counter() - t0
    return out


def _generate(cfg: dict, runner, model) -> dict | None:
    if not cfg["gen_tokens"]:
        return None
    prompt = torch.tensor([list(b"To be, or not")])
    start = time.perf_counter()
    with torch.no_grad():
        sample = runner.generate(model, prompt, max_new_tokens=cfg["gen_tokens"])
    new = sample[0, prompt.shape[1]:].tolist()
    return {"token_ids": new, "text": bytes(new).decode("utf-8", errors="replace"),
            "seconds": time.perf_counter() - start}


def trial_main(cfg_path: str) -> None:
    """Entry of the watched child: run the ranks, write rank 0's figures to ``cfg['result']``."""
    cfg = json.loads(Path(cfg_path).read_text())
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import shardkit

    # One rank runs in this process (launch's default for 1): one process start fewer, and launch still sets
    # the rank variables (DeepSpeed's zero.Init reads LOCAL_RANK).
    result = shardkit.launch(train_rank, args=(cfg,), num_processes=cfg["ranks"])[0]
    Path(cfg["result"]).write_text(json.dumps(result))


# ---- modes ------------------------------------------------------------------------------------


def _cfg(args: argparse.Namespace, **over) -> dict:
    cfg = {"params": args.params, "ranks": args.ranks, "steps": args.steps, "seq_len": args.seq_len,
           "lr": args.lr, "gen_tokens": args.gen_tokens, "strategy": "zero_infinity", "driver": "shardkit",
           "aio": dict(TUNED_AIO), "sub_group_size": args.sub_group_size, "buffer_size": args.buffer_size,
           "threads": args.threads, "linear_math": args.linear_math, "max_live": args.max_live,
           "repeat_batch": args.repeat_batch, "max_in_cpu": args.max_in_cpu,
           "malloc_mmap_threshold": args.malloc_mmap_threshold}
    cfg.update(over)
    return cfg


def _per_process(peaks: dict[str, int]) -> str:
    big = {k: v for k, v in peaks.items() if v > 50 * 2**20}  # helpers (compiler probes, ldconfig) left out
    return ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in sorted(big.items()))


def _estimate(r: dict) -> str | None:
    """What `shardkit estimate-memory` predicts per rank for this run, beside what rank 0 measured."""
    from shardkit.memory import ModelSpec, estimate_model_states

    measured = r.get("model_state_bytes")
    if not measured:
        return None
    config = model_config(r["params"], r["seq_len"])
    spec = ModelSpec(r["params"], config.hidden_size * config.intermediate_size, hidden_size=config.hidden_size)
    e = estimate_model_states(spec, r["strategy"], num_gpus_per_node=r["ranks"], precision="bf16",
                              params_in_cpu=int(r["max_in_cpu"]))
    held = sum(measured.get(k, 0) for k in ("params", "grads", "optimizer"))  # FSDP adds a "total": not summed
    predicted = e.device_total + e.host  # on a CPU machine both are host memory
    r["estimate"] = {"predicted_held": predicted, "measured_held": held, "predicted_nvme": e.nvme}
    return (f"  model states per rank: measured {held / GIB:.2f} GiB held ({measured}); estimate-memory predicts "
            f"{predicted / GIB:.2f} GiB held (ratio {predicted / max(held, 1):.2f}), {e.nvme / GIB:.2f} GiB on NVMe")


def _summary(name: str, r: dict) -> str:
    if not r.get("ok"):
        return f"{name}: FAILED: {r.get('error')}"
    times = r["step_times"]
    steady = times[1:] or times
    per_step = sum(steady) / len(steady)
    lines = [f"{name}: {r['params'] / 1e9:.3f}B params, {r['ranks']} rank(s), seq {r['seq_len']}",
             f"  loss per step: {', '.join(f'{x:.4f}' for x in r['losses'])}",
             f"  s/step: {', '.join(f'{t:.1f}' for t in times)} (mean after the first {per_step:.1f} s; "
             f"{r['seq_len'] * r['ranks'] / per_step:.2f} tokens/s)",
             f"  peak memory: tree {r['peak_tree_rss'] / GIB:.2f} GiB PSS "
             f"({100 * r['peak_tree_rss'] / r['mem_total']:.0f}% "
             f"of RAM); peak RSS per process {_per_process(r['peak_rss_per_process'])}",
             f"  NVMe path peak {r['peak_disk_bytes'] / 1e9:.3f} GB (sampled every 2 s; after the steps "
             f"{r.get('nvme_bytes_after_steps', 0) / 1e9:.3f} GB); wall {r['wall_s']:.0f} s"]
    est = _estimate(r)
    if est:
        lines.append(est)
    if r.get("generated"):
        g = r["generated"]
        lines.append(f"  generated {len(g['token_ids'])} tokens in {g['seconds']:.1f} s: {g['token_ids']} "
                     f"{g['text']!r}")
    return "\n".join(lines)


def run_one(args: argparse.Namespace, cfg: dict, budget: Budget, label: str) -> dict:
    result = watched_run(cfg, budget, Path(args.work_dir), script=Path(__file__))
    result.update({k: cfg[k] for k in ("ranks", "seq_len", "strategy", "driver", "max_in_cpu")})
    print(_summary(label, result), flush=True)
    if args.json:
        with open(args.json, "a") as fh:
            fh.write(json.dumps({"label": label, "cfg": cfg, **result}) + "\n")
    return result


def run_compare(args: argparse.Namespace, budget: Budget) -> None:
    """shardkit and DeepSpeed directly, alternating whole runs (A B B A ...), same model, config and steps."""
    per = {"shardkit": [], "deepspeed": []}
    losses = set()  # the same seed, weights and tokens: every run of either driver gives the same losses
    for round_ in range(args.rounds):
        # A B, B A, A B, ...: neither driver always runs first (the machine's load drifts)
        for driver in ("shardkit", "deepspeed")[:: 1 if round_ % 2 == 0 else -1]:
            r = run_one(args, _cfg(args, driver=driver, gen_tokens=0), budget, f"{driver} round {round_ + 1}")
            if r.get("ok"):
                per[driver].extend(r["step_times"][1:])
                losses.add(tuple(r["losses"]))
    if per["shardkit"] and per["deepspeed"]:
        import statistics

        a, b = statistics.median(per["shardkit"]), statistics.median(per["deepspeed"])
        spread = {k: (min(v), max(v)) for k, v in per.items()}
        print(f"median s/step shardkit {a:.2f} deepspeed {b:.2f} ratio {a / b:.3f} (goal <= 1.03); "
              f"spread {spread}; losses {'bitwise equal' if len(losses) == 1 else 'DIFFER'} across all runs")


def run_limits(args: argparse.Namespace, budget: Budget) -> None:
    """Largest model that completes a step, per strategy: sizes x--factor from --start until a failure (or,
    when --start already fails, down by the factor until one completes), then one bisection."""
    for name in args.strategies:
        ok, bad, size = None, None, args.start
        while args.min_params <= size <= args.max_params and (ok is None or bad is None):
            cfg = _cfg(args, strategy=name, params=size, steps=1, gen_tokens=0)
            r = run_one(args, cfg, budget, f"{name} {size:.3g}")
            if r.get("ok"):
                ok = size
                size *= args.factor
            else:
                bad = size
                size /= args.factor
            if (ok is not None and bad is not None) or (ok is not None and size > args.max_params):
                break
        if ok is not None and bad is not None:
            mid = math.sqrt(ok * bad)
            r = run_one(args, _cfg(args, strategy=name, params=mid, steps=1, gen_tokens=0), budget, f"{name} {mid:.3g}")
            ok, bad = (mid, bad) if r.get("ok") else (ok, mid)
        print(f"LIMIT {name}: largest completed {ok}, smallest failed {bad}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    for flag in ("--smoke", "--proof", "--deepspeed", "--compare", "--limits", "--aio-tune"):
        mode.add_argument(flag, action="store_true")
    mode.add_argument("--_trial", help=argparse.SUPPRESS)
    p.add_argument("--params", type=float, default=3.3e9, help="model size (parameters), e.g. 3.3e9")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--gen-tokens", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="--compare: A/B rounds")
    p.add_argument("--strategies", nargs="+", default=list(LIMIT_STRATEGIES), choices=LIMIT_STRATEGIES)
    p.add_argument("--start", type=float, default=2.5e8, help="--limits: first size")
    p.add_argument("--factor", type=float, default=1.6, help="--limits: size ratio between trials")
    p.add_argument("--min-params", type=float, default=2e7, help="--limits: smallest size tried")
    p.add_argument("--max-params", type=float, default=4e9, help="--limits: largest size tried")
    p.add_argument("--sub-group-size", type=float, default=5e7, help="DeepSpeed sub_group_size (elements)")
    p.add_argument("--buffer-size", type=float, default=3e7,
                   help="parameter swap buffer (elements; must hold the largest weight)")
    p.add_argument("--max-live", type=float, default=1e8,
                   help="ZeRO-3 max_live_parameters and max_reuse_distance (elements)")
    p.add_argument("--max-in-cpu", type=float, default=1e8,
                   help="ZeROInfinity: 16-bit parameter elements DeepSpeed keeps in host memory (its default 1e9)")
    p.add_argument("--repeat-batch", action="store_true",
                   help="train every step on the same batch (a working step must lower its loss)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    p.add_argument("--malloc-mmap-threshold", type=int, default=1 << 20,
                   help="glibc MALLOC_MMAP_THRESHOLD_ for the run (bytes; 0: glibc's sliding default). Blocks this "
                        "large are mapped and returned on free, so freed swap buffers do not stay resident")
    p.add_argument("--linear-math", choices=("fp32", "native"), default="fp32")
    p.add_argument("--mem-budget", type=float, default=0.75, help="fraction of MemTotal the run's tree may hold")
    p.add_argument("--min-available-gib", type=float, default=1.5, help="kill the run if the machine drops below")
    p.add_argument("--disk-budget-gb", type=float, default=60.0)
    p.add_argument("--work-dir", default=str(ROOT / "runs" / "scale"), help="NVMe swap and scratch (removed after)")
    p.add_argument("--json", help="append each run's figures as a JSON line here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._trial:
        trial_main(args._trial)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the watch kills its run and removes its files
    budget = Budget(mem_fraction=args.mem_budget, min_available=args.min_available_gib * GIB,
                    disk_bytes=args.disk_budget_gb * 1e9)
    if args.aio_tune:
        aio_tune(Path(args.work_dir))
        return 0
    if args.smoke:
        args.steps, args.gen_tokens, args.lr = 3, 3, 1e-2
        cfg = _cfg(args, params=1e5, sub_group_size=1e6, buffer_size=1e6, repeat_batch=True)
        result = run_one(args, cfg, budget, "smoke")
        return 0 if result.get("ok") and result["losses"][-1] < result["losses"][0] else 1
    if args.limits:
        args.ranks = 2
        run_limits(args, budget)
        return 0
    if args.compare:
        run_compare(args, budget)
        return 0
    cfg = _cfg(args, driver="deepspeed" if args.deepspeed else "shardkit")
    result = run_one(args, cfg, budget, "deepspeed" if args.deepspeed else "proof")
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
