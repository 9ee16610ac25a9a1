"""The safetensors checkpoint: its shard files, each rank's share of the tensors, reading that share."""

from __future__ import annotations

import json
import os
import re
from typing import Any

INDEX_NAME = "model.safetensors.index.json"

LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
LAST_STAGE_RE = re.compile(r"(?:^|\.)(?:lm_head|norm|final_layernorm|final_norm)\.")


class SafetensorError(Exception):
    """What the safetensors library raises for a bad file (shown as safetensors_rust.SafetensorError)."""


SafetensorError.__module__ = "safetensors_rust"
SAFETENSORS_CODES = {
    "truncated": "MetadataIncompleteBuffer",
    "size_mismatch": "MetadataIncompleteBuffer",
    "bad_header": "InvalidHeaderDeserialization",
}


def layer_stage(layer: int, num_layers: int, pp: int) -> int:
    """Contiguous layer ranges per pipeline stage; earlier stages take the remainder."""
    base, rem = divmod(max(num_layers, 1), pp)
    end = 0
    for stage in range(pp):
        end += base + (1 if stage < rem else 0)
        if layer < end:
            return stage
    return pp - 1


def tensor_stage(name: str, num_layers: int, pp: int) -> int:
    m = LAYER_RE.search(name)
    if m:
        return layer_stage(int(m.group(1)), num_layers, pp)
    return pp - 1 if LAST_STAGE_RE.search(name) else 0


def plan_share(names: list[str], num_layers: int, tp: int, pp: int, tp_rank: int, pp_rank: int) -> set[str]:
    """This rank's tensors: its pipeline stage's, round-robin among the stage's tp ranks."""
    stage = sorted(n for n in names if tensor_stage(n, num_layers, pp) == pp_rank)
    return {n for i, n in enumerate(stage) if i % tp == tp_rank}


def shard_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, INDEX_NAME)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return sorted(set(weight_map.values()))
    if os.path.exists(os.path.join(model_dir, "model.safetensors")):
        return ["model.safetensors"]
    found = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"Cannot find any model weights with `{model_dir}` (no *.safetensors files)")
    return found


def model_config(model_dir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def derived_context(model_dir: str) -> int:
    cfg = model_config(model_dir)
    for c in (cfg, cfg.get("text_config") or {}):
        if isinstance(c.get("max_position_embeddings"), int):
            return c["max_position_embeddings"]
    return 32768


def read_span(path: str, start: int, length: int) -> int:
    with open(path, "rb") as f:
        f.seek(start)
        got = 0
        while got < length:
            chunk = f.read(min(length - got, 8 << 20))
            if not chunk:
                raise SafetensorError(
                    f"Error while deserializing header: MetadataIncompleteBuffer ({path}: short read)"
                )
            got += len(chunk)
    return got
