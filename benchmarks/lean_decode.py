"""One generate call, shardkit's lean decoding loop against Hugging Face's ``generate``, in one process.

    python benchmarks/lean_decode.py [--hidden 128] [--layers 2] [--vocab 2000] [--batch 8] [--prompt 8]
                                     [--new 16] [--rounds 20] [--greedy] [--threads 1]

The GRPO benchmark's model and sampling (HF Llama, fp32, temperature 1, HF's default top_k=50, the EOS token
suppressed so every row decodes --new tokens), left-padded prompts. The two alternate call by call with the same
seed (their tokens are checked equal every round); the figures are medians over --rounds after 2 dropped.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, default in (("hidden", 128), ("layers", 2), ("vocab", 2000), ("batch", 8), ("prompt", 8), ("new", 16),
                          ("rounds", 20)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (more oversubscribe a shared machine)")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardkit.inference.decode import lean_generate

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=opts.vocab, hidden_size=opts.hidden, intermediate_size=4 * opts.hidden,
                         num_hidden_layers=opts.layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, opts.vocab, (opts.batch, opts.prompt))
    mask = torch.ones_like(ids)
    for row in range(opts.batch):
        mask[row, :row % 3] = 0
        ids[row, :row % 3] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": opts.new, "pad_token_id": 0, "eos_token_id": 2,
              "do_sample": not opts.greedy, "suppress_tokens": [2], "use_cache": True}
    times: dict[str, list[float]] = {"hf": [], "lean": []}
    with torch.no_grad():
        for round_ in range(opts.rounds + 2):
            outs = {}
            for name in ("hf", "lean") if round_ % 2 else ("lean", "hf"):
                torch.manual_seed(round_)
                start = time.perf_counter()
                outs[name] = (model.generate(ids, **kwargs) if name == "hf" else lean_generate(model, ids, kwargs))
                if round_ >= 2:
                    times[name].append(time.perf_counter() - start)
            assert outs["lean"] is not None and torch.equal(outs["lean"], outs["hf"]), "tokens differ"
    hf, lean = statistics.median(times["hf"]), statistics.median(times["lean"])
    print(f"tokens equal in all {opts.rounds + 2} rounds; {opts.batch}x{opts.new} new tokens per call")
    print(f"| HF generate | {hf * 1e3:.1f} ms |\n| lean loop   | {lean * 1e3:.1f} ms |")
    print(f"| lean / HF   | {lean / hf:.2f} |")


if __name__ == "__main__":
    main()
