"""labkit installed, not only checked out: a non-editable install into a folder of its own, imported from outside
the checkout, carries its kernels' C++ sources, decodes speculatively, and finds the shipped heads through
LABKIT_DATA (or says that it cannot)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CODE = """
import json, sys, torch
import labkit
from labkit import DraftModelDrafter, speculative_generate, autoregressive_generate
from labkit.files.shipped import shipped
from labkit.kernels import cpu
from labkit.models.transformer import ModelArgs, Transformer
m = Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=64)).init_random(std=0.3)
prompt = torch.tensor([1, 2, 3])
same = speculative_generate(m, DraftModelDrafter(m), prompt, 12).tokens == autoregressive_generate(m, prompt, 12).tokens
from pathlib import Path
sources = sorted(p.name for p in Path(cpu.__file__).parent.glob("*.cpp"))
heads = json.loads((shipped("heads", "medusa-qwen2.5-coder-1.5b") / "config.json").read_text())["n_heads"]
print(json.dumps({"file": labkit.__file__, "same": same, "sources": sources, "heads": heads}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    source, target = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("site")
    for name in ("pyproject.toml", "README.md"):              # what the package is built from, copied: the build
        shutil.copy(ROOT / name, source / name)               # writes its build/ there, not into the checkout
    for package in ("labkit", "kernels"):                     # kernels/ installs as labkit.kernels
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return target


def run(installed, tmp_path, **env):
    done = subprocess.run([sys.executable, "-c", CODE], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(installed), **env})
    return done


def test_a_non_editable_install_runs_from_outside_the_checkout(installed, tmp_path):
    import json
    done = run(installed, tmp_path, LABKIT_DATA=str(ROOT / "data"))
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).is_relative_to(installed) and got["same"] and got["heads"] == 4
    assert {"linear.cpp", "int4.cpp", "attention.cpp"} <= set(got["sources"])


def test_without_its_data_it_says_where_to_point(installed, tmp_path):
    done = run(installed, tmp_path, LABKIT_DATA=str(tmp_path / "nothing"))
    assert done.returncode != 0 and "set LABKIT_DATA to a checkout's data/ folder" in done.stderr


@pytest.mark.integration
def test_the_installed_package_drafts_with_the_shipped_medusa_heads(installed, tmp_path):
    """From the install, outside the checkout: the real target with the shipped Medusa heads (found through
    LABKIT_DATA), drafting trees on the command line (exactness is tests/test_integration_heads.py's)."""
    import json
    prompt = "Write a Python function that adds two numbers."
    done = subprocess.run([sys.executable, "-m", "labkit", "generate", "--method", "medusa", "--json", "--dtype",
                           "fp32", "--max-new-tokens", "12", "--prompt", prompt], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(installed), "LABKIT_DATA": str(ROOT / "data")})
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(out["tokens"]) == 12 and out["stats"]["tokens_per_forward"] > 1
    assert any(s["parents"] for s in out["steps"]), "the heads drafted trees"
