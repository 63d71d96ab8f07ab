"""Every strategy by name: the one list the CLI, the examples, the config readers and the lazy imports use.

    from shardkit.strategies.registry import STRATEGIES
    STRATEGIES.names()                     # ["single", "ddp", "fsdp", "tp", "cp", "pp", "zero1", ...]
    STRATEGIES.build("tp")                 # TensorParallel over every rank
    STRATEGIES.build_from_cli("zero3", ["offload=cpu", "overlap_comm=false"])

A new strategy is one ``STRATEGIES.register(...)`` line here: ``shardkit.X``, ``shardkit.strategies.X``,
``--strategy`` choices and ``--strategy-opt`` options follow from it.
"""

from __future__ import annotations

import argparse
from typing import Any

from shardkit.utils.registry import Entry, Option, Registry

__all__ = ["STRATEGIES", "Entry", "Option", "Registry", "add_strategy_arguments", "exported_strategy_class",
           "is_registered_as", "strategy_from_args", "strategy_options"]

STRATEGIES = Registry("strategy")

_S = "shardkit.strategies"
STRATEGIES.register("single", f"{_S}.single:SingleDevice", aliases=("single_device",),
                    description="one device, no process group")
STRATEGIES.register("ddp", f"{_S}.ddp:DDP", aliases=("data_parallel",),
                    description="torch DistributedDataParallel: replicated weights, gradients all-reduced")
STRATEGIES.register("fsdp", f"{_S}.fsdp:FSDP", aliases=("fsdp2", "fully_shard"),
                    description="torch FSDP2 (fully_shard): parameters, gradients and optimizer state sharded")
STRATEGIES.register("tp", f"{_S}.tensor_parallel:TensorParallel", aliases=("tensor_parallel",),
                    description="DTensor tensor parallelism over tp_size ranks (default: all), 2-D with FSDP")
STRATEGIES.register("cp", f"{_S}.context_parallel:ContextParallel", aliases=("context_parallel",),
                    description="context parallelism: sequences split over cp_size ranks (ring or Ulysses "
                                "attention), FSDP2 over dp_shard x cp; tp_size > 1 adds tensor parallelism (CP x TP)")
STRATEGIES.register("ep", f"{_S}.expert_parallel:ExpertParallel", aliases=("expert_parallel",),
                    description="expert parallelism: each MoE layer's experts split over ep_size ranks (all-to-all "
                                "token dispatch), FSDP2 over every rank for the rest; cp_size > 1 splits sequences "
                                "too (EP x CP), tp_size > 1 the dense layers (EP x TP)")
STRATEGIES.register("pp", f"{_S}.pipeline:Pipeline", aliases=("pipeline", "pipeline_parallel"),
                    description="pipeline parallelism (torch.distributed.pipelining): layers split into stages "
                                "over pp_size ranks, GPipe/1F1B/interleaved/zero-bubble, DDP or FSDP2 (dp=fsdp) over "
                                "the rest")
STRATEGIES.register("zero1", f"{_S}.zero:ZeRO1", aliases=("zero_1", "deepspeed_stage_1"),
                    description="DeepSpeed ZeRO stage 1: optimizer state partitioned")
STRATEGIES.register("zero2", f"{_S}.zero:ZeRO2", aliases=("zero_2", "deepspeed_stage_2"),
                    description="DeepSpeed ZeRO stage 2: optimizer state and gradients partitioned")
STRATEGIES.register("zero3", f"{_S}.zero:ZeRO3", aliases=("zero_3", "deepspeed_stage_3"),
                    description="DeepSpeed ZeRO stage 3: parameters, gradients and optimizer state partitioned")
STRATEGIES.register("zero_infinity", f"{_S}.zero:ZeROInfinity", aliases=("zero-infinity", "infinity"),
                    description="ZeRO-3 with parameters and optimizer state on NVMe (default path: see ZeRO3)")


def exported_strategy_class(name: str) -> type | None:
    """The class registered under the class name ``name`` (``"ZeRO3"``), imported now; None if no entry's class has
    that name. What ``shardkit.X`` and ``shardkit.strategies.X`` serve lazily."""
    names = STRATEGIES.class_names()
    return STRATEGIES.get_class(names[name]) if name in names else None


def is_registered_as(strategy: Any, name: str) -> bool:
    """Whether ``strategy`` is an instance of exactly the class registered under ``name`` (a name, alias or class
    name; a subclass registered under its own name is not): how a config that names a strategy checks the object a
    user gave. Code outside this package asks a strategy's facts (``family``, ``dims``, ...) instead of its class."""
    return name in STRATEGIES and type(strategy) is STRATEGIES.get_class(name)


def add_strategy_arguments(parser: argparse.ArgumentParser, default: str = "auto", auto_help: str = "") -> None:
    """Add ``--strategy`` (choices: the registry's names; aliases accepted) and ``--strategy-opt KEY=VALUE``.

    Args:
        parser: the parser to add them to.
        default: the default strategy name ("auto" is offered as a choice when it is the default).
        auto_help: what "auto" means to this script.
    """
    extra = ("auto",) if default == "auto" else ()
    parser.add_argument("--strategy", default=default, type=STRATEGIES.argparse_type(*extra),
                        choices=[*extra, *STRATEGIES.names()],
                        help=f"default {default}{auto_help}; aliases: {', '.join(STRATEGIES.aliases())}")
    parser.add_argument("--strategy-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="a constructor argument of the strategy, repeatable: --strategy zero3 --strategy-opt "
                             "offload=cpu --strategy-opt overlap_comm=false (values: none, true/false, numbers, "
                             "JSON objects, text; checked against the strategy's signature)")


def strategy_options(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> dict[str, Any]:
    """``--strategy-opt`` values parsed and checked against ``--strategy``'s constructor.

    Call it right after parsing, so a bad option stops the script before any process starts. With
    ``parser``, a bad option is a usage error (exit 2) naming the option and the valid ones; without, a
    ValueError.
    """
    pairs = list(args.strategy_opt or [])
    try:
        if args.strategy == "auto":
            if pairs:
                raise ValueError("--strategy-opt needs a --strategy (auto picks one for you)")
            return {}
        return STRATEGIES.parse_options(args.strategy, pairs)
    except ValueError as e:
        if parser is None:
            raise
        parser.error(f"--strategy {args.strategy}: {e}")


def strategy_from_args(args: argparse.Namespace, **kwargs: Any) -> Any:
    """The strategy ``--strategy``/``--strategy-opt`` ask for, or None for "auto".

    Args:
        args: parsed arguments of a parser given :func:`add_strategy_arguments`.
        **kwargs: constructor arguments the script sets; ``--strategy-opt`` overrides them.
    """
    if args.strategy == "auto":
        return None
    return STRATEGIES.build_from_cli(args.strategy, list(args.strategy_opt or []), **kwargs)
