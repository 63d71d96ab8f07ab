"""The fused causal-LM loss selects positions as transformers does (``logits_to_keep`` in every form), with its
own helper: transformers' ``slice_logits_to_keep`` is missing from some 5.x releases (5.17 on the GPU machine)."""

import pytest
import torch

from shardkit.nn._hf_loss import _keep_positions

modeling_utils = pytest.importorskip("transformers.modeling_utils")


@pytest.mark.parametrize("keep", [0, 1, 3, "positions", "per_sample", "mask"])
def test_keep_positions_matches_transformers(keep):
    hidden = torch.randn(2, 7, 5, generator=torch.Generator().manual_seed(0))
    if keep == "positions":
        keep = torch.tensor([0, 4, 6])
    elif keep == "per_sample":
        keep = torch.tensor([[1, 2], [5, 6]])
    elif keep == "mask":
        keep = torch.rand(2, 7, generator=torch.Generator().manual_seed(1)) > 0.5
    theirs = getattr(modeling_utils, "slice_logits_to_keep", None)
    if theirs is None:
        pytest.skip("this transformers has no slice_logits_to_keep to compare with")
    assert torch.equal(_keep_positions(hidden, keep), theirs(hidden, keep))
