"""The package's layers: labkit's import graph has no circle, and no module imports from a higher layer.

Read from the source with `ast` (every import, also those inside functions), so a lazy import
cannot hide a circle. A layer may import from itself and from the layers below it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[1]
ROOT = CHECKOUT / "labkit"
# where each package's source lives: labkit/, except the kernels, at the checkout's top (pyproject's package-dir)
SOURCES = {"labkit.kernels": CHECKOUT / "kernels", "labkit": ROOT}

# lowest first: the math and the lab's files, the kernels, model and cache, drafters, decoding loops, the speed
# choices beside them, training and export, presentation and hardware, benchmarks, the command line
LAYERS = [("core", "files"), ("kernels",), ("models",), ("drafters",), ("decoding",), ("tuning",),
          ("training", "export"), ("viz", "hw"), ("bench",),
          ("cli", "lab", "book", "__main__", "__init__")]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    for package, folder in SOURCES.items():
        if path.is_relative_to(folder):
            parts = package.split(".") + list(path.relative_to(folder).with_suffix("").parts)
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise AssertionError(f"{path} is in no package folder")


def source(mod: str) -> Path:
    """Where a labkit module or package would live."""
    for package, folder in SOURCES.items():
        if mod == package or mod.startswith(package + "."):
            return folder.joinpath(*mod.split(".")[len(package.split(".")):])
    return ROOT.parent.joinpath(*mod.split("."))


def imports(path: Path) -> set[str]:
    """The labkit modules `path` imports (a name that is a submodule counts as the submodule)."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "labkit"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "labkit":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                is_module = source(sub).with_suffix(".py").exists() or source(sub).is_dir()
                found.add(sub if is_module else target)
    return found - {mod}


FILES = sorted(p for folder in SOURCES.values() for p in folder.rglob("*.py"))
GRAPH = {module_name(p): imports(p) for p in FILES}


def test_pyproject_installs_every_package_from_its_folder():
    """The kernels live in kernels/ and install as labkit.kernels; every package folder is in pyproject's list."""
    import tomllib
    tool = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"] == {"labkit.kernels": "kernels"}
    folders = {module_name(p) for p in FILES if p.name == "__init__.py"}
    assert set(tool["packages"]) == folders, (f"add {sorted(folders - set(tool['packages']))} to / remove "
                                              f"{sorted(set(tool['packages']) - folders)} from pyproject's packages")
    assert not (ROOT / "kernels").exists(), "the kernels' sources are in kernels/ at the checkout's top"


def layer(mod: str) -> int:
    parts = mod.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top not in LAYER_OF:
        raise AssertionError(f"{mod} is in no layer: add its folder to LAYERS in tests/test_layers.py")
    return LAYER_OF[top]


def test_every_module_has_a_layer():
    for mod in GRAPH:
        layer(mod)


def test_no_import_reaches_up_a_layer():
    upward = [f"{mod} (layer {layer(mod)}) imports {dep} (layer {layer(dep)})"
              for mod, deps in GRAPH.items() for dep in deps if dep in GRAPH and layer(dep) > layer(mod)]
    assert not upward, "\n".join(upward)


def test_the_algorithm_does_not_see_the_tuning():
    """The math, the drafters and the loops run without labkit.tuning, and the loops' base keeps no shadows."""
    low = {"core", "drafters", "decoding"}
    seen = [f"{mod} imports {dep}" for mod, deps in GRAPH.items() if mod.split(".")[1:2][0:1] and
            mod.split(".")[1] in low for dep in deps if dep.startswith("labkit.tuning")]
    assert not seen, "\n".join(seen)
    assert "shadow" not in (ROOT / "decoding" / "base.py").read_text().lower()


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports, as the list of modules on it, or None (depth-first search)."""
    state: dict[str, int] = {}                      # 1: on the current path, 2: done
    path: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        path.append(mod)
        for dep in sorted(graph.get(mod, ())):
            # a package's __init__ importing its own submodules is how packages work, not a circle
            if dep not in graph or mod.startswith(dep + "."):
                continue
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        state[mod] = 2
        path.pop()
        return None

    for mod in sorted(graph):
        if mod not in state and (circle := visit(mod)):
            return circle
    return None


def test_the_import_graph_has_no_circle():
    circle = find_circle(GRAPH)
    assert circle is None, " -> ".join(circle)


def test_the_checks_catch_a_circle_and_an_upward_import():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None
    assert layer("labkit.core.sampling") < layer("labkit.decoding.speculative") < layer("labkit.bench.runner")
    with pytest.raises(AssertionError, match="no layer"):
        layer("labkit.somewhere.new")


def test_every_drafter_lives_in_drafters_behind_one_interface():
    import importlib
    import inspect

    from labkit.drafters.base import Drafter
    drafters = []
    for mod in GRAPH:
        if mod == "labkit.__main__":               # running it is running the command line
            continue
        for name, obj in inspect.getmembers(importlib.import_module(mod), inspect.isclass):
            if issubclass(obj, Drafter) and obj is not Drafter and obj.__module__ == mod:
                drafters.append(obj)
    assert {d.__name__ for d in drafters} >= {"DraftModelDrafter", "PromptLookupDrafter", "MedusaDrafter",
                                              "EagleDrafter", "GloeckleDrafter", "DeepSeekDrafter"}
    assert all(d.__module__.startswith("labkit.drafters.") for d in drafters), \
        [d.__module__ for d in drafters if not d.__module__.startswith("labkit.drafters.")]


def test_shipped_data_is_found_in_one_place_and_its_absence_says_what_to_do(tmp_path, monkeypatch):
    from labkit.files.shipped import CHECKOUT, shipped
    assert shipped("heads", "medusa-qwen2.5-coder-1.5b") == CHECKOUT / "data" / "heads" / "medusa-qwen2.5-coder-1.5b"
    monkeypatch.setenv("LABKIT_DATA", str(tmp_path))
    assert shipped("bench", must_exist=False) == tmp_path / "bench"
    with pytest.raises(FileNotFoundError, match="LABKIT_DATA"):
        shipped("heads")
    package = CHECKOUT / "labkit"
    others = [p for p in package.rglob("*.py") if p.name != "shipped.py" and "parents[2]" in p.read_text()]
    assert not others, f"find shipped files through labkit.files.shipped, not parents[2]: {others}"
