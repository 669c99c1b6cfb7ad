"""The shared secret of the zmq KV server and its clients: where it comes from.

There is always one. In order of precedence:

1. an explicit file (the server's ``--secret-file PATH``, a client's ``TierOptions.secret_file``);
2. ``$VERICACHE_TIER_SECRET`` (the secret itself, >= 16 bytes);
3. the file named by ``$VERICACHE_TIER_SECRET_FILE``, else ``~/.cache/sglang_vericache/
   tier_secret`` (``$XDG_CACHE_HOME`` is honoured): generated with 32 random bytes and mode
   0600 by whichever process on this machine needs it first, so every KV server and SGLang
   server of one user on one machine shares it without configuration.

A secret file readable by group or others is refused (anyone who can read it can forge KV).
Clients on other machines need the same secret: copy the file, or set the variable on both
sides. Error messages name the ``source`` so a mismatch says where each side looked.
"""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from sglang_vericache.paths import cache_path

SECRET_ENV = "VERICACHE_TIER_SECRET"
SECRET_FILE_ENV = "VERICACHE_TIER_SECRET_FILE"
MIN_SECRET_BYTES = 16


@dataclass(frozen=True, slots=True)
class TierSecret:
    """value: the key bytes (>= MIN_SECRET_BYTES); source: where it came from, for messages."""

    value: bytes
    source: str

    def __post_init__(self) -> None:
        if len(self.value) < MIN_SECRET_BYTES:
            raise ValueError(f"the tier secret from {self.source} is shorter than "
                             f"{MIN_SECRET_BYTES} bytes")

    def __repr__(self) -> str:  # never print the key itself
        return f"TierSecret(source={self.source!r})"


def default_secret_path() -> Path:
    """``$VERICACHE_TIER_SECRET_FILE``, else the per-user cache path (module doc)."""
    return cache_path("tier_secret", SECRET_FILE_ENV)


def mismatch_hint(source: str) -> str:
    """What to tell a user whose peer refused this side's secret."""
    return (f"both sides must use the same shared secret: set ${SECRET_ENV} to one value on "
            f"the KV server and every client, or give them the same secret file "
            f"(--secret-file / ${SECRET_FILE_ENV}); this side used {source}")


def resolve_secret(path: str | os.PathLike[str] | None = None, *,
                   create: bool = True) -> TierSecret:
    """The secret this process uses (precedence in the module doc).

    create: generate the default file when it does not exist (False: FileNotFoundError).
    Raises ValueError for a too-short secret or a file readable by others.
    """
    if path is not None:
        return _read_file(Path(path).expanduser(), f"secret file {path}")
    env = os.environ.get(SECRET_ENV)
    if env:
        return TierSecret(env.encode(), f"${SECRET_ENV}")
    target = default_secret_path()
    if create and not target.exists():
        _create_file(target)
    return _read_file(target, f"secret file {target}")


def _read_file(path: Path, source: str) -> TierSecret:
    with open(path, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        value = f.read().strip()
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{source} is accessible by group/others (mode {stat.filemode(mode)}); "
                         f"run: chmod 600 {path}")
    return TierSecret(value, source)


def _create_file(path: Path) -> None:
    """Write a fresh random secret to ``path`` atomically, mode 0600; if another process won
    the race, keep its file (link() fails instead of overwriting)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode() + b"\n")
        try:
            os.link(tmp, path)  # atomic create-if-absent: readers never see a partial file
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
