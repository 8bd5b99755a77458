"""Bearer tokens: where the server's token comes from, how a caller presents it, how it is checked.

One admin token guards the calls that change or reveal the service's configuration
(``UpdatePolicy``, ``GetPolicy``). The server reads it from the environment variable named
in the config (``auth.admin_token_env``, default ``ADAPTSPEC_ADMIN_TOKEN``; a Kubernetes
Secret in the manifests). When that variable is unset, ``adaptspec serve`` / ``make run``
creates a random token once and keeps it in ``$ADAPTSPEC_HOME/admin-token`` (mode 0600),
which the replicas on the same machine and the CLI (``adaptspec policy ...``) read.

Callers send gRPC metadata ``authorization: Bearer <token>`` (HTTP: the ``Authorization``
header, same form). ``check`` compares in constant time (``hmac.compare_digest``) and
tells a missing token (gRPC UNAUTHENTICATED) from a wrong one (PERMISSION_DENIED). The
token never appears in a log line, an exception message or a ``repr``: ``Token`` hides it.

API keys (``ApiKeys``) guard the data calls: the OpenAI HTTP API and, unless
``auth.grpc_api_keys`` is off, gRPC ``Generate``, ``GenerateStream`` and ``GetStats``. They are
read from the variable named by ``http.api_keys_env``: the keys themselves, or the path of a
file of them (a Kubernetes Secret volume), re-read when it changes so keys rotate without a
restart. This module imports neither Ray nor gRPC.
"""
from __future__ import annotations

import hmac
import os
import re
import secrets
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Iterable

DEFAULT_TOKEN_ENV = "ADAPTSPEC_ADMIN_TOKEN"
TOKEN_FILE_NAME = "admin-token"
TOKEN_BYTES = 32  # 256 bits of randomness, 43 URL-safe characters
MAX_TOKEN_CHARS = 4096  # a presented value longer than this is refused before any comparison
_BEARER = "bearer"


class Verdict(str, Enum):
    """The result of checking a presented token."""

    OK = "ok"
    MISSING = "missing"                # no (or malformed) Authorization: UNAUTHENTICATED
    WRONG = "wrong"                    # a token, but not an accepted one: PERMISSION_DENIED
    NOT_CONFIGURED = "not_configured"  # the server has no token, admin calls are closed: PERMISSION_DENIED

    @property
    def grpc_code(self) -> str:
        """The gRPC status code name for this verdict."""
        return {"ok": "OK", "missing": "UNAUTHENTICATED"}.get(self.value, "PERMISSION_DENIED")


@dataclass(frozen=True)
class Token:
    """A secret with where it came from; its ``repr``/``str`` never show the secret."""

    secret: str
    source: str  # "env:NAME" or "file:/path"

    def __repr__(self) -> str:
        return f"Token(source={self.source!r}, secret=<{len(self.secret)} chars hidden>)"

    __str__ = __repr__


def default_home() -> Path:
    """``$ADAPTSPEC_HOME`` or ``~/.cache/adaptspec`` (the models' cache root)."""
    return Path(os.environ.get("ADAPTSPEC_HOME", Path.home() / ".cache" / "adaptspec")).expanduser()


def token_file(home: str | Path | None = None) -> Path:
    """Where the generated admin token lives: ``$ADAPTSPEC_HOME/admin-token``."""
    return Path(home).expanduser() / TOKEN_FILE_NAME if home is not None else default_home() / TOKEN_FILE_NAME


def _valid_secret(value: str, where: str) -> str:
    value = value.strip()
    if not value:
        raise ValueError(f"{where}: the token is empty")
    if len(value) > MAX_TOKEN_CHARS:
        raise ValueError(f"{where}: the token is longer than {MAX_TOKEN_CHARS} characters")
    if any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError(f"{where}: the token holds whitespace or control characters")
    return value


def read_token_file(path: str | Path) -> Token | None:
    """The token in ``path``, or None if there is no such file. Refuses a file that other users
    can read (as ssh does with keys): a token others could read is not a secret."""
    path = Path(path).expanduser()
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    if os.name == "posix" and st.st_mode & 0o077:
        raise PermissionError(f"{path}: the token file is readable by group or others (mode "
                              f"{oct(st.st_mode & 0o777)}); run `chmod 600 {path}`")
    return Token(_valid_secret(path.read_text(), str(path)), f"file:{path}")


def load_token(env_var: str = DEFAULT_TOKEN_ENV, path: str | Path | None = None) -> Token | None:
    """The server's token: the environment variable if set (and non-empty), else the token file,
    else None (then admin calls are refused)."""
    value = os.environ.get(env_var, "")
    if value.strip():
        return Token(_valid_secret(value, f"${env_var}"), f"env:{env_var}")
    return read_token_file(path if path is not None else token_file())


def ensure_token(env_var: str = DEFAULT_TOKEN_ENV, path: str | Path | None = None) -> tuple[Token, bool]:
    """The server's token, creating the token file (mode 0600) when neither the variable nor the
    file exists. Returns (token, created). Creation is atomic: two starts racing get one token."""
    existing = load_token(env_var, path)
    if existing is not None:
        return existing, False
    path = Path(path).expanduser() if path is not None else token_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_urlsafe(TOKEN_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another start won the race: use its token
        token = read_token_file(path)
        assert token is not None
        return token, False
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return Token(secret, f"file:{path}"), True


def client_token(env_var: str = DEFAULT_TOKEN_ENV, path: str | Path | None = None) -> str | None:
    """The token a client (the CLI) sends: an explicit file if given, else the environment
    variable, else the default token file; None when there is none."""
    if path is not None:
        tok = read_token_file(path)
        if tok is None:
            raise FileNotFoundError(f"--token-file: {path} does not exist")
        return tok.secret
    tok = load_token(env_var)
    return tok.secret if tok else None


def parse_bearer(value: str | bytes | None) -> str | None:
    """The token in an ``Authorization`` value ``Bearer <token>`` (scheme case-insensitive, RFC 6750),
    or None when the value is absent or not of that form."""
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if len(value) > MAX_TOKEN_CHARS + 16:
        return None
    scheme, _, rest = value.strip().partition(" ")
    token = rest.strip()
    if scheme.lower() != _BEARER or not token or any(c.isspace() for c in token):
        return None
    return token


def bearer_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The bearer token in gRPC invocation metadata (key ``authorization``), or None."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            return parse_bearer(value)
    return None


def authorization_metadata(token: str) -> tuple[str, str]:
    """The metadata pair a client adds to a call."""
    return ("authorization", f"Bearer {token}")


def check(presented: str | None, accepted: Token | str | Iterable[Token | str] | None) -> Verdict:
    """Is ``presented`` one of the ``accepted`` tokens? Every accepted token is compared (in
    constant time each) so the time taken does not tell which one, or how much, matched."""
    if accepted is None:
        return Verdict.NOT_CONFIGURED
    if isinstance(accepted, (Token, str)):
        accepted = [accepted]
    secrets_ = [a.secret if isinstance(a, Token) else a for a in accepted]
    if not secrets_:
        return Verdict.NOT_CONFIGURED
    if presented is None:
        return Verdict.MISSING
    given = presented.encode("utf-8", "surrogatepass")
    ok = False
    for secret in secrets_:
        ok |= hmac.compare_digest(given, secret.encode("utf-8"))
    return Verdict.OK if ok else Verdict.WRONG


def refusal_message(verdict: Verdict, what: str = "this call") -> str:
    """The status details for a refusal; names the remedy, never the token."""
    if verdict is Verdict.MISSING:
        return (f"{what} needs an admin token: send gRPC metadata 'authorization: Bearer <token>' "
                f"(the CLI reads $ADAPTSPEC_HOME/{TOKEN_FILE_NAME} or ${DEFAULT_TOKEN_ENV})")
    if verdict is Verdict.NOT_CONFIGURED:
        return (f"{what} is closed: the server has no admin token configured (set the variable named by "
                f"auth.admin_token_env, or start with `adaptspec serve`, which creates one)")
    return f"{what}: the admin token is not valid"


# ---- API keys ---------------------------------------------------------------------------------
class KeysUnavailable(Exception):
    """The configured key source cannot be used (a missing or malformed file): the caller refuses
    the request (closed), it never serves it unchecked. The message names the source, never a key."""


class ApiKeys:
    """The accepted API keys: ``$<env_var>`` holds them comma-separated, or is the path (starting
    with /) of a file holding them one per line or comma-separated. The file is re-read when it
    changes (Kubernetes swaps a mounted Secret's files in place). Unset or empty: no key is needed."""

    def __init__(self, env_var: str):
        self.env_var = env_var
        self._seen: tuple | None = None
        self._keys: tuple[str, ...] = ()

    def current(self) -> tuple[str, ...]:
        value = os.environ.get(self.env_var, "").strip()
        if not value.startswith("/"):
            return split_keys(value, f"${self.env_var}")
        try:
            st = os.stat(value)
        except FileNotFoundError:  # a Secret not mounted yet: closed, not open
            raise KeysUnavailable(f"the API key file named by ${self.env_var} does not exist; see the server's "
                                  "configuration") from None
        seen = (value, st.st_mtime_ns, st.st_size, st.st_ino)
        if seen != self._seen:
            with open(value, encoding="utf-8") as f:
                keys = split_keys(f.read(), value)
            if not keys:
                raise KeysUnavailable(f"the API key file named by ${self.env_var} holds no key")
            self._keys, self._seen = keys, seen
        return self._keys

    def verdict(self, presented: str | None) -> Verdict:
        """OK when no key is configured or ``presented`` is one of the keys; raises KeysUnavailable."""
        keys = self.current()
        return Verdict.OK if not keys else check(presented, keys)


def split_keys(text: str, where: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in re.split(r"[,\n]", text) if k.strip())
    for k in keys:
        if len(k) > MAX_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in k):
            raise KeysUnavailable(f"an API key in {where} is malformed (whitespace, control characters or too "
                                  "long); see the server's configuration")
    return keys
