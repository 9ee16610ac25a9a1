"""Generate real safetensors checkpoints for tests and benchmarks.

`make_checkpoint` writes shards with the `safetensors` library itself (so the files are what
engines read), an index, config and tokenizer files. `write_raw` writes a shard from an explicit
header, for dtypes numpy lacks (BF16, FP8) and for deliberately corrupt headers.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def make_checkpoint(
    root: Path,
    shards: int = 3,
    tensors_per_shard: int = 4,
    shape: tuple[int, ...] = (16, 32),
    dtype: str = "float16",
    seed: int = 0,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    weight_map = {}
    total = 0
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for t in range(tensors_per_shard):
            key = f"model.layers.{s}.w{t}.weight"
            tensors[key] = rng.standard_normal(shape).astype(dtype)
            weight_map[key] = name
            total += tensors[key].nbytes
        save_file(tensors, str(root / name), metadata={"format": "pt"})
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (root / "config.json").write_text(json.dumps({"architectures": ["TestForCausalLM"], "num_hidden_layers": shards}))
    (root / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (root / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 32768}))
    return root


def write_raw(path: Path, header: dict, data: bytes, header_len: int | None = None) -> None:
    """A safetensors file from an explicit header dict (or broken length) and data bytes."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
