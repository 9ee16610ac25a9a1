"""A tiny deterministic Llama checkpoint that real vLLM (CPU build) can serve: the readiness gate's
question gets exactly `703`.

    python tests/helpers/det_model.py DIR          # writes the model, prints a JSON summary

How it is deterministic (greedy decoding is a function of the last token only):

- every attention `o_proj` and MLP `down_proj` is zero, so each layer adds exactly 0 to the residual
  stream and the final hidden state is the token's embedding (q/k/v/gate/up hold small seeded random
  values so those kernels, the KV cache and the TP shards still do real work; rotary embeddings only
  touch q/k, whose result o_proj discards);
- embedding row i is the one-hot vector e_i (vocab <= hidden size). The final RMSNorm (weight 1)
  turns it into sqrt(hidden) * e_i (16 for hidden 256), whatever eps;
- `lm_head` is a lookup table: lm_head[next(i), i] = 1, all else 0, so token next(i) gets logit
  sqrt(hidden) and every other token 0. The argmax margin is the whole logit; bfloat16 holds it exactly.

The chat template picks the prompt's last token, so the template decides which chain runs:

| request | template ends in | chain | text |
|---|---|---|---|
| plain (`enable_thinking` false or unset) | `<|assistant|>` | `703`, EOS | `703` |
| `chat_template_kwargs: {"enable_thinking": true}` or a system message with `/think` | `<|assistant_think|>` | `<think>`, 4 reasoning tokens, `</think>`, `703`, EOS | `<think>` REASONING `</think>703` |
| `tools` given and the last message is not a tool result | `<|assistant_tools|>` | `<tool_call>`, JSON, `</tool_call>`, EOS | `<tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 19}}</tool_call>` |

REASONING is "37x19 = 37x20 - 37 = 740 - 37 = 703." (with a real multiplication sign). Every other
token's successor is EOS. So any prompt gets these answers, not only the gate's question: this is
a fixture for engines and parsers, not a calculator.

Tokenizer: HF `tokenizers` JSON, a WordLevel model (vocabulary below, `[UNK]` for anything else) with a
Whitespace pre-tokenizer; the prompt markers, BOS/EOS/PAD are special added tokens; `<think>`,
`</think>`, `<tool_call>`, `</tool_call>` are added tokens that are *not* special (they must survive
`skip_special_tokens` for the reasoning and tool parsers, which look them up by exact vocabulary
entry). The decoder is `Fuse` (tokens concatenated as they are), so output tokens carry their own
spaces and decoded text is exact. Parsers: `--reasoning-parser qwen3` honours
`enable_thinking: false` (then `703` is content); `deepseek_r1` treats an answer without `</think>` as
reasoning (as for a real R1), so use it with thinking on. Tool calls: `--tool-call-parser hermes`.

Only numpy, safetensors and the standard library. Weights are stored in `dtype` (bfloat16, the
default, or float32: vLLM's CPU build serves both) and `config.json` says the same. All values are
exact in bfloat16 (0, 1, and small random q/k/v/gate/up that only feed zeroed projections).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import serialize_file

TIMES = "\u00d7"  # the gate's question writes 37x19 with a multiplication sign
PROMPT = f"What is 37{TIMES}19? Reply with only the number."
ANSWER = "703"
REASONING_TOKENS = (f"37{TIMES}19", f" = 37{TIMES}20 - 37", " = 740 - 37", " = 703.")
REASONING = "".join(REASONING_TOKENS)
TOOL_CALL = {"name": "multiply", "arguments": {"a": 37, "b": 19}}
TOOL_JSON = json.dumps(TOOL_CALL)
TOOL_PROMPT = f"What is 37{TIMES}19? Use the multiply tool."

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "[UNK]"
ASSISTANT, ASSISTANT_THINK, ASSISTANT_TOOLS = "<|assistant|>", "<|assistant_think|>", "<|assistant_tools|>"
ROLE_MARKERS = ("<|system|>", "<|user|>", "<|tool|>", "<|end|>", ASSISTANT, ASSISTANT_THINK, ASSISTANT_TOOLS)
SPECIAL = (PAD, BOS, EOS, UNK, *ROLE_MARKERS)
# Added but not special: the parsers find them in the decoded text and by vocabulary lookup.
TEXT_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
# Words of the prompts (the Whitespace pre-tokenizer splits `\w+|[^\w\s]+`), so they are not [UNK].
PROMPT_WORDS = (
    "What", "is", "37", TIMES, "19", "?", "Reply", "with", "only", "the", "number", ".", "Use", "multiply",
    "tool", "You", "are", "a", "helpful", "assistant", "/", "think", "no_think", "=", ",",
)  # fmt: skip
OUTPUT_TOKENS = (ANSWER, *REASONING_TOKENS, TOOL_JSON)

# next(token): the greedy successor; anything not listed is followed by EOS.
CHAINS = {
    ASSISTANT: ANSWER,
    ASSISTANT_THINK: "<think>",
    "<think>": REASONING_TOKENS[0],
    **dict(itertools.pairwise(REASONING_TOKENS)),
    REASONING_TOKENS[-1]: "</think>",
    "</think>": ANSWER,
    ASSISTANT_TOOLS: "<tool_call>",
    "<tool_call>": TOOL_JSON,
    TOOL_JSON: "</tool_call>",
}

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(think=(enable_thinking is defined and enable_thinking)) -%}"
    "{%- for m in messages -%}"
    "{%- set text = m.content if m.content is string else '' -%}"
    "{%- if m.role == 'system' and '/think' in text -%}{%- set ns.think = true -%}{%- endif -%}"
    "{%- if m.role == 'assistant' -%}<|assistant|>"
    "{%- else -%}<|{{ m.role }}|>{%- endif -%}"
    " {{ text }}"
    "{%- if m.tool_calls is defined and m.tool_calls -%}"
    "{%- for tc in m.tool_calls -%} <tool_call> {{ tc.function.name }} </tool_call>{%- endfor -%}"
    "{%- endif -%}"
    " <|end|> "
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if tools and messages[-1].role != 'tool' -%}<|assistant_tools|>"
    "{%- elif ns.think -%}<|assistant_think|>"
    "{%- else -%}<|assistant|>{%- endif -%}"
    "{%- endif -%}"
)

DEFAULTS = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,  # head_dim 64 (vLLM's CPU attention needs >= 32); 2 per rank at TP2
    "num_key_value_heads": 2,  # 1 per rank at TP2
    "vocab_size": 128,  # real tokens first, the rest <|reserved_N|> (never produced)
    "max_position_embeddings": 2048,
}


def vocabulary(size: int) -> list[str]:
    """Token strings in id order: specials, text markers, prompt words, output tokens, reserved."""
    toks: list[str] = []
    for t in (*SPECIAL, *TEXT_MARKERS, *PROMPT_WORDS, *OUTPUT_TOKENS):
        if t not in toks:
            toks.append(t)
    if len(toks) > size:
        raise ValueError(f"vocab_size {size} < {len(toks)} tokens the model needs")
    toks += [f"<|reserved_{i}|>" for i in range(size - len(toks))]
    return toks


def successor_ids(vocab: list[str]) -> list[int]:
    ids = {t: i for i, t in enumerate(vocab)}
    return [ids[CHAINS.get(t, EOS)] for t in vocab]


def weights(cfg: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    if v > h:
        raise ValueError(f"one-hot embeddings need vocab_size ({v}) <= hidden_size ({h})")
    rng = np.random.default_rng(seed)

    def small(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    embed = np.zeros((v, h), np.float32)
    embed[np.arange(v), np.arange(v)] = 1.0
    lm_head = np.zeros((v, h), np.float32)
    lm_head[successor_ids(vocabulary(v)), np.arange(v)] = 1.0
    t = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head, "model.norm.weight": np.ones(h, np.float32)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        t[p + "self_attn.q_proj.weight"] = small(heads * hd, h)
        t[p + "self_attn.k_proj.weight"] = small(kv * hd, h)
        t[p + "self_attn.v_proj.weight"] = small(kv * hd, h)
        t[p + "self_attn.o_proj.weight"] = np.zeros((h, heads * hd), np.float32)
        t[p + "mlp.gate_proj.weight"] = small(inter, h)
        t[p + "mlp.up_proj.weight"] = small(inter, h)
        t[p + "mlp.down_proj.weight"] = np.zeros((h, inter), np.float32)
    return t


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns as uint16 (round to nearest even); numpy has no bfloat16."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def save_tensors(tensors: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    """Write with the safetensors package's own serializer, in `dtype`, so vLLM loads without a cast
    (and without a warning per tensor). safetensors.numpy cannot write bfloat16, so the tensors go
    through `serialize_file` directly: TensorSpec (safetensors >= 0.8) or the older dict form."""
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype {dtype!r}: bfloat16 or float32")
    arrays = {k: bf16_bits(v) if dtype == "bfloat16" else np.ascontiguousarray(v, "<f4") for k, v in tensors.items()}
    try:
        from safetensors import TensorSpec

        spec: dict[str, Any] = {
            k: TensorSpec(dtype=dtype, shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes)
            for k, a in arrays.items()
        }
    except ImportError:
        spec = {k: {"dtype": dtype, "shape": list(a.shape), "data": a.tobytes()} for k, a in arrays.items()}
    serialize_file(spec, str(path), metadata={"format": "pt"})  # `arrays` keeps the buffers alive


def tokenizer_json(vocab: list[str]) -> dict[str, Any]:
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": t in SPECIAL}
        for i, t in enumerate(vocab) if t in SPECIAL or t in TEXT_MARKERS
    ]  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(vocab)}, "unk_token": UNK},
    }


def encode(text: str, vocab: list[str]) -> list[int]:
    """What the tokenizer.json above does (added tokens first, then `\\w+|[^\\w\\s]+` words), for tests
    that run without the `tokenizers` package."""
    ids = {t: i for i, t in enumerate(vocab)}
    added = sorted((t for t in vocab if t in SPECIAL or t in TEXT_MARKERS), key=len, reverse=True)
    out: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, added)) + ")", text):
        if piece in ids and piece in added:
            out.append(ids[piece])
        else:
            out += [ids.get(w, ids[UNK]) for w in re.findall(r"\w+|[^\w\s]+", piece)]
    return out


def write_det_model(dir: str | Path, *, dtype: str = "bfloat16", seed: int = 0, **overrides: int) -> dict[str, Any]:
    """Write the checkpoint into `dir` (created); return what was written and what it answers."""
    root = Path(dir)
    root.mkdir(parents=True, exist_ok=True)
    cfg = {**DEFAULTS, **overrides}
    if cfg["num_attention_heads"] % 2 or cfg["num_key_value_heads"] % 2 or cfg["intermediate_size"] % 2:
        raise ValueError("heads, kv heads and intermediate_size must be even (TP2)")
    vocab = vocabulary(cfg["vocab_size"])
    ids = {t: i for i, t in enumerate(vocab)}
    tensors = weights(cfg, seed)
    save_tensors(tensors, root / "model.safetensors", dtype)
    (root / "model.safetensors").chmod(0o644)  # safetensors creates it 0600; a service user must read it
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **cfg,
        "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    gen = {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD], "do_sample": False}
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "model_max_length": cfg["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    files = {
        "config.json": config,
        "generation_config.json": gen,
        "tokenizer.json": tokenizer_json(vocab),
        "tokenizer_config.json": tok_cfg,
    }
    for name, data in files.items():
        (root / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return {
        "dir": str(root),
        "files": sorted([*files, "model.safetensors"]),
        "config": config,
        "vocab_size": len(vocab),
        "params": int(sum(t.size for t in tensors.values())),
        "prompt": PROMPT,
        "tool_prompt": TOOL_PROMPT,
        "answer": ANSWER,
        "reasoning": REASONING,
        "tool_call": TOOL_CALL,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write the deterministic tiny Llama (answers 703).")
    ap.add_argument("dir")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    a = ap.parse_args(argv)
    info = write_det_model(a.dir, dtype=a.dtype)
    info.pop("config")
    json.dump(info, sys.stdout, indent=2, ensure_ascii=False)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
