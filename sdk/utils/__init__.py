"""Small helpers shared across shardkit's packages (they import nothing else of shardkit)."""

from shardkit.utils.operations import batch_size, json_object, move_to_device

__all__ = ["batch_size", "json_object", "move_to_device"]
