"""Context parallelism inside each rank: many cases in one process group, each compared with one process.

Each case trains the same tiny Llama on the same global batches under ``ContextParallel`` and, in the same
process, under a plain single-device run (no collectives); it returns the largest differences of the loss
and of every whole gradient, step by step.
"""

from __future__ import annotations

from typing import Any

import torch

from shardkit import Runner
from shardkit.models import Llama, LlamaConfig

__all__ = ["CONFIG", "cp_worker"]

# 4 heads so that Ulysses splits them over 2 and 4 ranks; 16 tokens: 2 * cp chunks of 2 on 4 ranks.
CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, max_position=32,
                     tie_embeddings=False, fused=False)
GLOBAL_BATCH, SEQ, STEPS = 4, 16, 2


def batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, CONFIG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ), generator=g)
    # Ignored labels at the end of every row: they fall on one cp rank's chunk (rank 0 holds the last one), so
    # the loss must be token-weighted across the cp group, not a mean of its ranks' means. Equal in every row,
    # so that data-parallel groups hold equal token counts and DDP's mean of means is the global mean.
    x[:, :, -3:] = -100
    return x


def _reference() -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    from shardkit.strategies import SingleDevice

    runner = Runner(SingleDevice("cpu"), seed=0)
    with runner.init_module():
        model = Llama(CONFIG)
    model, opt = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    losses, grads = [], []
    for labels in batches():
        loss = model(labels.clamp(min=0), labels=labels)
        runner.backward(loss)
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        runner.step()
    return losses, grads


def _case(strategy: Any, reference: tuple[list[float], list[dict[str, torch.Tensor]]]) -> dict:
    runner = Runner(strategy, seed=0)
    with runner.init_module():
        model = Llama(CONFIG)
    model, opt = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    s = runner.strategy
    per = GLOBAL_BATCH // s.data_parallel_size
    out: dict = {"loss": [], "grad": []}
    for step, labels in enumerate(batches()):
        labels = labels[s.data_parallel_rank * per:(s.data_parallel_rank + 1) * per]
        loss = model(labels.clamp(min=0), labels=labels)
        runner.backward(loss)
        # Token-weighted over the whole global batch, as the reference's single mean is.
        count = (labels[:, 1:] != -100).sum().float()
        total = runner.all_reduce(torch.stack([loss.detach() * count, count]), "sum") / s.cp_size
        out["loss"].append(abs(total[0].item() / total[1].item() - reference[0][step]))
        diffs = {}
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            diffs[n] = (g - reference[1][step][n]).abs().max().item()
        out["grad"].append(max(diffs.values()))
        runner.step()
    return out


def _hf_model(kind: str) -> Any:
    """A tiny Hugging Face decoder from a config (no download), grouped-query attention, same weights everywhere."""
    import transformers

    config_class, model_class = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[kind]
    config = getattr(transformers, config_class)(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).float()


def _hf_case(kind: str, mode: str) -> dict:
    """A Hugging Face model under ContextParallel against the same model in this process, one step."""
    from shardkit.strategies.context_parallel import ContextParallel

    labels = batches()[0]
    reference = _hf_model(kind)
    ref_loss = reference(input_ids=labels.clamp(min=0), labels=labels).loss
    ref_loss.backward()
    runner = Runner(ContextParallel(cp_mode=mode), seed=0)
    model = runner.setup(_hf_model(kind))
    per = GLOBAL_BATCH // runner.strategy.data_parallel_size
    local = labels[runner.strategy.data_parallel_rank * per:(runner.strategy.data_parallel_rank + 1) * per]
    loss = model(input_ids=local.clamp(min=0), labels=local).loss
    runner.backward(loss)
    total = runner.all_reduce(loss.detach().clone(), "mean")
    grads = dict(reference.named_parameters())
    diff = max((p.grad.full_tensor() - grads[n].grad).abs().max().item() for n, p in model.named_parameters())
    return {"loss": [abs(total.item() - ref_loss.item())], "grad": [diff]}


def cp_worker(cases: list[dict]) -> dict:
    """Run each case (ContextParallel keyword arguments, or {"hf": "llama"|"qwen2", "cp_mode": ...}) and return
    its differences from one process."""
    from shardkit.strategies.context_parallel import ContextParallel

    reference = _reference()
    out = {}
    for kw in cases:
        if "hf" in kw:
            out[f"hf {kw['hf']} {kw['cp_mode']}"] = _hf_case(kw["hf"], kw["cp_mode"])
        else:
            out[repr(sorted(kw.items()))] = _case(ContextParallel(**kw), reference)
    return out
