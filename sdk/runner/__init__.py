"""The Runner and its parts: ``core`` (set-up, the step, collectives), ``checkpoints`` (save and resume),
``observe`` (logging, trackers, throughput, OOM reports) and ``user_state`` (what the user asks to be saved)."""

from shardkit.utils.lazy import lazy_exports

__all__ = ["Runner", "RunnerCheckpoints", "RunnerObservability", "StateSaver"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "Runner": "core", "RunnerCheckpoints": "checkpoints", "RunnerObservability": "observe",
    "StateSaver": "user_state",
})
