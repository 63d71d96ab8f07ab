"""Padded rows in the MoE Llama on 2 CPU ranks. Under expert parallelism (ep 2, one row per rank, different amounts
of left padding) the padding is dropped before the all-to-all, so the routing statistics summed over the
data-parallel ranks (load, aux loss) and the router bias after the aux-loss-free update are the one-device values of
the real tokens, and each row's logits are its own alone. Under ContextParallel (cp 2) and TensorParallel (tp 2,
sequence parallel) the padded batch gives the one-device load, aux loss and logits. One launch."""

from __future__ import annotations

from typing import Any

import torch
from harness import run_distributed

from shardkit.models import Llama, LlamaConfig
from shardkit.models.moe import moe_layers, update_router_biases

CONFIG = LlamaConfig.small_moe(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_position=32,
                               tie_embeddings=False, fused=False,
                               moe=dict(num_experts=4, top_k=2, intermediate_size=16, aux_loss_coef=0.05,
                                        bias_update_rate=0.1, first_dense_layers=0))
SEQ, PADS = 12, (5, 2)


def _rows() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's (ids, mask) of one row of SEQ tokens, its first PADS[rank] padding."""
    ids = torch.randint(0, CONFIG.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    out = []
    for row, pad in enumerate(PADS):
        mask = torch.ones(1, SEQ, dtype=torch.long)
        mask[:, :pad] = 0
        out.append((ids[row : row + 1], mask))
    return out


def _stats(model: torch.nn.Module) -> dict[str, Any]:
    layers = moe_layers(model)
    return {"load": [m.last_load.tolist() for m in layers], "aux": [float(m.aux_loss.detach()) for m in layers]}


def _ep_padded_worker() -> dict[str, Any]:
    from shardkit import Runner
    from shardkit.strategies import ContextParallel, SingleDevice, TensorParallel
    from shardkit.strategies.expert_parallel import ExpertParallel

    rows = _rows()
    ref_runner = Runner(SingleDevice("cpu"), seed=0)
    with ref_runner.init_module():
        ref = Llama(CONFIG)
    ref = ref_runner.setup(ref)
    # one device: each row's real tokens alone, then the two rows in one batch (the padding masked)
    ref.train()
    alone_load = [[0.0] * 4 for _ in moe_layers(ref)]
    alone_logits = []
    for (row, _), pad in zip(rows, PADS):
        real = row[:, pad:]
        ref(real, labels=real)
        for i, m in enumerate(moe_layers(ref)):
            alone_load[i] = [a + b for a, b in zip(alone_load[i], m.last_load.tolist())]
            m.tokens_per_expert.zero_()
        ref.eval()
        with torch.no_grad():
            alone_logits.append(ref(real))
        ref.train()
    ids, mask = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    ref.eval()
    with torch.no_grad():
        batch_logits = ref(ids, attention_mask=mask)
    ref.train()
    ref(ids, labels=ids.masked_fill(mask == 0, -100), attention_mask=mask)
    want = _stats(ref)
    update_router_biases(ref)
    want["bias"] = [m.router.expert_bias.tolist() for m in moe_layers(ref)]

    runner = Runner(ExpertParallel(ep_size=2), seed=0)
    with runner.init_module():
        model = Llama(CONFIG)
    model = runner.setup(model)
    rank = runner.strategy.data_parallel_rank
    row, row_mask = rows[rank]
    model.train()
    model(row, labels=row.masked_fill(row_mask == 0, -100), attention_mask=row_mask)
    got = _stats(model)
    model.eval()
    with torch.no_grad():  # before the bias update, as the rows alone were run
        logits = model(row, attention_mask=row_mask)[:, PADS[rank]:]
    update_router_biases(model)
    got["bias"] = [m.router.expert_bias.tolist() for m in moe_layers(model)]
    out = {"got": got, "want": want, "alone_load": alone_load,
           "logits": (logits - alone_logits[rank]).abs().max().item(), "finite": bool(torch.isfinite(logits).all())}
    # the whole padded batch on every rank: context parallelism (its masked forward runs unsplit) and tensor
    # parallelism with sequence parallelism (router and experts whole on every rank)
    cases = (("cp", ContextParallel(cp_size=2)), ("tp", TensorParallel(tp_size=2, sequence_parallel=True)))
    for name, strategy in cases:
        runner = Runner(strategy, seed=0)
        model = Llama(CONFIG)
        model.load_state_dict(init)
        model = runner.setup(model)
        model.eval()
        with torch.no_grad():
            logits = model(ids, attention_mask=mask)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        real = mask.bool()
        model.train()
        model(ids, labels=ids.masked_fill(mask == 0, -100), attention_mask=mask)
        out[name] = {**_stats(model), "logits": (logits - batch_logits)[real].abs().max().item()}
    return out


def test_padded_rows_route_as_their_real_tokens_under_ep_cp_tp():
    for rank, out in enumerate(run_distributed(_ep_padded_worker, world_size=2, timeout=300)):
        got, want = out["got"], out["want"]
        assert got["load"] == want["load"] == out["alone_load"], (rank, got["load"], want["load"], out["alone_load"])
        assert max(abs(a - b) for a, b in zip(got["aux"], want["aux"])) < 1e-6, (rank, got["aux"], want["aux"])
        assert got["bias"] == want["bias"], (rank, got["bias"], want["bias"])
        assert out["finite"] and out["logits"] < 1e-5, (rank, out["logits"])
        for name in ("cp", "tp"):
            case = out[name]
            assert case["load"] == want["load"], (rank, name, case["load"], want["load"])
            assert max(abs(a - b) for a, b in zip(case["aux"], want["aux"])) < 1e-6, (rank, name, case["aux"])
            assert case["logits"] < 1e-5, (rank, name, case["logits"])
