"""Generation on 2 ranks: decoding speed under ZeRO-3 and FSDP against SingleDevice and the raw engines, and the
bytes each rank holds in ZeRO inference with CPU and NVMe offload against DDP.

    python benchmarks/inference.py [--hidden 256 --layers 4 --batch 4 --prompt 32 --new 32 --rounds 3 --mem-hidden 512]

speed: a Hugging Face LlamaForCausalLM built from a config (random weights, nothing downloaded), greedy,
``--batch`` prompts of ``--prompt`` tokens per rank, ``--new`` new tokens (no EOS). Tokens/s counts the new
tokens of every rank over the wall time. "raw" is DeepSpeed's engine built by ``deepspeed.initialize`` with the
same config shardkit builds and driven directly with ``model.generate(synced_gpus=True)``, and torch FSDP2
(``fully_shard`` per decoder layer) with the same call; shardkit is ``runner.generate``. ZeRO-3 runs one engine
per pair of processes, whole runs alternating (raw, shardkit, shardkit, raw); the FSDP rows alternate rounds
(raw then shardkit, shardkit then raw, ...) in the same 2 processes. SingleDevice runs alone in 1 process.
memory: ``strategy.model_state_bytes`` of each rank (bytes held in memory, host or device) after the model is
built in ``runner.init_module()``, ``runner.setup(model)`` without an optimizer and one generate; "on NVMe"
is the parameter partitions DeepSpeed swapped out (partitions under 1 MiB stay in memory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from _timing import machine_description, print_table, ranks_timed

import shardkit
from shardkit import Runner
from shardkit.distributed.process_group import init_distributed
from shardkit.strategies import strategy_from_name

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _hf_model(args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
                      num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 32),
                      max_position_embeddings=args.prompt + args.new, pad_token_id=0, eos_token_id=None,
                      bos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def _prompts(args: argparse.Namespace) -> torch.Tensor:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return torch.randint(1, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(rank))


def _gen_kwargs(args: argparse.Namespace) -> dict:
    return {"max_new_tokens": args.new, "min_new_tokens": args.new, "do_sample": False, "pad_token_id": 0}


def _raw_deepspeed(args, ids, ds_config):
    import deepspeed

    engine, *_ = deepspeed.initialize(model=_hf_model(args), config=ds_config)
    return lambda: engine.module.generate(ids, synced_gpus=True, **_gen_kwargs(args))


def _raw_fsdp(args, ids):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _hf_model(args)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return lambda: model.generate(ids, synced_gpus=True, **_gen_kwargs(args))


def _ours(args, ids, name: str, **generate_kwargs):
    runner = Runner(strategy_from_name(name), seed=0)
    model = runner.setup(_hf_model(args))
    return runner, (lambda: runner.generate(model, ids, **_gen_kwargs(args), **generate_kwargs))


def _alternate(raw, ours, args) -> dict:
    for fn in (raw, ours):
        ranks_timed(fn, 1)  # warm-up: lazy inits, engine hooks, first all-gathers
    times = {"raw": [], "ours": []}
    for i in range(args.rounds):
        order = (("raw", raw), ("ours", ours)) if i % 2 == 0 else (("ours", ours), ("raw", raw))
        for key, fn in order:  # who goes first alternates: neither always runs on a warmer (or busier) machine
            times[key].append(ranks_timed(fn, 1))
    return times


def zero3_worker(driver: str, args: argparse.Namespace) -> list[float]:
    """One ZeRO-3 engine in this process, raw DeepSpeed or shardkit's, timed over ``args.rounds`` generations.

    NOTE: one engine per process. With two ZeRO-3 engines in one process the one built second was measured
    1.3-1.5x slower in 2 of 3 runs (ratios 0.65, 0.77, 1.11 with shardkit's first; 1.03 with the raw one first).
    """
    init_distributed("cpu")
    ids = _prompts(args)
    if driver == "raw":  # from the config shardkit's strategy gives for this model
        config = Runner(strategy_from_name("zero3"), seed=0).strategy.deepspeed_config(_hf_model(args))
        fn = _raw_deepspeed(args, ids, config)
    else:
        fn = _ours(args, ids, "zero3")[1]
    ranks_timed(fn, 1)  # warm-up: lazy inits, engine hooks, first all-gathers
    return [ranks_timed(fn, 1) for _ in range(args.rounds)]


def speed_worker(args: argparse.Namespace) -> dict:
    init_distributed("cpu")
    ids = _prompts(args)
    results = {}
    raw_fsdp = _raw_fsdp(args, ids)
    results["fsdp (kept unsharded)"] = _alternate(raw_fsdp, _ours(args, ids, "fsdp")[1], args)
    results["fsdp (per forward)"] = _alternate(raw_fsdp, _ours(args, ids, "fsdp", keep_unsharded=False)[1], args)
    ddp = _ours(args, ids, "ddp")[1]
    ranks_timed(ddp, 1)
    results["ddp"] = {"ours": [ranks_timed(ddp, 1) for _ in range(args.rounds)]}
    return results


def single_worker(args: argparse.Namespace) -> list[float]:
    runner = Runner(strategy_from_name("single"), seed=0)
    model = runner.setup(_hf_model(args))
    ids = _prompts(args)
    runner.generate(model, ids, **_gen_kwargs(args))
    out = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        runner.generate(model, ids, **_gen_kwargs(args))
        out.append(time.perf_counter() - start)
    return out


def run_speed(args: argparse.Namespace) -> None:
    single = statistics.median(shardkit.launch(single_worker, args=(args,), num_processes=1)[0])
    zero3 = {"raw": [], "ours": []}
    for i in range(2):  # whole processes alternate: raw, ours, then ours, raw
        for driver in ("raw", "ours")[:: 1 if i == 0 else -1]:
            zero3[driver] += shardkit.launch(zero3_worker, args=(driver, args), num_processes=2)[0]
    results = {"zero3 (one engine per process)": zero3,
               **shardkit.launch(speed_worker, args=(args,), num_processes=2)[0]}
    single_tps = args.batch * args.new / single
    print(f"\ndecoding, HF Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}, {args.batch} prompts x "
          f"{args.prompt} tokens per rank, {args.new} new tokens, greedy, fp32, CPU (gloo); medians of {args.rounds}")
    print(machine_description())
    rows = [["single (1 rank)", "", f"{single_tps:,.0f}", "1.00", ""]]
    for name, times in results.items():
        ours = statistics.median(times["ours"])
        tps = 2 * args.batch * args.new / ours
        raw_cells = ["", ""]
        if "raw" in times:
            raw = statistics.median(times["raw"])
            raw_cells = [f"{2 * args.batch * args.new / raw:,.0f}", f"{raw / ours:.2f}"]
        rows.append([f"{name} (2 ranks)", raw_cells[0], f"{tps:,.0f}", f"{tps / single_tps:.2f}", raw_cells[1]])
    print_table(["mode", "raw engine tok/s", "shardkit tok/s", "vs single", "vs raw (>1: faster)"], rows)


def memory_worker(name: str, kwargs: dict, args: argparse.Namespace) -> dict:
    from shardkit.models import Llama, LlamaConfig

    runner = Runner(strategy_from_name(name, **kwargs), seed=0)
    hidden = args.mem_hidden
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 8 * 8,
                      num_layers=args.layers, num_heads=max(1, hidden // 32), max_position=args.prompt + args.new)
    with runner.init_module():  # ZeRO-3: built partitioned (and offloaded) from the start
        model = Llama(cfg)
    psi = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    model = runner.setup(model)
    ids = _prompts(args)[:1]
    runner.generate(model, ids, max_new_tokens=2)  # bytes after a generation, parameters released again
    counted = runner.strategy.model_state_bytes(model, None)
    params = list(runner.unwrap_model(model).parameters())
    counted["nvme"] = sum(p.ds_tensor.ds_numel * p.element_size() for p in params if hasattr(p, "ds_tensor")
                          and str(getattr(p.ds_tensor, "final_location", "")).endswith("nvme"))
    runner.teardown()
    return {"psi": psi, **counted}


def run_memory(args: argparse.Namespace) -> None:
    nvme = tempfile.mkdtemp(prefix="shardkit-inference-bench-")
    cases = [("ddp", "ddp", {}), ("zero3", "zero3", {}), ("zero3 offload cpu", "zero3", {"offload_params": "cpu"}),
             ("zero_infinity nvme", "zero_infinity", {"nvme_path": nvme, "offload_optimizer": None,
                                                      "buffer_size": args.nvme_buffer})]
    rows, ddp_total = [], None
    for label, name, kwargs in cases:
        r = shardkit.launch(memory_worker, args=(name, kwargs, args), num_processes=2)[0]
        total = r["params"] + r["grads"] + r["optimizer"]
        ddp_total = ddp_total or total
        rows.append([label, f"{r['params'] / 2**20:.2f}", f"{r['grads'] / 2**20:.2f}", f"{r['optimizer'] / 2**20:.2f}",
                     f"{total / 2**20:.2f}", f"{total / ddp_total:.3f}", f"{total / r['psi']:.2f}",
                     f"{r['nvme'] / 2**20:.2f}"])
    print(f"\nmodel-state bytes per rank after setup(model) with no optimizer and one generate, shardkit Llama "
          f"hidden={args.mem_hidden} layers={args.layers} vocab={args.vocab} (Ψ parameters), 2 ranks, fp32")
    print_table(["strategy", "params MiB", "grads MiB", "optimizer MiB", "total held MiB", "vs ddp", "bytes/Ψ",
                 "on NVMe MiB"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    # DeepSpeed swaps a partition to NVMe only from 1 MiB up: at 512 the MLP weights' halves (348k fp32) are swapped
    parser.add_argument("--mem-hidden", type=int, default=512, help="hidden size of the memory figure's model")
    parser.add_argument("--nvme-buffer", type=int, default=1_000_000, help="elements per NVMe swap buffer")
    parser.add_argument("--only", choices=["speed", "memory"], default=None)
    args = parser.parse_args()
    if args.only != "memory":
        run_speed(args)
    if args.only != "speed":
        run_memory(args)


if __name__ == "__main__":
    main()
