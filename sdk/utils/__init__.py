"""Small helpers shared across shardkit's packages, below all of them: they import nothing else of shardkit
(``partitioned`` imports a strategy's handler by name, only when asked about a parameter). Every name loads on
first use (``lazy``), so that the command line's imports of ``suggest`` or ``registry`` do not import torch."""

from shardkit.utils.lazy import lazy_exports

__all__ = ["batch_size", "json_object", "move_to_device", "seconds_from_env", "seed_everything"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "seconds_from_env": "env", "batch_size": "operations", "json_object": "operations",
    "move_to_device": "operations", "seed_everything": "seeding",
})
