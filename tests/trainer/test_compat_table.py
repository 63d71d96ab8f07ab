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


# A value other than the default for each TrainingArguments field the table marks "refused" (not an obsolete name).
_REFUSED_FIELD_VALUES = {"parallelism_config": {"tp_size": 2}}


def test_every_mark_is_true(tmp_path):
    """Each "supported"/"different" method exists on shardkit's Trainer; each "refused" name (method, keyword,
    argument, obsolete argument) raises an error that names it."""
    import pytest
    from trainer_tiny import Line

    from shardkit.trainer import Trainer, TrainingArguments
    from shardkit.trainer.compat import compat_rows, init_rows

    args_rows, method_rows = compat_rows()
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", disable_tqdm=True)
    trainer = Trainer(Line(), args)
    for name, status, _ in method_rows:
        if status == "refused":
            with pytest.raises(NotImplementedError, match=name):
                getattr(trainer, name)()
        else:
            assert status in ("supported", "different", "shardkit only") and hasattr(trainer, name), (name, status)
            assert callable(getattr(Trainer, name)) or name == "loss_is_scaled_for_ga", name
    fields = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    for name, status, _ in args_rows:
        if status != "refused":
            assert name in fields, (name, status)
            continue
        with pytest.raises(Exception, match=name):
            TrainingArguments(output_dir=str(tmp_path), **{name: _REFUSED_FIELD_VALUES.get(name, "x")})
    for name, status, _ in init_rows():
        if status == "refused":
            with pytest.raises(Exception, match=name):
                Trainer(Line(), args, **{name: object()})
