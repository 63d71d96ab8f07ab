"""What the Accelerate-front tests run inside their ranks: the seed page's training code as written, and the
checks of real behaviour (accumulation equal to the Runner's, exact resume, gather_for_metrics, the window).

Functions here run in spawned ranks (``harness.run_distributed``), so they are top level and take picklable
arguments. Each check returns plain results or ``{"error": traceback}``, so one launch per world size runs
every check under every strategy in one process group.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

# The strategies the seed's code runs under, as `shardkit launch --config_file` would choose them: an Accelerate
# YAML per kind (fp32, so that every strategy can be compared with DDP).
YAML = {
    "ddp": "distributed_type: MULTI_CPU\nnum_processes: {n}\n",
    "fsdp": "distributed_type: FSDP\nnum_processes: {n}\nfsdp_config:\n  fsdp_version: 2\n"
            "  fsdp_transformer_layer_cls_to_wrap: BertLayer\n",
    "zero2": "distributed_type: DEEPSPEED\nnum_processes: {n}\ndeepspeed_config:\n  zero_stage: 2\n",
    "zero3": "distributed_type: DEEPSPEED\nnum_processes: {n}\ndeepspeed_config:\n  zero_stage: 3\n",
}
KINDS = tuple(YAML)
SAMPLES, BATCH = 20, 4


def tiny_checkpoint(path: str) -> str:
    """A 2-layer BERT classifier saved where ``from_pretrained`` reads it (nothing downloaded)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    BertForSequenceClassification(config).save_pretrained(path)
    return path


def dataset(n: int = SAMPLES, length: int = 8) -> list[dict[str, torch.Tensor]]:
    """Token sequences labelled by whether token 5 occurs in them: learnable by the tiny model."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(6, 64, (n, length), generator=g)
    labels = (torch.arange(n) % 2)
    ids[labels == 1, 0] = 5
    return [{"input_ids": ids[i], "attention_mask": torch.ones(length, dtype=torch.long), "labels": labels[i]}
            for i in range(n)]


@contextlib.contextmanager
def launched_with(kind: str | None, root: str, world: int):
    """The environment `shardkit launch --config_file <kind>.yaml` gives the script (none: a plain launch)."""
    if kind not in YAML:  # "single": no config file, no launcher
        yield
        return
    path = Path(root) / f"{kind}-{world}.yaml"
    if not path.exists():
        path.write_text(YAML[kind].format(n=world))
    os.environ["SHARDKIT_CONFIG_FILE"] = str(path)
    try:
        yield
    finally:
        del os.environ["SHARDKIT_CONFIG_FILE"]


def _flat_weights(accelerator, model) -> torch.Tensor:
    """The whole model as one fp32 vector on every rank (gathered however it is sharded)."""
    return _broadcast_flat(accelerator.runner, accelerator.get_state_dict(model))


# ---- the seed page (001): "Distributed training with Accelerate", its training program as written ----------

def seed_program(checkpoint: str, train_dataloader: DataLoader, eval_dataloader: DataLoader) -> dict[str, Any]:
    """The page's program with its '+' lines in, its '-' lines out, and `from accelerate` -> `from shardkit`.

    NOTE: transformers 5 no longer exports AdamW (the page's `from transformers import AdamW`); torch's is the one
    it deprecated in favour of, imported here under the same name.
    """
    from torch.optim import AdamW
    from tqdm.auto import tqdm
    from transformers import AutoModelForSequenceClassification, get_scheduler

    from shardkit import Accelerator

    accelerator = Accelerator()

    model = AutoModelForSequenceClassification.from_pretrained(checkpoint, num_labels=2)
    optimizer = AdamW(model.parameters(), lr=3e-5)

    train_dataloader, eval_dataloader, model, optimizer = accelerator.prepare(
        train_dataloader, eval_dataloader, model, optimizer
    )

    num_epochs = 3
    num_training_steps = num_epochs * len(train_dataloader)
    lr_scheduler = get_scheduler(
        "linear",
        optimizer=optimizer,
        num_warmup_steps=0,
        num_training_steps=num_training_steps
    )

    progress_bar = tqdm(range(num_training_steps))
    initial = _flat_weights(accelerator, model)

    model.train()
    for epoch in range(num_epochs):
        for batch in train_dataloader:
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)

            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            progress_bar.update(1)

    final = _flat_weights(accelerator, model)
    mine = final.clone()
    everyone = accelerator.gather(mine[None])
    return {"steps": progress_bar.n, "expected_steps": num_training_steps, "last_lr": lr_scheduler.get_last_lr()[0],
            "moved": float((final - initial).abs().max()), "weights": final, "ranks_equal": bool(
                all(torch.equal(everyone[0], row) for row in everyone)), "distributed_type": str(
                accelerator.distributed_type), "optimizer_steps": accelerator.runner.optimizer_steps}


def run_seed_program(checkpoint: str) -> dict[str, Any]:
    train_dataloader = DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    eval_dataloader = DataLoader(dataset(6), batch_size=BATCH)
    return seed_program(checkpoint, train_dataloader, eval_dataloader)


# ---- the TPU page (003): its training function, for notebook_launcher ---------------------------------------

hyperparameters = {"learning_rate": 1e-3, "num_epochs": 2, "train_batch_size": BATCH, "eval_batch_size": BATCH}


def create_dataloaders(train_batch_size: int, eval_batch_size: int):
    return (DataLoader(dataset(), batch_size=train_batch_size, shuffle=True),
            DataLoader(dataset(6), batch_size=eval_batch_size))


def training_function(model):
    """The TPU page's function after its diff (the model made once, outside, and passed in), returning what the
    test checks (the page's function returns nothing)."""
    from torch.optim import AdamW

    from shardkit import Accelerator

    # Initialize accelerator
    accelerator = Accelerator()
    train_dataloader, eval_dataloader = create_dataloaders(
        train_batch_size=hyperparameters["train_batch_size"], eval_batch_size=hyperparameters["eval_batch_size"]
    )

    # Instantiate optimizer
    optimizer = AdamW(params=model.parameters(), lr=hyperparameters["learning_rate"])

    # Prepare everything
    # There is no specific order to remember, we just need to unpack the objects in the same order we gave them to the
    # prepare method.
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )

    num_epochs = hyperparameters["num_epochs"]
    losses = []
    # Now we train the model
    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)

            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return {"losses": losses, "num_processes": accelerator.num_processes,
            "weights": _flat_weights(accelerator, model)}


# ---- real behaviour ------------------------------------------------------------------------------------------

def plugin_accelerator(kind: str, **kwargs: Any):
    """An Accelerator for ``kind`` built from Accelerate's constructor arguments (plugin dicts and objects)."""
    from shardkit import Accelerator

    if kind == "fsdp":
        return Accelerator(fsdp_plugin={"fsdp_version": 2, "transformer_cls_names_to_wrap": ["BertLayer"]}, **kwargs)
    if kind == "zero2":
        return Accelerator(deepspeed_plugin={"zero_stage": 2}, **kwargs)
    if kind == "zero3":
        from accelerate.utils import DeepSpeedPlugin  # Accelerate's own object, read by attribute

        return Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3), **kwargs)
    from shardkit.accelerate_compat import DistributedDataParallelKwargs

    return Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=1)], **kwargs)


def _model(checkpoint: str):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(checkpoint, num_labels=2)


def accumulation_vs_runner(kind: str, checkpoint: str, root: str, steps: int = 2) -> dict[str, Any]:
    """``accumulate(model)`` with 2 micro-batches per step against the Runner's own window: the same weights."""
    from shardkit import Runner

    accelerator = plugin_accelerator(kind, gradient_accumulation_steps=2)
    model = _model(checkpoint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset(32), batch_size=BATCH)  # 4 batches a rank on 2 ranks: no window ends early
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    pattern = []
    for index, batch in enumerate(loader):
        if index == 2 * steps:
            break
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            pattern.append(accelerator.sync_gradients)
            optimizer.zero_grad()
    front = _flat_weights(accelerator, model)
    export = _exported(accelerator, model, str(Path(root) / f"export-{kind}"))

    runner = Runner(type(accelerator.runner.strategy)(**_same_settings(accelerator.runner.strategy)),
                    gradient_accumulation_steps=2)
    model = _model(checkpoint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = runner.setup(model, optimizer)
    loader = runner.setup_dataloader(DataLoader(dataset(32), batch_size=BATCH))
    for index, batch in enumerate(loader):
        if index == 2 * steps:
            break
        runner.backward(model(**batch).loss)
        runner.step()
    plain = _runner_weights(runner, model)
    return {"front": front, "runner": plain, "pattern": pattern, "steps": accelerator.runner.optimizer_steps,
            "runner_steps": runner.optimizer_steps, "export": export, "settings": _same_settings(
                accelerator.runner.strategy)}


def _exported(accelerator, model, path: str) -> dict[str, Any]:
    """``save_model`` on every rank; the main process reads the files back with safetensors and compares them with
    the gathered state dict."""
    from safetensors.torch import load_file

    accelerator.save_model(model, path)
    state = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return {}
    files = sorted(Path(path).glob("*.safetensors"))
    saved = {k: v for f in files for k, v in load_file(str(f)).items()}
    return {"files": [f.name for f in files], "equal": sorted(saved) == sorted(state) and all(
        torch.equal(saved[k], state[k]) for k in state)}


def _same_settings(strategy) -> dict[str, Any]:
    """Constructor arguments that rebuild ``strategy`` with the same settings (for the Runner's side)."""
    settings = getattr(strategy, "settings", None)
    name = type(strategy).__name__
    if name == "FSDP":
        return {"auto_wrap": settings.auto_wrap}
    if name == "DDP":
        return {"bucket_cap_mb": settings.bucket_cap_mb}
    return {}


def _runner_weights(runner, model) -> torch.Tensor:
    return _broadcast_flat(runner, dict(runner.iter_full_state_dict(model)))


def _broadcast_flat(runner, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The main process's full state dict as one fp32 vector, on every rank (a list: the others hold none)."""
    vector = torch.cat([t.float().reshape(-1) for t in state.values()]) if state else None
    return runner.broadcast([vector], 0)[0]


def resume(kind: str, checkpoint: str, root: str) -> dict[str, Any]:
    """Train 3 windows saving after the 1st; a fresh Accelerator loading that save trains the last 2 the same."""
    def build():
        accelerator = plugin_accelerator(kind, gradient_accumulation_steps=2)
        model = _model(checkpoint)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        loader = DataLoader(dataset(), batch_size=BATCH, shuffle=True)
        return accelerator, *accelerator.prepare(model, optimizer, loader, scheduler)

    def train(accelerator, model, optimizer, loader, scheduler, windows, save=None):
        losses = []
        while True:
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                losses.append(loss.item())
                if accelerator.sync_gradients:
                    windows -= 1
                    if save is not None and len(losses) == 2:
                        accelerator.save_state(save)
                    if windows == 0:
                        return losses

    path = str(Path(root) / f"resume-{kind}")
    first = build()
    straight = train(*first, windows=3, save=path)
    straight_weights = _flat_weights(first[0], first[1])
    second = build()
    second[0].load_state(path)
    resumed = train(*second, windows=2)
    return {"straight": straight[2:], "resumed": resumed, "straight_weights": straight_weights,
            "resumed_weights": _flat_weights(second[0], second[1]), "lr": second[4].get_last_lr(),
            "straight_lr": first[4].get_last_lr(), "step": second[0].step}


def metrics(kind: str) -> dict[str, Any]:
    """gather_for_metrics over an eval set of 7 samples in batches of 2: every sample exactly once."""
    accelerator = plugin_accelerator(kind)
    loader = accelerator.prepare(DataLoader(torch.arange(7), batch_size=2))
    seen, plain = [], 0
    for batch in loader:
        seen += accelerator.gather_for_metrics(batch).tolist()
        plain += len(accelerator.gather(batch))
        objects = accelerator.gather_for_metrics([f"s{int(i)}" for i in batch])
    return {"seen": seen, "plain": plain, "objects_last": objects}


def loaders(root: str) -> dict[str, Any]:
    """The data loaders Accelerate users rely on, on real processes: a loader with its own batch sampler, uneven
    evaluation under join_uneven_inputs, an iterable dataset resumed exactly, prepare_data_loader's order, and a
    checkpoint directory that differs between processes."""
    from torch.utils.data import BatchSampler, IterableDataset, RandomSampler

    from shardkit import Accelerator
    from shardkit.accelerate_compat import DataLoaderConfiguration, prepare_data_loader, set_seed

    torch.manual_seed(int(os.environ["RANK"]))  # each process's generators differ, as under a launcher
    set_seed(7)
    out: dict[str, Any] = {}
    accelerator = Accelerator()
    own = accelerator.prepare(DataLoader(list(range(22)), batch_sampler=BatchSampler(RandomSampler(range(22)), 4,
                                                                                     False)))
    out["own_batches"] = [b.tolist() for b in own]
    out["own_metrics"] = sorted(i for b in own for i in accelerator.gather_for_metrics(b).tolist())

    uneven = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
    model = uneven.prepare(torch.nn.Linear(1, 1))
    evaluation = uneven.prepare(DataLoader(torch.arange(3.0), batch_size=1))
    out["uneven"] = []
    with uneven.join_uneven_inputs([model]):
        for batch in evaluation:
            model(batch[:, None]).sum().backward()
            out["uneven"] += batch.tolist()

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(16)

    stream = accelerator.prepare(DataLoader(Stream(), batch_size=2))
    seen, rest, state = [], [], None
    for step, batch in enumerate(stream):
        seen += batch.tolist()
        if step == 1:
            state = stream.state_dict()
        elif step > 1:
            rest.append(batch.tolist())
    stream.load_state_dict(state)
    out["stream"] = {"seen": seen, "rest": rest, "resumed": [b.tolist() for b in stream]}

    # A loader shuffled with its own generator, seeded differently on each process: the main process's decides.
    mine = torch.Generator().manual_seed(int(os.environ["RANK"]))
    shuffled = accelerator.prepare(DataLoader(list(range(10)), batch_size=5, shuffle=True, generator=mine))
    out["generator_order"] = [b.tolist() for b in shuffled]

    ordered = prepare_data_loader(DataLoader(range(16), batch_size=4))
    out["prepare_data_loader"] = torch.cat([accelerator.gather(b) for b in ordered]).tolist()
    try:
        accelerator.save_state(f"{root}/own-{os.environ['RANK']}")
        out["different_dirs"] = "saved"
    except ValueError as err:
        out["different_dirs"] = str(err)
    return out


def _guarded(fn, *args) -> Any:
    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def worker(checkpoint: str, root: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    """Every check under every strategy of ``kinds``, in this job's one process group."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for kind in kinds:
        torch.manual_seed(0)
        with launched_with(kind, root, world):
            results[f"seed/{kind}"] = _guarded(run_seed_program, checkpoint)
        results[f"accumulation/{kind}"] = _guarded(accumulation_vs_runner, kind, checkpoint, root)
        results[f"resume/{kind}"] = _guarded(resume, kind, checkpoint, root)
        results[f"metrics/{kind}"] = _guarded(metrics, kind)
    if world == 2:
        results["loaders"] = _guarded(loaders, root)
    if dist.is_initialized():
        dist.barrier()
    return results
