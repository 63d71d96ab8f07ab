"""A small Llama-style decoder for examples, tests and benchmarks.

RMSNorm, rotary position embeddings (Hugging Face's rotate-half layout), a SwiGLU MLP and causal
attention through ``scaled_dot_product_attention``; grouped-query attention when
``num_kv_heads < num_heads``; tied or untied output head. Parameter names follow Hugging Face's
``LlamaForCausalLM`` so weights map one to one.

With ``fused=True`` (the default) the norms, rotary embedding, MLP and the loss run on
shardkit's fused ops (:mod:`shardkit.nn`), which pick the C++/CUDA/Triton kernels where they
are available and fall back to plain PyTorch; ``fused=False`` builds the same model from plain
PyTorch modules (the eager baseline the benchmarks compare against).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.models.llama_tp import llama_plan
from shardkit.models.mlp import PlainSwiGLUMLP
from shardkit.models.moe import MoE, MoEConfig, moe_aux_loss
from shardkit.models.padding import check_attention_mask, padded_causal_mask
from shardkit.nn.log_probs import shift_labels as next_token_labels
from shardkit.nn.varlen import Segments, varlen_attention

__all__ = ["KVCache", "LlamaConfig", "Llama", "LlamaBlock", "llama_plan"]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of the model. The defaults make a ~0.9M-parameter byte-level model that trains on CPU."""

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 344
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    max_position: int = 512
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    dropout: float = 0.0
    tie_embeddings: bool = True
    init_std: float = 0.02
    fused: bool = True
    # Mixture-of-experts MLPs (a MoEConfig or a dict of its fields); None: dense SwiGLU MLPs.
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe", MoEConfig.from_value(self.moe))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size({self.hidden_size}) is not divisible by num_heads({self.num_heads})")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads({self.num_heads}) is not divisible by num_kv_heads({self.kv_heads})")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head_dim({self.hidden_size // self.num_heads}) must be even for rotary embeddings")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def small_moe(cls, **overrides) -> LlamaConfig:
        """A ~0.3M-parameter byte-level MoE Llama for tests, examples and demos: 8 experts, top-2, one shared expert,
        the first layer dense. ``overrides`` replace fields; ``moe={...}`` replaces MoE fields."""
        moe = dict(num_experts=8, top_k=2, intermediate_size=64, num_shared_experts=1, first_dense_layers=1)
        moe.update(overrides.pop("moe", None) or {})
        fields = dict(hidden_size=64, intermediate_size=172, num_layers=3, num_heads=4, moe=MoEConfig(**moe))
        return cls(**{**fields, **overrides})


def _nn_parts(fused: bool):
    if fused:
        from shardkit.nn import RMSNorm, RotaryEmbedding, SwiGLUMLP

        return RMSNorm, RotaryEmbedding, SwiGLUMLP
    return _RMSNorm, _Rotary, PlainSwiGLUMLP


class _RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # 16-bit inputs are normalised in fp32; fp64 stays fp64 (an fp32 weight product would make the weight's
        # gradient, summed over tokens, depend on the batch's shape at fp32 rounding).
        wide = torch.promote_types(x.dtype, torch.float32)
        x32 = x.to(wide)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(wide)).to(x.dtype)


class _Rotary(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.max_position = max_position

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of ``positions`` (T,) as (T, D), or of (B, T) as (B, 1, T, D): either broadcasts over heads."""
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        if emb.dim() == 3:
            emb = emb.unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k (B, H, T, D) at ``position_ids`` (T,), (1, T) or (B, T), default 0..T-1 (as the fused
        module's)."""
        if position_ids is None:
            position_ids = torch.arange(q.shape[-2], device=q.device)
        cos, sin = self.cos_sin(position_ids, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, rotary: nn.Module):
        super().__init__()
        self.config = config
        hd = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_heads * hd, config.hidden_size, bias=False)
        self.rotary = rotary
        # Context parallelism replaces the causal attention of a training forward (no cache) with its own
        # over the split sequence: core(q, k, v, dropout_p) -> out, (B, H, T_local, D) each, or None for SDPA here.
        self.core = None

    def forward(self, x: torch.Tensor, cache: _LayerCache | None = None, position_ids: torch.Tensor | None = None,
                segments: Segments | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal self-attention over ``x``; with ``cache``, over the cached positions too (which it extends).

        ``position_ids``: the rotary positions of ``x``'s tokens, default 0..T-1 (after the cached ones): (T,) for
        one sequence's tokens (context parallelism gives each rank's chunks their places in the whole sequence),
        (B, T) per row. ``segments`` (packed sequences, from :meth:`Segments.from_position_ids`) keep each
        sequence's attention inside it. ``key_mask`` (B, cached + T) bool: the positions that are real tokens
        (False: padding, never attended; see :meth:`Llama.forward`'s ``attention_mask``).
        """
        cfg = self.config
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, cfg.head_dim).transpose(1, 2)
        if cache is None:
            q, k = self.rotary.rotate(q, k, position_ids)
        else:
            start = cache.owner.length
            if position_ids is None:
                position_ids = torch.arange(start, start + seq, device=x.device)
            q, k = self.rotary.rotate(q, k, position_ids)
            k, v = cache.extend(k, v)
        dropout = cfg.dropout if self.training else 0.0
        if segments is not None and self.core is not None:
            raise ValueError("Llama: packed sequences (position_ids restarting per sequence) under context "
                             "parallelism are not supported: train packed batches without context parallelism")
        if segments is not None:  # packed sequences: (B*T, H, D) tokens, attention within each sequence only
            flat = [t.transpose(1, 2).reshape(batch * seq, -1, cfg.head_dim) for t in (q, k, v)]
            out = varlen_attention(*flat, segments, dropout_p=dropout)
            return self.o_proj(out.reshape(batch, seq, -1))
        if cfg.kv_heads != cfg.num_heads:
            repeat = cfg.num_heads // cfg.kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        past = k.shape[-2] - seq
        if key_mask is not None:
            if cache is None and self.core is not None:
                raise ValueError("Llama: an attention_mask (padded rows) under context parallelism is not supported; "
                                 "pack the sequences instead (position_ids), or train without context parallelism")
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=padded_causal_mask(key_mask, past, seq),
                                                 dropout_p=dropout)
        elif cache is None and self.core is not None:
            out = self.core(q, k, v, dropout)
        elif past == 0 or seq == 1:  # no cache, or one new token that sees every position: no mask to build
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=past == 0)
        else:  # several new tokens after cached ones: token i sees positions up to past + i
            mask = torch.arange(past + seq, device=x.device) <= torch.arange(past, past + seq, device=x.device)[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class KVCache:
    """The keys and values of the positions a :class:`Llama` has seen, per layer, for incremental decoding.

    ``model(new_ids, cache=cache)`` attends over the cached positions and appends the new ones; the
    keys are stored rotated and before grouped-query repetition (``num_kv_heads`` heads; under tensor
    parallelism each rank keeps its own heads). :meth:`Llama.generate` uses one by default.
    """

    def __init__(self, num_layers: int):
        self.length = 0  # positions cached so far
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        # (B, length) bool, False at padding; None while every cached position is a real token
        self.real: torch.Tensor | None = None

    def layer(self, index: int) -> _LayerCache:
        return _LayerCache(self, index)


@dataclass(frozen=True)
class _LayerCache:
    owner: KVCache
    index: int

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this call's keys and values (B, H, T, D) and return every cached position's."""
        keys, values = self.owner.keys, self.owner.values
        i = self.index
        if keys[i] is not None:
            k, v = torch.cat([keys[i], k], dim=2), torch.cat([values[i], v], dim=2)
        keys[i], values[i] = k, v
        return k, v


class LlamaBlock(nn.Module):
    """One pre-norm decoder layer: attention and SwiGLU MLP (or, with ``config.moe`` from layer
    ``moe.first_dense_layers`` on, a :class:`~shardkit.models.moe.MoE`), each with a residual."""

    def __init__(self, config: LlamaConfig, layer_index: int = 0):
        super().__init__()
        norm, rotary, mlp = _nn_parts(config.fused)
        self.input_layernorm = norm(config.hidden_size, eps=config.rms_eps)
        self.self_attn = Attention(config, rotary(config.head_dim, config.max_position, config.rope_theta))
        self.post_attention_layernorm = norm(config.hidden_size, eps=config.rms_eps)
        if config.moe is not None and layer_index >= config.moe.first_dense_layers:
            self.mlp = MoE(config.hidden_size, config.moe)
        else:
            self.mlp = mlp(config.hidden_size, config.intermediate_size)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: _LayerCache | None = None, position_ids: torch.Tensor | None = None,
                segments: Segments | None = None, key_mask: torch.Tensor | None = None,
                token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``key_mask``: see :meth:`Attention.forward`; ``token_mask`` (B, T) bool, False at padding: an MoE layer's
        padding takes no expert capacity and no part in the routing statistics (None: every token is real)."""
        if key_mask is not None:
            attended = self.self_attn(self.input_layernorm(x), cache=cache, position_ids=position_ids,
                                      key_mask=key_mask)
        elif cache is not None:
            attended = self.self_attn(self.input_layernorm(x), cache=cache)
        elif position_ids is None:
            attended = self.self_attn(self.input_layernorm(x))
        else:
            attended = self.self_attn(self.input_layernorm(x), position_ids=position_ids, segments=segments)
        x = x + self.dropout(attended)
        if token_mask is not None and isinstance(self.mlp, MoE):
            return x + self.dropout(self.mlp(self.post_attention_layernorm(x), token_mask=token_mask))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class LMHead(nn.Linear):
    """The output projection; given labels it returns the mean cross-entropy instead of logits (0 without any).

    With ``fused`` the loss is :func:`shardkit.ops.fused_linear_cross_entropy`, which never holds
    the (tokens x vocab) logits. It runs inside this module's forward on purpose: engines that gather
    a partitioned weight around its owner's forward (ZeRO-3, FSDP) then see it used there.
    """

    def __init__(self, hidden: int, vocab: int, fused: bool = True):
        super().__init__(hidden, vocab, bias=False)
        self.fused = fused

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(hidden)
        if self.fused:
            from shardkit.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

            total = fused_linear_cross_entropy(hidden, self.weight, labels, ignore_index=-100, reduction="sum")
        else:
            total = F.cross_entropy(super().forward(hidden).float(), labels, ignore_index=-100, reduction="sum")
        # Sum over the count, not a "mean" reduction: a micro-batch without a label token (a prompt-only packed row
        # under completion-only loss) gives 0 and zero gradients instead of 0/0 = NaN, which the Trainer's
        # rescaling by its share of the window (0) would not undo.
        return total / (labels != -100).sum().clamp(min=1)


class Llama(nn.Module):
    """Decoder-only language model. ``forward(input_ids, labels)`` returns the mean next-token loss."""

    def __init__(self, config: LlamaConfig | None = None):
        super().__init__()
        self.config = config = config or LlamaConfig()
        norm, _, _ = _nn_parts(config.fused)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaBlock(config, i) for i in range(config.num_layers))
        self.norm = norm(config.hidden_size, eps=config.rms_eps)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, fused=config.fused)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    def hf_export(self) -> Any:
        """This model's transformers form (config.json, names, expert layout; :mod:`shardkit.models.hf_export`):
        what ``save_pretrained`` writes and a checkpoint's ``zero-to-fp32`` / ``convert --to hf`` too. Raises a
        ``CheckpointError`` naming the field when the config has no exact transformers equivalent."""
        from shardkit.checkpoint.llama_hf import LlamaExport

        return LlamaExport(self.config.to_dict())

    def parallel_plan(self, tp_size: int, sequence_parallel: bool = False) -> dict:
        """The tensor-parallel plan ``TensorParallel`` applies to this model: see :func:`llama_plan`."""
        return llama_plan(self, tp_size, sequence_parallel)

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for linear and embedding weights, ones for norms."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=self.config.init_std)
            elif hasattr(module, "weight") and module.weight is not None and module.weight.dim() == 1:
                nn.init.ones_(module.weight)
            elif callable(getattr(module, "init_weights", None)):  # stacked expert weights, the router
                module.init_weights(self.config.init_std)

    def hidden_states(self, input_ids: torch.Tensor, cache: KVCache | None = None,
                      position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                      ) -> torch.Tensor:
        """Final normed hidden states, (batch, seq, hidden); ``cache``: see :class:`KVCache`; ``position_ids``,
        ``attention_mask``: see :meth:`forward` (``position_ids`` (seq,): the tokens' rotary positions, as context
        parallelism passes its chunks')."""
        start = 0 if cache is None else cache.length
        if position_ids is not None and cache is not None:
            raise ValueError("Llama: position_ids (packed training batches) and a KV cache (decoding) do not mix; "
                             "pass one of them")
        if attention_mask is not None or (cache is not None and cache.real is not None):
            if position_ids is not None:
                raise ValueError("Llama: position_ids (packed sequences) and attention_mask (padded rows) do not mix; "
                                 "pass one of them")
            return self._padded_hidden_states(input_ids, cache, attention_mask)
        packed = position_ids is not None and position_ids.dim() == 2  # (B, T): rows of packed sequences
        if position_ids is not None:
            position_ids = _check_position_ids(position_ids, input_ids, self.config.max_position)
        elif start + input_ids.shape[-1] > self.config.max_position:
            raise ValueError(f"sequence length {start + input_ids.shape[-1]} exceeds "
                             f"max_position={self.config.max_position}")
        x = self.embed_tokens(input_ids)
        if position_ids is not None:
            segments = Segments.from_position_ids(position_ids, input_ids.shape[0]) if packed else None
            for layer in self.layers:
                x = layer(x, position_ids=position_ids, segments=segments)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x) if cache is None else layer(x, cache=cache.layer(i))
        if cache is not None:
            cache.length += input_ids.shape[-1]
        return self.norm(x)

    def _padded_hidden_states(self, input_ids: torch.Tensor, cache: KVCache | None,
                              attention_mask: torch.Tensor | None) -> torch.Tensor:
        """:meth:`hidden_states` of padded rows: each row's positions count from its first real token and no query
        attends to a padding key (a row's real tokens see what they would see alone)."""
        batch, seq = input_ids.shape
        device = input_ids.device
        new = torch.ones((batch, seq), dtype=torch.bool, device=device) if attention_mask is None else \
            check_attention_mask(attention_mask, input_ids)
        past = 0 if cache is None else cache.length
        before = None if cache is None else cache.real
        if before is None:
            before = torch.ones((batch, past), dtype=torch.bool, device=device)
        elif before.shape[0] != batch:
            raise ValueError(f"Llama: the KV cache holds {before.shape[0]} rows but input_ids has {batch}")
        key_mask = torch.cat([before, new], dim=1)
        # a padding position takes its row's next real position (clamped at 0): finite, and never attended
        position_ids = (before.sum(1, keepdim=True) + new.long().cumsum(1) - 1).clamp(min=0)
        # The rows' real lengths count, not the padded width: a long prompt with a short completion beside a short
        # prompt with a long one is wider than either row (the positions are read only when the width is over).
        if past + seq > self.config.max_position and int(key_mask.sum(1).max()) > self.config.max_position:
            raise ValueError(f"sequence length {int(key_mask.sum(1).max())} (real tokens of the longest row) exceeds "
                             f"max_position={self.config.max_position}")
        x = self.embed_tokens(input_ids)
        # Decoding steps after a padded prompt pass no mask (their new tokens are all real): the MoE layers then skip
        # the count of real tokens, a device sync per layer and step.
        token_mask = None if attention_mask is None else new
        for i, layer in enumerate(self.layers):
            x = layer(x, cache=None if cache is None else cache.layer(i), position_ids=position_ids,
                      key_mask=key_mask, token_mask=token_mask)
        if cache is not None:
            cache.length += seq
            cache.real = key_mask
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                cache: KVCache | None = None, position_ids: torch.Tensor | None = None,
                return_log_probs: bool = False, return_hidden: bool = False,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The mean cross-entropy of predicting ``labels[t+1]`` from position t (labels of -100 are
        ignored), or the logits when no labels are given; ``cache`` (inference) holds earlier positions.

        ``position_ids`` (B, T) or (1, T) make a packed (padding-free) batch: positions restart at each sequence
        (wherever a position is not the previous one plus one) and attention never crosses a restart. Label the
        first token of each sequence -100 so that no loss is taken across the boundary (the collators of
        :mod:`shardkit.sft` do).

        ``attention_mask`` (B, T), 1 on real tokens and 0 on padding (left padding, as prompts are batched for
        generation, or anywhere): padding is never attended, and each row's rotary positions count from its first
        real token, so a padded row's real tokens get the outputs they would get alone. With a ``cache`` it covers
        the new tokens; the cache remembers the earlier ones'. Label padding -100 (its outputs are not meaningful).

        ``return_log_probs=True`` (with labels) returns instead the (B, T) log-probabilities of ``labels[t+1]`` at
        each position t (0 at the last one and where the label is -100), from the chunked
        :func:`shardkit.nn.causal_lm_log_probs`: no logits. Computed here, inside the model's forward, so that
        an engine that shards the head (FSDP, ZeRO-3) has it whole, as for the loss.

        ``return_hidden=True`` returns the final hidden states instead (no head): a loss of its own, such as the
        preference trainers' log-probs, then runs through the set-up model's forward (and its strategy's hooks).
        """
        hidden = self.hidden_states(input_ids, cache, position_ids, attention_mask)
        if return_hidden:
            if labels is not None or return_log_probs:
                raise ValueError("Llama.forward: return_hidden=True returns hidden states, not a loss nor log-probs: "
                                 "drop labels and return_log_probs")
            return hidden
        if return_log_probs:
            if labels is None:
                raise ValueError("Llama: return_log_probs=True needs labels (the tokens to score)")
            return self.label_log_probs(hidden, next_token_labels(labels))
        if labels is None:
            return self.lm_head(hidden)
        shift_hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        shift_labels = labels[:, 1:].reshape(-1)
        loss = self.lm_head(shift_hidden, shift_labels)
        aux = moe_aux_loss(self) if self.config.moe is not None and self.training else None
        return loss if aux is None else loss + aux.to(loss.dtype)

    def label_log_probs(self, hidden: torch.Tensor, shifted_labels: torch.Tensor) -> torch.Tensor:
        """(B, T) log-probabilities of ``shifted_labels`` (-100: 0) from the final hidden states, chunked (no logits;
        :func:`shardkit.nn.causal_lm_log_probs`). Called inside a forward (this one, or ContextParallel's on its
        chunk of the sequence), where a sharding engine has the head whole."""
        from shardkit.nn.log_probs import causal_lm_log_probs

        return causal_lm_log_probs(hidden, self.lm_head, shifted_labels=shifted_labels)

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
        generator: torch.Generator | None = None, eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None, synced: bool | None = None, use_cache: bool = True,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append up to ``max_new_tokens`` tokens: greedy at temperature 0, else sampled (optionally top-k).

        With ``eos_token_id`` (one id or several) a row that produced it is finished: later positions get
        ``pad_token_id`` (default: the (first) EOS id), and decoding stops once every row is finished.

        ``attention_mask`` (B, prompt length), 0 on padding: prompts of different lengths batched with left padding
        (see :meth:`forward`); each row then generates what its prompt would generate alone.

        Under ZeRO-3, FSDP and tensor parallelism call it on every rank (or use ``runner.generate``): each
        forward is a collective, so with ``synced`` (default: when the weights are partitioned across
        ranks) a rank that is done, or has an empty batch, keeps joining every forward until all ranks are
        done (an all-reduced flag per step) and a call on only some ranks fails within seconds
        (:class:`shardkit.inference.NotCalledOnAllRanksError`).

        With ``use_cache`` (default) the prompt runs once and each later step computes only the new token,
        attending over a :class:`KVCache`; past ``max_position`` tokens, and with ``use_cache=False``, each
        step recomputes the last ``max_position`` tokens instead. Steps go through ``self(...)`` (the root
        forward) so that FSDP's and ZeRO-3's hooks gather the weights.
        """
        from shardkit.inference.sync import any_rank, needs_sync, synced_call

        synced = needs_sync(self) if synced is None else synced
        was_training = self.training
        self.eval()
        tokens, device = input_ids, input_ids.device
        # one id or several, as ints or a tensor (a generation config may hold either)
        eos_ids = None if eos_token_id is None else torch.as_tensor(eos_token_id, device=device).reshape(-1).long()
        if eos_ids is not None and eos_ids.numel() == 0:
            eos_ids = None
        pad = (None if eos_ids is None else int(eos_ids[0])) if pad_token_id is None else pad_token_id
        # an empty batch (a rank joining the other ranks' forwards, handed their requests' kwargs) has no rows to mask
        mask = None if attention_mask is None or input_ids.shape[0] == 0 else \
            check_attention_mask(attention_mask, input_ids)
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=device)
        dummy = torch.zeros((1, 1), dtype=input_ids.dtype, device=device)
        cache = KVCache(len(self.layers)) if use_cache else None
        try:
            with synced_call("Llama.generate()") if synced else contextlib.nullcontext():
                while True:
                    running = tokens.shape[1] - input_ids.shape[1] < max_new_tokens and not bool(done.all())
                    if not (any_rank(running, device) if synced else running):
                        break
                    if not running:
                        self(dummy)  # keep the other ranks' collectives company; the result is not used
                        continue
                    if cache is not None and tokens.shape[1] > self.config.max_position:
                        cache = None  # the window slides from here: positions shift, cached keys no longer fit
                    window = self.config.max_position
                    if cache is None and mask is None:
                        logits = self(tokens[:, -window:])[:, -1].float()
                    elif cache is None:
                        logits = self(tokens[:, -window:], attention_mask=mask[:, -window:])[:, -1].float()
                    elif mask is not None and cache.length == 0:  # the prompt: the cache keeps its padding after
                        logits = self(tokens, cache=cache, attention_mask=mask)[:, -1].float()
                    else:
                        logits = self(tokens[:, cache.length :], cache=cache)[:, -1].float()
                    next_token = _pick(logits, temperature, top_k, generator)
                    if eos_ids is not None:
                        next_token = next_token.masked_fill(done[:, None], pad)
                        done |= torch.isin(next_token[:, 0], eos_ids)
                    tokens = torch.cat([tokens, next_token], dim=1)
                    if mask is not None:
                        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        finally:
            self.train(was_training)
        return tokens


def _check_position_ids(position_ids: torch.Tensor, input_ids: torch.Tensor, max_position: int) -> torch.Tensor:
    """``position_ids`` as (B or 1, T) integers inside the rotary table, or a ValueError naming the problem."""
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    batch, seq = input_ids.shape
    if position_ids.dim() != 2 or position_ids.shape[1] != seq or position_ids.shape[0] not in (1, batch):
        raise ValueError(f"Llama: position_ids of shape {tuple(position_ids.shape)} do not match input_ids "
                         f"{tuple(input_ids.shape)}; pass (B, T) or (1, T)")
    if position_ids.is_floating_point() or position_ids.is_complex():
        raise ValueError(f"Llama: position_ids must be integers, got {position_ids.dtype}")
    if position_ids.numel() and position_ids.device.type == "cpu":  # on CUDA the rope kernel asserts instead
        lo, hi = int(position_ids.min()), int(position_ids.max())
        if lo < 0 or hi >= max_position:
            raise ValueError(f"Llama: position_ids span [{lo}, {hi}] but max_position={max_position}; a packed "
                             "sequence is longer than the model's rotary table (build it with max_position >= "
                             f"{hi + 1}, or pack into max_length <= max_position)")
    return position_ids


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None):
    """The next token of each row, (batch, 1): argmax at temperature 0, else a (top-k) sample."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k:  # None or 0: no top-k filter (Hugging Face's meaning of 0)
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)
