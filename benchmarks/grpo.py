"""GRPO training step: shardkit's GRPOTrainer against TRL's, same tiny HF Llama, prompts, reward and settings, on CPU,
side by side: one process each, or 2 ranks each under ZeRO-3 or DDP.

    python benchmarks/grpo.py [--hidden 128] [--layers 2] [--vocab 2000] [--batch 16] [--generations 8]
                              [--completion 32] [--steps 6] [--warmup 2] [--strategy zero3,ddp] [--before DIR]

With ``--strategy`` each contender runs on 2 ranks per strategy: TRL under ``accelerate launch --multi_gpu`` (on a
machine without GPUs: torch DDP over gloo; ZeRO-3: a stage-3 DeepSpeed config in ``GRPOConfig(deepspeed=...)``,
DS_ACCELERATOR=cpu),
shardkit under ``shardkit launch`` with that strategy. --batch is per rank. Each rank measures its own figures; the
table shows rank 0's step time and generation share, the rollout tokens of both ranks over the longer rank's sampling
time, and the larger rank's peak.

Each contender runs in a child process of its own (glibc's mmap threshold at 1 MiB so that freed blocks leave the
resident set, see benchmarks/_timing.py). Reported per contender:

- step time: the median wall time of the optimizer steps after --warmup (a TrainerCallback's on_step_end);
- generation share: the time spent sampling completions (TRL's ``_generate_single_turn``, shardkit's ``generate``)
  within the timed steps over those steps' time;
- rollout tokens/s: completion tokens sampled per second of sampling;
- peak memory: the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) from just before the
  trainer is built to the end of training, over what was resident then.

Both: fp32, AdamW, no gradient checkpointing, beta=0 (no reference), loss_type="dapo", temperature 1, the EOS token
suppressed (``generation_kwargs``) so that every completion has --completion tokens on both sides. The libraries are
imported before the memory baseline (DeepSpeed too, under ZeRO-3). TRL is not a shardkit requirement (1.16.0 here).
Under ZeRO-3 both gather the whole model once per generation batch by default (TRL's ``ds3_gather_for_generation``,
shardkit's ``generation_context``), and both take DeepSpeed's module hooks out for the call; --per-layer sets
``ds3_gather_for_generation=False`` on both (or with =trl / =shardkit on that one only), gathering per layer and
token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import fmt_bytes, machine_description, print_table, status_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the river ran fast and cold under the old stone bridge while the children watched from the bank and the "
         "miller counted sacks of grain in the yard behind the house").split()


def _accelerate_deepspeed_on_cpu() -> None:
    """Let accelerate count the ranks of a DeepSpeed job on a machine without a GPU.

    accelerate 1.x picks no process-group backend when neither a GPU nor ``cpu=True`` is there, and then reports one
    process, while DeepSpeed (DS_ACCELERATOR=cpu) runs on two: the Trainer's "auto" batch size is then half what the
    engine checks. ``cpu=True`` is no way out, as it turns DeepSpeed off. Naming gloo where it picked nothing is the
    least change that makes it count both ranks (benchmark only).
    """
    from accelerate.state import PartialState

    pick = PartialState._prepare_backend

    def gloo_when_none(self, *args, **kwargs):
        backend, kind = pick(self, *args, **kwargs)
        return ("gloo" if backend is None else backend), kind

    PartialState._prepare_backend = gloo_when_none


def child(contender: str, opts: argparse.Namespace) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    from shardkit.sft.chat import train_tokenizer

    torch.manual_seed(0)
    tokenizer = train_tokenizer(texts=[" ".join(WORDS)] * 4, vocab_size=300)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=opts.vocab, hidden_size=opts.hidden,
                                         intermediate_size=2 * opts.hidden, num_hidden_layers=opts.layers,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512))
    rows = [{"prompt": " ".join(WORDS[i % 7:i % 7 + 6])} for i in range(200)]
    times: list[float] = []
    gens: list[float] = []  # seconds spent sampling within each of those steps
    sampled = {"tokens": 0, "seconds": 0.0}

    def reward(completion_ids, **kwargs):
        sampled["tokens"] += sum(len(c) for c in completion_ids)
        return [sum(t % 2 for t in c) / max(len(c), 1) for c in completion_ids]

    class Clock(TrainerCallback):
        last = None

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if self.last is not None:
                times.append(now - self.last[0])
                gens.append(sampled["seconds"] - self.last[1])
            self.last = (now, sampled["seconds"])

    distributed = opts.strategy is not None
    settings = dict(output_dir=f"/tmp/grpo_bench_{contender}", per_device_train_batch_size=opts.batch,
                    num_generations=opts.generations, max_completion_length=opts.completion,
                    max_steps=opts.warmup + opts.steps, learning_rate=1e-4, report_to="none", save_strategy="no",
                    logging_steps=1, disable_tqdm=True, beta=0.0, loss_type="dapo", seed=0,
                    # accelerate turns DeepSpeed off when told use_cpu; without a GPU the device is the CPU anyway
                    use_cpu=not (contender == "trl" and opts.strategy == "zero3"),
                    generation_kwargs={"suppress_tokens": [tokenizer.eos_token_id]})
    if distributed:
        settings["ds3_gather_for_generation"] = opts.per_layer not in ("both", contender)
    if contender == "trl" and opts.strategy == "zero3":  # the Trainer's documented way; "auto" filled from the args
        settings["deepspeed"] = {"zero_optimization": {"stage": 3}, "train_batch_size": "auto",
                                 "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
        if not settings["ds3_gather_for_generation"]:
            # DeepSpeed 0.19.8's prefetch fails TRL's first backward after a generation through the hooks
            # ("size of tensor a (0) must match ... (128)"); shardkit's engine keeps the default
            settings["deepspeed"]["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
        _accelerate_deepspeed_on_cpu()
    if opts.strategy == "zero3":  # a library both use: its import (~130 MiB resident here) is no contender's memory
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # noqa: F401
    if contender == "trl":
        import datasets
        import trl
    else:
        from shardkit.rl import GRPOConfig, GRPOTrainer
        from shardkit.trainer.callbacks import TrainerCallback as OurCallback
    Path("/proc/self/clear_refs").write_text("5")
    before = status_bytes("VmRSS")
    if contender == "trl":
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, train_dataset=datasets.Dataset.from_list(rows),
                                  args=trl.GRPOConfig(bf16=False, gradient_checkpointing=False, **settings),
                                  processing_class=tokenizer, callbacks=[Clock()])
        name = "_generate_single_turn"
    else:
        class OurClock(Clock, OurCallback):  # Clock's on_step_end first (the base's is a no-op)
            pass

        from shardkit.strategies import strategy_from_name

        strategy = strategy_from_name(opts.strategy) if distributed else None
        trainer = GRPOTrainer(model, reward, args=GRPOConfig(**settings), train_dataset=rows,
                              processing_class=tokenizer, callbacks=[OurClock()], strategy=strategy)
        name = "generate"
    inner = getattr(trainer, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sampled["seconds"] += time.perf_counter() - t

    setattr(trainer, name, timed)
    trainer.train()
    peak = status_bytes("VmHWM") - before
    timed = slice(opts.warmup - 1, None)
    return {"step_s": statistics.median(times[timed]), "peak": peak, "gen_share": sum(gens[timed]) / sum(times[timed]),
            "tokens_per_s": sampled["tokens"] / max(sampled["seconds"], 1e-9), "tokens": sampled["tokens"],
            "gen_s": sampled["seconds"]}


def combine(ranks: list[dict]) -> dict:
    """One row from every rank's figures (see the module docstring)."""
    first = ranks[0]
    return {"step_s": first["step_s"], "gen_share": first["gen_share"], "peak": max(r["peak"] for r in ranks),
            "tokens_per_s": sum(r["tokens"] for r in ranks) / max(max(r["gen_s"] for r in ranks), 1e-9)}


def launch_command(contender: str, strategy: str, script_args: list[str]) -> tuple[list[str], dict]:
    if contender == "shardkit":
        return [sys.executable, "-m", "shardkit.cli", "launch", "--num_processes", "2", __file__, *script_args], {}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no"]
    if strategy not in ("zero3", "ddp"):
        raise SystemExit(f"--strategy {strategy!r}: zero3 or ddp")
    # ZeRO-3: the child passes the DeepSpeed config to GRPOConfig(deepspeed=...)
    return [*launch, "--multi_gpu", __file__, *script_args], {"DS_ACCELERATOR": "cpu"} if strategy == "zero3" else {}


def run(contender: str, opts: argparse.Namespace, keys: tuple[str, ...], env: dict, strategy: str | None) -> dict:
    if contender == "shardkit@before":  # the same child, importing shardkit from the --before checkout
        contender = "shardkit"
        env = {**env, "PYTHONPATH": os.pathsep.join([opts.before, env["PYTHONPATH"]])}
    args = ["--child", contender] + [f"--{k}={getattr(opts, k)}" for k in keys]
    if opts.per_layer:
        args.append(f"--per-layer={opts.per_layer}")
    if strategy is None:
        proc = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{contender} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(line[len("RESULT "):])
    with tempfile.TemporaryDirectory() as out:
        cmd, extra = launch_command(contender, strategy, [*args, f"--strategy={strategy}", f"--out={out}"])
        proc = subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True)
        files = sorted(Path(out).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != 2:
            sys.exit(f"{contender} under {strategy} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                     f"{proc.stderr[-5000:]}")
        return combine([json.loads(f.read_text()) for f in files])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--strategy", default=None,
                        help="comma-separated, of zero3 and ddp: 2 ranks per contender and strategy; none: 1 process")
    parser.add_argument("--per-layer", nargs="?", const="both", choices=("both", "trl", "shardkit"),
                        help="ds3_gather_for_generation=False on both sides, or on the one named (with --strategy)")
    parser.add_argument("--before", metavar="DIR",
                        help="also run shardkit imported from DIR (a folder holding a `shardkit` package, e.g. another "
                             "checkout's .pp), between TRL and this checkout, for a before/after in one run")
    parser.add_argument("--child", choices=("shardkit", "trl"))
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    keys = ("vocab", "hidden", "layers", "batch", "generations", "completion", "steps", "warmup")
    if opts.child:
        if opts.child == "shardkit":
            import shardkit

            print(f"shardkit from {Path(shardkit.__file__).resolve().parent}", file=sys.stderr, flush=True)
        result = child(opts.child, opts)
        if opts.out:
            (Path(opts.out) / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))
        else:
            print("RESULT " + json.dumps(result), flush=True)
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / ".pp"), os.environ.get("PYTHONPATH", "")])}
    print(f"machine: {machine_description()}; load average at start: {os.getloadavg()}", flush=True)
    rows = []
    for strategy in opts.strategy.split(",") if opts.strategy else [None]:
        for contender in ("trl", *(("shardkit@before",) if opts.before else ()), "shardkit"):
            r = run(contender, opts, keys, env, strategy)
            rows.append([contender, strategy or "1 process", f"{r['step_s']:.3f}", f"{r['gen_share']:.0%}",
                         f"{r['tokens_per_s']:.0f}", fmt_bytes(r["peak"])])
            print(f"  done: {contender} {strategy or ''}; load average {os.getloadavg()}", flush=True)
    print_table(["contender", "ranks", "s/step", "generation share", "rollout tokens/s", "peak memory"], rows)
    print(f"load average at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
