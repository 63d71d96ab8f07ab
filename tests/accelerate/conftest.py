"""Make the distributed tests' ``harness`` and this folder's workers importable, whatever pytest's import mode."""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _path in (str(_HERE), str(_HERE.parent / "distributed")):
    if _path not in sys.path:
        sys.path.insert(0, _path)
