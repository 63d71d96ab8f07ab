"""Time lost per failure: ``shardkit launch --max-restarts`` vs the same job restarted by hand from its checkpoint.

    python benchmarks/restart_time_lost.py [--kills 1] [--steps 20] [--rounds 1]

The job is tests/distributed/scripts/restart_job.py: 2 ranks of DDP on CPU, a checkpoint every 2 steps, resumed
with ``Runner.resume``; one rank SIGKILLs itself at a seeded random moment of each of the first ``--kills`` attempts.

* uninterrupted: one ``shardkit launch`` without a kill (T0);
* automatic: ``shardkit launch --max-restarts 5`` (Ta); the launcher's per-failure breakdown (detection + restart +
  load + replayed steps, measured by the job) is printed too;
* by hand: ``shardkit launch`` typed again the moment the previous one ended (no reaction time), resuming from the
  newest complete checkpoint as a person passing ``mode=True`` would (Th).

Time lost per failure = (T - T0) / kills, medians over ``--rounds``. A person's reaction time (minutes; hours at
night) is not in the by-hand figure: what is left is the launcher's own start, which the automatic restart skips.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _timing import machine_description, print_table

JOB = Path(__file__).resolve().parents[1] / "tests" / "distributed" / "scripts" / "restart_job.py"


def _launch(out: Path, flags: list[str], job: list[str], env: dict[str, str]) -> tuple[int, float, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "shardkit.cli", "launch", "--num-processes", "2", *flags, str(JOB),
                           str(out), *job], capture_output=True, text=True, env={**os.environ, **env}, timeout=1200)
    return done.returncode, time.perf_counter() - start, done.stderr


def _round(steps: int, kills: int) -> dict[str, float | str]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        job = ["--steps", str(steps)]
        killing = [*job, "--kill-seed", "7", "--kills", str(kills)]
        for name in ("plain", "auto", "hand"):
            (root / name).mkdir()
        code, plain, err = _launch(root / "plain", [], job, {})
        assert code == 0, err[-3000:]
        code, auto, err = _launch(root / "auto", ["--max-restarts", "5"], killing, {})
        assert code == 0, err[-3000:]
        breakdown = [line.strip() for line in err.splitlines() if re.match(r"\s+failure \d+:", line)]
        hand, records = 0.0, root / "hand-records"
        records.mkdir()
        for attempt in range(kills + 1):
            last = max((json.loads(p.read_text()).get("step") or -1 for p in records.glob("progress.*.json")),
                       default=-1)
            env = {"SHARDKIT_RESTART_DIR": str(records), "SHARDKIT_RESTART_COUNT": str(attempt),
                   "SHARDKIT_RESTART_LAST_STEP": str(last)}
            code, seconds, err = _launch(root / "hand", [], killing, env)
            hand += seconds
            if code == 0:
                break
        assert code == 0 and attempt == kills, err[-3000:]
    return {"plain": plain, "auto": auto, "hand": hand, "breakdown": "; ".join(breakdown)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    rounds = [_round(args.steps, args.kills) for _ in range(args.rounds)]
    plain = statistics.median(r["plain"] for r in rounds)
    rows = [["uninterrupted", f"{plain:.1f}", "-"]]
    for key, name in (("auto", "--max-restarts 5 (automatic)"), ("hand", "by hand, no reaction time")):
        total = statistics.median(r[key] for r in rounds)
        rows.append([name, f"{total:.1f}", f"{(total - plain) / args.kills:.1f}"])
    print(machine_description())
    print(f"{args.kills} kill(s) of a rank (SIGKILL) in a {args.steps}-step job, 2 ranks DDP on CPU, {args.rounds} "
          f"round(s)")
    print_table(["run", "wall s", "lost per failure s"], rows)
    for r in rounds:
        print(f"automatic, measured by the job: {r['breakdown']}")


if __name__ == "__main__":
    main()
