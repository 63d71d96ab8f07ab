"""What shardkit's replacement forwards of Hugging Face expert blocks compute, checked against a block's layout.

shardkit computes a transformers 5 expert block (stacked ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I),
``act_fn(gate) * up``, no bias) through its grouped experts (``shardkit.models.moe_hf``) or expert parallelism
(``shardkit.strategies.expert_parallel``). transformers declares other layouts on the same kind of block
(``is_transposed``: (E, H, 2I) weights; ``has_bias``; ``has_post_expert_norm``: a norm after the experts;
``has_gate=False``; ``is_concatenated=False``): such a block, given the replacement forward, would compute another
function with no error, so it is refused by name here.
"""

from __future__ import annotations

from torch import nn

__all__ = ["check_hf_expert_layout"]

_WEIGHTS = {"gate_up_proj", "down_proj"}


def check_hf_expert_layout(block: nn.Module, what: str) -> None:
    """Raise ValueError when ``block`` holds anything the plain stacked-SwiGLU forward would leave out or misread.

    Args:
        what: the caller, for the message (``"use_grouped_experts"``, ``"ExpertParallel"``).
    """
    name = type(block).__name__
    problems = []
    for flag, meaning, plain in (("is_transposed", "weights stored (E, in, out)", False),
                                 ("has_bias", "expert biases", False),
                                 ("has_post_expert_norm", "a norm after the experts", False),
                                 ("has_gate", "no gate projection", True),
                                 ("is_concatenated", "separate gate and up weights", True)):
        if getattr(block, flag, plain) != plain:
            problems.append(f"{flag}={getattr(block, flag)!r} ({meaning})")
    extra = sorted(n for n, _ in block.named_parameters() if n not in _WEIGHTS)
    if extra:
        problems.append(f"parameters besides gate_up_proj/down_proj: {', '.join(extra)}")
    gate_up, down = block.gate_up_proj, block.down_proj
    if not problems and (gate_up.shape[0] != down.shape[0] or gate_up.shape[1] != 2 * down.shape[2]
                         or gate_up.shape[2] != down.shape[1]):
        problems.append(f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
                        "(E, 2I, H) and (E, H, I)")
    if problems:
        raise ValueError(f"{what}: {name} is an expert block shardkit cannot compute as stacked SwiGLU experts: "
                         f"{'; '.join(problems)}. Leave this model's experts as they are")
