"""Rollouts: prompts tokenized, completions generated on the training model, rewards computed.

Generation goes through ``runner.generate`` (:func:`shardkit.inference.generate`): every rank calls it once per
generation round with its own prompts, ranks whose completions end early keep joining the others' forwards while the
weights are partitioned (ZeRO-3, FSDP, tensor parallelism), and the strategy's ``generation_context`` holds the
parameters for the call (ZeRO-3 and FSDP2 gather them once per call when memory allows, not once per token; with
every weight then whole, each rank decodes on its own, with no per-token all-reduce). Hugging Face
models and shardkit's Llama decode with their KV cache, the prompts left-padded under an attention mask (each row
generates what its prompt would alone).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from shardkit.inference import is_hf_model

__all__ = ["Completions", "RewardFunctions", "generate_completions", "is_conversational", "left_pad",
           "llama_sampling", "right_pad", "tokenize_prompts"]


def is_conversational(prompt: Any) -> bool:
    """A prompt given as a list of chat messages (``{"role": ..., "content": ...}``)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def tokenize_prompts(tokenizer: Any, prompts: Sequence[Any], chat_template_kwargs: dict | None = None
                     ) -> list[list[int]]:
    """Token ids of each prompt: plain text as the tokenizer encodes it, a conversation through its chat template
    with the generation prompt added (as TRL does)."""
    out = []
    for index, prompt in enumerate(prompts):
        if is_conversational(prompt):
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                **(chat_template_kwargs or {}))
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        elif isinstance(prompt, str):
            ids = tokenizer(text=prompt)["input_ids"]
        else:
            raise TypeError(f"prompt {index} is a {type(prompt).__name__}: a prompt is a string or a list of chat "
                            "messages ({'role': ..., 'content': ...})")
        if not ids:
            raise ValueError(f"prompt {index} tokenizes to no tokens: {str(prompt)[:80]!r}")
        out.append(list(ids))
    return out


def left_pad(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(ids, mask)`` ``[B, max len]``, padded on the left (prompts)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def right_pad(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(ids, mask)`` ``[B, max len]``, padded on the right (completions)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids.to(device), mask.to(device)


@dataclass
class Completions:
    """One rank's generated completions: token ids up to and including the first EOS, and which were cut off at
    ``max_completion_length`` (no EOS); with vLLM's correction, the engine's log-prob of each token (NaN where it
    gave none)."""

    ids: list[list[int]]
    truncated: list[bool]
    logprobs: list[list[float]] | None = None


def generate_completions(runner: Any, model: nn.Module, prompt_ids: Sequence[Sequence[int]], *, pad_token_id: int,
                         eos_token_ids: Sequence[int], max_new_tokens: int, sampling: dict[str, Any],
                         keep_unsharded: bool | None = None) -> Completions:
    """Sample one completion per prompt row with the set-up ``model``, on every rank together.

    Args:
        runner: the Runner that set the model up (its ``generate`` keeps the ranks in step).
        prompt_ids: this rank's prompts (each repeated as many times as it needs completions).
        sampling: ``do_sample``, ``temperature``, ``top_p``, ``top_k``, ... for the model's ``generate``.
        keep_unsharded: the strategy's choice of holding partitioned parameters gathered for the whole call (None:
            when memory allows; False: gathered per layer, TRL's ``ds3_gather_for_generation=False``).
    """
    unwrapped = runner.unwrap_model(model)
    if not is_hf_model(unwrapped):
        sampling = llama_sampling(unwrapped, sampling)
    ids, mask = left_pad(prompt_ids, pad_token_id, runner.device)
    was_training = unwrapped.training
    unwrapped.eval()
    try:
        out = runner.generate(model, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                              pad_token_id=pad_token_id, eos_token_id=list(eos_token_ids), use_cache=True,
                              keep_unsharded=keep_unsharded, **sampling)
    finally:
        unwrapped.train(was_training)
    generated = out[:, ids.shape[1]:].cpu()
    eos = set(int(e) for e in eos_token_ids)
    completions, truncated = [], []
    for row in generated.tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        completions.append(row if end is None else row[:end + 1])
        truncated.append(end is None)
    return Completions(completions, truncated)


def llama_sampling(model: nn.Module, sampling: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face-style ``sampling`` settings as shardkit's Llama takes them (``temperature``, ``top_k``), or
    an error naming a setting it does not implement (never ignored)."""
    from shardkit.models import Llama

    if not isinstance(model, Llama):
        raise NotImplementedError(f"{type(model).__name__}: GRPO/RLOO rollouts generate with a Hugging Face causal LM "
                                  "(GenerationMixin) or shardkit's Llama")
    settings = dict(sampling)
    do_sample = settings.pop("do_sample", True)
    temperature = float(settings.pop("temperature", 1.0))
    top_k = settings.pop("top_k", None)
    neutral = {"top_p": (None, 1.0), "min_p": (None, 0.0), "repetition_penalty": (None, 1.0)}
    for key, values in neutral.items():
        value = settings.pop(key, None)
        if value not in values:
            raise NotImplementedError(f"shardkit's Llama samples with temperature and top_k only: {key}={value!r} is "
                                      f"not implemented; set {key}={values[-1]} (or use a Hugging Face model)")
    if settings:
        raise NotImplementedError(f"shardkit's Llama generate takes no {sorted(settings)} (generation_kwargs); it "
                                  "samples with temperature and top_k only")
    return {"temperature": temperature if do_sample else 0.0, "top_k": top_k or None}


def _callable_name(func: Any) -> str:
    name = getattr(func, "__name__", None)
    return name if name else type(func).__name__


class RewardFunctions:
    """The reward functions of a run (TRL's ``reward_funcs``): callables ``f(prompts=, completions=,
    completion_ids=, **dataset_columns) -> list[float | None]`` and sequence-classification models (the reward is
    the first logit of prompt + completion, with ``reward_processing_classes``' tokenizer)."""

    def __init__(self, reward_funcs: Any, processing_classes: Any = None, weights: Sequence[float] | None = None):
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ValueError("reward_funcs is empty: pass at least one reward function or reward model")
        for i, f in enumerate(funcs):
            if isinstance(f, str):
                raise NotImplementedError(f"reward_funcs[{i}]={f!r}: reward models are not loaded by name (nothing is "
                                          "downloaded); load the sequence-classification model and pass it")
            if not (isinstance(f, nn.Module) or callable(f)):
                raise TypeError(f"reward_funcs[{i}] is a {type(f).__name__}: pass a callable or a reward model")
        classes = processing_classes if isinstance(processing_classes, (list, tuple)) else \
            [processing_classes] * len(funcs) if processing_classes is not None else [None] * len(funcs)
        if len(classes) != len(funcs):
            raise ValueError(f"{len(classes)} reward_processing_classes for {len(funcs)} reward functions")
        for i, (f, c) in enumerate(zip(funcs, classes)):
            if isinstance(f, nn.Module) and c is None:
                raise ValueError(f"reward_funcs[{i}] is a model: pass its tokenizer in reward_processing_classes "
                                 "(nothing is downloaded)")
            if isinstance(f, nn.Module) and c.pad_token_id is None:
                c.pad_token = c.eos_token
        if weights is not None and len(weights) != len(funcs):
            raise ValueError(f"reward_weights has {len(weights)} weights for {len(funcs)} reward functions")
        self.funcs, self.classes = funcs, list(classes)
        self.weights = torch.tensor(list(weights) if weights is not None else [1.0] * len(funcs),
                                    dtype=torch.float32)
        self.names = [_model_name(f) if isinstance(f, nn.Module) else _callable_name(f) for f in funcs]

    def __len__(self) -> int:
        return len(self.funcs)

    def models(self) -> list[nn.Module]:
        return [f for f in self.funcs if isinstance(f, nn.Module)]

    def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
                 rows: list[dict[str, Any]], device: torch.device, extra: dict[str, Any]) -> Tensor:
        """``[N, F]`` this rank's rewards (NaN where a function returned None)."""
        out = torch.zeros(len(prompts), len(self.funcs), device=device)
        keys = [k for k in (rows[0] if rows else {}) if k not in ("prompt", "completion", "completion_ids")]
        columns = {k: [row.get(k) for row in rows] for k in keys}
        for i, (func, tokenizer, name) in enumerate(zip(self.funcs, self.classes, self.names)):
            if isinstance(func, nn.Module):
                out[:, i] = _model_rewards(func, tokenizer, prompts, completions, device)
                continue
            values = func(prompts=prompts, completions=completions, completion_ids=completion_ids,
                          **_accepted(func, {**columns, **extra}))
            if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__") or \
                    (isinstance(values, Tensor) and values.dim() == 0):
                raise TypeError(f"reward function {name!r} returned a {type(values).__name__}: return a list of one "
                                "float (or None) per completion")
            values = list(values)
            if len(values) != len(prompts):
                raise ValueError(f"reward function {name!r} returned {len(values)} rewards for {len(prompts)} "
                                 "completions: return one per completion")
            out[:, i] = torch.tensor([_reward_value(v, name, j) for j, v in enumerate(values)], device=device)
        return out


def _reward_value(value: Any, name: str, index: int) -> float:
    """One reward as a float (None: NaN, "this function does not apply"); anything else but a number is refused."""
    if value is None:
        return float("nan")
    if isinstance(value, (str, bytes)) or (isinstance(value, Tensor) and value.numel() != 1):
        raise TypeError(f"reward function {name!r} returned {value!r} for completion {index}: a reward is a number "
                        "or None")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"reward function {name!r} returned {value!r} for completion {index}: a reward is a number "
                        "or None") from None


def _accepted(func: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The extra keyword arguments ``func`` takes (all of them when it has ``**kwargs``)."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _model_name(model: nn.Module) -> str:
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    return str(path).rstrip("/").split("/")[-1]


@torch.no_grad()
def _model_rewards(model: nn.Module, tokenizer: Any, prompts: list[Any], completions: list[Any],
                   device: torch.device) -> Tensor:
    if is_conversational(prompts[0]):
        texts = [tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    return model(**inputs).logits[:, 0].float()
