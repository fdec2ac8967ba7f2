"""environment.yml (conda users) installs what requirements.txt + the Makefile's torch install (everyone else) do.

No conda on these machines, so the check is on the files: same packages, same pins.
"""
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([^\s;]+))?\s*(?:;\s*(.+))?$")


def parse_requirement(line: str) -> tuple[str, str | None]:
    """'pandas==3.1.1' -> ('pandas', '3.1.1'); 'tqdm' -> ('tqdm', None); a marker stays with the pin:
    'triton==3.7.1; platform_system == "Linux"' -> ('triton', '3.7.1; platform_system == "Linux"')."""
    m = REQUIREMENT.match(line.strip())
    assert m, f"unexpected requirement {line!r}: use a plain name or name==version (optionally ; marker)"
    pin = m.group(2) if m.group(3) is None else f"{m.group(2)}; {m.group(3).strip()}"
    return m.group(1).lower().replace("_", "-"), pin


def requirements_txt() -> dict[str, str | None]:
    lines = [ln.split("#", 1)[0].strip() for ln in (ROOT / "requirements.txt").read_text().splitlines()]
    return dict(parse_requirement(ln) for ln in lines if ln)


def environment_yml() -> tuple[list, dict[str, str | None]]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    pip_sections = [d["pip"] for d in deps if isinstance(d, dict) and "pip" in d]
    assert len(pip_sections) == 1, "environment.yml needs exactly one pip: section"
    return [d for d in deps if isinstance(d, str)], dict(parse_requirement(ln) for ln in pip_sections[0])


def makefile_torch_pin() -> str:
    m = re.search(r"^TORCH_VERSION\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert m, "the Makefile should set TORCH_VERSION := x.y.z"
    return m.group(1)


def test_conda_environment_has_python_311_and_pip():
    conda_deps, _ = environment_yml()
    assert "python=3.11" in conda_deps and "pip" in conda_deps


def test_environment_pins_equal_requirements_plus_torch():
    _, pip_deps = environment_yml()
    expected = {**requirements_txt(), "torch": makefile_torch_pin()}
    assert pip_deps == expected


def test_torch_is_installed_first_and_not_through_requirements():
    assert "torch" not in requirements_txt(), "torch is installed on its own first (Makefile), not from requirements"
    recipe = (ROOT / "Makefile").read_text()
    assert recipe.index("install torch==$(TORCH_VERSION)") < recipe.index("install -r requirements.txt")
