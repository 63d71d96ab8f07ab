"""Run by a launcher on one process (test_launch.py): a Trainer script as the seed pages write one, its arguments
parsed from the command line into TrainingArguments. It trains the tiny Llama 4 steps with the command line's
``--fsdp``, then 4 steps with ZeRO-3 (the same arguments, ``--deepspeed`` instead of ``--fsdp``), each Trainer ended
with ``trainer.end()`` so that the second joins the launcher's process group anew, as a second script would.

    shardkit launch --num_processes 1 seed_trainer.py --result out.json --zero3_config ds_config_zero3.json \\
        --output_dir out --fsdp "full_shard auto_wrap" --max_steps 4 ...

``--mixed`` and ``--num`` are this script's own (they prefix-match launcher flags: the launcher must pass them
through). Writes ``{"argv": sys.argv[1:], "mixed": ..., "num": ..., "fsdp": losses, "zero3": losses}``.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: trainer_fixtures

import torch  # noqa: E402
from trainer_fixtures import logged_losses, text_data  # noqa: E402

from shardkit.models.llama import Llama, LlamaConfig  # noqa: E402
from shardkit.trainer import HfArgumentParser, Trainer, TrainingArguments  # noqa: E402

TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16)


def train(argv: list[str]) -> list[float]:
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv)
    torch.manual_seed(0)
    trainer = Trainer(model=Llama(TINY), args=args, train_dataset=text_data(8))
    trainer.train()
    trainer.end()
    return logged_losses(trainer)


def without_fsdp(argv: list[str]) -> list[str]:
    at = argv.index("--fsdp")
    return argv[:at] + argv[at + 2:]


def main() -> None:
    own = argparse.ArgumentParser(allow_abbrev=False)
    own.add_argument("--result", required=True)
    own.add_argument("--zero3_config", required=True)
    own.add_argument("--mixed")
    own.add_argument("--num", type=int)
    mine, hf_argv = own.parse_known_args()
    result = {"argv": sys.argv[1:], "mixed": mine.mixed, "num": mine.num, "fsdp": train(hf_argv)}
    result["zero3"] = train([*without_fsdp(hf_argv), "--deepspeed", mine.zero3_config])
    Path(mine.result).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
