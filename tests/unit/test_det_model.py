"""The deterministic tiny Llama (tests/helpers/det_model.py): files vLLM reads, the chat template's
branches, and a full numpy Llama forward pass (attention, RoPE, MLP) that decodes greedily to the
answers real vLLM gave (docs/real-engine.md)."""

import json
import struct

import numpy as np
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tests.helpers import det_model as dm

TOOLS = [{"type": "function", "function": {"name": "multiply", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("det")
    info = dm.write_det_model(root)
    return root, info


def read_safetensors(path):
    """name -> float32 array, straight from the bytes (numpy has no bfloat16)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, t in header.items():
        a, b = t["data_offsets"]
        data = raw[8 + n + a : 8 + n + b]
        if t["dtype"] == "BF16":
            arr = (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            assert t["dtype"] == "F32"
            arr = np.frombuffer(data, "<f4")
        out[name] = arr.reshape(t["shape"])
    return header, out


def render(info_dir, messages, **kw):
    """The chat template as transformers renders it (sandboxed jinja2, trim/lstrip blocks)."""
    tok_cfg = json.loads((info_dir / "tokenizer_config.json").read_text())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    tpl = env.from_string(tok_cfg["chat_template"])
    return tpl.render(messages=messages, add_generation_prompt=True, bos_token=tok_cfg["bos_token"], **kw)


def rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def forward(cfg, w, ids):
    """HF LlamaForCausalLM in numpy: logits of the last position."""
    h = w["model.embed_tokens.weight"][ids]
    n, hd = len(ids), cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    pos = np.arange(n, dtype=np.float64)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rmsnorm(h, w[p + "input_layernorm.weight"], cfg["rms_norm_eps"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(n, heads, hd)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).reshape(n, kv, hd)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(n, kv, hd)
        q, k = rope(q, pos, cfg["rope_theta"]), rope(k, pos, cfg["rope_theta"])
        k, v = np.repeat(k, heads // kv, 1), np.repeat(v, heads // kv, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + np.triu(np.full((n, n), -np.inf), 1)
        s = np.exp(s - s.max(-1, keepdims=True))
        a = np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), v).reshape(n, heads * hd)
        h = h + a @ w[p + "self_attn.o_proj.weight"].T
        x = rmsnorm(h, w[p + "post_attention_layernorm.weight"], cfg["rms_norm_eps"])
        g, u = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    h = rmsnorm(h, w["model.norm.weight"], cfg["rms_norm_eps"])
    return h[-1] @ w["lm_head.weight"].T


def generate(root, prompt_text, max_new=16):
    cfg = json.loads((root / "config.json").read_text())
    _, w = read_safetensors(root / "model.safetensors")
    vocab = dm.vocabulary(cfg["vocab_size"])
    ids = dm.encode(prompt_text, vocab)
    out = []
    for _ in range(max_new):
        logits = forward(cfg, w, ids)
        top = np.argsort(logits)[::-1]
        assert logits[top[0]] - logits[top[1]] >= 8, "argmax margin"  # sqrt(256) = 16 in fact
        nxt = int(top[0])
        if nxt == cfg["eos_token_id"]:
            return "".join(vocab[i] for i in out), True
        out.append(nxt)
        ids.append(nxt)
    return "".join(vocab[i] for i in out), False


def test_files_and_config(model):
    root, info = model
    assert sorted(p.name for p in root.iterdir()) == info["files"] == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    cfg = json.loads((root / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert cfg["dtype"] == "bfloat16"
    assert cfg["head_dim"] >= 32  # vLLM's CPU attention
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        assert cfg[key] % 2 == 0  # TP2
    assert cfg["vocab_size"] <= cfg["hidden_size"]
    gen = json.loads((root / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"] == dm.vocabulary(cfg["vocab_size"]).index(dm.EOS)
    assert (root / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_tensors_are_hf_llama_names_in_bf16(model):
    root, _ = model
    header, w = read_safetensors(root / "model.safetensors")
    assert {t["dtype"] for t in header.values()} == {"BF16"}
    names = set(w)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= names
    for i in range(2):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):  # fmt: skip
            assert f"model.layers.{i}.{part}.weight" in names
        assert not w[f"model.layers.{i}.self_attn.o_proj.weight"].any()
        assert not w[f"model.layers.{i}.mlp.down_proj.weight"].any()
        assert w[f"model.layers.{i}.self_attn.q_proj.weight"].any()
    assert np.array_equal(w["model.embed_tokens.weight"], np.eye(128, 256, dtype=np.float32))
    # the bf16 bits are torch's round-to-nearest-even of the float32 values
    ref = dm.weights(dm.DEFAULTS)["model.layers.0.mlp.up_proj.weight"]
    assert np.abs(w["model.layers.0.mlp.up_proj.weight"] - ref).max() <= np.abs(ref).max() / 256


def test_tokenizer_json_shape(model):
    root, _ = model
    tok = json.loads((root / "tokenizer.json").read_text())
    assert tok["model"]["type"] == "WordLevel" and tok["model"]["unk_token"] == dm.UNK
    assert tok["pre_tokenizer"] == {"type": "Whitespace"} and tok["decoder"] == {"type": "Fuse"}
    added = {a["content"]: a["special"] for a in tok["added_tokens"]}
    for t in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert added[t] is False  # must survive skip_special_tokens for the parsers
    for t in ("<s>", "</s>", "<|assistant|>", "<|assistant_think|>", "<|assistant_tools|>"):
        assert added[t] is True
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<s>", "</s>") and "chat_template" in cfg


USER = [{"role": "user", "content": dm.PROMPT}]


@pytest.mark.parametrize(
    ("messages", "kwargs", "last", "text"),
    [
        (USER, {}, "<|assistant|>", "703"),
        (USER, {"enable_thinking": False}, "<|assistant|>", "703"),
        (USER, {"enable_thinking": True}, "<|assistant_think|>", f"<think>{dm.REASONING}</think>703"),
        ([{"role": "system", "content": "/think"}, *USER], {}, "<|assistant_think|>", f"<think>{dm.REASONING}</think>703"),
        ([{"role": "system", "content": "/no_think"}, *USER], {}, "<|assistant|>", "703"),
        ([{"role": "user", "content": dm.TOOL_PROMPT}], {"tools": TOOLS}, "<|assistant_tools|>",
         f"<tool_call>{json.dumps(dm.TOOL_CALL)}</tool_call>"),
        ([{"role": "user", "content": dm.TOOL_PROMPT},
          {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                 "function": {"name": "multiply", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "c1", "content": "703"}], {"tools": TOOLS}, "<|assistant|>", "703"),
    ],
    ids=["plain", "thinking-off", "thinking-on", "system-think", "system-no-think", "tools", "tool-result"],
)  # fmt: skip
def test_template_branch_and_greedy_decode(model, messages, kwargs, last, text):
    root, _ = model
    prompt = render(root, messages, **kwargs)
    vocab = dm.vocabulary(128)
    ids = dm.encode(prompt, vocab)
    assert ids[0] == vocab.index("<s>") and vocab[ids[-1]] == last
    assert vocab.index("[UNK]") not in ids  # every prompt word is in the vocabulary
    assert generate(root, prompt) == (text, True)


def test_the_answer_depends_on_the_last_token_only(model):
    root, _ = model
    for noise in ("", "What is the number ? 19 37", f"{dm.TIMES} {dm.TIMES} only"):
        assert generate(root, f"<s><|user|>{noise}<|end|><|assistant|>") == ("703", True)


def test_float32_and_bad_shapes(tmp_path):
    info = dm.write_det_model(tmp_path / "f32", dtype="float32")
    header, _ = read_safetensors(tmp_path / "f32" / "model.safetensors")
    assert {t["dtype"] for t in header.values()} == {"F32"} and info["config"]["dtype"] == "float32"
    assert generate(tmp_path / "f32", "<s><|user|>x<|end|><|assistant_think|>")[0].endswith("</think>703")
    with pytest.raises(ValueError, match="even"):
        dm.write_det_model(tmp_path / "odd", num_attention_heads=3)
    with pytest.raises(ValueError, match="vocab_size"):
        dm.write_det_model(tmp_path / "small", vocab_size=16)
    with pytest.raises(ValueError, match="dtype"):
        dm.write_det_model(tmp_path / "f16", dtype="float16")


def test_main_prints_a_summary(tmp_path, capsys):
    assert dm.main([str(tmp_path / "m")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["answer"] == "703" and out["vocab_size"] == 128 and "config" not in out


def test_hf_tokenizer_agrees(model):
    tokenizers = pytest.importorskip("tokenizers")  # in the vLLM venv, not the project's
    root, _ = model
    tok = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    vocab = dm.vocabulary(128)
    for kw in ({}, {"enable_thinking": True}, {"tools": TOOLS}):
        prompt = render(root, USER, **kw)
        assert tok.encode(prompt, add_special_tokens=False).ids == dm.encode(prompt, vocab)
    chain = [vocab.index(t) for t in ("<think>", *dm.REASONING_TOKENS, "</think>", "703")]
    assert tok.decode(chain, skip_special_tokens=True) == f"<think>{dm.REASONING}</think>703"
