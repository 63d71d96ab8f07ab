"""Train the small built-in Llama on a public-domain text shipped with the repository.

    python examples/train_llama.py                                   # one process, CPU or GPU
    python examples/train_llama.py --num-processes 2 --strategy ddp  # two ranks
    python examples/train_llama.py --steps 200 --resume              # continue from the latest save
    python examples/train_llama.py --num-processes 2 --strategy zero3 --strategy-opt overlap_comm=false

Byte-level tokens (vocabulary 256), so no tokenizer and nothing to download.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

import shardkit
from shardkit import Runner
from shardkit.models import ByteTextDataset, Llama, LlamaConfig
from shardkit.precision import precision_from_name
from shardkit.precision.registry import add_precision_argument
from shardkit.strategies.registry import add_strategy_arguments, strategy_from_args, strategy_options

DATA = Path(__file__).parent / "data" / "public_domain.txt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_strategy_arguments(parser, default="auto", auto_help=" (ddp when several processes, else single)")
    add_precision_argument(parser, default="fp32")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps in all (a resumed run stops here too)")
    parser.add_argument("--batch-size", type=int, default=16, help="micro-batch size per rank")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=Path("runs/llama"), help="checkpoint directory")
    parser.add_argument("--save-every", type=int, default=50, help="optimizer steps between checkpoints (0: never)")
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    parser.add_argument("--log-every", type=int, default=25)
    args = parser.parse_args(argv)
    strategy_options(args, parser)  # a bad --strategy-opt stops here, before any rank starts
    return args


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def train(args: argparse.Namespace) -> float:
    strategy = strategy_from_args(args)  # None for auto
    runner = Runner(strategy, precision_from_name(args.precision), gradient_accumulation_steps=args.grad_accum,
                    seed=args.seed, checkpoint_keep_last=args.keep_last)
    config = LlamaConfig(hidden_size=args.hidden_size, intermediate_size=int(args.hidden_size * 8 / 3 // 8 * 8),
                         num_layers=args.layers, num_heads=max(1, args.hidden_size // 32), dropout=args.dropout,
                         max_position=args.seq_len)
    with runner.init_module():
        model = Llama(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(max(1, args.steps // 20), args.steps))
    model, optimizer, scheduler = runner.setup(model, optimizer, scheduler)
    dataset = ByteTextDataset(args.data, seq_len=args.seq_len, stride=args.seq_len // 2)
    loader = runner.setup_dataloader(DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    if args.resume and (args.out / "latest").exists():
        runner.load(args.out, state)
        runner.print(f"resumed from {args.out} at step {runner.optimizer_steps}")
    n_params = runner.num_parameters(model)  # whole counts under ZeRO-3 and FSDP too
    runner.print(f"{runner}\nmodel: {n_params / 1e6:.2f}M parameters, {len(dataset)} examples of {args.seq_len} bytes")

    bar = tqdm(total=args.steps, initial=runner.optimizer_steps, disable=not runner.is_main_process, unit="step")
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * runner.world_size
    first = last = None
    window_start, window_steps = time.perf_counter(), 0
    while runner.optimizer_steps < args.steps:
        for batch in loader:
            loss = model(batch["input_ids"], batch["labels"])
            runner.backward(loss)
            if not runner.sync_gradients:
                continue
            runner.clip_gradients(args.max_grad_norm)
            if not runner.step():
                continue
            last = runner.all_reduce(loss.detach().float(), "mean").item()
            first = last if first is None else first
            bar.update(1)
            window_steps += 1
            step = runner.optimizer_steps
            if step % args.log_every == 0 or step == args.steps:
                elapsed = time.perf_counter() - window_start
                rate = window_steps * tokens_per_step / elapsed
                if runner.is_main_process:
                    bar.write(f"step {step:5d}  loss {last:.4f}  lr {scheduler.get_last_lr()[0]:.2e}  "
                              f"{rate:,.0f} tokens/s")
                window_start, window_steps = time.perf_counter(), 0
            if args.save_every and (step % args.save_every == 0 or step == args.steps):
                runner.save(args.out / f"step-{step:06d}", state)
            if step >= args.steps:
                break
    bar.close()
    if first is not None:
        runner.print(f"loss {first:.4f} -> {last:.4f} over {args.steps} steps")
    # Every rank generates (under ZeRO-3, FSDP and TP each forward is a collective); the main process prints.
    prompt = torch.tensor([list(b"To be")], device=runner.device)
    sample = runner.generate(model, prompt, max_new_tokens=60)
    runner.print("sample:", bytes(sample[0].tolist()).decode("utf-8", errors="replace"))
    runner.teardown()
    return last


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.num_processes > 1:
        shardkit.launch(train, args=(args,), num_processes=args.num_processes)
    else:
        train(args)


if __name__ == "__main__":
    main()
