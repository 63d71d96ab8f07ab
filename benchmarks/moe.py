"""MoE expert blocks: shardkit's grouped experts against transformers' own, on the same Qwen3-MoE model and data.

Run: ``python benchmarks/moe.py [--device cuda] [--dtype bf16] [--tokens 2048]`` (about a minute on CPU).

One forward+backward of a Hugging Face Qwen3-MoE model built from a config (no download; 2 layers, 16 experts,
top-4) per step, under:

- ``hf_eager``: transformers' loop over the experts that were hit (``set_experts_implementation("eager")``);
- ``hf_grouped_mm``: transformers 5's default (``grouped_mm``; on CPU its own fallback op);
- ``shardkit_<backend>``: the same model with :func:`shardkit.models.moe_hf.use_grouped_experts` (``auto``: the
  grouped GEMM where it works on the device and dtype, else the loop; ``bmm``: padded batched matmul; ``loop``).

Tokens/s is the median step; peak is what one step adds over what was live before it (``_timing.peak_memory``:
the resident-set high-water mark on CPU, the allocator's on CUDA). Every variant's loss is checked against
hf_eager's first.
"""

from __future__ import annotations

import argparse
import copy

import torch
from _timing import ensure_malloc_returns_memory, fmt_bytes, machine_description, median_time, peak_memory, print_table

from shardkit.models.moe_experts import grouped_mm_works
from shardkit.models.moe_hf import use_grouped_experts


def build(device: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=16, num_experts_per_tok=4, max_position_embeddings=4096)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).to(device=device, dtype=dtype)


def main() -> None:
    ensure_malloc_returns_memory()
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    base = build(args.device, dtype)
    ids = torch.randint(0, 1024, (args.tokens // 512, 512), generator=torch.Generator().manual_seed(1)).to(args.device)
    variants = {}
    for name in ("hf_eager", "hf_grouped_mm", "shardkit_auto", "shardkit_bmm", "shardkit_loop"):
        model = copy.deepcopy(base)
        if name == "hf_eager":
            model.set_experts_implementation("eager")
        elif name.startswith("shardkit_"):
            use_grouped_experts(model, backend=name.removeprefix("shardkit_"))
        variants[name] = model
    ref_loss = None
    rows = []
    for name, model in variants.items():
        def step(model=model):
            model.zero_grad(set_to_none=True)
            loss = model(ids, labels=ids).loss
            loss.backward()
            return loss

        loss = float(step())
        ref_loss = loss if ref_loss is None else ref_loss
        seconds = median_time(step, warmup=1, repeats=args.repeats, device=args.device)
        peak = peak_memory(step, args.device, setup=lambda model=model: model.zero_grad(set_to_none=True))
        rows.append([name, f"{args.tokens / seconds:,.0f}", f"{seconds * 1e3:.1f}", fmt_bytes(peak),
                     f"{abs(loss - ref_loss):.1e}"])
    print(machine_description(args.device))
    print(f"Qwen3-MoE 2 layers, hidden 256, 16 experts x 256, top-4; {args.tokens} tokens per step, {args.dtype}; "
          f"grouped_mm usable here: {grouped_mm_works(torch.device(args.device).type, dtype)}")
    print_table(["variant", "tokens/s", "step ms", "peak over live", "|loss - hf_eager|"], rows)


if __name__ == "__main__":
    main()
