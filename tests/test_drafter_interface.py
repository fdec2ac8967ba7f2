"""The drafter interface stays small, and the loops ask a drafter's needs, never its class."""
import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import labkit.drafters
from labkit.drafters.base import Drafter, Needs

LOOPS = Path(labkit.__file__).parent / "decoding"


def drafter_classes() -> set[type]:
    for info in pkgutil.iter_modules(labkit.drafters.__path__):
        importlib.import_module(f"labkit.drafters.{info.name}")
    found, todo = set(), [Drafter]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("labkit.") and sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def test_a_drafter_is_four_methods_and_one_needs_record():
    methods = {name for name, value in vars(Drafter).items() if inspect.isfunction(value)}
    assert methods == {"check_target", "start", "propose", "commit"}
    assert Drafter.__abstractmethods__ == {"propose"}
    assert isinstance(Drafter.needs, Needs) and Drafter.needs == Needs()
    flags = {name for name, value in vars(Drafter).items() if isinstance(value, bool)}
    assert not flags, f"a drafter declares what it needs in `needs`, not in flags: {flags}"


def test_every_drafter_declares_its_needs_in_the_record_and_no_flag_beside_it():
    classes = drafter_classes()
    assert len(classes) >= 15
    old_flags = {"reads_features", "reads_verdict", "best_first", "samples_tokens", "drafts_on_device"}
    for cls in classes:
        assert isinstance(cls.needs, Needs), cls
        assert not old_flags & set(vars(cls)), (cls, old_flags & set(vars(cls)))
        if cls.needs.device == "model":
            assert callable(getattr(cls, "device_parts", None)), cls
        if cls.needs.rows:
            assert callable(getattr(cls, "rows", None)), cls


def test_no_loop_names_a_drafters_class():
    names = {cls.__name__ for cls in drafter_classes()}
    for path in sorted(LOOPS.glob("*.py")):
        tree = ast.parse(path.read_text())
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
               {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
               {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not used & names, f"{path.name} names {sorted(used & names)}: ask the drafter's needs instead"


def test_a_needs_record_refuses_a_device_path_no_loop_has():
    with pytest.raises(ValueError, match="'model' or 'tree'"):
        Needs(device="gpu")
