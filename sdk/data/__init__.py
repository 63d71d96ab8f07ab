"""Data loading for a Runner: map-style datasets (``loader``: sharded by rank, shuffled reproducibly per epoch,
resumable mid-epoch), streamed ones (``streaming``: an iterable read in chunks, resumable at a position), and many
files split by file over ranks and workers, each reader opening only its own (``sharded_files``, ``sharded_loader``).

One entry for both: :func:`rebuild_loader` turns a user's ``DataLoader`` into the one that fits its dataset.
"""

from shardkit.utils.lazy import lazy_exports

__all__ = ["ChunkedStream", "ResumableSampler", "RunnerDataLoader", "SeededDataset", "StreamPosition",
           "ShardedFiles", "ShardedLoader", "StreamingLoader", "is_stream", "rebuild_loader", "sample_seed"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "ResumableSampler": "loader", "RunnerDataLoader": "loader", "SeededDataset": "loader",
    "sample_seed": "loader", "ChunkedStream": "streaming", "StreamPosition": "streaming",
    "StreamingLoader": "streaming", "is_stream": "streaming", "rebuild_loader": "streaming",
    "ShardedFiles": "sharded_files", "ShardedLoader": "sharded_loader",
})
