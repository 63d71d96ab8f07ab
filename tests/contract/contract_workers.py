"""The strategy contract, run inside each rank: every check a registered strategy must pass, in one process group.

``contract_worker(name, root)`` runs on 2 ranks (one launch per strategy) and returns, per check, the raw
numbers the test compares (or the traceback of the check that raised); ``reload_worker(name, root)`` runs on
1 rank and loads the 2-rank checkpoint. References come from the same processes: SingleDevice's initial
weights and greedy tokens (plain, no collectives) and DDP's losses, clip norms and weights on the same data.
A strategy that runs as one process (it creates no process group: SingleDevice) runs in each launched
process on its own and takes the whole global batch; its data-parallel size says so.

Functions are top level so spawned ranks import them by name; strategies are built from their registered
name inside the child. The preference check (a DPO step on chunked log-probs) is in ``contract_preference``.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader
from typing_extensions import override
from workloads import full_state

from shardkit import FP16, Runner
from shardkit.models import ByteTextDataset, Llama, LlamaConfig

__all__ = ["CHECKS", "contract_worker", "registrations", "reload_worker", "replay", "strategy_names", "build_strategy",
           "whole_weights"]

TEXT = Path(__file__).resolve().parents[2] / "examples" / "data" / "public_domain.txt"
# Tiny on purpose (37k parameters): every check is about agreement, not scale. 4 heads so that TP splits them.
CONFIG = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, max_position=32)
GLOBAL_BATCH, SEQ = 4, 12
PARITY_STEPS = 5
ACCUM, ACCUM_MICRO_STEPS, CLIP = 2, 4, 0.05  # CLIP sits below every measured norm (~0.5), so it always cuts
RESUME_STEPS = 2  # optimizer steps before the save and after it (accumulation 2: 4 micro-batches each)
# Sizes for the tiny model, not behaviour: ZeROInfinity's default swap buffers (5 x 1e8 elements) take 2 GB
# per rank; the largest tensor here has 8192 elements.
TEST_SIZE_KWARGS: dict[str, dict[str, Any]] = {"zero_infinity": {"buffer_size": 100_000}}
CHECKS = ("init", "gathered", "facts", "fp32_losses", "accumulation_clipping", "fp16_overflow", "resume",
          "generation", "preference")


# ---- the registry ---------------------------------------------------------------------------------------


def strategy_names() -> list[str]:
    """Every registered strategy name, in registration order."""
    from shardkit.strategies.registry import STRATEGIES

    return list(STRATEGIES.names())


def registrations() -> tuple:
    """Every registered strategy's entry, for the spawned ranks: a strategy a test registers in this process (see
    test_added_strategy.py) is then built there by its name too."""
    from shardkit.strategies.registry import STRATEGIES

    return tuple(STRATEGIES.entry(name) for name in STRATEGIES.names())


def replay(entries: tuple) -> None:
    """Register in this (spawned) rank the entries of :func:`registrations` it does not have."""
    from shardkit.strategies.registry import STRATEGIES

    for e in entries:
        if e.name not in STRATEGIES:
            STRATEGIES.register(e.name, e.target, aliases=e.aliases, description=e.description, defaults=e.defaults,
                                options=e.options)


def build_strategy(name: str):
    """A fresh strategy built from its registered name with its defaults (test sizes where they apply)."""
    from shardkit.strategies.registry import STRATEGIES

    return STRATEGIES.build(name, **TEST_SIZE_KWARGS.get(name, {}))


# ---- shared pieces --------------------------------------------------------------------------------------


def batches(steps: int) -> torch.Tensor:
    """(steps, GLOBAL_BATCH, SEQ) tokens, the same everywhere: rows count up from a random start (learnable)."""
    starts = torch.randint(0, CONFIG.vocab_size, (steps, GLOBAL_BATCH, 1), generator=torch.Generator().manual_seed(1))
    return (starts + torch.arange(SEQ)) % CONFIG.vocab_size


def local_slice(runner: Runner, x: torch.Tensor) -> torch.Tensor:
    """This data-parallel rank's share of a global batch (the whole of it where peers share the batch)."""
    s = runner.strategy
    per = x.shape[0] // s.data_parallel_size
    return x[s.data_parallel_rank * per:(s.data_parallel_rank + 1) * per].to(runner.device)


def global_mean(runner: Runner, loss: torch.Tensor) -> float:
    """The mean over ranks of each rank's loss: DDP's global batch loss; TP peers hold equal values."""
    return runner.all_reduce(loss.detach().float().clone(), "mean").item()


def setup_training(runner: Runner, optimizer_kind: str = "adamw", dropout: float = 0.0):
    """Build the tiny Llama under ``init_module`` and set it up with its optimizer."""
    with runner.init_module():
        model = Llama(LlamaConfig(**{**CONFIG.to_dict(), "dropout": dropout}))
    if optimizer_kind == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return runner.setup(model, optimizer)


def single_device_reference() -> dict[str, torch.Tensor]:
    """SingleDevice's initial weights for seed 0 (no process group involved)."""
    from shardkit.strategies import SingleDevice

    reference = Runner(SingleDevice("cpu"), seed=0)
    with reference.init_module():
        model = Llama(CONFIG)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def whole_weights(runner: Runner, model) -> dict[str, torch.Tensor]:
    """The model's full fp32 weights as plain CPU tensors: on every rank through ``gathered_parameters`` where
    the strategy gives whole parameters; where it refuses (NotImplementedError: a pipeline rank holds only its
    stages) the whole state dict streamed by ``iter_full_state_dict`` to the main rank, and {} on the others.
    The test knows which strategies refuse (test_strategy_contract.REFUSALS) and which ranks hold weights."""
    try:
        return full_state(runner, model)
    except NotImplementedError:
        return {k: v.detach().float().cpu().clone() for k, v in runner.iter_full_state_dict(model)}


def _guarded(fn: Callable[[], Any], seconds: dict[str, float], check: str) -> Any:
    """Run one check; an exception becomes its result (its type and message apart, for the test to match a
    documented refusal), so the other checks still run and report."""
    start = time.perf_counter()
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - reported to the test, which fails that check with it
        return {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}", "error_type": type(err).__name__,
                "message": str(err)}
    finally:
        seconds[check] = round(time.perf_counter() - start, 2)


# ---- checks on one model: init, whole parameters, streamed state dict -----------------------------------


def init_and_gathered(name: str, reference: dict[str, torch.Tensor], seconds: dict[str, float]) -> dict:
    """init_module's weights, gathered_parameters and iter_full_state_dict on one set-up model; gathered runs
    guarded on its own, so a strategy that refuses it (by name, as Pipeline does) still reports its init."""
    runner = Runner(build_strategy(name), seed=0)
    model, _ = setup_training(runner)
    probe = _stream_probe(runner.unwrap_model(model))
    with probe:
        state = dict(runner.iter_full_state_dict(model))
    init = {"state": state, "main": runner.is_main_process, "stream_peak": probe.peak,
            "stream_new_peak": probe.new_peak, "model_bytes": 4 * _numel()}
    return {"init": init, "gathered": _guarded(lambda: _gathered(runner, model, reference), seconds, "gathered"),
            "facts": _guarded(lambda: _facts(runner), seconds, "facts")}


def _facts(runner: Runner) -> dict:
    """What the set-up strategy declares (family, dims) and what Accelerate's front says of it on these ranks."""
    from shardkit.accelerate_compat.state import AcceleratorState, forget_state, use_strategy

    s = runner.strategy
    use_strategy(s)
    try:
        accelerate = str(AcceleratorState().distributed_type)
    finally:
        forget_state()
    dims = None if s.dims is None else {"sizes": s.dims.sizes, "world_size": s.dims.world_size}
    return {"family": s.family.value, "dims": dims, "world_size": s.world_size, "accelerate": accelerate}


def _stream_probe(module: torch.nn.Module):
    """test_init_parity's LiveBytes (the peak of the storages torch ops return inside the block, views of held
    tensors included), that also keeps ``new_peak``: the storages this rank did not hold before the block. A
    pipeline rank holds its stages whole, and its state dict's views of them allocate nothing."""
    from test_init_parity import LiveBytes

    held = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
            for p in (*module.parameters(), *module.buffers())}

    class NewBytes(LiveBytes):
        new_peak = 0

        @override
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.new_peak = max(self.new_peak, sum(n for ptr, (_, n) in self.live.items() if ptr not in held))
            return out

    return NewBytes()


def _numel() -> int:
    """Parameters of the model, tied weights once (built on meta: no memory, no RNG draws)."""
    with torch.device("meta"):
        return sum(p.numel() for p in Llama(CONFIG).parameters())


def _gathered(runner: Runner, model, reference: dict[str, torch.Tensor]) -> dict:
    inner = runner.unwrap_model(model)
    names = [n for n, _ in inner.named_parameters()]
    out: dict = {"model_numel": _numel()}
    with runner.gathered_parameters(inner.parameters()) as whole:
        out["types"] = sorted({type(t).__name__ for t in whole})
        out["differ"] = [n for n, t in zip(names, whole) if not torch.equal(t.detach().cpu(), reference[n])]
        out["flat_numel"] = torch.cat([t.detach().reshape(-1) for t in whole]).numel()
        # The documented idiom: the model's own parameters read whole inside the block.
        out["module_flat_numel"] = torch.cat([p.detach().reshape(-1) for p in inner.parameters()]).numel()
    target = dict(inner.named_parameters())["layers.1.mlp.up_proj.weight"]
    with runner.gathered_parameters([target], modifier_rank=0) as (w,), torch.no_grad():
        w.fill_(0.25 if runner.rank == 0 else 7.0)  # only rank 0's write counts
    with runner.gathered_parameters([target]) as (w,):
        out["kept"] = torch.equal(w.detach(), torch.full_like(w.detach(), 0.25))
    return out


# ---- training parity with DDP ---------------------------------------------------------------------------


def train_parity(strategy, steps: int = PARITY_STEPS) -> dict:
    """AdamW, no accumulation, no clipping: each step's global loss and the final whole weights."""
    runner = Runner(strategy, seed=0)
    model, _ = setup_training(runner)
    losses = []
    for x in batches(steps):
        x = local_slice(runner, x)
        loss = model(x, labels=x)
        runner.backward(loss)
        runner.step()
        losses.append(global_mean(runner, loss))
    return {"losses": losses, "weights": whole_weights(runner, model)}


def train_accumulate_clip(strategy) -> dict:
    """Accumulation over 2 micro-batches and clipping to CLIP: the norms clip returns, global losses, weights."""
    runner = Runner(strategy, seed=0, gradient_accumulation_steps=ACCUM)
    model, _ = setup_training(runner)
    losses, norms, norm_types = [], [], set()
    for x in batches(ACCUM_MICRO_STEPS):
        x = local_slice(runner, x)
        loss = model(x, labels=x)
        runner.backward(loss)
        losses.append(global_mean(runner, loss))
        norm = runner.clip_gradients(CLIP)
        runner.step()
        if norm is not None:  # ZeRO fills the norm in during its step, so it is read after step()
            norm_types.add((type(norm).__name__, norm.dim()))
            norms.append(float(norm))
    return {"losses": losses, "norms": norms, "norm_types": sorted(norm_types),
            "weights": whole_weights(runner, model), "steps": runner.optimizer_steps}


# ---- FP16 overflow --------------------------------------------------------------------------------------


def fp16_overflow(name: str) -> dict:
    """One good step, then an inf on the last rank only: every rank must skip and halve the scale.

    The inf goes into this rank's local part of one gradient after backward (the reduction is done, so no
    other rank can see it) where the engine shows gradients on the parameters, else into this rank's loss.
    """
    try:
        runner = Runner(build_strategy(name), FP16(initial_scale_power=8, hysteresis=1), seed=0)
        model, _ = setup_training(runner, "adamw")
    except Exception as err:  # noqa: BLE001 - an engine without FP16 here says so; the test names it
        if "fp16" in str(err).lower() and "not supported" in str(err).lower():
            return {"unsupported": f"{type(err).__name__}: {err}"}
        raise
    x = local_slice(runner, batches(1)[0])
    runner.backward(model(x, labels=x))
    shows_grads = any(p.grad is not None for p in model.parameters())  # DeepSpeed keeps them in its engine
    first = runner.step()
    before = whole_weights(runner, model)
    last = runner.rank == runner.world_size - 1
    loss = model(x, labels=x)
    where = "none"
    if last and not shows_grads:
        loss, where = loss * float("inf"), "loss"
    runner.backward(loss)
    if last and shows_grads:
        where = _inf_into_grad(model)
    stepped = runner.step()
    after = whole_weights(runner, model)
    return {"first": first, "stepped": stepped, "scale": runner.precision.current_loss_scale, "where": where,
            "unchanged": before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before),
            "compared": sorted(before)}


def _inf_into_grad(model) -> str:
    grad = next(p.grad for p in model.parameters() if p.grad is not None)
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    local.view(-1)[0] = float("inf")
    return "grad"


# ---- save then exact resume -----------------------------------------------------------------------------


def _resume_build(name: str):
    """test_resume.py's workload: dropout, a shuffled loader mid-epoch, StepLR, accumulation 2, clipping 1."""
    runner = Runner(build_strategy(name), gradient_accumulation_steps=2, seed=0)
    model, optimizer = setup_training(runner, dropout=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    dataset = ByteTextDataset(TEXT, seq_len=16, stride=16)  # 575 windows: every save is mid-epoch
    loader = runner.setup_dataloader(DataLoader(dataset, batch_size=4, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "step": 0}
    return runner, model, loader, state


def _train_steps(runner: Runner, model, batches_left, steps: int) -> list[float]:
    """``steps`` optimizer steps from ``batches_left``, an iterator over the loader kept across calls (a new
    ``iter(loader)`` starts the next epoch, unless a load has just set the position)."""
    losses: list[float] = []
    target = runner.optimizer_steps + steps
    while runner.optimizer_steps < target:
        batch = next(batches_left)
        loss = model(batch["input_ids"], batch["labels"])
        runner.backward(loss)
        losses.append(loss.item())
        if runner.sync_gradients:
            runner.clip_gradients(1.0)
            runner.step()
    return losses


def checkpoint_dir(root: str, name: str, runner: Runner) -> Path:
    # A one-process strategy runs in each launched process on its own: each saves its own checkpoint.
    own = f"-process{os.environ.get('RANK', '0')}" if runner.world_size == 1 else ""
    return Path(root) / f"{name}{own}"


def exact_resume(name: str, root: str) -> dict:
    """2N steps straight (saving after N and at the end) against a fresh run that loads the N-step save and
    trains N more (and saves at the end): the test compares losses, weights and both final checkpoints. The
    saves are asynchronous (issue 27): training goes on while the N-step one is written (the resume must not see
    it), the next save waits for it, and the resumed run's save is in flight while its weights are read."""
    runner, model, loader, state = _resume_build(name)
    where, batches_left = checkpoint_dir(root, name, runner), iter(loader)
    straight = _train_steps(runner, model, batches_left, RESUME_STEPS)
    state["step"] = RESUME_STEPS
    runner.save(where / "mid", state, blocking=False)
    at_save = whole_weights(runner, model)
    straight += _train_steps(runner, model, batches_left, RESUME_STEPS)
    state["step"] = 2 * RESUME_STEPS
    runner.save(where / "straight", state, blocking=False)
    weights = whole_weights(runner, model)
    runner.wait_for_save()

    torch.manual_seed(1234)  # whatever the RNG holds now, the load must restore the saved one
    runner2, model2, loader2, state2 = _resume_build(name)
    values = runner2.load(where / "mid", state2)
    resumed = _train_steps(runner2, model2, iter(loader2), RESUME_STEPS)
    state2["step"] = 2 * RESUME_STEPS
    runner2.save(where / "resumed", state2, blocking=False)
    resumed_weights = whole_weights(runner2, model2)
    runner2.wait_for_save()
    return {"straight": straight, "resumed": resumed, "loaded_step": values["step"], "dir": str(where),
            "saved_world_size": runner.world_size, "weights_at_save": at_save, "weights": weights,
            "resumed_weights": resumed_weights, "scales": [r.precision.current_loss_scale
                                                                         for r in (runner, runner2)],
            "steps": [runner.optimizer_steps, runner2.optimizer_steps]}


# ---- generation -----------------------------------------------------------------------------------------


def requests(dp_rank: int) -> tuple[torch.Tensor, int]:
    """Data-parallel rank 0: two prompts of 5 tokens, 6 new tokens; the others: one prompt of 3, 3 new."""
    g = torch.Generator().manual_seed(100 + dp_rank)
    batch, length, new = (2, 5, 6) if dp_rank == 0 else (1, 3, 3)
    return torch.randint(1, CONFIG.vocab_size, (batch, length), generator=g), new


def generation(name: str, reference: dict[str, torch.Tensor]) -> dict:
    """Greedy tokens from runner.generate (set up without an optimizer) and from plain SingleDevice weights."""
    base = Llama(CONFIG).eval()
    base.load_state_dict(reference)
    ids0, new0 = requests(0)
    eos = int(base.generate(ids0, max_new_tokens=new0, synced=False)[0, ids0.shape[1] + 1])  # mid-sequence EOS
    runner = Runner(build_strategy(name), seed=0)
    model = Llama(CONFIG).eval()
    model.load_state_dict(reference)
    model = runner.setup(model)
    ids, new = requests(runner.strategy.data_parallel_rank)
    out = {"dp_size": runner.strategy.data_parallel_size}
    for case, e in (("plain", None), ("eos", eos)):
        want = base.generate(ids, max_new_tokens=new, eos_token_id=e, pad_token_id=0, synced=False)
        got = runner.generate(model, ids, max_new_tokens=new, eos_token_id=e, pad_token_id=0)
        out[case] = (got.cpu(), want)
    # left-padded prompts under an attention mask: each row's tokens are its prompt's alone, on SingleDevice
    padded, mask = ids.clone(), torch.ones_like(ids)
    padded[0, :2], mask[0, :2] = 0, 0
    got = runner.generate(model, padded, attention_mask=mask, max_new_tokens=new, pad_token_id=0)
    want = [base.generate(padded[i:i + 1, int(mask[i].argmax()):], max_new_tokens=new, synced=False)
            for i in range(len(ids))]
    out["padded"] = ([row[int(m.argmax()):] for row, m in zip(got.cpu(), mask)], [w[0] for w in want])
    return out


# ---- the workers ----------------------------------------------------------------------------------------


def contract_worker(name: str, root: str, entries: tuple = ()) -> dict:
    """Every check for strategy ``name`` in this process group, then DDP's references on the same data.

    The strategy runs first: a one-process strategy must see no process group (DDP's setup creates it).
    ``entries``: the parent's registrations (:func:`registrations`), replayed here first.
    """
    replay(entries)
    seconds: dict[str, float] = {}
    reference = single_device_reference()
    out: dict = {"name": name, "reference": reference, "seconds": seconds}
    first = _guarded(lambda: init_and_gathered(name, reference, seconds), seconds, "init+gathered")
    out["init"], out["gathered"], out["facts"] = (first, first, first) if "error" in first else (
        first["init"], first["gathered"], first["facts"])
    out["fp32_losses"] = _guarded(lambda: train_parity(build_strategy(name)), seconds, "fp32_losses")
    out["accumulation_clipping"] = _guarded(lambda: train_accumulate_clip(build_strategy(name)), seconds,
                                            "accumulation_clipping")
    out["fp16_overflow"] = _guarded(lambda: fp16_overflow(name), seconds, "fp16_overflow")
    out["resume"] = _guarded(lambda: exact_resume(name, root), seconds, "resume")
    out["generation"] = _guarded(lambda: generation(name, reference), seconds, "generation")
    from contract_preference import PREFERENCE_ADAMW, preference_one_device, preference_step

    out["preference"] = _guarded(lambda: preference_step(name), seconds, "preference")
    start = time.perf_counter()
    out["ddp"] = {"fp32_losses": train_parity(build_strategy("ddp")),
                  "accumulation_clipping": train_accumulate_clip(build_strategy("ddp"))}
    out["ddp"]["preference"] = preference_one_device("adamw" if name in PREFERENCE_ADAMW else "sgd")
    seconds["ddp_reference"] = round(time.perf_counter() - start, 2)
    return out


def _entry_values(reader, name: str, kind: str) -> Any:
    from shardkit.strategies._sharded_state import read_full_optimizer_state

    if kind == "optimizer":
        return read_full_optimizer_state(reader, name)
    if kind == "module":
        return dict(reader.iter_full_tensors(name))
    return reader.read_json(name) if reader.entries()[name] == "json" else reader.read_state(name)


def checkpoint_contents(path: str | Path, kinds: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every entry of a checkpoint whole (sharded tensors reassembled), keyed by entry name; with ``kinds``
    only the entries holding those kinds of object (module, optimizer, stateful)."""
    from shardkit.checkpoint import CheckpointReader

    with CheckpointReader(path) as reader:
        saved = reader.read_json("entries")
        out = {}
        for entry in reader.entries():
            kind = saved.get(entry, "runner")
            if kinds is None or kind in kinds:
                out[entry] = _entry_values(reader, entry, kind)
        return out


def reload_worker(name: str, path: str, entries: tuple = ()) -> dict:
    """On 1 rank: the strategy loads the 2-rank save at ``path`` (a different init first), saves again, and
    takes one more step; or the error it raises, for the test to match against the documented one."""
    replay(entries)
    runner = Runner(build_strategy(name), gradient_accumulation_steps=2, seed=123)
    model, optimizer = setup_training(runner, dropout=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    try:
        values = runner.load(path, state)
    except Exception as err:  # noqa: BLE001 - compared with the strategy's documented error by the test
        return {"error_type": type(err).__name__, "error": str(err)}
    weights = whole_weights(runner, model)
    again = Path(path).parent / "reloaded-1-rank"
    runner.save(again, state, blocking=False)  # written while the next step runs
    x = batches(1)[0]
    for micro in range(2):
        loss = model(x[2 * micro:2 * micro + 2], labels=x[2 * micro:2 * micro + 2])
        runner.backward(loss)
    stepped = runner.step()
    runner.wait_for_save()
    return {"world_size": runner.world_size, "step": values["step"], "weights": weights, "again": str(again),
            "stepped": stepped, "loss": loss.item()}
