"""A strategy that exists only in tests, to show what adding one takes: this class and one register line
(test_added_strategy.py registers it, runs it through the estimator, both fronts and the contract suite, and
unregisters it). A subclass of FSDP under another name: it inherits every declared fact of FSDP's."""

from __future__ import annotations

from shardkit.strategies.fsdp import FSDP

NAME = "fsdp_added"
TARGET = "added_strategy:AddedFSDP"  # this module is on the path of the spawned ranks too (conftest.py)


class AddedFSDP(FSDP):
    """FSDP2 under a name no file of the package knows."""
