"""Checkpoint structure (checkpoint.py) and manifest (manifest.py) checks on real safetensors files."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors import safe_open

from llmfleet.stage import checkpoint, manifest
from tests.helpers.ckpt import make_checkpoint, write_raw

SHARD1 = "model-00001-of-00003.safetensors"
SHARD2 = "model-00002-of-00003.safetensors"


@pytest.fixture
def ckpt(tmp_path):
    return make_checkpoint(tmp_path / "ckpt")


def kinds(report):
    return sorted((p.file, p.kind) for p in report.problems)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "llmfleet", *args], capture_output=True, text=True, check=False)


def test_good_checkpoint(ckpt):
    r = checkpoint.verify(str(ckpt))
    assert r.ok, r.problems
    assert (r.shards, r.tensors, r.tensor_bytes) == (3, 12, 12 * 16 * 32 * 2)


def test_parser_agrees_with_the_safetensors_library(ckpt):
    hdr = checkpoint.parse_header(str(ckpt / SHARD1))
    with safe_open(str(ckpt / SHARD1), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(hdr["tensors"])
        assert f.metadata() == hdr["metadata"] == {"format": "pt"}
        for k in f.keys():
            assert list(f.get_slice(k).get_shape()) == hdr["tensors"][k]["shape"]
            assert f.get_slice(k).get_dtype() == hdr["tensors"][k]["dtype"] == "F16"


def _truncate(p, n):
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - n)


def _append(p, data):
    with open(p, "ab") as f:
        f.write(data)


def _raw(ckpt, header, data=b"", header_len=None):
    """Replace SHARD2 by a crafted shard that still holds the tensors the index maps to it."""
    write_raw(ckpt / SHARD2, header, data, header_len)


def _f16(begin, end, shape=(16, 32)):
    return {"dtype": "F16", "shape": list(shape), "data_offsets": [begin, end]}


SHARD2_TENSORS = [f"model.layers.1.w{t}.weight" for t in range(4)]
T = 16 * 32 * 2


def _contiguous(**over):
    h = {k: _f16(i * T, (i + 1) * T) for i, k in enumerate(SHARD2_TENSORS)}
    h.update(over)
    return h


CORRUPTIONS = [
    ("missing shard", lambda c: os.remove(c / SHARD2), SHARD2, "missing_shard", "not on disk"),
    ("truncated shard", lambda c: _truncate(c / SHARD2, 100), SHARD2, "truncated", "header describes"),
    ("shard cut inside header", lambda c: _truncate(c / SHARD2, os.path.getsize(c / SHARD2) - 20), SHARD2, "truncated", ""),
    ("shard with trailing bytes", lambda c: _append(c / SHARD2, b"\0" * 8), SHARD2, "size_mismatch", "8 extra bytes"),
    ("4-byte file", lambda c: (c / SHARD2).write_bytes(b"\1\2\3\4"), SHARD2, "truncated", "8-byte"),
    ("header not JSON", lambda c: _raw(c, {}, b"", None) or (c / SHARD2).write_bytes(b"\x08" + b"\0" * 7 + b"{notjson"),
     SHARD2, "bad_header", "JSON"),
    ("header length beyond file", lambda c: _raw(c, _contiguous(), b"\0" * 4 * T, header_len=10**7), SHARD2, "truncated", ""),
    ("huge header length", lambda c: _raw(c, _contiguous(), b"", header_len=2**40), SHARD2, "bad_header", "exceeds"),
    ("gap between tensors", lambda c: _raw(c, _contiguous(**{SHARD2_TENSORS[3]: _f16(3 * T + 8, 4 * T + 8)}), b"\0" * (4 * T + 8)),
     SHARD2, "bad_header", "gap of 8 bytes"),
    ("overlapping tensors", lambda c: _raw(c, _contiguous(**{SHARD2_TENSORS[3]: _f16(3 * T - 2, 4 * T - 2)}), b"\0" * (4 * T)),
     SHARD2, "bad_header", "overlaps"),
    ("shape/offsets disagree", lambda c: _raw(c, _contiguous(**{SHARD2_TENSORS[3]: _f16(3 * T, 4 * T, (16, 31))}), b"\0" * 4 * T),
     SHARD2, "bad_header", "needs 992 bytes"),
    ("unknown dtype", lambda c: _raw(c, _contiguous(**{SHARD2_TENSORS[0]: {"dtype": "Q4", "shape": [1], "data_offsets": [0, T]}}),
     b"\0" * 4 * T), SHARD2, "bad_header", "unknown dtype"),
    ("negative dim", lambda c: _raw(c, _contiguous(**{SHARD2_TENSORS[0]: _f16(0, T, (-16, -32))}), b"\0" * 4 * T),
     SHARD2, "bad_header", "non-negative"),
    ("index names a tensor the shard lacks", lambda c: _raw(c, {k: _f16(i * T, (i + 1) * T) for i, k in enumerate(SHARD2_TENSORS[:3])},
     b"\0" * 3 * T), SHARD2, "missing_tensor", "model.layers.1.w3.weight"),
    ("no config.json", lambda c: os.remove(c / "config.json"), "config.json", "missing_config", ""),
    ("config.json not JSON", lambda c: (c / "config.json").write_text("{"), "config.json", "missing_config", ""),
    ("no tokenizer", lambda c: os.remove(c / "tokenizer.json"), "tokenizer.json", "missing_tokenizer", ""),
    ("index not JSON", lambda c: (c / checkpoint.INDEX_NAME).write_text("{"), checkpoint.INDEX_NAME, "bad_index", ""),
    ("index without weight_map", lambda c: (c / checkpoint.INDEX_NAME).write_text("{}"), checkpoint.INDEX_NAME, "bad_index", ""),
]  # fmt: skip


@pytest.mark.parametrize(("label", "damage", "file", "kind", "text"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_each_corruption_is_named(ckpt, label, damage, file, kind, text):
    damage(ckpt)
    r = checkpoint.verify(str(ckpt))
    assert (file, kind) in kinds(r), f"{label}: got {r.problems}"
    assert text in " ".join(p.message for p in r.problems if p.file == file)
    assert all(p.fix for p in r.problems), "every problem says what to do"
    cp = cli("checkpoint", "verify", str(ckpt), "--json")
    assert cp.returncode == 1, cp.stdout + cp.stderr
    out = json.loads(cp.stdout)
    assert out["ok"] is False and {"file": file, "kind": kind} in [
        {"file": p["file"], "kind": p["kind"]} for p in out["problems"]
    ]


@pytest.mark.parametrize(
    "entry", ["../outside.safetensors", "../../../../etc/passwd", "/etc/passwd", "sub/x.safetensors", "..", "", 7]
)
def test_index_entries_outside_the_revision_are_a_failed_verification(ckpt, entry):
    """A hostile index is something verify found in the checkpoint (exit 1, culprit named), not bad usage."""
    idx = json.loads((ckpt / checkpoint.INDEX_NAME).read_text())
    idx["weight_map"]["model.layers.0.w0.weight"] = entry
    (ckpt / checkpoint.INDEX_NAME).write_text(json.dumps(idx))
    r = checkpoint.verify(str(ckpt))
    assert (checkpoint.INDEX_NAME, "unsafe_path") in kinds(r)
    assert not r.bad_input and not r.ok
    cp = cli("checkpoint", "verify", str(ckpt))
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert (
        f"PROBLEM {checkpoint.INDEX_NAME}: unsafe_path: weight_map['model.layers.0.w0.weight'] = {entry!r}" in cp.stdout
    )
    assert "Traceback" not in cp.stderr
    js = cli("checkpoint", "verify", str(ckpt), "--json")
    assert js.returncode == 1
    [p] = [p for p in json.loads(js.stdout)["problems"] if p["kind"] == "unsafe_path"]
    assert p["file"] == checkpoint.INDEX_NAME and "model.layers.0.w0.weight" in p["message"] and p["fix"]


def test_unreadable_file_in_the_revision_is_named_not_a_traceback(ckpt):
    """A hub snapshot whose blob is missing (interrupted download) leaves a dangling symlink."""
    (ckpt / "merges.txt").symlink_to(ckpt / "../blobs/0123abcd")
    cp = cli("checkpoint", "manifest", str(ckpt))
    assert cp.returncode == 1 and "Traceback" not in cp.stderr
    assert f"cannot read {ckpt / 'merges.txt'}: No such file or directory" in cp.stderr
    assert "download or copy it again" in cp.stderr


def test_single_file_checkpoint_and_exotic_dtypes(tmp_path):
    d = tmp_path / "single"
    d.mkdir()
    hdr = {
        "a": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 32]},
        "b": {"dtype": "F8_E4M3", "shape": [8], "data_offsets": [32, 40]},
        "c": {"dtype": "F4", "shape": [3], "data_offsets": [40, 42]},  # packed: ceil(3*4/8) = 2 bytes
        "__metadata__": {"format": "pt"},
    }
    write_raw(d / "model.safetensors", hdr, b"\0" * 42)
    (d / "config.json").write_text("{}")
    (d / "tokenizer.model").write_bytes(b"x")
    r = checkpoint.verify(str(d))
    assert r.ok, r.problems
    assert (r.shards, r.tensors, r.tensor_bytes) == (1, 3, 42)


def test_no_weights_at_all(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert kinds(checkpoint.verify(str(tmp_path))) == [(str(tmp_path), "no_weights")]


def test_stray_shard_is_a_warning(ckpt):
    shutil.copy(ckpt / SHARD1, ckpt / "model-old.safetensors")
    r = checkpoint.verify(str(ckpt))
    assert r.ok and "model-old.safetensors" in r.warnings[0]


def test_manifest_roundtrip_and_content_damage(ckpt, tmp_path):
    m = manifest.build_manifest(str(ckpt), threads=3)
    files = {e["path"]: e for e in m["files"]}
    assert set(files) == {SHARD1, SHARD2, "model-00003-of-00003.safetensors", checkpoint.INDEX_NAME, "config.json",
                          "tokenizer.json", "tokenizer_config.json"}  # fmt: skip
    assert files[SHARD1]["sha256"] == hashlib.sha256((ckpt / SHARD1).read_bytes()).hexdigest()
    assert m["total_bytes"] == sum(os.path.getsize(ckpt / p) for p in files)
    mf = tmp_path / "manifest.json"
    mf.write_text(json.dumps(m))
    assert checkpoint.verify(str(ckpt), str(mf)).ok
    # flip one data byte: same size, header intact -> only the hash can see it
    data = bytearray((ckpt / SHARD2).read_bytes())
    data[-5] ^= 0xFF
    (ckpt / SHARD2).write_bytes(bytes(data))
    assert checkpoint.verify(str(ckpt)).ok
    r = checkpoint.verify(str(ckpt), str(mf))
    assert kinds(r) == [(SHARD2, "hash_mismatch")]
    assert checkpoint.verify(str(ckpt), str(mf), deep=False).ok  # sizes only
    assert cli("checkpoint", "verify", str(ckpt), "--manifest", str(mf)).returncode == 1
    assert cli("checkpoint", "verify", str(ckpt), "--manifest", str(mf), "--no-hash").returncode == 0
    # a file the manifest lists is gone
    os.remove(ckpt / "tokenizer_config.json")
    assert ("tokenizer_config.json", "missing_file") in kinds(checkpoint.verify(str(ckpt), str(mf)))


@pytest.mark.parametrize(
    "bad",
    [
        {"format": "other", "files": []},
        {"format": manifest.MANIFEST_FORMAT, "files": [{"path": "../x", "size": 1, "sha256": "0" * 64}]},
        {"format": manifest.MANIFEST_FORMAT, "files": [{"path": "x", "size": "1", "sha256": "0" * 64}]},
        {"format": manifest.MANIFEST_FORMAT, "files": [{"path": "x", "size": 1, "sha256": "zz"}]},
    ],
)
def test_bad_manifest_is_reported(ckpt, tmp_path, bad):
    mf = tmp_path / "m.json"
    mf.write_text(json.dumps(bad))
    r = checkpoint.verify(str(ckpt), str(mf))
    assert [p.kind for p in r.problems] == ["bad_manifest"]


def test_revision_from_hub_cache_layout(tmp_path):
    rev = "d2dc35658bcf77e66643428cb52e774cc3b5bd29"
    snap = tmp_path / "models--Qwen--Qwen3.8" / "snapshots" / rev
    blobs = tmp_path / "models--Qwen--Qwen3.8" / "blobs"
    make_checkpoint(tmp_path / "src", shards=1)
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in (tmp_path / "src").iterdir():  # hub layout: snapshot entries are symlinks into blobs/
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.move(f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    assert manifest.revision_from_path(str(snap)) == rev
    assert manifest.revision_from_path(str(tmp_path / "src")) is None
    m = manifest.build_manifest(str(snap))
    assert m["revision"] == rev
    for e in m["files"]:  # manifest sha256 == the hub's LFS oid (the blob name)
        assert os.path.basename(os.readlink(snap / e["path"])) == e["sha256"]
    assert checkpoint.verify(str(snap)).ok


def test_manifest_cli(ckpt, tmp_path):
    out = tmp_path / "m.json"
    cp = cli("checkpoint", "manifest", str(ckpt), "--revision", "a" * 40, "-o", str(out))
    assert cp.returncode == 0, cp.stderr
    m = json.loads(out.read_text())
    assert m["revision"] == "a" * 40 and len(m["files"]) == 7
    assert cli("checkpoint", "manifest", str(ckpt), "--revision", "main").returncode == 2
    assert cli("checkpoint", "manifest", str(tmp_path / "nope")).returncode == 2
    assert cli("checkpoint", "verify", str(tmp_path / "nope")).returncode == 2
    assert cli("checkpoint", "verify", str(ckpt), "--manifest", str(tmp_path / "nope.json")).returncode == 2
    assert cli("checkpoint").returncode == 2
