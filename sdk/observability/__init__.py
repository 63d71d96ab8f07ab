"""What a run is doing: throughput and MFU, experiment trackers for the Runner, the step profiler."""

from shardkit.observability.profiler import StepProfiler, install_oom_snapshot, parse_profile_steps
from shardkit.observability.run_log import RunLog
from shardkit.observability.throughput import PEAK_TFLOPS, FlopsPerToken, Throughput, flops_per_token

__all__ = ["PEAK_TFLOPS", "FlopsPerToken", "RunLog", "StepProfiler", "Throughput", "flops_per_token",
           "install_oom_snapshot", "parse_profile_steps"]
