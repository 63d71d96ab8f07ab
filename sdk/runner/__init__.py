"""The Runner and its parts: ``core`` (set-up, the step, collectives), ``assembly`` (what the Runner is built from:
names, ``accelerate launch``'s variables, defaults), and the objects it holds: ``checkpoints``
(``runner.checkpoints``: save and resume), ``observe`` (``runner.observability``: logging, trackers, throughput, OOM
reports), ``gathering`` (``runner.gathering``: ``gather_for_metrics``); ``user_state`` (what the user asks to be
saved)."""

from shardkit.utils.lazy import lazy_exports

__all__ = ["Runner", "RunnerCheckpoints", "RunnerObservability", "StateSaver"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "Runner": "core", "RunnerCheckpoints": "checkpoints", "RunnerObservability": "observe",
    "StateSaver": "user_state",
})
