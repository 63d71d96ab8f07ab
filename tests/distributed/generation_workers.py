"""Worker functions for the generation and batch-inference tests; top level so spawned ranks import them.

Every rank builds the same weights (a seed) as a plain module and computes the reference outputs of
every rank's requests with plain ``generate`` (no Runner, no collectives); then each strategy sets up
a copy of those weights and generates through ``runner.generate`` with rank-dependent requests.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from shardkit import Runner
from shardkit.distributed.process_group import init_distributed
from shardkit.models.llama import Llama, LlamaConfig
from shardkit.strategies import strategy_from_name

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, max_position=32)


def hf_tiny():
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = HFConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def shardkit_tiny():
    torch.manual_seed(0)
    return Llama(TINY).eval()


def requests(rank: int) -> tuple[torch.Tensor, int]:
    """Rank 0: two prompts of 5 tokens, 6 new tokens; rank 1: one prompt of 3 tokens, 3 new tokens."""
    g = torch.Generator().manual_seed(100 + rank)
    batch, length, new = (2, 5, 6) if rank == 0 else (1, 3, 3)
    return torch.randint(1, 64, (batch, length), generator=g), new


def reference(model: nn.Module, ids: torch.Tensor, new: int, eos: int | None, hf: bool) -> torch.Tensor:
    if hf:
        return model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=0,
                              synced_gpus=False)
    return model.generate(ids, max_new_tokens=new, eos_token_id=eos, pad_token_id=0, synced=False)


def pick_eos(model: nn.Module, hf: bool) -> int:
    """A token rank 0's first row produces at its 2nd step: EOS then comes at different steps on each row."""
    ids, new = requests(0)
    return int(reference(model, ids, new, None, hf)[0, ids.shape[1] + 1])


STRATEGY_KWARGS = {
    "ddp": {}, "zero2": {}, "zero3": {}, "fsdp": {}, "tp": {"tp_size": 2},
    "zero_infinity": {"buffer_size": 100_000},
}


def hf_tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"model.layers.*.self_attn.q_proj": ColwiseParallel(), "model.layers.*.self_attn.k_proj": ColwiseParallel(),
            "model.layers.*.self_attn.v_proj": ColwiseParallel(), "model.layers.*.self_attn.o_proj": RowwiseParallel(),
            "model.layers.*.mlp.gate_proj": ColwiseParallel(), "model.layers.*.mlp.up_proj": ColwiseParallel(),
            "model.layers.*.mlp.down_proj": RowwiseParallel()}


def make_runner(name: str, hf: bool, nvme_path: str | None) -> Runner:
    kwargs = dict(STRATEGY_KWARGS[name])
    if name == "zero_infinity":
        kwargs["nvme_path"] = nvme_path
    if name == "tp" and hf:
        kwargs["plan"] = hf_tp_plan()
    return Runner(strategy=strategy_from_name(name, **kwargs), seed=0)


def _rank() -> int:
    init_distributed("cpu")
    return dist.get_rank()


def generation_worker(names: list[str], nvme_path: str | None = None, kinds: tuple[str, ...] = ("shardkit", "hf"),
                      ) -> dict:
    """For each model kind in ``kinds``, strategy and case (no EOS / EOS): this rank's output and the reference."""
    rank = _rank()
    out: dict = {}
    for kind, build in (("shardkit", shardkit_tiny), ("hf", hf_tiny)):
        if kind not in kinds:
            continue
        hf = kind == "hf"
        base = build()
        state = {k: v.clone() for k, v in base.state_dict().items()}
        eos = pick_eos(base, hf)
        ids, new = requests(rank)
        want = {case: reference(base, ids, new, e, hf) for case, e in (("plain", None), ("eos", eos))}
        for name in names:
            model = build()
            model.load_state_dict(state)
            runner = make_runner(name, hf, nvme_path)
            model = runner.setup(model)
            for case, e in (("plain", None), ("eos", eos)):
                kw = {"do_sample": False} if hf else {}
                got = runner.generate(model, ids, max_new_tokens=new, eos_token_id=e, pad_token_id=0, **kw)
                out[(kind, name, case)] = (got.cpu(), want[case])
    return out


def _counting(module, names: list[str], calls: list[int]) -> dict:
    """Wrap ``module``'s functions ``names`` so that each call adds one to ``calls[0]``; returns the originals."""
    real = {n: getattr(module, n) for n in names}

    def counting(name):
        def call(*args, **kwargs):
            calls[0] += 1
            return real[name](*args, **kwargs)
        return call

    for n in names:
        setattr(module, n, counting(n))
    return real


def _fsdp_gather_counts() -> dict:
    runner = Runner(strategy=strategy_from_name("fsdp"), seed=0)
    model = runner.setup(shardkit_tiny())
    ids, new = requests(dist.get_rank())
    counts, outputs = {}, {}
    # FSDP2 all-gathers through dist.all_gather_single (torch 2.13; all_gather_into_tensor before): count both
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    calls, reduces, reduced = [0], [0], {}
    real = _counting(dist, names, calls)
    real_reduce = _counting(dist, ["all_reduce"], reduces)
    try:
        for keep in (True, False):
            calls[0] = reduces[0] = 0
            outputs[keep] = runner.generate(model, ids, max_new_tokens=new, keep_unsharded=keep)
            counts[keep], reduced[keep] = calls[0], reduces[0]
    finally:
        for n, f in {**real, **real_reduce}.items():
            setattr(dist, n, f)
    units = sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP"))
    return {"counts": counts, "units": units, "same": torch.equal(outputs[True], outputs[False]),
            "all_reduces": reduced, "new": new}


def _zero3_train_step(runner: Runner, model: nn.Module, optimizer) -> list[torch.Tensor]:
    ids = torch.arange(1, 9).reshape(1, 8) + dist.get_rank()
    runner.backward(model(input_ids=ids, labels=ids).loss)
    runner.step()
    params = list(runner.unwrap_model(model).parameters())
    with runner.strategy.gathered_parameters(params):
        return [p.detach().clone() for p in params]


def _zero3_gather_counts() -> dict:
    """The Hugging Face model (what the RL trainers generate with) under ZeRO-3 with an optimizer: DeepSpeed's
    all-gathers per generate call with 2 and 6 new tokens, held (True) and per layer (False); the tokens against
    plain generate; which parameters are partitioned before and after each mode's calls; then one training step, and
    the same step on a copy that never generated."""
    import deepspeed.comm.comm as ds_comm
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    base = hf_tiny()
    state = {k: v.clone() for k, v in base.state_dict().items()}
    ids, _ = requests(dist.get_rank())
    want = reference(base, ids, 6, None, True)

    def build():
        model = hf_tiny()
        model.load_state_dict(state)
        runner = Runner(strategy=strategy_from_name("zero3"), seed=0)
        model, optimizer = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return runner, model, optimizer

    runner, model, optimizer = build()
    user = runner.unwrap_model(model)

    def partitioned():  # persistent parameters stay whole once a forward gathered them, as the engine keeps them
        return [p.ds_status.name == "NOT_AVAILABLE" for p in user.parameters() if not p.ds_persist]

    def hook_tables():
        return [(list(m._forward_pre_hooks.items()), list(m._forward_hooks.items())) for m in user.modules()]

    # DeepSpeed gathers through its comm backend, which holds torch's function itself: count at the backend. Its
    # module hooks run the coordinator's fetch_sub_module before every module's forward: count those too.
    # Hugging Face's synced decoding all-reduces a "still running" flag per token through torch: count those.
    calls, fetches, reduces, whole = [0], [0], [0], [0]
    real = _counting(ds_comm.cdb, ["all_gather_into_tensor"], calls)
    counted = ds_comm.cdb.all_gather_into_tensor
    sharded = [p for p in user.parameters() if not p.ds_persist]

    def gathering(*args, **kwargs):  # the most partitioned parameters whole (or in flight) at any gather
        whole[0] = max(whole[0], sum(p.ds_status.name != "NOT_AVAILABLE" for p in sharded))
        return counted(*args, **kwargs)

    ds_comm.cdb.all_gather_into_tensor = gathering
    real_fetch = _counting(PartitionedParameterCoordinator, ["fetch_sub_module"], fetches)
    real_reduce = _counting(dist, ["all_reduce"], reduces)
    counts, hooked, same, status, tables, reduced = {}, {}, {}, [partitioned()], [hook_tables()], {}
    most_whole: dict = {}
    try:
        for keep in (True, False):
            for new in (2, 6):
                calls[0] = fetches[0] = reduces[0] = whole[0] = 0
                got = runner.generate(model, ids, max_new_tokens=new, do_sample=False, pad_token_id=0,
                                      keep_unsharded=keep)
                counts[(keep, new)], hooked[(keep, new)], reduced[(keep, new)] = calls[0], fetches[0], reduces[0]
                most_whole[(keep, new)] = whole[0]
                same[(keep, new)] = torch.equal(got, want[:, :ids.shape[1] + new])
            status.append(partitioned())
            tables.append(hook_tables())
    finally:
        ds_comm.cdb.all_gather_into_tensor = real["all_gather_into_tensor"]
        PartitionedParameterCoordinator.fetch_sub_module = real_fetch["fetch_sub_module"]
        dist.all_reduce = real_reduce["all_reduce"]
    before = status[0]
    trained = _zero3_train_step(runner, model, optimizer)
    plain = _zero3_train_step(*build())
    return {"counts": counts, "hooked": hooked, "all_reduces": reduced,
            "hooks_back": all(t == tables[0] for t in tables) and len(tables[0][0][0]) > 0,
            "same": same, "partitioned": (sum(before), all(after == before for after in status)),
            "layers": len(user.model.layers), "most_whole": most_whole, "sharded": len(sharded),
            # the other modules owning partitioned (not persistent) parameters: the embedding, the output head
            "others": sum(any(not p.ds_persist for p in m.parameters(recurse=False))
                          for name, m in user.named_modules() if not name.startswith("model.layers")),
            "largest_layer": max(sum(not p.ds_persist for p in layer.parameters()) for layer in user.model.layers),
            "train_equal": all(torch.equal(a, b) for a, b in zip(trained, plain)),
            "moved": any(not torch.equal(a, state[n].to(a.dtype))
                         for a, (n, _) in zip(trained, user.named_parameters()))}


def gather_count_worker() -> dict:
    """FSDP2 and ZeRO-3 holding parameters gathered for a generate call against gathering them per forward."""
    _rank()
    return {"fsdp": _fsdp_gather_counts(), "zero3": _zero3_gather_counts()}


def rank0_only_worker() -> dict:
    """Both ranks generate once; then rank 0 alone calls generate (rank 1 went on to a barrier)."""
    runner = Runner(strategy=strategy_from_name("zero3"), seed=0)
    model = runner.setup(shardkit_tiny())
    ids, new = requests(dist.get_rank())
    runner.generate(model, ids, max_new_tokens=new)
    result = {}
    if runner.rank == 0:
        from shardkit.inference import NotCalledOnAllRanksError

        start = time.perf_counter()
        try:
            runner.generate(model, ids, max_new_tokens=new)
            result["error"] = None
        except NotCalledOnAllRanksError as err:
            result["error"] = str(err)
        result["seconds"] = time.perf_counter() - start
    dist.barrier()  # the job goes on after the error: rank 1 waited here all along
    return result


def llama_direct_rank0_only_worker() -> dict:
    """Llama.generate called directly (not through the Runner) on rank 0 only, under FSDP."""
    runner = Runner(strategy=strategy_from_name("fsdp"), seed=0)
    model = runner.setup(shardkit_tiny())
    result = {}
    if runner.rank == 0:
        from shardkit.inference import NotCalledOnAllRanksError

        start = time.perf_counter()
        try:
            model.generate(requests(0)[0], max_new_tokens=2)
            result["error"] = None
        except NotCalledOnAllRanksError as err:
            result["error"] = str(err)
        result["seconds"] = time.perf_counter() - start
    dist.barrier()
    return result


def batch_worker(names: list[str], n_prompts: int) -> dict:
    """Split ``n_prompts`` prompts over the ranks, generate, gather. With padding: one call per prompt, each
    with its own max_new_tokens; without: this rank's share in one batched call (possibly empty). Per
    strategy and mode: the gathered outputs and the indices this rank was given."""
    from shardkit.inference import split_between_processes

    prompts = [torch.tensor([[1 + i, 2 + i, 3 + (i % 5)]]) for i in range(n_prompts)]
    _rank()
    base = shardkit_tiny()
    state = {k: v.clone() for k, v in base.state_dict().items()}
    out = {"want_each": [base.generate(p, max_new_tokens=2 + i % 3, synced=False) for i, p in enumerate(prompts)],
           "want_batched": [base.generate(p, max_new_tokens=3, synced=False) for p in prompts]}
    for name in names:
        model = shardkit_tiny()
        model.load_state_dict(state)
        runner = make_runner(name, False, None)
        model = runner.setup(model)
        with runner.split_between_processes(list(range(n_prompts)), apply_padding=True) as mine:
            results = [runner.generate(model, prompts[i], max_new_tokens=2 + i % 3).cpu() for i in mine]
            out[(name, "each")] = {"gathered": runner.gather_object(results), "mine": list(mine)}
        with runner.split_between_processes(torch.cat(prompts)) as mine:
            results = runner.generate(model, mine, max_new_tokens=3).cpu()
            out[(name, "batched")] = {"gathered": runner.gather_object(list(results)), "mine": mine.shape[0]}
    with split_between_processes({"a": [1, 2, 3], "b": ["x", "y", "z"]}, dp_rank=dist.get_rank(), dp_size=2) as d:
        out["dict"] = d
    return out
