"""The wrapper's secrets: systemd credentials handed to the engine (environment variables or a private YAML file)
and the redaction of every loaded value from everything the wrapper writes.

Stdlib only, Python >= 3.8 (copied to nodes). docs/wrapper.md#secrets has the contract.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Any

REDACTED = "***"
MIN_SECRET_PART = 8  # a line of a multi-line secret shorter than this is not redacted on its own
_CRED_NAME = r"[A-Za-z0-9_.@-]+"  # systemd credential names: no '/'
_SECRET_ENV = re.compile(rf"([A-Za-z_][A-Za-z0-9_]*)=({_CRED_NAME})")
_SECRET_CONFIG = re.compile(rf"([A-Za-z0-9][A-Za-z0-9_-]*):([A-Za-z_][A-Za-z0-9_.-]*)=({_CRED_NAME})")


class SetupError(Exception):
    """A configuration problem found before the child starts (exit 2)."""


def read_credential(cred: str) -> str:
    hint = f"add LoadCredential={cred}:/path/to/secret-file to the unit's [Service] section"
    cdir = os.environ.get("CREDENTIALS_DIRECTORY")
    if not cdir:
        raise SetupError(f"credential {cred!r}: $CREDENTIALS_DIRECTORY is not set; {hint}")
    path = os.path.join(cdir, cred)
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read()
    except OSError as e:
        raise SetupError(f"credential {cred!r}: cannot read {path}: {e.strerror}; {hint}") from None
    value = value.rstrip("\r\n")
    if not value:
        raise SetupError(f"credential {cred!r}: {path} is empty; point LoadCredential={cred}: at the secret")
    return value


def secret_forms(value: str) -> list[str]:
    """What to redact for one secret value: the value as it is, as it looks inside a JSON string or a
    Python repr (SGLang logs ``server_args=ServerArgs(..., api_key='...')``), and each line of a
    multi-line secret (output is handled line by line). Longest first."""
    forms = {value, json.dumps(value)[1:-1], repr(value)[1:-1]}
    for part in re.split(r"\r\n|\n|\r", value):
        if len(part.strip()) >= MIN_SECRET_PART:
            forms.update({part, part.strip()})
    return sorted((f for f in forms if f), key=lambda f: (-len(f), f))


class Redactor:
    """Replaces every loaded secret value with ``***`` in bytes (the stream) and text (the record)."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.raw: list[bytes] = []

    def add(self, value: str) -> None:
        self.texts = sorted(set(self.texts) | set(secret_forms(value)), key=lambda f: (-len(f), f))
        self.raw = [t.encode("utf-8") for t in self.texts]

    def __bool__(self) -> bool:
        return bool(self.texts)

    def data(self, raw: bytes) -> bytes:
        for s in self.raw:
            if s in raw:
                raw = raw.replace(s, REDACTED.encode())
        return raw

    def text(self, text: str) -> str:
        for s in self.texts:
            if s in text:
                text = text.replace(s, REDACTED)
        return text

    def deep(self, obj: Any) -> Any:
        """A copy of a JSON-able value with every string redacted."""
        if not self.texts:
            return obj
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, dict):
            return {k: self.deep(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.deep(v) for v in obj]
        return obj

    def safe_cut(self, buf: bytes, cut: int) -> int:
        """Where to cut an over-long line so that no secret is split between two pieces (each piece is
        redacted on its own): before the longest tail of buf[:cut] that starts a secret."""
        for k in range(min(cut - 1, max((len(s) for s in self.raw), default=1) - 1), 0, -1):
            tail = buf[cut - k : cut]
            if any(s.startswith(tail) for s in self.raw):
                return cut - k
        return cut


def parse_secret_specs(env_specs: list[str], config_specs: list[str]) -> tuple[list, dict]:
    envs = []
    for spec in env_specs:
        m = _SECRET_ENV.fullmatch(spec)
        if not m:
            raise SetupError(f"--secret-env {spec!r}: expected VAR=CREDENTIAL")
        envs.append((m.group(1), m.group(2)))
    configs: dict[str, list] = {}
    for spec in config_specs:
        m = _SECRET_CONFIG.fullmatch(spec)
        if not m:
            raise SetupError(f"--secret-config {spec!r}: expected OPTION:KEY=CREDENTIAL (e.g. config:api_key=api-key)")
        configs.setdefault(m.group(1), []).append((m.group(2), m.group(3)))
    return envs, configs


class Secrets:
    """The credentials one engine run gets (--secret-env, --secret-config), the files written for them, and
    the Redactor that knows every value loaded: never in the output, the record or the status."""

    def __init__(self) -> None:
        self.redact = Redactor()
        self.files: list[str] = []
        self.dir: str | None = None

    def load(self, env_specs: list[str], config_specs: list[str], env: dict[str, str], argv: list[str]) -> None:
        """Set the --secret-env variables in env; write each --secret-config option's keys to a private YAML
        file and append ``--OPT FILE`` to argv. Raises SetupError (bad spec, missing credential) or OSError."""
        envs, configs = parse_secret_specs(env_specs, config_specs)
        for var, cred in envs:
            env[var] = read_credential(cred)
            self.redact.add(env[var])
        values = {name: [(key, read_credential(cred)) for key, cred in items] for name, items in configs.items()}
        for items in values.values():
            for _key, value in items:
                self.redact.add(value)
        if values:
            rt = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
            if not rt:
                self.dir = rt = tempfile.mkdtemp(prefix="llmfleet-exec-")  # mode 0700
            for name, items in values.items():
                fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".yaml", dir=rt)  # mode 0600
                self.files.append(path)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    for key, value in items:
                        f.write(f"{key}: {json.dumps(value)}\n")  # a JSON string is a valid YAML scalar
                argv += [f"--{name}", path]

    def cleanup(self) -> None:
        for path in self.files:
            try:
                os.unlink(path)
            except OSError:
                pass
        if self.dir:
            try:
                os.rmdir(self.dir)
            except OSError:
                pass
