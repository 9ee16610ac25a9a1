"""Does this engine know this model: the architecture in config.json against the model registry captured from
an engine version (module_utils/llmfleet/engine/data/registries/<engine>-<version>.json).

vLLM's list is what its own ModelRegistry.get_supported_archs() returned; SGLang's is the class names its
registry collects (`EntryClass` of every module in python/sglang/srt/models/). How each was captured is in the
JSON and in docs/engine-fit.md. An unknown engine version is checked against the nearest captured one, with a
warning. Stdlib only, Python >= 3.8.

The registries are data files beside this module: a node has them (the base role copies the package tree), an
Ansible module's AnsiballZ payload does not (it ships .py files only), so run this on the ops host or through
`llmfleet` on the node, or pass registry_dir.
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import re
import sys
from typing import Any

from .. import engines

# Captured from source (SGLang's models directory, read with ast); vLLM's by its own registry (VLLM_SNIPPET).
_SGLANG = engines.SGLANG.registry
REGISTRY_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "registries")
# The engines with a captured model registry (the profile's file stem), and how messages name them.
ENGINE_NAMES = {e: engines.get(e).label for e in engines.engines() if engines.get(e).registry}


class ArchCheckError(ValueError):
    """No registry to check against; the message says which and where."""


def version_key(version: str) -> tuple[int, ...]:
    """(0, 32, 0) from "0.32", "0.32.0", "0.32.0+cpu", "v0.32.0rc1"; (0, 5, 23) from "0.5.23.post1"."""
    m = re.match(r"v?(\d+(?:\.\d+)*)", str(version).strip())
    if not m:
        raise ArchCheckError(f"engine version {version!r}: not a version number (expected e.g. 0.32.0)")
    parts = [int(p) for p in m.group(1).split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def captured(engine: str, registry_dir: str | None = None) -> list[str]:
    """Versions with a registry file for `engine`, oldest first."""
    d = registry_dir or REGISTRY_DIR
    stem = engines.get(engine).registry if engine in ENGINE_NAMES else engine
    try:
        names = os.listdir(d)
    except OSError:
        return []
    out = [n[len(stem) + 1 : -5] for n in names if n.startswith(stem + "-") and n.endswith(".json")]
    return sorted(out, key=version_key)


def nearest(version: str, versions: list[str]) -> str:
    """The captured version closest to `version`: the newest not above it, else the oldest above it."""
    want = version_key(version)
    below = [v for v in versions if version_key(v) <= want]
    return below[-1] if below else versions[0]


def load_registry(engine: str, version: str, registry_dir: str | None = None) -> tuple[dict[str, Any], str | None]:
    """(registry, warning): the registry captured for `version`, or the nearest one and a warning saying so."""
    if engine not in ENGINE_NAMES:
        raise ArchCheckError(f"engine {engine!r}: not one of {', '.join(ENGINE_NAMES)}")
    d = registry_dir or REGISTRY_DIR
    versions = captured(engine, d)
    if not versions:
        raise ArchCheckError(f"no {ENGINE_NAMES[engine]} registry in {d}: reinstall the llmfleet package (data files)")
    want = version_key(version)
    exact = [v for v in versions if version_key(v) == want]
    use = exact[0] if exact else nearest(version, versions)
    warning = None
    if not exact:
        warning = (
            f"no registry captured for {ENGINE_NAMES[engine]} {version}; checked against {use}, the nearest captured "
            f"(an architecture added or removed in between is not seen)"
        )
    path = os.path.join(d, f"{engine}-{use}.json")
    try:
        with open(path, encoding="utf-8") as f:
            reg = json.load(f)
    except (OSError, ValueError) as e:
        raise ArchCheckError(f"{path}: cannot read the registry ({e}); reinstall the llmfleet package") from None
    if not isinstance(reg.get("architectures"), list):
        raise ArchCheckError(f"{path}: no architectures list; recapture it (docs/engine-fit.md)")
    return reg, warning


def supported(arch: str, engine: str, version: str, registry_dir: str | None = None) -> tuple[bool, str]:
    """(known, message) for one architecture name (config.json `architectures[0]`)."""
    reg, warning = load_registry(engine, version, registry_dir)
    name = f"{ENGINE_NAMES[engine]} {reg.get('version', version)}"
    archs = reg["architectures"]
    prefix = warning + ": " if warning else ""
    if arch in archs:
        how = ""
        if arch in reg.get("transformers_backend", []):
            how = " (served by its generic Transformers backend, not a native implementation)"
        return True, f"{prefix}{arch} is in {name}'s model registry{how}"
    close = difflib.get_close_matches(arch, archs, n=3, cutoff=0.6)
    near = f"; close: {', '.join(close)}" if close else ""
    return False, (
        f"{prefix}{arch} is not in {name}'s model registry ({len(archs)} architectures){near}. The engine would "
        f"try its generic Transformers backend, which runs only models transformers itself implements and without "
        f"the engine's own kernels, or refuse. Fix: an engine version that lists {arch}, or check the checkpoint's "
        f"config.json architectures (a renamed or custom-code model?)"
    )


def check_config(
    config: dict[str, Any], engine: str, version: str, registry_dir: str | None = None
) -> tuple[bool, str]:
    """(known, message) for a checkpoint's config.json: its first architecture, as both engines resolve it."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        return False, (
            f"config.json has no architectures list (got {archs!r}): neither engine can pick a model class; "
            f"copy config.json from the pinned revision"
        )
    return supported(archs[0], engine, version, registry_dir)


# ---- capturing a registry (refreshing the data files; docs/engine-fit.md) --------------------------------------------

VLLM_SNIPPET = engines.VLLM_REGISTRY_SNIPPET


def sglang_entry_classes(models_dir: str) -> list[str]:
    """The class names SGLang's registry would collect from python/sglang/srt/models/, read with ast (no import):
    `EntryClass = Cls` or `[Cls, ...]` in each top-level module (registry.import_model_classes skips packages),
    a name resolved through `from x import Cls as Alias` and `Alias = Cls` the way `Cls.__name__` would be."""
    out = set()
    for fn in sorted(os.listdir(models_dir)):
        if not fn.endswith(".py") or fn == "__init__.py":
            continue
        with open(os.path.join(models_dir, fn), encoding="utf-8") as f:
            tree = ast.parse(f.read(), fn)
        classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        imported = {
            a.asname or a.name: a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
        }
        assigns = {
            n.targets[0].id: n.value
            for n in tree.body
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
        }
        entry = assigns.get("EntryClass")
        if entry is None:
            continue
        for e in entry.elts if isinstance(entry, (ast.List, ast.Tuple)) else [entry]:
            if not isinstance(e, ast.Name):
                raise ValueError(f"{fn}: EntryClass element {ast.dump(e)} is not a name; capture by import instead")
            name = e.id
            for _ in range(5):  # Alias = Cls chains
                if name in classes or name not in assigns or not isinstance(assigns[name], ast.Name):
                    break
                name = assigns[name].id
            if name not in classes and name not in imported:
                raise ValueError(f"{fn}: EntryClass names {e.id!r}, defined nowhere in the module")
            out.add(name if name in classes else imported[name])
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    """python -m llmfleet.engine.archcheck sglang MODELS_DIR VERSION SOURCE  (prints the registry JSON)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4 or args[0] != _SGLANG:
        print(main.__doc__, file=sys.stderr)
        print(f'vLLM: run, in the engine\'s venv: python -c "{VLLM_SNIPPET}"', file=sys.stderr)
        return 2
    _, models_dir, version, source = args
    reg = {
        "engine": _SGLANG,
        "version": version,
        "source": source,
        "method": "archcheck.sglang_entry_classes: EntryClass of python/sglang/srt/models/*.py, read with ast",
        "architectures": sglang_entry_classes(models_dir),
    }
    print(json.dumps(reg, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
