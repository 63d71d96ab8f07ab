"""MoE: shardkit's grouped experts against transformers' own on the same Qwen3-MoE model and data, and the step time of
expert parallelism on 2 ranks against one process.

    python benchmarks/moe.py blocks [--dtypes fp32 bf16] [--tokens 1024] [--rounds 5] [--device cuda]
    python benchmarks/moe.py ep [--rounds 3 --steps 2]
    python benchmarks/moe.py            # both

blocks: one forward+backward of a Hugging Face Qwen3-MoE model built from a config (no download; 2 layers, hidden
256, 16 experts of 256, top-4) per step, for each dtype in one run, under:

- ``hf_eager``: transformers' loop over the experts that were hit (``set_experts_implementation("eager")``);
- ``hf_grouped_mm``: transformers 5's default experts implementation (``grouped_mm``: ``torch._grouped_mm``
  where its check allows, else its own loop op with a hand-written backward);
- ``shardkit_<backend>``: the same model with :func:`shardkit.models.moe_hf.use_grouped_experts` (``auto``: the
  per-expert loop engine on CPU, the grouped GEMM on GPUs where it works; ``grouped_mm``: one grouped GEMM of every
  expert; ``bmm``: padded).

transformers' ``batched_mm`` is left out: it gathers an (H x 2I) weight matrix per assignment (2 GiB here).
Variants take turns, one step each per round; the figure is the median step. Peak memory, two views of one more
step: ``tensors`` is the most bytes of tensors allocated at once during it over what was live before (the profiler's
allocation events, on CPU and CUDA alike: the allocator's view), ``RSS`` (CPU) the resident-set high-water mark it
adds (``_timing.peak_memory``; it misses blocks under the 1 MiB mmap threshold that earlier steps left resident,
which flatters per-expert loops with small chunks). Each variant's loss is checked against ``hf_eager``'s.

ep: a MoE Llama (hidden 256, 4 layers, the last 3 MoE with 16 experts of 256, top-4, one shared expert), AdamW,
the same global batch (2 x ``--batch`` sequences of ``--seq``) per step in three ways that take turns in each round:
one process with the whole batch (EP 1, no parallelism), ``Runner(strategy="fsdp")`` on 2 ranks (the experts
sharded by FSDP2, EP 1) and ``Runner(strategy="ep")`` on 2 ranks (``ep_size=2``: each rank computes half the
experts for both ranks' tokens, all-to-all). gloo on CPU.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from _timing import (
    ensure_malloc_returns_memory,
    fmt_bytes,
    machine_description,
    peak_memory,
    print_table,
    ranks_timed,
    sync,
)

import shardkit
from shardkit.models.moe_experts import grouped_mm_works
from shardkit.models.moe_hf import use_grouped_experts

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_qwen3_moe(device: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=16, num_experts_per_tok=4, max_position_embeddings=4096)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).to(device=device, dtype=dtype)


def tensor_peak(fn, device: str) -> int:
    """Most bytes of tensors ``fn()`` holds at once on ``device`` over what was live before, from the profiler's
    allocation and free events (exact, and blind to allocator caching and page residency)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        fn()
        sync(device)
    want = torch.device(device).type
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == torch._C._profiler._EventType.Allocation and node.extra_fields.device.type == want:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
    events.sort()
    live = peak = 0
    for _, size in events:
        live += size
        peak = max(peak, live)
    return peak


def block_variants(base: torch.nn.Module, device: str, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    names = ["hf_eager", "hf_grouped_mm", "shardkit_auto", "shardkit_bmm"]
    if grouped_mm_works(torch.device(device).type, dtype):
        names.insert(3, "shardkit_grouped_mm")
    variants = {}
    for name in names:
        model = copy.deepcopy(base)
        if name == "hf_eager":
            model.set_experts_implementation("eager")
        elif name == "hf_grouped_mm":
            model.set_experts_implementation("grouped_mm")
        else:
            use_grouped_experts(model, backend=name.removeprefix("shardkit_"))
        variants[name] = model
    return variants


def run_blocks(args: argparse.Namespace) -> None:
    print(machine_description(args.device))
    ids = torch.randint(0, 1024, (args.tokens // 512, 512), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        variants = block_variants(build_qwen3_moe(args.device, dtype), args.device, dtype)
        steps, losses = {}, {}
        for name, model in variants.items():
            def step(model=model):
                model.zero_grad(set_to_none=True)
                loss = model(ids, labels=ids).loss
                loss.backward()
                return loss.detach()

            steps[name] = step
            losses[name] = float(step())  # also the warm-up
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, step in steps.items():
                sync(args.device)
                t0 = time.perf_counter()
                step()
                sync(args.device)
                times[name].append(time.perf_counter() - t0)
        rows = []
        base_name = "hf_grouped_mm"
        med = {name: statistics.median(t) for name, t in times.items()}
        peaks, rss = {}, {}
        for name, model in variants.items():
            model.zero_grad(set_to_none=True)
            peaks[name] = tensor_peak(steps[name], args.device)
            rss[name] = None
            if torch.device(args.device).type == "cpu":
                rss[name] = peak_memory(steps[name], args.device,
                                        setup=lambda model=model: model.zero_grad(set_to_none=True))
        for name in variants:
            rows.append([name, f"{args.tokens / med[name]:,.0f}", f"{med[name] * 1e3:.1f}",
                         f"{med[base_name] / med[name]:.2f}x", fmt_bytes(peaks[name]),
                         f"{peaks[name] / peaks[base_name]:.2f}x", fmt_bytes(rss[name]),
                         f"{abs(losses[name] - losses['hf_eager']):.1e}"])
        print(f"\nQwen3-MoE 2 layers, hidden 256, 16 experts x 256, top-4; {args.tokens} tokens per step, "
              f"{dtype_name}, "
              f"{args.rounds} rounds (median); grouped_mm usable here: "
              f"{grouped_mm_works(torch.device(args.device).type, dtype)}")
        print_table(["variant", "tokens/s", "step ms", f"speed vs {base_name}", "peak tensors",
                     f"vs {base_name}", "peak RSS", "|loss - hf_eager|"], rows)


def _moe_llama_config():
    from shardkit.models import LlamaConfig

    return LlamaConfig(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, max_position=1024,
                       vocab_size=1024, moe=dict(num_experts=16, top_k=4, intermediate_size=256, num_shared_experts=1,
                                                 first_dense_layers=1))


def ep_worker(args: argparse.Namespace) -> dict:
    from shardkit import Runner
    from shardkit.distributed.process_group import init_distributed
    from shardkit.models import Llama
    from shardkit.strategies import strategy_from_name

    if args.threads:
        torch.set_num_threads(args.threads)
    init_distributed("cpu")
    rank = dist.get_rank()
    config = _moe_llama_config()
    whole = torch.randint(0, config.vocab_size, (2 * args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    mine = whole[rank * args.batch:(rank + 1) * args.batch]
    steps = {}
    for name in ("fsdp", "ep"):
        runner = Runner(strategy_from_name(name), seed=0)
        torch.manual_seed(0)
        model = Llama(config)
        model, optimizer = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

        def step(runner=runner, model=model):
            runner.backward(model(mine, labels=mine))
            runner.step()

        steps[name] = step
    torch.manual_seed(0)
    single = Llama(config)
    single_opt = torch.optim.AdamW(single.parameters(), lr=1e-4)

    def one_process():
        # rank 0 alone with the whole batch; rank 1 waits at the barriers of ranks_timed
        if rank == 0:
            single(whole, labels=whole).backward()
            single_opt.step()
            single_opt.zero_grad(set_to_none=True)

    steps["one process"] = one_process
    for step in steps.values():
        ranks_timed(step, 1)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            times[name].append(ranks_timed(step, args.steps))
    return times


def run_ep(args: argparse.Namespace) -> None:
    times = shardkit.launch(ep_worker, args=(args,), num_processes=2)[0]
    med = {name: statistics.median(t) for name, t in times.items()}
    tokens = 2 * args.batch * args.seq
    print(f"\nMoE Llama hidden 256, 4 layers (3 MoE: 16 experts x 256, top-4, 1 shared), fp32 AdamW; {tokens} tokens "
          f"per step in all; {args.rounds} rounds x {args.steps} steps (median); gloo, CPU")
    rows = [[name, f"{med[name] * 1e3:.1f}", f"{tokens / med[name]:,.0f}", f"{med['one process'] / med[name]:.2f}x",
             f"{med['fsdp'] / med[name]:.2f}x"] for name in ("one process", "fsdp", "ep")]
    print_table(["layout", "step ms", "tokens/s", "speed vs one process", "speed vs fsdp (EP 1)"], rows)


def main() -> None:
    ensure_malloc_returns_memory()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["blocks", "ep", "all"], default="all")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="ep: steps per timed round")
    parser.add_argument("--batch", type=int, default=2, help="ep: sequences per rank")
    parser.add_argument("--seq", type=int, default=256, help="ep: sequence length")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per process (0: torch's default); 1 on a shared, loaded machine, where "
                             "threads waiting on each other at every op's barrier swamp the comparison")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mode in ("blocks", "all"):
        run_blocks(args)
    if args.mode in ("ep", "all"):
        run_ep(args)


if __name__ == "__main__":
    main()
