"""The strategy contract's preference check, run inside each rank: one DPO-sigmoid step on sequence log-probs from
the chunked op (``return_log_probs=True``), under the strategy and on one process; under TensorParallel with the
head split on the vocabulary, the vocab-parallel path against the op on the whole weight.

Imported by ``contract_workers.contract_worker`` when the check runs (this module reads that one's shared pieces).
"""

from __future__ import annotations

import torch
from contract_workers import CONFIG, GLOBAL_BATCH, batches, build_strategy, global_mean, local_slice, whole_weights

from shardkit import Runner
from shardkit.models import Llama, LlamaConfig

__all__ = ["PREFERENCE_ADAMW", "preference_one_device", "preference_step"]

# An untied head, so that TensorParallel can split it on the vocabulary (a tied one stays replicated).
PREFERENCE_CONFIG = LlamaConfig(**{**CONFIG.to_dict(), "tie_embeddings": False})
PROMPT, BETA, PREFERENCE_LR = 4, 0.5, 0.5
# Strategies whose optimizer steps on the host, which takes Adam-type optimizers only (SGD is refused by name): their
# step, and the one-process step they are compared with, use AdamW.
PREFERENCE_ADAMW = {"zero_infinity"}


def preference_optimizer(params, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        # eps=1: the first step is lr * g / (|g| + 1), smooth in the gradient, so that rounding-level gradient
        # differences stay rounding-level in the weights (with a tiny eps it is lr * sign(g) for any |g| >> eps, and
        # a gradient near 0 flips a weight by the whole step).
        return torch.optim.AdamW(params, lr=PREFERENCE_LR, eps=1.0, weight_decay=0.0)
    return torch.optim.SGD(params, lr=PREFERENCE_LR)


def preference_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GLOBAL_BATCH (chosen, rejected) pairs sharing a PROMPT-token prompt, and their labels (prompt: -100)."""
    chosen, rejected = batches(2)
    rejected[:, :PROMPT] = chosen[:, :PROMPT]
    ids = torch.cat([chosen, rejected])
    labels = ids.clone()
    labels[:, :PROMPT] = -100
    return ids, labels, torch.arange(GLOBAL_BATCH)


def preference_models() -> tuple[Llama, Llama]:
    """The policy and a different reference (frozen by running it under no_grad), plain CPU models from fixed
    seeds."""
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(Llama(PREFERENCE_CONFIG))
    return models[0], models[1]


def dpo_sigmoid(policy_logps: torch.Tensor, reference_logps: torch.Tensor, pairs: int) -> torch.Tensor:
    """DPO's sigmoid loss from per-token log-probs of [chosen; rejected] rows: mean of -logsigmoid(beta * margin)."""
    policy, reference = policy_logps.sum(-1), reference_logps.sum(-1)
    margin = (policy[:pairs] - reference[:pairs]) - (policy[pairs:] - reference[pairs:])
    return -torch.nn.functional.logsigmoid(BETA * margin).mean()


def preference_one_device(kind: str = "sgd") -> dict:
    """The same step on one process, plain models and plain SGD (or AdamW): the loss and the updated weights."""
    policy, reference = preference_models()
    ids, labels, _ = preference_data()
    optimizer = preference_optimizer(policy.parameters(), kind)
    with torch.no_grad():
        ref_logps = reference(ids, labels, return_log_probs=True)
    loss = dpo_sigmoid(policy(ids, labels, return_log_probs=True), ref_logps, GLOBAL_BATCH)
    loss.backward()
    optimizer.step()
    return {"loss": loss.item(), "weights": {k: v.detach().clone() for k, v in policy.state_dict().items()}}


def preference_strategy(name: str):
    """The strategy under test; TensorParallel with the head split on the vocabulary (the model's own plan keeps
    it replicated), so that the log-probs run the vocab-parallel path."""
    if name != "tp":
        return build_strategy(name)
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    from shardkit.models.llama import llama_plan
    from shardkit.strategies import TensorParallel

    with torch.device("meta"):
        shape = Llama(PREFERENCE_CONFIG)
    return TensorParallel(plan={**llama_plan(shape, 2), "lm_head": ColwiseParallel(output_layouts=Replicate())})


def preference_step(name: str) -> dict:
    """One DPO-sigmoid step under the strategy: the policy and the frozen reference model set up the same way
    (sharded alike under ZeRO-3/FSDP), sequence log-probs from the chunked op inside each model's forward
    (chosen and rejected in one forward), SGD. Returns the global loss, the whole updated policy weights, and
    whether the head was split on the vocabulary."""
    runner = Runner(preference_strategy(name), seed=0)
    policy, reference = preference_models()
    kind = "adamw" if name in PREFERENCE_ADAMW else "sgd"
    policy, _ = runner.setup(policy, preference_optimizer(policy.parameters(), kind))
    # A runner holds one trained model: the reference gets a runner of its own on the same strategy (and process
    # group), set up without an optimizer and only ever run under no_grad.
    reference = Runner(preference_strategy(name), seed=0).setup(reference)
    ids, labels, pairs = preference_data()
    mine = local_slice(runner, pairs).cpu()
    rows = torch.cat([mine, mine + GLOBAL_BATCH])
    ids, labels = ids[rows].to(runner.device), labels[rows].to(runner.device)
    with torch.no_grad():
        ref_logps = reference(ids, labels, return_log_probs=True)
    loss = dpo_sigmoid(policy(ids, labels, return_log_probs=True), ref_logps, len(mine))
    runner.backward(loss)
    runner.step()
    head = runner.unwrap_model(policy).lm_head.weight
    return {"loss": global_mean(runner, loss), "weights": whole_weights(runner, policy), "optimizer": kind,
            "head_placements": str(getattr(head, "placements", None)),
            "vocab_parallel": vocab_parallel_errors(head) if name == "tp" else None}


def vocab_parallel_errors(head) -> dict[str, float]:
    """The vocab-parallel path with every option (bias, softcap, temperature, entropy, ignored rows) on the tp
    group against the op on the whole weight in this process: the largest difference per output and gradient."""
    from torch.distributed.tensor import distribute_tensor

    from shardkit.nn import head_log_probs
    from shardkit.ops import linear_log_probs

    gen = torch.Generator().manual_seed(5)
    vocab, hidden_size = head.shape
    whole = torch.randn(vocab, hidden_size, generator=gen)
    bias = torch.randn(vocab, generator=gen)
    hidden = torch.randn(3, 5, hidden_size, generator=gen)
    labels = torch.randint(0, vocab, (3, 5), generator=gen)
    labels[:, 0] = -100
    opts = dict(softcap=4.0, temperature=0.8, return_entropy=True, chunk_size=4)
    up = torch.randn(2, 3, 5, generator=gen)
    got_in = [t.clone().requires_grad_() for t in (hidden, whole, bias)]
    shards = [distribute_tensor(t, head.device_mesh, head.placements) for t in got_in[1:]]
    got = head_log_probs(got_in[0], shards[0], labels, bias=shards[1], **opts)
    got_grads = torch.autograd.grad(sum((o * u).sum() for o, u in zip(got, up)), [got_in[0], *shards])
    want_in = [t.clone().requires_grad_() for t in (hidden, whole, bias)]
    want = linear_log_probs(want_in[0], want_in[1], labels, bias=want_in[2], **opts)
    want_grads = torch.autograd.grad(sum((o * u).sum() for o, u in zip(want, up)), want_in)
    got_grads = [got_grads[0]] + [g.full_tensor() for g in got_grads[1:]]
    names = ("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias")
    return {n: float((a - b).detach().abs().max()) for n, a, b in zip(names, [*got, *got_grads], [*want, *want_grads])}
