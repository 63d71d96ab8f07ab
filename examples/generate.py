"""Generate from the built-in Llama with ZeRO-3 and CPU offload on N ranks, prompts split across the ranks.

    python examples/train_llama.py --steps 150 --out runs/llama                # train and save a checkpoint
    shardkit launch --num-processes 2 examples/generate.py --checkpoint runs/llama
    python examples/generate.py --num-processes 2 --prompt "To be" --prompt "Once upon"   # spawns its ranks

Each rank takes its share of the prompts (``runner.split_between_processes``), and every rank calls
``runner.generate`` the same number of times (padding repeats a prompt on short ranks): under ZeRO-3 each
forward gathers the layers' weights from every rank, so ranks decode in lock step. The outputs are gathered
back in the prompts' order (``runner.gather_object``) and printed by the main process. Without
``--checkpoint`` the model keeps its random initial weights (the output is noise, the mechanics the same).
The model flags must match the ones the checkpoint was trained with.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

import shardkit
from shardkit import Runner
from shardkit.models import Llama, LlamaConfig
from shardkit.precision import precision_from_name
from shardkit.precision.registry import add_precision_argument
from shardkit.strategies.registry import add_strategy_arguments, strategy_from_args, strategy_options

PROMPTS = ["To be", "Once upon a time", "The king", "And so", "What light", "Now is the"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="a shardkit checkpoint (or its parent with `latest`)")
    parser.add_argument("--prompt", action="append", help="repeatable; default: six built-in prompts")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    add_strategy_arguments(parser, default="zero3")
    parser.add_argument("--offload", default="cpu", help="zero3's parameter offload: cpu (default), nvme or none")
    parser.add_argument("--nvme-path", default=None, help="directory for --offload nvme")
    add_precision_argument(parser, default="fp32")
    parser.add_argument("--num-processes", type=int, default=1, help="spawn this many ranks (or use shardkit launch)")
    parser.add_argument("--hidden-size", type=int, default=128, help="as in train_llama.py")
    parser.add_argument("--layers", type=int, default=4, help="as in train_llama.py")
    parser.add_argument("--seq-len", type=int, default=64, help="as in train_llama.py (the context length)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    strategy_options(args, parser)  # a bad --strategy-opt stops here, before any rank starts
    return args


def model_config(args: argparse.Namespace) -> LlamaConfig:
    """The same shape train_llama.py builds from the same flags."""
    return LlamaConfig(hidden_size=args.hidden_size, intermediate_size=int(args.hidden_size * 8 / 3 // 8 * 8),
                       num_layers=args.layers, num_heads=max(1, args.hidden_size // 32), max_position=args.seq_len)


def make_strategy(args: argparse.Namespace):
    # --strategy-opt wins over --offload/--nvme-path (e.g. --strategy-opt offload_params=none).
    if args.strategy in ("zero3", "zero_infinity") and args.offload != "none":
        return strategy_from_args(args, offload_params=args.offload, nvme_path=args.nvme_path)
    return strategy_from_args(args)


def generate(args: argparse.Namespace) -> list[str]:
    logging.basicConfig(format="%(message)s")
    logging.getLogger("shardkit.inference").setLevel(logging.INFO)  # says how the ranks decode
    runner = Runner(make_strategy(args), precision_from_name(args.precision), seed=args.seed)
    model = runner.setup(Llama(model_config(args)))
    if args.checkpoint is not None:
        runner.load(args.checkpoint, {"model": model})
        runner.print(f"loaded {args.checkpoint}")
    runner.print(f"{runner}: {len(args.prompt or PROMPTS)} prompts over {runner.world_size} rank(s)")
    prompts = [p.encode() for p in (args.prompt or PROMPTS)]
    with runner.split_between_processes(prompts, apply_padding=True) as mine:
        outputs = []
        for prompt in mine:
            ids = torch.tensor([list(prompt)], device=runner.device)
            out = runner.generate(model, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature)
            outputs.append(bytes(out[0].tolist()).decode("utf-8", errors="replace"))
        texts = runner.gather_object(outputs)
    for i, text in enumerate(texts):
        runner.print(f"[{i}] {text!r}")
    runner.teardown()
    return texts


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.num_processes > 1:
        shardkit.launch(generate, args=(args,), num_processes=args.num_processes)
    else:
        generate(args)


if __name__ == "__main__":
    main()
