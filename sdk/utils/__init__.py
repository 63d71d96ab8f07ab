"""Small helpers shared across shardkit's packages (they import nothing else of shardkit; ``partitioned`` imports a
strategy's handler by name, only when asked about a parameter)."""

from shardkit.utils.env import seconds_from_env
from shardkit.utils.operations import batch_size, json_object, move_to_device

__all__ = ["batch_size", "json_object", "move_to_device", "seconds_from_env"]
