"""Checkpoint structure and integrity: safetensors headers, the shard index, required files,
and the verification of a checkpoint directory (its structure, plus its manifest when given).

The manifest itself (format, building, reading, comparing files with it) is in manifest.py.
Stdlib only: runs inside Ansible modules on nodes and in the CLI. Every problem is reported as
``Problem(file, kind, message)`` so callers can block a publish, print a table or emit JSON.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from .manifest import load_manifest, verify_manifest

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")
MAX_HEADER = 100 * 1024 * 1024  # the safetensors reference implementation's own limit

# Bytes per element. Sub-byte and exotic types the format allows are included so real FP8/FP4
# checkpoints parse; packed sub-byte types are in PACKED_BITS.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "C64": 8,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
PACKED_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}  # packed: ceil(n * bits / 8) bytes

# Problem kinds (stable: the CLI's --json and tests use them). manifest.verify_manifest reports
# missing_file, truncated, size_mismatch and hash_mismatch; verify() reports bad_manifest.
KIND_FIX = {
    "not_a_directory": "give the checkpoint directory (the one holding config.json)",
    "unsafe_path": "the index must name plain file names inside the revision; this checkpoint is malformed or hostile",
    "bad_index": "re-download model.safetensors.index.json from the pinned revision",
    "no_weights": "the directory holds neither model.safetensors.index.json nor model.safetensors",
    "missing_shard": "copy the shard again from the pinned revision (the download or copy is incomplete)",
    "missing_file": "copy the file again from the pinned revision",
    "truncated": "the file is shorter than its header says: copy it again (interrupted download/copy)",
    "size_mismatch": "the file size differs from what the header/manifest says: copy it again",
    "bad_header": "the safetensors header is corrupt: copy the shard again",
    "missing_tensor": "the shard lacks a tensor the index maps to it: the shard and index are from different revisions",
    "hash_mismatch": "the content differs from the manifest: copy the file again from the pinned revision",
    "missing_config": "config.json is missing or not JSON: copy it from the pinned revision",
    "missing_tokenizer": "no tokenizer file (tokenizer.json / tokenizer.model / ...): copy it from the pinned revision",
    "bad_manifest": "regenerate the manifest with `llmfleet checkpoint manifest DIR`",
}


@dataclass
class Problem:
    file: str
    kind: str
    message: str

    @property
    def fix(self) -> str:
        return KIND_FIX.get(self.kind, "")

    def as_dict(self) -> dict[str, str]:
        return {"file": self.file, "kind": self.kind, "message": self.message, "fix": self.fix}

    def __str__(self) -> str:
        return f"{self.file}: {self.kind}: {self.message}" + (f" (fix: {self.fix})" if self.fix else "")


@dataclass
class Report:
    directory: str
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    shards: int = 0
    tensors: int = 0
    tensor_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bad_input(self) -> bool:
        """The caller gave no checkpoint to check (CLI exit 2). Everything found *inside* the
        checkpoint, a hostile index (unsafe_path) included, is a failed verification (exit 1)."""
        return any(p.kind == "not_a_directory" for p in self.problems)

    def as_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "ok": self.ok,
            "problems": [p.as_dict() for p in self.problems],
            "warnings": self.warnings,
            "shards": self.shards,
            "tensors": self.tensors,
            "tensor_bytes": self.tensor_bytes,
        }


class HeaderError(ValueError):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _nbytes(dtype: str, shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    if dtype in PACKED_BITS:
        return (n * PACKED_BITS[dtype] + 7) // 8
    return n * DTYPE_BYTES[dtype]


def _tensor_span(name: str, t: Any) -> tuple[int, int, str]:
    """(begin, end, name) of one header entry after checking dtype, shape and offsets."""
    if not isinstance(t, dict):
        raise HeaderError("bad_header", f"tensor {name!r}: entry is not an object")
    dtype, shape, offs = t.get("dtype"), t.get("shape"), t.get("data_offsets")
    if dtype not in DTYPE_BYTES and dtype not in PACKED_BITS:
        raise HeaderError("bad_header", f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise HeaderError("bad_header", f"tensor {name!r}: shape {shape!r} is not a list of non-negative ints")
    if not isinstance(offs, list) or len(offs) != 2 or not all(map(_is_int, offs)) or not 0 <= offs[0] <= offs[1]:
        raise HeaderError("bad_header", f"tensor {name!r}: data_offsets {offs!r} are not [begin, end], begin <= end")
    want = _nbytes(dtype, shape)
    if offs[1] - offs[0] != want:
        span = offs[1] - offs[0]
        raise HeaderError("bad_header", f"tensor {name!r}: {dtype}{shape} needs {want} bytes, data_offsets span {span}")
    return offs[0], offs[1], name


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(path: str) -> dict[str, Any]:
    """Read and check one safetensors file's header against the file itself.

    Returns {"tensors": {name: {"dtype", "shape", "data_offsets"}}, "metadata": {...},
    "header_len": N, "data_bytes": B}. Raises HeaderError(kind, message) on any inconsistency:
    8-byte little-endian length, JSON object, known dtypes, shapes of non-negative ints,
    offsets that match dtype x shape, are contiguous from 0 and end exactly at the file end.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError("truncated", f"{size} bytes: shorter than the 8-byte header length")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > MAX_HEADER:
            raise HeaderError("bad_header", f"header length {hlen} exceeds {MAX_HEADER} bytes")
        if 8 + hlen > size:
            raise HeaderError("truncated", f"header length says {hlen} bytes, the file has {size - 8} after it")
        raw = f.read(hlen)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise HeaderError("bad_header", f"header is not UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise HeaderError("bad_header", "header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise HeaderError("bad_header", "__metadata__ must map strings to strings")
    spans = sorted(_tensor_span(name, t) for name, t in header.items())
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            what = "overlaps the previous tensor" if begin < pos else f"leaves a gap of {begin - pos} bytes"
            raise HeaderError("bad_header", f"tensor {name!r} at offset {begin} {what} (offsets must be contiguous)")
        pos = end
    expected = 8 + hlen + pos
    if size < expected:
        raise HeaderError("truncated", f"file has {size} bytes, header describes {expected} (8 + {hlen} + {pos})")
    if size > expected:
        extra = size - expected
        raise HeaderError("size_mismatch", f"file has {size} bytes, header describes {expected}: {extra} extra bytes")
    return {"tensors": header, "metadata": metadata, "header_len": hlen, "data_bytes": pos}


def safe_member(name: Any) -> bool:
    """A plain file name inside the revision: no directories, no '..', not absolute."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and not os.path.isabs(name)
    )


def _load_index(directory: str, report: Report) -> dict[str, list[str]] | None:
    """{shard file: [tensor names]} from the index, or None when the index is unusable."""
    path = os.path.join(directory, INDEX_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        report.problems.append(Problem(INDEX_NAME, "bad_index", f"cannot read the index: {e}"))
        return None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not wm:
        report.problems.append(Problem(INDEX_NAME, "bad_index", "no weight_map object (tensor -> shard file)"))
        return None
    shards: dict[str, list[str]] = {}
    for tensor, shard in wm.items():
        if not safe_member(shard):
            report.problems.append(
                Problem(INDEX_NAME, "unsafe_path", f"weight_map[{tensor!r}] = {shard!r} is not a plain file name")
            )
            continue
        shards.setdefault(shard, []).append(tensor)
    return shards


def _check_shard(directory: str, shard: str, indexed: list[str], report: Report) -> None:
    path = os.path.join(directory, shard)
    if not os.path.isfile(path):
        report.problems.append(
            Problem(shard, "missing_shard", f"named by the index for {len(indexed)} tensors, not on disk")
        )
        return
    try:
        hdr = parse_header(path)
    except HeaderError as e:
        report.problems.append(Problem(shard, e.kind, str(e)))
        return
    except OSError as e:
        report.problems.append(Problem(shard, "missing_shard", f"cannot read: {e}"))
        return
    report.shards += 1
    report.tensors += len(hdr["tensors"])
    report.tensor_bytes += hdr["data_bytes"]
    missing = [t for t in indexed if t not in hdr["tensors"]]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        report.problems.append(
            Problem(shard, "missing_tensor", f"index maps {', '.join(missing[:3])}{more} here; the header lacks them")
        )


def verify_structure(directory: str, require_tokenizer: bool = True) -> Report:
    """Completeness and structure of a checkpoint directory (no hashing)."""
    report = Report(directory)
    if not os.path.isdir(directory):
        report.problems.append(Problem(directory, "not_a_directory", "not a directory"))
        return report
    if os.path.exists(os.path.join(directory, INDEX_NAME)):
        shards = _load_index(directory, report)
        if shards is None:
            return report
    elif os.path.exists(os.path.join(directory, SINGLE_NAME)):
        shards = {SINGLE_NAME: []}
    else:
        report.problems.append(Problem(directory, "no_weights", f"neither {INDEX_NAME} nor {SINGLE_NAME} found"))
        shards = {}
    for shard in sorted(shards):
        _check_shard(directory, shard, shards[shard], report)
    on_disk = {n for n in os.listdir(directory) if n.endswith(".safetensors")}
    stray = sorted(on_disk - set(shards))
    if stray:
        report.warnings.append(f"shards not referenced by the index (ignored by engines): {', '.join(stray)}")
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as e:
        report.problems.append(Problem("config.json", "missing_config", str(e)))
    if require_tokenizer and not any(os.path.isfile(os.path.join(directory, t)) for t in TOKENIZER_FILES):
        report.problems.append(Problem("tokenizer.json", "missing_tokenizer", f"none of {', '.join(TOKENIZER_FILES)}"))
    return report


def verify(directory: str, manifest_path: str | None = None, deep: bool = True, threads: int = 4) -> Report:
    """Structure checks, plus manifest checks when a manifest is given."""
    report = verify_structure(directory)
    if manifest_path and os.path.isdir(directory):
        try:
            manifest = load_manifest(manifest_path)
        except (OSError, ValueError) as e:
            report.problems.append(Problem(manifest_path, "bad_manifest", str(e)))
            return report
        # Files whose structure already failed are reported once, by the structure check.
        already = {p.file for p in report.problems}
        problems, warnings = verify_manifest(directory, manifest, deep=deep, threads=threads)
        report.problems += [Problem(*p) for p in problems if p[0] not in already]
        report.warnings += warnings
    return report
