"""``shardkit estimate-memory``: per-device memory of every strategy for a model, and which one fits."""

from __future__ import annotations

import argparse
import sys

from shardkit.precision.registry import add_precision_argument
from shardkit.utils.parsing import float_range, int_range

from .estimate import (
    activation_bytes,
    activation_dtype,
    all_to_all_bytes,
    deepspeed_table,
    estimate_model_states,
    find_layout,
    layouts,
    listed_layouts,
    recommend,
)
from .model_spec import ModelSpec, parse_count, spec_from_hf_config

__all__ = ["register"]

GIB = 2**30
_RESERVE = 0.1  # of the device's memory, kept back for the allocator, the CUDA context and buffers
# NOTE: the largest jobs reported run ~100k accelerators; 10**6 per node or nodes refuses typos (and 10**400).
_MAX_DEVICES = 10**6


def _add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", help="total parameters, e.g. 2783M or 2.78B")
    src.add_argument("--config", help="a Hugging Face config.json (or its directory) of a decoder model")
    p.add_argument("--largest-layer-params", help="parameters of the largest layer (ZeRO-3), e.g. 131M")
    p.add_argument("--num-gpus", type=int_range(1, _MAX_DEVICES), default=1, help="GPUs per node (default 1)")
    p.add_argument("--num-nodes", type=int_range(1, _MAX_DEVICES), default=1, help="nodes (default 1)")
    p.add_argument("--strategy", default="all", type=_layout_name, choices=["all", *(x.name for x in layouts())],
                   help="one strategy (a registered name or alias, or a variant such as zero3_offload), or all "
                        "(default; includes DeepSpeed's ZeRO-2 and ZeRO-3 tables)")
    add_precision_argument(p, default="bf16")
    p.add_argument("--batch-size", type=int_range(1, 2**31), help="micro-batch per device, for the activation "
                                                                   "estimate")
    p.add_argument("--seq-len", type=int_range(1, 2**31), help="sequence length, for the activation estimate")
    p.add_argument("--activation-checkpointing", action="store_true", help="activations with checkpointing")
    p.add_argument("--cp-size", type=int_range(1, _MAX_DEVICES), default=1,
                   help="context-parallel ranks splitting each sequence (cp row)")
    p.add_argument("--tp-size", type=int_range(1, _MAX_DEVICES), default=1,
                   help="tensor-parallel ranks: the tp row's split (default: --num-gpus), and composed with "
                        "--cp-size (ContextParallel(cp_size, tp_size)) the cp row's activations also split over tp; "
                        "the ep row's ExpertParallel(tp_size=...) (dense layers split over tp)")
    p.add_argument("--ep-size", type=int_range(1, _MAX_DEVICES), default=None,
                   help="expert-parallel ranks splitting each MoE layer's experts: the ep row's model states and the "
                        "all-to-all buffers (default: every device, as ExpertParallel() splits); with --cp-size, "
                        "ExpertParallel's ep x cp (each rank dispatches seq_len / cp tokens of each sequence), with "
                        "--tp-size its ep x tp (each tp rank dispatches 1/tp of the assignments; ep a multiple of tp), "
                        "with both its ep x cp x tp (1/tp of each chunk's assignments; ep a multiple of cp x tp)")
    p.add_argument("--expert-tp", action="store_true",
                   help="with --tp-size > 1: the ep row's ExpertParallel(expert_tp=True), tensor parallelism inside "
                        "the experts (ep borrowed from dp_shard x cp only, so ep need not be a multiple of tp; each tp "
                        "rank holds its block of its ep slice; the all-to-all buffers add the tp peers' gathers)")
    p.add_argument("--pp-size", type=int_range(1, _MAX_DEVICES), default=None,
                   help="pipeline stages (pp row; default: --num-gpus)")
    p.add_argument("--microbatches", type=int_range(1, 2**20), default=None,
                   help="pipeline micro-batches per step (default: --gradient-accumulation-steps when over 1, else "
                        "pp, as the Pipeline strategy chooses)")
    p.add_argument("--gradient-accumulation-steps", type=int_range(1, 2**20), default=1,
                   help="the Runner's accumulation window: a pipeline's micro-batches when --microbatches is unset")
    p.add_argument("--pp-schedule", default="1f1b", choices=["gpipe", "1f1b"],
                   help="pipeline schedule for the activation estimate (in-flight micro-batches)")
    p.add_argument("--device-memory", help="memory per device, e.g. 80GB or 24GiB: recommend what fits")
    p.add_argument("--additional-buffer-factor", type=float_range(minimum=1.0, maximum=100.0), default=1.5,
                   help="DeepSpeed's tables' CPU factor (>= 1: extra room over the states, default 1.5)")


def _layout_name(text: str) -> str:
    """``--strategy``: "all", a row of the estimate, or a registered strategy's name or alias (its plain row)."""
    if text == "all":
        return text
    try:
        return find_layout(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _spec(args: argparse.Namespace) -> ModelSpec:
    if args.config:
        spec = spec_from_hf_config(args.config)
        if args.largest_layer_params:
            spec = ModelSpec(**{**spec.__dict__, "largest_layer_params": parse_count(args.largest_layer_params)})
        return spec
    return ModelSpec(parse_count(args.params), parse_count(args.largest_layer_params or 0))


def _strategy_rows(spec: ModelSpec, args: argparse.Namespace) -> list[str]:
    names = [x.name for x in listed_layouts()] if args.strategy == "all" else [args.strategy]
    cols = "".join(f"{c:>9}" for c in ("params", "grads", "optim", "states", "+working", "host", "nvme"))
    rows = [f"{'strategy':<16}{cols}  (GiB per device, {args.precision})"]
    ep_row = find_layout("ep").name
    for name in names:
        e = estimate_model_states(spec, name, num_gpus_per_node=args.num_gpus, num_nodes=args.num_nodes,
                                  precision=args.precision, pp_size=args.pp_size, ep_size=args.ep_size,
                                  tp_size=args.tp_size if args.tp_size > 1 else None,
                                  options=_ep_options(args) if name == ep_row else None)
        rows.append(f"{name:<16}{e.params / GIB:9.2f}{e.grads / GIB:9.2f}{e.optimizer / GIB:9.2f}"
                    f"{e.device_total / GIB:9.2f}{e.device_peak / GIB:9.2f}{e.host / GIB:9.2f}{e.nvme / GIB:9.2f}")
    return rows


def _ep_options(args: argparse.Namespace) -> dict[str, object]:
    """The ep row's strategy options the arguments select beyond its sizes: ``expert_tp`` with the tp size it
    splits the experts over."""
    return {"expert_tp": True, "tp_size": args.tp_size} if args.expert_tp else {}


def _parallel_rows(spec: ModelSpec, args: argparse.Namespace) -> list[str]:
    """Activations per rank under context parallelism and per pipeline stage, the pipeline's bubble, and an MoE's
    all-to-all buffers under expert parallelism."""
    from shardkit.strategies.pipeline import bubble_fraction

    rows = []
    cp_size = _cp_size(args)
    if _shows(args, "cp", args.cp_size > 1 or args.tp_size > 1) and (cp_size > 1 or args.tp_size > 1):
        cp = activation_bytes(spec, args.batch_size, args.seq_len, cp_size=cp_size, tp_size=args.tp_size)
        layout = " x ".join(f"{n} {s}" for n, s in (("cp", cp_size), ("tp", args.tp_size)) if s > 1)
        how = ", ".join(w for w, s in (("sequence split, load-balanced", cp_size),
                                       ("heads and MLP split", args.tp_size)) if s > 1)
        rows.append(f"Activations per rank under {layout} ({how}): {cp / GIB:.2f} GiB")
    # ExpertParallel()'s default ep: every rank it borrows from (dp_shard x cp, and x tp without expert_tp)
    ep = args.ep_size or args.num_gpus * args.num_nodes // (args.tp_size if args.expert_tp else 1)
    if _shows(args, "ep", args.ep_size is not None) and ep > 1 and spec.moe_top_k:
        # ExpertParallel(cp_size=...): each rank dispatches its chunk of every sequence, seq_len / cp tokens of each;
        # ExpertParallel(tp_size=...): the tp peers see the same tokens and each dispatches 1/tp of the assignments.
        # The tokens cross in the run's activation dtype: fp32 runs send 4 bytes a value, bf16/fp16 ones 2
        dtype = activation_dtype(args.precision)
        tokens = args.batch_size * (args.seq_len // args.cp_size)
        a2a = all_to_all_bytes(spec, args.batch_size, args.seq_len // args.cp_size, ep, dtype_bytes=dtype.itemsize,
                               tp_size=args.tp_size, expert_tp=args.expert_tp)
        layout = f"ep {ep}" + "".join(f" x {n} {s}" for n, s in (("cp", args.cp_size), ("tp", args.tp_size)) if s > 1)
        layout += " (expert_tp)" if args.expert_tp else ""
        size = f"top_k {spec.moe_top_k} x hidden {spec.hidden_size} x {dtype.itemsize} bytes " \
               f"({str(dtype).removeprefix('torch.')})"
        if args.expert_tp:
            share = -(-tokens * spec.moe_top_k // args.tp_size)
            how = (f"{a2a / GIB:.2f} GiB = (2 + 3 x {args.tp_size}) x {share} assignments (1/{args.tp_size} of "
                   f"{tokens} tokens x top_k, each tp rank's share) x hidden {spec.hidden_size} x {dtype.itemsize} "
                   f"bytes ({str(dtype).removeprefix('torch.')}): dispatch + combine of its share, and over tp the "
                   "all-gather of the dispatched rows, the sum of the partial outputs and the all-gather of the "
                   "outputs")
        elif args.tp_size > 1:
            share = -(-tokens * spec.moe_top_k // args.tp_size)
            how = (f"{a2a / GIB:.2f} GiB = (2 + {args.tp_size}) x {share} assignments (1/{args.tp_size} of {tokens} "
                   f"tokens x top_k, each tp rank's share) x hidden {spec.hidden_size} x {dtype.itemsize} bytes "
                   f"({str(dtype).removeprefix('torch.')}): dispatch + combine of its share, and the tp all-gather "
                   "of the outputs")
        else:
            how = f"{a2a / GIB:.2f} GiB = 2 x {tokens} tokens x {size}"
        rows.append(f"All-to-all buffers per rank under {layout} (dispatch + combine, one MoE layer in flight, "
                    f"balanced routing): {how}")
    pp = args.pp_size or args.num_gpus
    if _shows(args, "pp", args.pp_size is not None) and pp > 1:
        m = args.microbatches or (args.gradient_accumulation_steps if args.gradient_accumulation_steps > 1 else pp)
        stage = activation_bytes(spec, args.batch_size, args.seq_len, pp_size=pp, microbatches=m,
                                 schedule=args.pp_schedule)
        rows.append(f"Activations per pipeline stage (pp {pp}, {m} micro-batches, {args.pp_schedule}): "
                    f"{stage / GIB:.2f} GiB; bubble (pp-1)/(m+pp-1) = {bubble_fraction(pp, m):.0%} of a step")
    return rows


def _shows(args: argparse.Namespace, row: str, sized: bool) -> bool:
    """Whether the ``row`` ("cp", "ep" or "pp") activation line applies: its strategy is the one asked for (or all), or
    its size was given explicitly (``--cp-size 4 --strategy pp`` still shows cp's split)."""
    return args.strategy in ("all", row) or sized


def _cp_size(args: argparse.Namespace) -> int:
    """--cp-size, or under ``--strategy cp`` without it every device over tp, as ContextParallel() splits."""
    if args.strategy == "cp" and args.cp_size == 1:
        return max(1, args.num_gpus * args.num_nodes // args.tp_size)
    return args.cp_size


def _check_layout(spec: ModelSpec, args: argparse.Namespace) -> None:
    """--cp-size x --tp-size must divide the devices, and tp the heads (the mesh's own checks); --ep-size the
    devices, and with --cp-size or --tp-size the rule of the expert-parallel strategy that composes them."""
    from shardkit.strategies.parallel_dims import ParallelDims

    devices = args.num_gpus * args.num_nodes
    if args.ep_size is not None and devices % args.ep_size:
        raise ValueError(f"--ep-size {args.ep_size} does not divide the {devices} device(s): each expert-parallel "
                         "group is ep ranks of the data-parallel ones")
    if args.expert_tp and (args.tp_size == 1 or args.strategy not in ("all", find_layout("ep").name)):
        raise ValueError("--expert-tp is ExpertParallel's tensor parallelism inside the experts: give --tp-size > 1 "
                         "and --strategy ep (or all)")
    if args.cp_size == 1 and args.tp_size == 1:
        return
    ep = (f" --ep-size {args.ep_size}" if args.ep_size else "") + (" --expert-tp" if args.expert_tp else "")
    where = f"--cp-size {args.cp_size} --tp-size {args.tp_size}{ep} on {devices} device(s)"
    # without --expert-tp ep must be a multiple of tp; the other layout lifts that
    hint = "" if args.expert_tp or args.tp_size == 1 else (
        " (or --expert-tp: ExpertParallel(expert_tp=True), ep borrowed from dp_shard x cp only)")
    if args.ep_size not in (None, 1):
        try:  # the ep row's strategy refuses what it cannot compose, by name
            find_layout("ep").build(ep_size=args.ep_size, cp_size=args.cp_size, tp_size=args.tp_size,
                                    expert_tp=args.expert_tp)
        except ValueError as err:
            raise ValueError(f"{where}: {err}{hint}") from None
    try:
        # ep composes with cp and tp in one strategy (ExpertParallel(cp_size=..., tp_size=...)) and follows its rule:
        # ep borrows every cp and tp rank (every cp rank with expert_tp), so it must be a multiple of cp x tp (cp)
        ParallelDims(cp=args.cp_size, tp=args.tp_size, ep=args.ep_size or 1,
                     expert_tp=args.expert_tp).resolve(devices)
        ParallelDims(dp_shard=1, tp=args.tp_size).validate(num_heads=spec.num_heads or None,
                                                           num_kv_heads=spec.num_kv_heads or None)
    except ValueError as err:
        raise ValueError(f"{where}: {err}{hint}") from None


def _header(spec: ModelSpec, args: argparse.Namespace) -> str:
    n = args.num_gpus * args.num_nodes
    if spec.largest_layer_params:
        largest = f"largest layer {spec.largest_layer_params / 1e6:.0f}M"
    else:
        largest = "largest layer unknown"
        print("warning: --largest-layer-params not given, so ZeRO-3 rows count the layer each device gathers whole "
              "as 0 and show too little (the per-GPU 0.00 of offload_param=cpu). It is usually the embedding, "
              "vocab x hidden (131M for a 7B Llama with a 32000 vocabulary): pass --largest-layer-params or "
              "--config config.json", file=sys.stderr)
    active = "" if spec.active_params is None else f" ({spec.active_params / 1e6:.0f}M active per token)"
    return (f"Model: {spec.total_params / 1e6:.0f}M params{active}, {largest}; {args.num_nodes} node(s) x "
            f"{args.num_gpus} device(s) = {n}. Sizes in GiB (2^30 bytes).")


def _run(args: argparse.Namespace) -> int:
    try:
        spec = _spec(args)
        _check_layout(spec, args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(_header(spec, args))
    for stage, rows in ((2, ("all", "zero2", "zero2_offload")), (3, ("all", "zero3", "zero3_offload",
                                                                     "zero_infinity"))):
        if args.strategy in rows:
            table = deepspeed_table(stage, spec.total_params, spec.largest_layer_params, args.num_gpus,
                                    args.num_nodes, args.additional_buffer_factor, unit="GiB")
            print(f"\nDeepSpeed ZeRO-{stage} (DeepSpeed's own table; it labels these GiB as GB):\n{table}")
    print("\nModel states (Adam):")
    print("\n".join(_strategy_rows(spec, args)))
    if args.batch_size and args.seq_len:
        if not spec.has_shape:
            print("\nActivations: need --config (the model's shape), not a bare --params")
        else:
            plain = activation_bytes(spec, args.batch_size, args.seq_len)
            ckpt = activation_bytes(spec, args.batch_size, args.seq_len, checkpointing=True)
            print(f"\nActivations per device (batch {args.batch_size} x seq {args.seq_len}, 16-bit): "
                  f"{plain / GIB:.2f} GiB; with activation checkpointing {ckpt / GIB:.2f} GiB")
            print("\n".join(_parallel_rows(spec, args)))
    if args.device_memory:
        from shardkit.checkpoint.consolidate import parse_size

        memory = parse_size(args.device_memory)
        best, peaks = recommend(spec, memory, num_gpus_per_node=args.num_gpus, num_nodes=args.num_nodes,
                                precision=args.precision, batch_size=args.batch_size, seq_len=args.seq_len,
                                checkpointing=args.activation_checkpointing, reserve=_RESERVE)
        print(f"\nRecommended for {args.device_memory} per device: "
              f"{best or 'nothing fits: add devices, offload to NVMe or lower the batch'}")
        activations = bool(args.batch_size and args.seq_len and spec.has_shape)
        print(_why(best, peaks, args.device_memory, memory, args.strategy, activations))
    return 0


def _why(best: str | None, peaks: dict[str, int], device_memory: str, memory: int, asked: str,
         activations: bool) -> str:
    """The constraint that decided the recommendation: which strategies' peaks exceed the budget, and why ``best``
    rather than the strategy asked about."""
    budget = memory * (1 - _RESERVE)
    gib = {name: f"{peak / GIB:.2f} GiB" for name, peak in peaks.items()}
    head = (f"  why: the peak per device (model states + working set{' + activations' if activations else ''}) "
            f"must fit {device_memory} less a {_RESERVE:.0%} reserve = {budget / GIB:.2f} GiB; strategies are tried "
            "from least sharded (least communication) to most")
    over = [n for n in peaks if peaks[n] > budget and (best is None or list(peaks).index(n) < list(peaks).index(best))]
    lines = [head]
    if over:
        lines.append("  does not fit: " + ", ".join(f"{n} ({gib[n]})" for n in over))
    if best is not None:
        lines.append(f"  {best} is the first that fits ({gib[best]})")
    if asked not in ("all", best) and asked in peaks:
        if peaks[asked] > budget:
            lines.append(f"  {asked}, which you asked about, does not fit: {gib[asked]} per device")
        else:
            lines.append(f"  {asked}, which you asked about, fits too ({gib[asked]}); {best} shards less, so it "
                         "communicates less per step")
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``estimate-memory``; its ``func`` default takes the parsed args and returns the exit code."""
    p = subparsers.add_parser("estimate-memory", help="per-device memory of each strategy; what fits",
                              description=__doc__.splitlines()[0])
    _add_arguments(p)
    p.set_defaults(func=_run)
    return p
