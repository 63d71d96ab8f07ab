"""A lean decoding loop for Hugging Face causal LMs, token for token what their ``generate`` produces.

Hugging Face's ``generate`` spends a fifth of a small model's call outside the forwards: a deep-copied and validated
generation config, ``inspect.signature`` on every logits processor at every step, the per-step input preparation
and stopping-criteria machinery. :func:`lean_generate` runs the same forwards (prefill, then one token at a time on a
``DynamicCache``, with the 2-D attention mask and the position ids ``generate`` builds for left-padded batches), the
same logits arithmetic in the same order (repetition penalty, suppressed tokens, then temperature, top-k, top-p,
min-p when sampling) and the same draw (``torch.multinomial`` on the softmax), so greedy and seeded sampled tokens
are equal to ``generate``'s.

It takes only what it reproduces: the settings are merged with the model's ``generation_config`` by Hugging Face's
own merge (so its defaults, such as ``top_k=50``, apply as in ``generate``), and any merged field outside the
supported ones (beam search, stopping strings, min lengths, bad words, returned dictionaries, custom processors,
...), a model whose generation code is its own, a model without a default dynamic cache, an encoder-decoder, or a
model spread over devices returns ``None``: the caller then runs ``generate`` itself. In lock step with other ranks
(``synced_gpus=True``) it keeps ``generate``'s order of forwards and all-reduces: a rank that is done keeps joining
the forwards until every rank is, and ranks running ``generate`` and ranks running this loop meet at the same
collectives.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["lean_generate"]

# Fields of the merged generation config the loop honours; any other field away from Hugging Face's global default
# falls back to ``generate``.
_SUPPORTED = frozenset({"do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens",
                        "max_length", "pad_token_id", "eos_token_id", "bos_token_id", "suppress_tokens",
                        "transformers_version", "_from_model_config"})
_accepts: dict[type, bool] = {}
_defaults: dict[str, Any] = {}


def _plain_generation_code(model: nn.Module) -> bool:
    """The model decodes with GenerationMixin's own code (no override of the parts the loop replaces) and its forward
    takes the inputs the loop passes."""
    cls = type(model)
    if cls in _accepts:
        return _accepts[cls]
    from transformers import GenerationMixin

    same = all(getattr(cls, name, None) is getattr(GenerationMixin, name, None) for name in (
        "generate", "_sample", "prepare_inputs_for_generation", "_update_model_kwargs_for_generation", "_prefill"))
    params = inspect.signature(cls.forward).parameters
    ok = same and all(p in params for p in ("attention_mask", "position_ids", "past_key_values", "use_cache"))
    _accepts[cls] = ok
    return ok


def _model_fits(model: nn.Module, input_ids: torch.Tensor) -> bool:
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or getattr(model, "hf_device_map", None):
        return False
    try:
        if model.is_remote_code() or not model._supports_default_dynamic_cache():
            return False
        # on MPS generate decides to stop a step late and undoes an extra step, drawing once more from the RNG
        if input_ids.device != model.device or input_ids.device.type == "mps" or \
                "grouped_mm" in model.get_experts_implementation().values():
            return False
    except (AttributeError, TypeError):
        return False
    return _plain_generation_code(model)


def _same(ours: Any, default: Any) -> bool:
    """A merged field at its default: unset and off (None, False) are one (a model config's ``output_attentions=False``
    asks for nothing more than an unset one)."""
    return ours == default or (ours in (None, False) and default in (None, False))


def _merged_settings(model: nn.Module, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    """Hugging Face's merge of ``kwargs`` over the model's generation config and the global defaults, or None when it
    holds anything the loop does not reproduce."""
    from transformers import GenerationConfig

    try:
        config, model_kwargs = model._prepare_generation_config(None, **kwargs)
        if not _defaults:  # Hugging Face's global defaults: the same for every model
            reference = GenerationConfig()
            reference.update(**model.generation_config._get_default_generation_params(), defaults_only=True)
            _defaults.update(reference.to_dict())
    except Exception:  # noqa: BLE001 - whatever the merge refuses, generate refuses with its own message
        return None
    if set(model_kwargs) - {"attention_mask"}:
        return None
    ours, theirs = config.to_dict(), _defaults
    if any(not _same(ours.get(k), theirs.get(k)) for k in set(ours) | set(theirs) if k not in _SUPPORTED):
        return None
    return config, model_kwargs


def _settings_fit(config: Any) -> bool:
    """Values the loop reproduces exactly (generate would refuse or warn about the others: it keeps that)."""
    if config.max_new_tokens is None or int(config.max_new_tokens) < 1 or config.pad_token_id is None:
        return False
    if config.use_cache is not True or config.num_beams != 1 or config.num_return_sequences != 1:
        return False
    penalty = config.repetition_penalty
    if penalty is not None and penalty != 1.0 and not (isinstance(penalty, float) and penalty > 0):
        return False
    if not config.do_sample:
        return config.do_sample is False
    t, k, p, m = config.temperature, config.top_k, config.top_p, config.min_p
    return ((t is None or t == 1.0 or (isinstance(t, float) and t > 0))
            and (k is None or (isinstance(k, int) and not isinstance(k, bool) and k >= 0))
            and (p is None or 0.0 <= float(p) <= 1.0)
            and (m is None or 0.0 <= float(m) <= 1.0))


def _eos_tensor(eos: Any, device: torch.device) -> torch.Tensor | None:
    if eos is None:
        return None
    ids = [eos] if isinstance(eos, int) else list(eos)
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


class _Processing:
    """The logits processing ``generate`` builds for the supported settings, applied in its order."""

    def __init__(self, config: Any, prompt_mask: torch.Tensor | None):
        penalty = config.repetition_penalty
        self.penalty = float(penalty) if penalty is not None and penalty != 1.0 else None
        # generate ignores the left padding of the prompts when it penalises repeats
        self.ignore = (prompt_mask != 0).int().argmax(dim=1) if prompt_mask is not None else None
        self.suppress = None if config.suppress_tokens is None else [int(t) for t in config.suppress_tokens]
        self.suppressed: torch.Tensor | None = None
        self.sample = bool(config.do_sample)
        t, k, p, m = config.temperature, config.top_k, config.top_p, config.min_p
        self.temperature = t if self.sample and t is not None and t != 1.0 else None
        self.top_k = max(int(k), 1) if self.sample and k is not None and k != 0 else None
        self.top_p = float(p) if self.sample and p is not None and p < 1.0 else None
        self.min_p = float(m) if self.sample and m is not None else None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.penalty is not None:
            scores = self._penalise(input_ids, scores)
        if self.suppress is not None:
            if self.suppressed is None:  # the same vocabulary every step
                vocab = torch.arange(scores.shape[-1], device=scores.device)
                self.suppressed = torch.isin(vocab, torch.tensor(self.suppress, dtype=torch.long, device=scores.device))
            scores = torch.where(self.suppressed, -float("inf"), scores)
        if self.temperature is not None:
            scores = scores / self.temperature
        if self.top_k is not None:
            k = min(self.top_k, scores.size(-1))
            scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -float("inf"))
        if self.top_p is not None:
            ordered, order = torch.sort(scores, descending=False)
            drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - self.top_p)
            drop[..., -1:] = 0
            scores = scores.masked_fill(drop.scatter(1, order, drop), -float("inf"))
        if self.min_p is not None:
            probs = torch.softmax(scores, dim=-1)
            drop = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
            drop.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
            scores = scores.masked_fill(drop, -float("inf"))
        return scores

    def _penalise(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        if self.ignore is not None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            input_ids = input_ids.masked_fill(positions[None, :] < self.ignore.to(input_ids.device)[:, None], vocab)
        # the padding column takes the ignored positions, so they penalise nothing
        input_ids = input_ids.clamp(max=vocab)
        padded = torch.nn.functional.pad(scores, (0, 1))
        seen = torch.gather(padded, 1, input_ids)
        seen = torch.where(seen < 0, seen * self.penalty, seen / self.penalty)
        return padded.scatter(1, input_ids, seen)[..., :vocab]


@torch.no_grad()
def lean_generate(model: nn.Module, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """Decode ``input_ids`` (left-padded, with ``attention_mask`` in ``kwargs``) as ``model.generate(input_ids,
    **kwargs)`` would, on this process alone; None when the call holds anything the loop does not reproduce (the
    caller runs ``generate``)."""
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        return None
    synced = bool(kwargs.get("synced_gpus"))
    kwargs = {k: v for k, v in kwargs.items() if k != "synced_gpus"}
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape or not _model_fits(model, input_ids):
        return None
    merged = _merged_settings(model, kwargs)
    try:
        if merged is None or not _settings_fit(merged[0]) or _generate_would_warn(model, input_ids, mask, merged[0]):
            return None
    except (TypeError, ValueError):  # a value of a type generate may take in its own way
        return None
    return _decode(model, input_ids, mask, merged[0], synced)


def _generate_would_warn(model: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, config: Any) -> bool:
    """Calls ``generate`` warns about (right padding, a length past the model's positions, negative EOS ids): they run
    ``generate``, so that its warning is seen."""
    limit = getattr(model.config, "max_position_embeddings", None)
    eos = config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return ((input_ids.shape[0] > 1 and bool((mask[:, -1] == 0).any()))
            or (limit is not None and input_ids.shape[1] + int(config.max_new_tokens) > limit)
            or any(not isinstance(e, int) or e < 0 for e in eos))


def _decode(model: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, config: Any, synced: bool) -> torch.Tensor:
    from transformers import DynamicCache

    device = input_ids.device
    position_ids = mask.long().cumsum(-1) - 1
    last_position = position_ids.masked_fill(mask == 0, 0)
    # generate drops a mask of ones (no padding): the model then takes its causal path without one
    attention_mask = None if bool((mask == 1).all()) else mask
    processing = _Processing(config, attention_mask)
    eos = _eos_tensor(config.eos_token_id, device)
    pad = torch.tensor(config.pad_token_id, dtype=torch.long, device=device)
    max_length = int(config.max_new_tokens) + input_ids.shape[1]
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    extra = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=device)
    # the forwards and all-reduces come in generate's order, so that ranks running generate and ranks running this
    # loop in one lock step meet at the same collectives
    outputs = model(**_step_inputs(input_ids, cache, last_position, attention_mask), **extra, return_dict=True)
    consumed, finished = False, False
    while _anyone_unfinished(finished, synced, device):
        if consumed:
            outputs = model(**_step_inputs(input_ids[:, -1:], cache, last_position, attention_mask), **extra,
                            return_dict=True)
        consumed = True
        cache = outputs.past_key_values
        # every forward moves the positions and the mask on, also the ones a finished rank joins in lock step
        last_position = last_position[:, -1:] + 1
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        if finished:
            del outputs
            continue
        logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=device)
        del outputs
        scores = processing(input_ids, logits)
        if processing.sample:
            tokens = torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            tokens = torch.argmax(scores, dim=-1)
        if eos is not None:  # a finished row takes the padding token
            tokens = tokens * unfinished + pad * (1 - unfinished)
        input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
        if eos is not None:
            unfinished = unfinished & ~torch.isin(tokens, eos)
        finished = input_ids.shape[1] >= max_length or (eos is not None and int(unfinished.max()) == 0)
    return input_ids


def _step_inputs(ids: torch.Tensor, cache: Any, positions: torch.Tensor, mask: torch.Tensor | None) -> dict[str, Any]:
    inputs = {"input_ids": ids, "past_key_values": cache, "position_ids": positions, "use_cache": True}
    if mask is not None:
        inputs["attention_mask"] = mask
    return inputs


def _anyone_unfinished(finished: bool, synced: bool, device: torch.device) -> bool:
    """In lock step every rank learns whether any rank still decodes (one all-reduce per step, as ``generate``'s
    ``synced_gpus`` does, so a rank that is done keeps joining the forwards); otherwise only this rank's answer."""
    if not synced:
        return not finished
    flag = torch.tensor(0.0 if finished else 1.0, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.SUM)
    return flag.item() != 0.0
