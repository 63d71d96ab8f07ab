"""Per-token log-probs (what DPO needs): peak memory and time of the chunked op vs the full logits, on CPU.

Run: ``.venv/bin/python benchmarks/log_probs_memory.py [--tokens 256 --hidden 128 --chunk 64]`` (a minute or two).

One forward+backward of ``log_softmax(hidden @ weight.T)[labels]`` (and the entropy) summed, at a vocabulary of
32k and 128k: shardkit's :func:`shardkit.ops.linear_log_probs` (chunks of ``--chunk`` rows; the default chunk size
of a 256 MiB budget would take all 256 rows at once here) against the full-logits computation
(``linear_log_probs_reference``: log_softmax over the (tokens, vocab) logits, autograd). Peak memory as
``benchmarks/kernels.py`` measures it (``_timing.peak_memory``: the resident-set high-water mark over what was
live before), each in a fresh process with glibc's mmap threshold fixed (as tests/kernels/fresh_process.py does,
so that freed chunks are returned); it includes grad_weight (vocab x hidden fp32), which both need. Time: the
median of 3 runs after a warm-up, on whatever else this machine is running.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent


def _one(method: str, tokens: int, hidden_size: int, vocab: int, chunk: int) -> dict:
    sys.path.insert(0, str(_HERE))
    from _timing import peak_memory

    from shardkit.ops import linear_log_probs, linear_log_probs_reference

    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(tokens, hidden_size, generator=gen) * 0.5).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    fn = linear_log_probs if method == "chunked" else linear_log_probs_reference

    def clear():
        hidden.grad = weight.grad = None

    def run():
        logp, entropy = fn(hidden, weight, labels, return_entropy=True, chunk_size=chunk)
        (logp.sum() + 0.1 * entropy.sum()).backward()

    run()
    peak = peak_memory(run, "cpu", clear)
    times = []
    for _ in range(3):
        clear()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return {"peak": peak, "seconds": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--one", nargs=2, metavar=("METHOD", "VOCAB"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT", json.dumps(_one(args.one[0], args.tokens, args.hidden, int(args.one[1]), args.chunk)))
        return
    sys.path.insert(0, str(_HERE))
    from _timing import machine_description

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "MALLOC_ARENA_MAX": "2"}
    print(f"{machine_description()}\n")
    print(f"tokens={args.tokens} hidden={args.hidden} chunk={args.chunk} rows, fp32, logp + entropy, forward+backward")
    print("| vocab | fp32 logits | full logits: peak, time | chunked: peak, time | peak ratio | time ratio |")
    print("|---|---|---|---|---|---|")
    for vocab in (32000, 128256):
        got = {}
        for method in ("full", "chunked"):
            out = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--hidden", str(args.hidden),
                                  "--chunk", str(args.chunk), "--one", method, str(vocab)],
                                 capture_output=True, text=True, env=env, check=True)
            (line,) = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            got[method] = json.loads(line[len("RESULT "):])
        full, ours = got["full"], got["chunked"]
        mib = 2**20
        print(f"| {vocab} | {args.tokens * vocab * 4 / mib:.0f} MiB | {full['peak'] / mib:.0f} MiB, "
              f"{full['seconds'] * 1e3:.0f} ms | {ours['peak'] / mib:.0f} MiB, {ours['seconds'] * 1e3:.0f} ms | "
              f"{ours['peak'] / full['peak']:.2f}x | {ours['seconds'] / full['seconds']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
