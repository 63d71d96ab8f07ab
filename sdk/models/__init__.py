"""Reference models built from a config with random weights (no downloads)."""

from shardkit.models.llama import Llama, LlamaBlock, LlamaConfig
from shardkit.models.moe import MoE, MoEConfig
from shardkit.models.text import ByteTextDataset

__all__ = ["Llama", "LlamaBlock", "LlamaConfig", "ByteTextDataset", "MoE", "MoEConfig"]
