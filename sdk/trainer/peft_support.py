"""LoRA (``peft``) models in the Trainer, under every strategy: adapter-only checkpoints and saves, merged HF exports.

    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    trainer = Trainer(model, args, train_dataset=data, strategy=FSDP())
    trainer.train()
    trainer.save_model("adapter/")                          # adapter_model.safetensors + adapter_config.json
    trainer.save_model("merged/", merge_adapters=True)      # the base model with W + scale * B @ A, HF format

What is saved: a PeftModel's frozen base weights never change, so the Trainer's checkpoints hold only the
trainable parameters (the adapters, and ``modules_to_save`` copies) through :func:`checkpoint_module` — a view
module holding those parameters under their own names, which every strategy's save/load hooks take as they take
a model (FSDP's DTensor shards, ZeRO's fp32 fragments). A resumed run rebuilds the same base and loads the
adapters and the optimizer state into it. Each checkpoint also gets peft's files (``adapter_model.safetensors``,
``adapter_config.json``) so ``PeftModel.from_pretrained(base, "checkpoint-N")`` reads it as HF's do.

Gathering: adapters are gathered with ``runner.gathered_parameters`` (small: only they are gathered); the
merged export streams ``runner.iter_full_state_dict`` (one module at a time) through :func:`merged_tensors`,
which folds each LoRA layer into its base weight as its tensors arrive, into
:func:`shardkit.checkpoint.hf.save_pretrained`. No rank holds more than one module gathered.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["base_model_of", "checkpoint_module", "is_peft_model", "merged_tensors", "save_adapters",
           "save_peft_model", "trainable_view"]

_PEFT_PREFIX = "base_model.model."


def is_peft_model(module: Any) -> bool:
    """True for a ``peft.PeftModel`` (without importing peft: a PeftModel exists only once peft is imported)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def base_model_of(module: nn.Module) -> nn.Module:
    """The model a PeftModel wraps (with the LoRA layers injected), else ``module``: what the loss is read from."""
    return module.get_base_model() if is_peft_model(module) else module


def trainable_view(module: nn.Module) -> nn.Module:
    """A module holding ``module``'s trainable parameters (the same objects) under their own names.

    Its ``state_dict`` has the keys of ``module.state_dict()`` for the trainable parameters only, so a strategy's
    checkpoint hooks save and load it as they do a model, sharded or not, and loading writes the live parameters.
    Build it when needed: FSDP2 swaps the registered parameters between forward and backward.
    """
    root = nn.Module()
    count = 0
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if part not in node._modules:
                node.add_module(part, nn.Module())
            node = node._modules[part]
        node.register_parameter(leaf, param)
        count += 1
    if not count:
        raise ValueError(f"{type(module).__name__} has no trainable parameter (requires_grad=True): a peft model "
                         "from get_peft_model() has its adapters trainable; was every parameter frozen after it?")
    return root


def checkpoint_module(runner: Any, model: nn.Module) -> nn.Module:
    """What a Trainer checkpoint's "model" entry holds: a PeftModel's trainable parameters, else the model."""
    module = runner.unwrap_model(model)
    if not is_peft_model(module):
        return model
    view = trainable_view(module)
    engine_optimizer = getattr(model, "optimizer", None)
    if engine_optimizer is not None:
        # ZeRO's module load refreshes DeepSpeed's low-precision copies through the engine's optimizer.
        view.optimizer = engine_optimizer
    return view


def _trainable_state(runner: Any, module: nn.Module) -> dict[str, torch.Tensor]:
    """Whole CPU copies of the trainable parameters on the main process ({} elsewhere); a collective."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    with runner.gathered_parameters([p for _, p in named]) as whole:
        if not runner.is_main_process:
            return {}
        return {n: t.detach().cpu().clone() for (n, _), t in zip(named, whole)}


def save_adapters(runner: Any, model: nn.Module, output_dir: str | Path) -> None:
    """Write peft's ``adapter_model.safetensors`` and ``adapter_config.json`` into ``output_dir``.

    Call on every rank (the gather is a collective); the main process writes. The adapters are gathered whole
    from any strategy's shards; ``PeftModel.from_pretrained(base_model, output_dir)`` loads the directory.
    """
    module = runner.unwrap_model(model)
    state = _trainable_state(runner, module)
    if runner.is_main_process:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        # NOTE: save_embedding_layers=False: the frozen base embedding is not gathered or saved (peft's "auto"
        # would look it up on the Hub); trained embeddings are trainable (modules_to_save) and so are saved.
        module.save_pretrained(str(output_dir), state_dict=state, safe_serialization=True,
                               save_embedding_layers=False)
    runner.barrier("peft-save-adapters")


def _lora_layers(module: nn.Module) -> dict[str, tuple[list[str], dict[str, float], bool]]:
    """State-dict prefix of each LoRA layer -> (active adapters, scaling per adapter, fan_in_fan_out).

    Raises:
        NotImplementedError: naming a layer whose merge is not plain ``W + scale * B @ A`` (DoRA, LoRA bias,
            non-Linear LoRA layers, 4-bit base weights) or that is already merged.
    """
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    from shardkit.strategies.quant_storage import quantized_parameters

    quantized = quantized_parameters(module)
    if quantized:
        raise NotImplementedError(f"merge_adapters: the base model holds 4-bit weights ({quantized[0][0]}, QLoRA); "
                                  "merging into packed weights would lose the adapters' precision: save the adapters "
                                  "(merge_adapters=False) and merge them into the unquantized base model")
    layers = {}
    for name, sub in module.named_modules():
        if not isinstance(sub, LoraLayer):
            continue
        adapters = [a for a in sub.active_adapters if a in sub.lora_A]
        fix = "save the adapters (merge_adapters=False) and merge them with peft's merge_and_unload() in one process"
        if not isinstance(sub, LoraLinear):
            raise NotImplementedError(f"merge_adapters: {name} is a {type(sub).__name__}; only LoRA on Linear "
                                      f"layers is merged here: {fix}")
        odd = [a for a in adapters if sub.use_dora.get(a) or sub.lora_bias.get(a)]
        if odd or sub.merged:
            what = "already merged" if sub.merged else f"uses DoRA or lora_bias (adapters {odd})"
            raise NotImplementedError(f"merge_adapters: {name} {what}: {fix}")
        layers[f"{name}."] = (adapters, {a: float(sub.scaling[a]) for a in adapters}, bool(sub.fan_in_fan_out))
    return layers


def _base_key(key: str) -> str:
    return key.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


def _merge(pending: dict[str, torch.Tensor], prefix: str, layer: tuple[list[str], dict[str, float], bool]):
    adapters, scaling, fan_in_fan_out = layer
    weight = pending[f"{prefix}base_layer.weight"]
    merged = weight.float()
    for a in adapters:
        delta = pending[f"{prefix}lora_B.{a}.weight"].float() @ pending[f"{prefix}lora_A.{a}.weight"].float()
        merged = merged + (delta.T if fan_in_fan_out else delta) * scaling[a]
    yield _base_key(f"{prefix}base_layer.weight"), merged.to(weight.dtype)
    for key, tensor in pending.items():
        if key.startswith(f"{prefix}base_layer.") and not key.endswith("base_layer.weight"):
            yield _base_key(key), tensor


def _modules_to_save_key(key: str, adapters: set[str]) -> str | None:
    """The base name of a ModulesToSaveWrapper key: the active copy's under the original name, others dropped."""
    if ".original_module." in key:
        return None
    head, _, rest = key.partition(".modules_to_save.")
    adapter, _, leaf = rest.partition(".")
    return f"{head}.{leaf}" if adapter in adapters else None


def merged_tensors(stream: Iterable[tuple[str, torch.Tensor]], module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's ``(name, tensor)`` pairs with every LoRA layer merged in, from a PeftModel's full state
    stream (``runner.iter_full_state_dict``): a layer's tensors are held until its last one arrives.

    Keys lose peft's ``base_model.model.`` prefix and ``.base_layer``; LoRA factors and inactive adapters are
    dropped; a ``modules_to_save`` copy takes its original module's name.
    """
    layers = _lora_layers(module)
    active = set(getattr(module, "active_adapters", None) or [])
    prefix, pending = None, {}
    for key, tensor in stream:
        owner = prefix if prefix is not None and key.startswith(prefix) else \
            next((p for p in layers if key.startswith(p)), None)
        if prefix is not None and owner != prefix:
            yield from _merge(pending, prefix, layers[prefix])
            prefix, pending = None, {}
        if owner is not None:
            prefix = owner
            pending[key] = tensor
        elif ".modules_to_save." in key or ".original_module." in key:
            name = _modules_to_save_key(key, active)
            if name is not None:
                yield _base_key(name), tensor
        else:
            yield _base_key(key), tensor
    if prefix is not None:
        yield from _merge(pending, prefix, layers[prefix])


def save_peft_model(runner: Any, model: nn.Module, output_dir: str | Path, merge_adapters: bool = False,
                    processing_class: Any = None, args: Any = None) -> None:
    """``Trainer.save_model`` for a PeftModel: the adapters, or (``merge_adapters``) the merged base model.

    The merged export is the base model's HF format (``config.json`` + safetensors shards) written by
    :func:`shardkit.checkpoint.hf.save_pretrained`, so ``AutoModelForCausalLM.from_pretrained`` loads it and
    gives the PeftModel's logits. Call on every rank.
    """
    from shardkit.checkpoint.hf import save_pretrained

    out = Path(output_dir)
    if merge_adapters:
        module = runner.unwrap_model(model)
        stream = merged_tensors(runner.iter_full_state_dict(model), module)
        save_pretrained(runner, out, module.get_base_model(), tensors=stream)
    else:
        save_adapters(runner, model, out)
    if runner.is_main_process:
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(out)
        if args is not None:
            (out / "training_args.json").write_text(args.to_json_string() + "\n")
    runner.barrier("peft-save-model")
