"""The MFU and TFLOP/s shardkit reports (``runner.throughput``) for the demo model and a Hugging Face Llama on CPU,
with the FLOP formula checked against ``torch.utils.flop_counter`` on one training step.

    python benchmarks/mfu.py [--steps 6]

For each model: one forward+backward under ``FlopCounterMode`` gives the FLOPs torch counts; the formula's
``flops_per_token * tokens`` is printed beside it (ratio). Attention runs the math path (eager for transformers,
shardkit's Llama with ``fused=False`` and SDPA forced to its math kernel) because the counter has no formula for the
CPU flash-attention kernel and would count its FLOPs as 0. Then ``--steps`` optimizer steps through a Runner report
tokens/s, TFLOP/s and MFU against the CPU peak measured with a matmul at start-up (median of the steps after the
first).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _timing import machine_description, print_table
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from shardkit import Runner
from shardkit.models import Llama, LlamaConfig
from shardkit.observability import flops_per_token


def _demo():
    # examples/train_llama.py's defaults (hidden 128, 4 layers, 4 heads, seq 64), batch 8
    config = LlamaConfig(hidden_size=128, intermediate_size=336, num_layers=4, num_heads=4, max_position=64,
                         fused=False)
    model = Llama(config)
    return "shardkit demo Llama (1.0M)", model, 8, 64, lambda m, ids: m(ids, ids)


def _hf_llama():
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    config = HFConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    config._attn_implementation = "eager"
    return "HF LlamaForCausalLM", LlamaForCausalLM(config), 4, 128, lambda m, ids: m(input_ids=ids, labels=ids).loss


def _measure(name, model, batch, seq, loss_of, steps):
    vocab = 256 if "demo" in name else 1024
    ids = torch.randint(0, vocab, (batch, seq))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss_of(model, ids).backward()
    model.zero_grad(set_to_none=True)
    counted = counter.get_total_flops()
    formula = flops_per_token(model, seq).model * ids.numel()
    runner = Runner(seed=0)
    model, optimizer = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    rates = []
    with sdpa_kernel(SDPBackend.MATH):
        for _ in range(steps):
            runner.backward(loss_of(model, ids))
            runner.step()
            rates.append(runner.throughput.update(tokens=ids.numel(), samples=batch))
    rest = rates[1:] or rates
    peak = runner.throughput.peak
    runner.teardown()
    return [name, f"{counted / 1e9:.4f}", f"{formula / 1e9:.4f}", f"{formula / counted:.4f}",
            f"{statistics.median(r['tokens_per_s'] for r in rest):,.0f}",
            f"{statistics.median(r['tflops'] for r in rest):.4f}", f"{statistics.median(r['mfu'] for r in rest):.3f}",
            f"{peak:.3f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [_measure(*build(), args.steps) for build in (_demo, _hf_llama)]
    print(machine_description())
    print_table(["model", "flop_counter GFLOP/step", "formula GFLOP/step", "formula/counter", "tokens/s",
                 "TFLOP/s", "MFU", "peak TFLOP/s (measured fp32 matmul)"], rows)


if __name__ == "__main__":
    main()
