"""Decoding speed of shardkit's Llama with its KV cache, without it, and Hugging Face's LlamaForCausalLM with its
own cache, on the same weights, one process (and shardkit's with its fused ops through their torch.library
wrappers, as before eager inference called them directly).

    python benchmarks/kv_cache.py [--hidden 128 --layers 4 --batch 4 --prompt 32 --new 128 --rounds 3]

Greedy, fp32, no EOS. The Hugging Face model is built from the same config (nothing downloaded) and loaded with
shardkit's weights (the names match ``LlamaForCausalLM``'s under ``model.``), so all three must give the same
tokens; the script says whether they do. Rounds alternate the order of the contenders; the medians are compared.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _timing import machine_description, print_table

from shardkit.models import Llama, LlamaConfig


def _models(args: argparse.Namespace):
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
                         num_layers=args.layers, num_heads=max(1, args.hidden // 32),
                         max_position=args.prompt + args.new)
    torch.manual_seed(0)
    ours = Llama(config).eval()
    hf = LlamaForCausalLM(HFConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                                   intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                                   num_attention_heads=config.num_heads, num_key_value_heads=config.kv_heads,
                                   max_position_embeddings=config.max_position, rms_norm_eps=config.rms_eps,
                                   rope_theta=config.rope_theta, tie_word_embeddings=config.tie_embeddings,
                                   pad_token_id=0, bos_token_id=None, eos_token_id=None)).eval()
    state = {("" if k.startswith("lm_head") else "model.") + k: v for k, v in ours.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # lm_head is tied to the embedding
        raise RuntimeError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    return config, ours, hf


def _through_custom_ops(fn):
    """Run ``fn`` with the fused ops going through their torch.library custom ops even in inference (as before
    ``direct_call_ok``), to show what the direct call saves."""
    import importlib

    modules = [importlib.import_module(f"shardkit.ops.{name}") for name in ("rms_norm", "rope", "swiglu")]
    saved = [m.direct_call_ok for m in modules]
    for m in modules:
        m.direct_call_ok = lambda *tensors: False
    try:
        return fn()
    finally:
        for m, original in zip(modules, saved):
            m.direct_call_ok = original


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    config, ours, hf = _models(args)
    ids = torch.randint(1, config.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    run = {
        "shardkit, KV cache": lambda: ours.generate(ids, args.new),
        "shardkit, KV cache, ops via torch.library": lambda: _through_custom_ops(lambda: ours.generate(ids, args.new)),
        "shardkit, no cache": lambda: ours.generate(ids, args.new, use_cache=False),
        "transformers, its cache": lambda: hf.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new,
                                                       do_sample=False, pad_token_id=0),
    }
    times: dict[str, list[float]] = {name: [] for name in run}
    outputs = {}
    with torch.no_grad():
        for name, fn in run.items():  # warm-up (kernel builds, first-call allocations); also the tokens
            outputs[name] = fn()
        for round_ in range(args.rounds):
            for name in list(run)[:: 1 if round_ % 2 == 0 else -1]:
                start = time.perf_counter()
                run[name]()
                times[name].append(time.perf_counter() - start)
    tokens = args.batch * args.new
    base = statistics.median(times["shardkit, KV cache"])
    rows = [[name, f"{tokens / statistics.median(t):.0f}", f"{statistics.median(t) / base:.2f}",
             "yes" if torch.equal(outputs[name], outputs["shardkit, KV cache"]) else "NO"]
            for name, t in times.items()]
    print(machine_description())
    print(f"Llama hidden {config.hidden_size}, {config.num_layers} layers, {config.num_heads} heads; batch "
          f"{args.batch}, prompt {args.prompt}, {args.new} new tokens, greedy, fp32; median of {args.rounds} rounds")
    print_table(["contender", "new tokens/s", "time vs shardkit KV cache", "same tokens"], rows)


if __name__ == "__main__":
    main()
