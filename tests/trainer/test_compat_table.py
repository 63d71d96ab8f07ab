"""The README's table of Hugging Face Trainer keywords, arguments and methods is the generated one, and it
covers every field and public method of the transformers installed here (issue 23 item 6)."""

import dataclasses
import importlib.util
import inspect
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _table_module():
    spec = importlib.util.spec_from_file_location("trainer_compat_table", SCRIPTS / "trainer_compat_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_readme_table_is_generated_and_complete():
    import transformers

    table = _table_module()
    assert table.main(["--check"]) == 0
    text = table.readme_table(table.README.read_text())
    named = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `")}
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
    methods = {n for n, v in inspect.getmembers(transformers.Trainer) if not n.startswith("_") and callable(v)}
    assert fields <= named and methods <= named, (sorted(fields - named), sorted(methods - named))
    assert "| missing |" not in text
