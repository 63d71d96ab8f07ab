"""What a run is doing: throughput and MFU, experiment trackers for the Runner, the profiler, out-of-memory reports."""

from shardkit.observability.oom_report import StepRecorder, is_out_of_memory, write_oom_report
from shardkit.observability.profiler import StepProfiler, install_oom_snapshot, parse_profile_steps
from shardkit.observability.run_log import RunLog
from shardkit.observability.throughput import PEAK_TFLOPS, FlopsPerToken, Throughput, flops_per_token

__all__ = ["PEAK_TFLOPS", "FlopsPerToken", "RunLog", "StepProfiler", "StepRecorder", "Throughput", "flops_per_token",
           "install_oom_snapshot", "is_out_of_memory", "parse_profile_steps", "write_oom_report"]
