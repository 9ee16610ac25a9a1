#!/usr/bin/env python3
"""Put the demo checkpoint (real safetensors shards, index, config, tokenizer) on the lab's shared
storage, where inventory/lab/group_vars points model_stage at it. Idempotent.

    demo_model.py [SHARED_DIR]     (default: the default lab's shared directory)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.helpers.ckpt import make_checkpoint  # noqa: E402
from tests.lab.labctl import default_lab  # noqa: E402

NAME = "demo-model"


def ensure(shared: Path) -> Path:
    d = shared / NAME
    if not (d / "config.json").exists():
        make_checkpoint(d, shards=8, tensors_per_shard=4, shape=(512, 256))  # 8 MiB in 8 shards
    return d


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else default_lab().shared
    print(ensure(target))
