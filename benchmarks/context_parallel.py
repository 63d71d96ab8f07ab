"""Context parallelism: activation bytes per rank against sequence length (cp = 1, 2, 4, and cp x tp), the longest
sequence under a per-rank activation budget, step time of ring and Ulysses, and torch's experimental CP API where
it runs.

    .venv/bin/python benchmarks/context_parallel.py --seqs 256 512 1024 --budget-mib 64
    .venv/bin/python benchmarks/context_parallel.py --seqs 1024 2048 --cps 1 2 4 --tps 1 2   # + cp 2 x tp 2
    .venv/bin/python benchmarks/context_parallel.py --vs-torch   # against torch's context_parallel (CUDA), see
                                                                # benchmarks/context_parallel_vs_torch.py

Activation bytes are the tensors autograd saves for backward during one forward (counted through
``torch.autograd.graph.saved_tensors_hooks``, storage by storage), on each rank: what context parallelism
divides. Counted, not RSS: on a CPU RSS hides the split behind the allocator. cp = 1 ("none") is the same model
under FSDP2 on one rank (no split, SDPA attention); cp = 2 and 4 run as 2 and 4 gloo processes; cp x tp
(``--tps 2``) as ``ContextParallel(cp_size, tp_size)`` on cp * tp processes, next to what
``shardkit estimate-memory --cp-size --tp-size`` predicts for the same model (its ratio to cp = 1).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))

from harness import run_distributed  # noqa: E402

from shardkit import Runner  # noqa: E402
from shardkit.models import Llama, LlamaConfig  # noqa: E402

CONFIG = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_layers=4, num_heads=4,
                     max_position=65536, tie_embeddings=False, fused=False)


def _saved_bytes(fn) -> tuple[int, torch.Tensor]:
    from shardkit.strategies._dtensor import local_tensor

    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = local_tensor(t).untyped_storage()  # a DTensor (TP's weights) is counted by its local part
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _measure(mode: str, seqs: list[int], steps: int, tp: int = 1) -> dict:
    from shardkit.strategies import FSDP
    from shardkit.strategies.context_parallel import ContextParallel

    runner = Runner(ContextParallel(cp_mode=mode, tp_size=tp) if mode != "none" else FSDP(), seed=0)
    with runner.init_module():
        model = Llama(CONFIG)
    model, opt = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    out = {}
    for seq in seqs:
        x = torch.randint(0, CONFIG.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
        saved, loss = _saved_bytes(lambda: model(x, labels=x))
        runner.backward(loss)
        runner.step()
        times = []
        for _ in range(steps):
            runner.barrier()
            start = time.perf_counter()
            loss = model(x, labels=x)
            runner.backward(loss)
            runner.step()
            times.append(time.perf_counter() - start)
        out[seq] = {"saved": saved, "step_s": sorted(times)[len(times) // 2], "loss": loss.item()}
    return out


def _torch_cp_probe() -> str:
    """Whether torch's experimental context_parallel runs here, used as documented: the buffers it shards in place
    are inputs (no grad); attention goes through F.scaled_dot_product_attention. On CPU SDPA dispatches
    ``aten._scaled_dot_product_flash_attention_for_cpu``, which it has no ring handler for (torch 2.13)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("cp",))
    x = torch.randn(1, 4, 64, 32)
    proj = torch.nn.Linear(32, 32)
    try:
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
            q = proj(x)
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        return "ran"
    except Exception as err:  # noqa: BLE001 - reported as the finding
        return f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"


def worker(modes: list[str], seqs: list[int], steps: int, tp: int = 1) -> dict:
    out = {mode: _measure(mode, seqs, steps, tp) for mode in modes}
    if torch.distributed.get_world_size() > 1 and tp == 1:
        out["torch_cp"] = _torch_cp_probe()
    return out


def _longest(saved_per_token: float, budget: int, step: int) -> int:
    return int(budget / saved_per_token) // step * step


def _layouts(cps: list[int], tps: list[int]) -> list[tuple[int, int]]:
    """(cp, tp) pairs to run: every cp alone, and cp x tp for cp > 1 on at most max(cps) ranks (tp alone is
    TensorParallel, not measured)."""
    return [(cp, tp) for cp in cps for tp in tps if tp == 1 or 1 < cp and cp * tp <= max(cps)]


def _estimated_ratio(cp: int, tp: int, seq: int) -> float:
    from shardkit.memory.estimate import activation_bytes
    from shardkit.memory.model_spec import spec_from_llama_config

    spec = spec_from_llama_config(CONFIG)  # fp32 here: 4 bytes a value
    return activation_bytes(spec, 1, seq, cp_size=cp, tp_size=tp, dtype_bytes=4) / activation_bytes(spec, 1, seq,
                                                                                                     dtype_bytes=4)


def _name(cp: int, tp: int) -> str:
    return f"cp={cp}" + (f" x tp={tp}" if tp > 1 else "")


def _print_table(results: dict, seqs: list[int]) -> None:
    print("| seq | " + " | ".join(f"{_name(*k)} {m} saved MiB (x of cp=1; estimate x) / step s" for k in results
                                 for m in results[k] if m != "torch_cp") + " |")
    for seq in seqs:
        base = results[(1, 1)]["none"][seq]["saved"]
        cells = []
        for (cp, tp), per_layout in results.items():
            for mode, per in per_layout.items():
                if mode == "torch_cp":
                    continue
                r = per[seq]
                cells.append(f"{r['saved'] / 2**20:.1f} ({r['saved'] / base:.2f}; {_estimated_ratio(cp, tp, seq):.2f})"
                             f" / {r['step_s']:.3f}")
        print(f"| {seq} | " + " | ".join(cells) + " |")


def main() -> None:
    if "--vs-torch" in sys.argv[1:]:  # step time against torch's context_parallel: its own script and options
        from context_parallel_vs_torch import main as vs_torch

        vs_torch([a for a in sys.argv[1:] if a != "--vs-torch"])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tps", type=int, nargs="+", default=[1],
                        help="tensor-parallel sizes composed with cp > 1 (a cp x tp layout runs only where cp x tp <= "
                             "the largest --cps: that many ranks are launched)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget-mib", type=float, default=64.0, help="per-rank activation budget for 'longest'")
    args = parser.parse_args()
    if 1 not in args.cps:
        parser.error("--cps must include 1: the baseline every ratio is taken against")
    results = {(cp, tp): run_distributed(worker, world_size=cp * tp, timeout=3000, args=(
        ["ring", "ulysses"] if cp > 1 else ["none"], args.seqs, args.steps, tp))[0]
        for cp, tp in _layouts(args.cps, args.tps)}
    print(f"model hidden {CONFIG.hidden_size}, {CONFIG.num_layers} layers, batch 1, fp32; saved = activation bytes "
          "per rank (rank 0)")
    _print_table(results, args.seqs)
    budget = args.budget_mib * 2**20
    last = args.seqs[-1]
    for (cp, tp), per_layout in results.items():
        for mode, per in per_layout.items():
            if mode != "torch_cp":
                print(f"longest sequence under {args.budget_mib:.0f} MiB of activations per rank, {_name(cp, tp)} "
                      f"{mode}: ~{_longest(per[last]['saved'] / last, budget, 2 * cp)} tokens (linear from seq {last})")
        if "torch_cp" in per_layout:
            print(f"torch.distributed.tensor.experimental.context_parallel on {cp} CPU ranks: {per_layout['torch_cp']}")


if __name__ == "__main__":
    main()
