"""Run a measurement in a fresh Python process and return its JSON result.

CPU peak-memory tests read the resident-set high-water mark. In the full suite's one long process, glibc serves
large tensors from memory that earlier tests freed and that is still resident (its mmap threshold rises after the
first large frees), so the high-water mark does not move: the same test read 0.0 there and 3.0 alone.

Even in a fresh process the dynamic threshold let chunk-sized temporaries (4 MiB) land in per-thread heap arenas
whose pages stay resident: the cross-entropy overwrite peak read 0.25 to 0.37 here and 0.62 in CI. The child runs
with glibc's mmap threshold fixed at 128 KiB (every larger tensor its own mapping, returned on free) and two arenas,
so the high-water mark is the peak of live tensors: 0.185 in five runs of five.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["in_fresh_process"]

_REPO = Path(__file__).resolve().parents[2]


def in_fresh_process(module: str, function: str, *args: Any) -> Any:
    """``<module>.<function>(*args)`` (a module of tests/kernels) in a new interpreter (args and result as JSON)."""
    code = ("import json, sys; from {m} import {f}; "
            "print('RESULT', json.dumps({f}(*json.loads(sys.argv[1]))))").format(m=module, f=function)
    path = [str(_REPO), str(Path(__file__).parent), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path)),
           "MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "MALLOC_ARENA_MAX": "2"}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, env=env,
                          cwd=_REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])
