"""Will it fit: a GPU memory estimate per rank from the checkpoint (safetensors headers and config.json) before
launch, and the engine's own memory breakdown read from its start-up log after launch.

The model of the estimate, its sources and what it ignores are in docs/engine-fit.md. In short, per GPU:

    vLLM:    weights + margin + KV  <=  total memory x --gpu-memory-utilization
    SGLang:  weights + KV           <=  total memory x --mem-fraction-static, margin <= the rest

Weights are read from the checkpoint as stored (FP8 with its block scales, BF16, packed int4 as its storage
dtype), split by TP (the tensors every TP rank holds whole are counted whole) and placed on PP stages by layer
with the engine's own layer split. KV per token comes from config.json (GQA/MHA, MLA, DeepSeek sparse attention,
sliding-window and Gated-DeltaNet layers). Stdlib only, Python >= 3.8: runs on nodes.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from .. import engines
from ..stage.checkpoint import INDEX_NAME, SINGLE_NAME, HeaderError, parse_header, safe_member

GIB = 1 << 30
MIB = 1 << 20

# The engines the fit check knows, and their names for the knobs a fix turns (the profiles': llmfleet.engines).
ENGINES = tuple(e for e in engines.engines() if engines.get(e).fit_flags)
FLAGS = {e: dict(engines.get(e).fit_flags) for e in ENGINES}
# Where the engines' memory accounting differs (vLLM's layer split, state dtypes and margin; SGLang's).
_VLLM, _SGLANG = engines.VLLM.engine, engines.SGLANG.engine

DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "fp32": 4, "float": 4}
FP8_KV = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")

# Tensors every TP rank holds whole (tiny next to the rest, but MLA's down-projections are not):
# norms; MLA q_a_proj / kv_a_proj_with_mqa (ReplicatedLinear), the DSA indexer (wq_b ReplicatedLinear, wk and
# weights_proj with disable_tp=True), the MoE router gate and its correction bias (GateLinear):
# vllm 0.32.0 vllm/model_executor/models/deepseek_v2.py (q_a_proj l.494, kv_a_proj_with_mqa l.518, indexer
# l.703-717, gate l.321). Qwen3-Next's shared_expert_gate is a ReplicatedLinear too (qwen3_next.py).
_REPLICATED = re.compile(
    r"(?:norm\.(?:weight|bias)$|layernorm|\.q_a_proj\.|\.kv_a_proj_with_mqa\.|\.indexer\.|\.mlp\.gate\.weight$"
    r"|e_score_correction_bias$|\.shared_expert_gate\.)"
)
# Decoder layers of the language model: model.layers.N., model.language_model.layers.N., language_model.model...;
# vision towers (visual.blocks.N, vision_model.encoder.layers.N) do not match and count on the first stage.
_LAYER = re.compile(r"^(?:model\.|language_model\.)*layers\.(\d+)\.")
_FINAL_NORM = re.compile(r"^(?:model\.|language_model\.)*norm\.(?:weight|bias)$")


class FitError(ValueError):
    """Input the estimate cannot use; the message names the file or flag and what to do."""


# ---- reading the checkpoint ---------------------------------------------------------------------------------------


def read_config(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise FitError(f"{path}: cannot read config.json ({e}); copy it from the pinned revision") from None
    if not isinstance(cfg, dict):
        raise FitError(f"{path}: config.json is not a JSON object; copy it from the pinned revision")
    return cfg


def read_checkpoint(directory: str) -> dict[str, Any]:
    """config.json plus every tensor's name, storage dtype and stored bytes, from the safetensors headers only
    (checkpoint.parse_header: the 8-byte length and JSON header; no tensor is loaded). Shards come from
    model.safetensors.index.json (the ones engines load), else model.safetensors."""
    config = read_config(directory)
    index_path = os.path.join(directory, INDEX_NAME)
    if os.path.exists(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise FitError(f"{index_path}: cannot read the index ({e}); copy it from the pinned revision") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise FitError(f"{index_path}: no weight_map; copy the index from the pinned revision")
        shards = sorted(set(weight_map.values()))
        bad = [s for s in shards if not safe_member(s)]
        if bad:
            raise FitError(f"{index_path}: weight_map names {bad[0]!r}, not a plain file name; the index is malformed")
    elif os.path.exists(os.path.join(directory, SINGLE_NAME)):
        shards = [SINGLE_NAME]
    else:
        raise FitError(f"{directory}: neither {INDEX_NAME} nor {SINGLE_NAME}; give the checkpoint directory")
    tensors = []
    for shard in shards:
        path = os.path.join(directory, shard)
        try:
            header = parse_header(path)
        except HeaderError as e:
            raise FitError(f"{path}: {e.kind}: {e}; run `llmfleet checkpoint verify {directory}`") from None
        except OSError as e:
            raise FitError(f"{path}: cannot read ({e}); run `llmfleet checkpoint verify {directory}`") from None
        for name, t in header["tensors"].items():
            begin, end = t["data_offsets"]
            tensors.append((name, t["dtype"], end - begin))
    return {"directory": directory, "config": config, "tensors": tensors}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: multimodal checkpoints nest it under text_config."""
    merged = dict(config)
    merged.update(config.get("text_config") or {})
    return merged


def _int(cfg: dict[str, Any], key: str, where: str = "config.json") -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise FitError(f"{where}: {key} is {v!r}, expected a non-negative integer")
    return v


def model_dtype_bytes(cfg: dict[str, Any]) -> int:
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    return DTYPE_BYTES.get(name, 2)


# ---- layers, stages, KV --------------------------------------------------------------------------------------------


def pp_layer_split(n_layers: int, pp: int, engine: str, partition: list[int] | None = None) -> list[tuple[int, int]]:
    """[start, end) of each PP stage, as the engine splits layers.

    vLLM (vllm/distributed/utils.py get_pp_indices, 0.32.0): n // pp each, the remainder one each to the stages
    before the last, from the second-to-last backwards. SGLang (sglang/srt/distributed/utils.py, 0.5.23): the
    remainder to the last stages. `partition` is VLLM_PP_LAYER_PARTITION / SGLANG_PP_LAYER_PARTITION."""
    if partition is not None:
        if len(partition) != pp or sum(partition) != n_layers:
            raise FitError(f"PP layer partition {partition}: needs {pp} entries summing to {n_layers} layers")
        parts = list(partition)
    else:
        parts = [n_layers // pp] * pp
        rem = n_layers % pp
        if engine == _VLLM:
            for i in range(2, rem + 2):
                parts[-i] += 1
        else:
            for i in range(pp - rem, pp):
                parts[i] += 1
    out, start = [], 0
    for p in parts:
        out.append((start, start + p))
        start += p
    return out


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """One of full_attention / sliding_attention / linear_attention / other per decoder layer."""
    n = _int(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        return [str(t) for t in types]
    interval = cfg.get("full_attention_interval")  # Qwen3-Next configs without layer_types
    if isinstance(interval, int) and interval > 0 and cfg.get("linear_num_value_heads"):
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) is not False:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def kv_dtype_bytes(kv_cache_dtype: str, cfg: dict[str, Any]) -> int:
    if kv_cache_dtype in ("auto", "", None):
        return model_dtype_bytes(cfg)
    if kv_cache_dtype in FP8_KV:
        return 1
    if kv_cache_dtype in DTYPE_BYTES:
        return DTYPE_BYTES[kv_cache_dtype]
    raise FitError(f"--kv-cache-dtype {kv_cache_dtype!r}: not one of auto, fp8, fp8_e4m3, fp8_e5m2, bfloat16, float16")


def attention_cost(
    config: dict[str, Any],
    *,
    tp: int = 1,
    layers: tuple[int, int] | None = None,
    kv_cache_dtype: str = "auto",
    max_model_len: int = 0,
    engine: str = _VLLM,
    ssm_dtype: str = "auto",
) -> dict[str, Any]:
    """KV cache bytes per token and per-sequence state bytes on one rank holding `layers` [start, end).

    GQA/MHA: 2 (K and V) x max(1, kv_heads // TP) x head_dim x dtype bytes per full-attention layer: KV heads are
    split by TP and replicated when there are fewer than TP (vllm/config/model.py get_num_kv_heads, 0.32.0;
    sglang/srt/configs/model_config.py get_num_kv_heads, 0.5.23). head_dim = hidden_size / num_attention_heads
    when config.json has none.
    MLA (DeepSeek-V2/V3): one latent of kv_lora_rank + qk_rope_head_dim per layer per token, no x2, no heads, and
    every TP rank holds all of it (vLLM get_num_kv_heads returns 1 for MLA and get_head_size returns
    kv_lora_rank + qk_rope_head_dim, vllm/transformers_utils/model_arch_config_convertor.py; SGLang sizes the pool
    as (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes with no TP term, model_executor/pool_configurator.py
    _compute_cell_size).
    DeepSeek sparse attention (config has index_head_dim: DeepSeek-V3.2, GLM-5): FP8 KV is stored with scales,
    kv_lora_rank + kv_lora_rank/128 x 4 + qk_rope_head_dim x 2 bytes (656 for 512/64: vllm
    v1/attention/backends/mla/flashmla_sparse.py; sglang mem_cache/kv_cache_configurator.py
    calculate_mla_kv_cache_dim), plus the indexer's FP8 keys with scales, index_head_dim + index_head_dim/128 x 4
    bytes per layer per token in either KV dtype (vllm deepseek_v2.py DeepseekV32IndexerCache; sglang
    pool_configurator.py _compute_dsa_indexer_cell_size).
    Sliding-window layers hold min(window, max_model_len) tokens per sequence: a per-sequence cost.
    Gated-DeltaNet (linear_attention) layers hold a fixed state per sequence: conv (kernel - 1) x
    (2 x k_heads x k_dim + v_heads x v_dim) / TP in the conv dtype, and ssm (v_heads / TP) x k_dim x v_dim in the
    SSM dtype (vllm model_executor/layers/mamba/mamba_utils.py gated_delta_net_state_shape). SSM dtype "auto":
    the model dtype for vLLM, float32 for SGLang unless config.json says mamba_ssm_dtype
    (sglang/srt/configs/mamba_utils.py); conv dtype: model dtype (vLLM), bfloat16 (SGLang).
    """
    cfg = text_config(config)
    n = _int(cfg, "num_hidden_layers")
    start, end = layers if layers is not None else (0, n)
    types = layer_types(cfg)[start:end]
    kvb = kv_dtype_bytes(kv_cache_dtype, cfg)
    notes: list[str] = []
    if cfg.get("kv_lora_rank"):
        lora, rope = _int(cfg, "kv_lora_rank"), _int(cfg, "qk_rope_head_dim")
        if cfg.get("index_head_dim"):
            kind = "dsa"
            per_layer = lora + lora // 128 * 4 + rope * 2 if kvb == 1 else (lora + rope) * kvb
            ihd = _int(cfg, "index_head_dim")
            per_layer += ihd + ihd // 128 * 4
        else:
            kind = "mla"
            per_layer = (lora + rope) * kvb
    else:
        heads = _int(cfg, "num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or (_int(cfg, "hidden_size") // heads if heads else 0)
        kind = "mha" if kv_heads == heads else "gqa"
        per_rank_heads = max(1, kv_heads // tp)
        if kv_heads < tp:
            notes.append(f"{kv_heads} KV heads < TP {tp}: each rank holds a copy of one")
        per_layer = 2 * per_rank_heads * head_dim * kvb
    full = sum(1 for t in types if t in ("full_attention", "attention"))
    sliding = sum(1 for t in types if t == "sliding_attention")
    linear = sum(1 for t in types if t == "linear_attention")
    unknown = sorted(set(types) - {"full_attention", "attention", "sliding_attention", "linear_attention"})
    other = len(types) - full - sliding - linear
    per_seq = 0
    if sliding:
        window = _int(cfg, "sliding_window")
        held = min(window, max_model_len) if max_model_len else window
        per_seq += sliding * per_layer * held
    if linear:
        per_seq += linear * _gdn_state_bytes(cfg, tp, engine, ssm_dtype, notes)
    if other:
        notes.append(f"{other} layer(s) of type {', '.join(unknown)}: not modelled (no KV counted for them)")
    if full + sliding < len(types) or sliding:
        kind = "hybrid-" + kind
    return {
        "kind": kind,
        "kv_dtype_bytes": kvb,
        "bytes_per_token_per_layer": per_layer,
        "layers": {"full": full, "sliding": sliding, "linear": linear, "other": other},
        "per_token": per_layer * full,
        "per_seq": per_seq,
        "notes": notes,
    }


def _gdn_state_bytes(cfg: dict[str, Any], tp: int, engine: str, ssm_dtype: str, notes: list[str]) -> int:
    try:
        kh, vh = _int(cfg, "linear_num_key_heads"), _int(cfg, "linear_num_value_heads")
        kd, vd = _int(cfg, "linear_key_head_dim"), _int(cfg, "linear_value_head_dim")
        kernel = _int(cfg, "linear_conv_kernel_dim")
    except FitError:
        notes.append("linear-attention layers without Gated-DeltaNet fields: their state is not modelled")
        return 0
    model_b = model_dtype_bytes(cfg)
    conv_b = model_b if engine == _VLLM else 2
    if ssm_dtype in ("auto", "", None):
        ssm_b = model_b if engine == _VLLM else DTYPE_BYTES.get(str(cfg.get("mamba_ssm_dtype") or "float32"), 4)
    else:
        ssm_b = DTYPE_BYTES.get(ssm_dtype)
        if ssm_b is None:
            raise FitError(f"SSM state dtype {ssm_dtype!r}: not one of auto, float32, bfloat16, float16")
    conv = (kernel - 1) * ((2 * kh * kd + vh * vd) // tp) * conv_b
    ssm = max(1, vh // tp) * kd * vd * ssm_b
    return conv + ssm


# ---- weights per rank ------------------------------------------------------------------------------------------------


def _place(name: str, n_layers: int) -> tuple[str, int]:
    """("layer", i), ("first", -1), ("last", -1) or ("mtp", -1) for one tensor name."""
    if name.startswith("mtp.") or ".mtp." in name:
        return "mtp", -1
    m = _LAYER.match(name)
    if m:
        i = int(m.group(1))
        return ("layer", i) if i < n_layers else ("mtp", -1)
    if "lm_head" in name or _FINAL_NORM.match(name):
        return "last", -1
    return "first", -1


def weights_per_stage(
    ckpt: dict[str, Any], *, tp: int, stages: list[tuple[int, int]], include_mtp: bool = False
) -> dict[str, Any]:
    """Stored bytes per rank of each PP stage: sharded tensors / TP (rounded up) + replicated tensors whole.
    Embeddings and anything outside the decoder layers (a vision tower) sit on the first stage, the final norm
    and lm_head on the last; a tied lm_head costs the embedding again on the last stage when PP > 1 (the engines
    allocate it there). MTP layers (layer index >= num_hidden_layers, or mtp.*) count only with include_mtp
    (speculative decoding with the checkpoint's own MTP head), on the last stage."""
    cfg = text_config(ckpt["config"])
    n_layers = _int(cfg, "num_hidden_layers")
    sharded = [0] * len(stages)
    replicated = [0] * len(stages)
    by_dtype: dict[str, int] = {}
    total = mtp = embed = 0
    has_lm_head = any("lm_head" in t[0] for t in ckpt["tensors"])
    for name, dtype, nbytes in ckpt["tensors"]:
        where, layer = _place(name, n_layers)
        if where == "mtp":
            mtp += nbytes
            if not include_mtp:
                continue
            s = len(stages) - 1
        elif where == "layer":
            s = next(i for i, (a, b) in enumerate(stages) if a <= layer < b)
        else:
            s = 0 if where == "first" else len(stages) - 1
        if where == "first" and "embed_tokens" in name:
            embed += nbytes
        total += nbytes
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
        (replicated if _REPLICATED.search(name) else sharded)[s] += nbytes
    if len(stages) > 1 and not has_lm_head and cfg.get("tie_word_embeddings"):
        sharded[-1] += embed
    per_rank = [-(-sh // tp) + rep for sh, rep in zip(sharded, replicated)]
    return {"total": total, "by_dtype": by_dtype, "mtp": mtp, "per_rank": per_rank, "replicated": replicated}


# ---- the estimate ----------------------------------------------------------------------------------------------------


def default_margin_bytes(gpu_memory_bytes: int, *, tp: int, pp: int, activation_tokens: int, max_seqs: int) -> int:
    """Activations + CUDA graphs + what else a rank needs outside weights and KV, by SGLang 0.5.23's own rule for
    choosing --mem-fraction-static (sglang/srt/arg_groups/memory_hook.py _handle_gpu_memory_settings): 512 MiB +
    1.5 MiB per activation token (max(chunked prefill, 2048)) + TP x PP / 8 GiB + 2 MiB per decode CUDA-graph batch
    slot, at least 10 GiB on GPUs over 60 GiB. vLLM profiles its own instead of using a formula; the same rule
    stands in for it (docs/engine-fit.md)."""
    mib = 512 + max(activation_tokens, 2048) * 1.5 + tp * pp / 8 * 1024 + max_seqs * 2
    if gpu_memory_bytes > 60 * GIB:
        mib = max(mib, 10 * 1024)
    return int(mib * MIB)


def _gib(b: float) -> str:
    return f"{b / GIB:.1f} GiB"


def estimate(
    ckpt: dict[str, Any],
    *,
    tp: int,
    pp: int = 1,
    gpu_memory_bytes: int,
    mem_fraction: float,
    engine: str = _VLLM,
    max_model_len: int,
    max_seqs: int = 1,
    kv_cache_dtype: str = "auto",
    margin_bytes: int | None = None,
    activation_tokens: int = 8192,
    include_mtp: bool = False,
    ssm_dtype: str = "auto",
    pp_partition: list[int] | None = None,
    suggest: bool = True,
) -> dict[str, Any]:
    """Per-GPU memory estimate for one deployment shape; every term, a verdict and a one-line message.

    gpu_memory_bytes: one GPU's total (nvidia-smi memory.total); mem_fraction: vLLM --gpu-memory-utilization or
    SGLang --mem-fraction-static; max_model_len x max_seqs: the tokens the KV cache should hold.
    verdict: "fits" (the KV cache holds max_seqs requests of max_model_len tokens and the margin is covered),
    "tight" (it holds one full-length request but not max_seqs of them, or, SGLang, the memory outside the
    fraction is below the margin), "does_not_fit" (not even one full-length request without the margin: vLLM
    refuses to start, "To serve at least one request with the model's max seq len ...", v1/core/kv_cache_utils.py).
    """
    if engine not in ENGINES:
        raise FitError(f"engine {engine!r}: not one of {', '.join(ENGINES)}")
    for flag, v in (("tp", tp), ("pp", pp), ("max_model_len", max_model_len), ("max_seqs", max_seqs)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise FitError(f"{flag}={v!r}: must be a positive integer")
    if not isinstance(mem_fraction, (int, float)) or isinstance(mem_fraction, bool) or not 0 < mem_fraction <= 1:
        raise FitError(f"{FLAGS[engine]['fraction']} {mem_fraction!r}: must be in (0, 1]")
    if not isinstance(gpu_memory_bytes, int) or gpu_memory_bytes <= 0:
        raise FitError(f"gpu_memory_bytes={gpu_memory_bytes!r}: give one GPU's total memory in bytes")
    cfg = text_config(ckpt["config"])
    n_layers = _int(cfg, "num_hidden_layers")
    if n_layers < pp:
        raise FitError(f"PP {pp} > num_hidden_layers {n_layers}: a pipeline stage would hold no layer")
    stages = pp_layer_split(n_layers, pp, engine, pp_partition)
    w = weights_per_stage(ckpt, tp=tp, stages=stages, include_mtp=include_mtp)
    usable = int(gpu_memory_bytes * mem_fraction)
    margin = (
        default_margin_bytes(gpu_memory_bytes, tp=tp, pp=pp, activation_tokens=activation_tokens, max_seqs=max_seqs)
        if margin_bytes is None
        else int(margin_bytes)
    )
    outside = gpu_memory_bytes - usable
    wanted_tokens = max_model_len * max_seqs
    rows = []
    vllm_margin = margin if engine == _VLLM else 0
    for s, (a, b) in enumerate(stages):
        att = attention_cost(
            ckpt["config"],
            tp=tp,
            layers=(a, b),
            kv_cache_dtype=kv_cache_dtype,
            max_model_len=max_model_len,
            engine=engine,
            ssm_dtype=ssm_dtype,
        )
        room = usable - w["per_rank"][s] - vllm_margin
        state = att["per_seq"] * max_seqs
        rows.append(
            {
                "stage": s,
                "layers": [a, b],
                "weights_bytes": w["per_rank"][s],
                "kv_room_bytes": room,
                "kv_bytes_per_token": att["per_token"],
                "state_bytes_per_seq": att["per_seq"],
                "kv_wanted_bytes": att["per_token"] * wanted_tokens + state,
                "tokens_fit": _tokens(room - state, att["per_token"], wanted_tokens),
                "tokens_fit_without_margin": _tokens(
                    room + vllm_margin - att["per_seq"], att["per_token"], wanted_tokens
                ),
                "attention": att,
            }
        )
    worst = min(rows, key=lambda r: (r["tokens_fit"], -r["weights_bytes"]))
    tokens_fit = worst["tokens_fit"]
    short_margin = engine == _SGLANG and outside < margin
    # Not even one full-length request without any margin: the engine cannot serve the configured length.
    # Short only by the margin (an estimate, not a measurement): tight, never "does not fit".
    if min(r["tokens_fit_without_margin"] for r in rows) < max_model_len:
        verdict = "does_not_fit"
    elif tokens_fit < wanted_tokens or short_margin:
        verdict = "tight"
    else:
        verdict = "fits"
    out = {
        "engine": engine,
        "tp": tp,
        "pp": pp,
        "gpus": tp * pp,
        "gpu_memory_bytes": gpu_memory_bytes,
        "mem_fraction": mem_fraction,
        "usable_bytes": usable,
        "outside_fraction_bytes": outside,
        "margin_bytes": margin,
        "margin_source": "given"
        if margin_bytes is not None
        else (f"SGLang 0.5.23 reserve rule, {max(activation_tokens, 2048)} activation tokens"),
        "weights_total_bytes": w["total"],
        "weights_by_dtype": w["by_dtype"],
        "mtp_bytes": w["mtp"],
        "mtp_included": include_mtp,
        "weights_even_per_rank_bytes": -(-w["total"] // (tp * pp)),
        "weights_per_rank_bytes": worst["weights_bytes"],
        "worst_stage": worst["stage"],
        "kv_cache_dtype": kv_cache_dtype,
        "kv_bytes_per_token": worst["kv_bytes_per_token"],
        "state_bytes_per_seq": worst["state_bytes_per_seq"],
        "kv_room_bytes": worst["kv_room_bytes"],
        "kv_wanted_bytes": worst["kv_wanted_bytes"],
        "max_model_len": max_model_len,
        "max_seqs": max_seqs,
        "tokens_wanted": wanted_tokens,
        "tokens_fit": tokens_fit,
        "concurrency_fit": round(tokens_fit / max_model_len, 2),
        "stages": rows,
        "verdict": verdict,
        "short_margin": short_margin,
    }
    args = {
        "tp": tp,
        "pp": pp,
        "gpu_memory_bytes": gpu_memory_bytes,
        "mem_fraction": mem_fraction,
        "engine": engine,
        "max_model_len": max_model_len,
        "max_seqs": max_seqs,
        "kv_cache_dtype": kv_cache_dtype,
        "margin_bytes": margin_bytes,
        "activation_tokens": activation_tokens,
        "include_mtp": include_mtp,
        "ssm_dtype": ssm_dtype,
    }
    out["fixes"] = _fixes(ckpt, out, args) if suggest and verdict != "fits" else []
    out["message"] = _message(out)
    return out


def _tokens(room: int, per_token: int, wanted: int) -> int:
    """KV tokens that fit in `room` bytes (all that were asked for when there is no per-token KV at all)."""
    if room < 0:
        return 0
    return int(room // per_token) if per_token else wanted


_RANK = {"does_not_fit": 0, "tight": 1, "fits": 2}


def _reasons(e: dict[str, Any]) -> set[str]:
    """Why a verdict is not "fits": too few KV tokens, and (SGLang) too little memory outside the fraction."""
    out = set()
    if e["tokens_fit"] < e["tokens_wanted"]:
        out.add("tokens")
    if e["short_margin"]:
        out.add("margin")
    return out


def _better(new: dict[str, Any], old: dict[str, Any]) -> bool:
    if _RANK[new["verdict"]] != _RANK[old["verdict"]]:
        return _RANK[new["verdict"]] > _RANK[old["verdict"]]
    return new["verdict"] == "tight" and _reasons(new) < _reasons(old)


def _outcome(e: dict[str, Any]) -> str:
    if e["verdict"] != "tight":
        return e["verdict"].replace("_", " ")
    left = []
    if "tokens" in _reasons(e):
        left.append(f"{e['concurrency_fit']:g} full-length requests at once")
    if "margin" in _reasons(e):
        left.append("activation/graph headroom still short")
    return f"tight ({', '.join(left)})"


def _fixes(ckpt: dict[str, Any], est: dict[str, Any], args: dict[str, Any]) -> list[str]:
    """Single changes that improve the verdict (or, when tight, remove one of its reasons), each checked by
    re-running the estimate and named with what it reaches: configuration first, then more PP (the smallest that
    helps and the smallest that fits)."""
    flags = FLAGS[args["engine"]]
    out: list[str] = []

    def trial(**change: Any) -> dict[str, Any] | None:
        kw = dict(args)
        kw.update(change)
        try:
            e = estimate(ckpt, suggest=False, **kw)
        except FitError:
            return None
        return e if _better(e, est) else None

    kvb = est["stages"][est["worst_stage"]]["attention"]["kv_dtype_bytes"]
    e = trial(kv_cache_dtype="fp8") if kvb > 1 else None
    if e:
        out.append(f"{flags['kv_fp8']} (KV {kvb} bytes -> 1 byte per element): {_outcome(e)}")
    per_seq = est["tokens_fit"] // args["max_seqs"]
    e = trial(max_model_len=per_seq) if 1024 <= per_seq < args["max_model_len"] else None
    if e:
        out.append(f"{flags['max_len']} {per_seq}: {_outcome(e)}")
    seqs = est["tokens_fit"] // args["max_model_len"]
    e = trial(max_seqs=seqs) if 1 <= seqs < args["max_seqs"] else None
    if e:
        out.append(f"{flags['seqs']} {seqs}: {_outcome(e)}")
    fractions = [0.90, 0.92, 0.95]
    if est["short_margin"]:  # the fraction SGLang itself would choose for this margin
        fractions.insert(0, math.floor((1 - est["margin_bytes"] / est["gpu_memory_bytes"]) * 1000) / 1000)
    for frac in fractions:
        e = trial(mem_fraction=frac) if frac != args["mem_fraction"] else None
        if e:
            out.append(f"{flags['fraction']} {frac:g}: {_outcome(e)}")
            break
    # More GPUs last: the configuration changes above cost no hardware.
    n_layers = _int(text_config(ckpt["config"]), "num_hidden_layers")
    tried = [(args["pp"] * m, trial(pp=args["pp"] * m)) for m in (2, 4, 8) if args["pp"] * m <= n_layers]
    better = [(p, e) for p, e in tried if e]
    first_fit = next(((p, e) for p, e in better if e["verdict"] == "fits"), None)
    # The smallest PP that helps, and the smallest that fits when that is a larger one (compared by PP: the
    # generator above builds new tuples, so identity never matched and a PP that did both was listed twice).
    for p, e in better[:1] + ([first_fit] if first_fit and first_fit[0] != better[0][0] else []):
        out.append(
            f"TP{args['tp']}xPP{p} on {args['tp'] * p} GPUs ({_gib(e['weights_per_rank_bytes'])} weights per "
            f"GPU): {_outcome(e)}"
        )
    return out


def _message(e: dict[str, Any]) -> str:
    flags = FLAGS[e["engine"]]
    where = f"TP{e['tp']}" + (f"xPP{e['pp']} stage {e['worst_stage']}" if e["pp"] > 1 else "")
    budget = (
        f"{_gib(e['usable_bytes'])} usable ({_gib(e['gpu_memory_bytes'])} x {e['mem_fraction']:g} {flags['fraction']})"
    )
    margin = f" + margin {_gib(e['margin_bytes'])}" if e["engine"] == _VLLM else ""
    need = (
        f"weights {_gib(e['weights_per_rank_bytes'])}{margin} + KV {_gib(e['kv_wanted_bytes'])} "
        f"({e['max_model_len']:,} tokens x {e['max_seqs']} seqs)"
    )
    fix = ("; what helps: " + " | ".join(e["fixes"][:3])) if e["fixes"] else ""
    if e["verdict"] == "does_not_fit":
        fix = fix or "; no single change (more PP, FP8 KV, a shorter context, a fraction up to 0.95) is enough"
        return (
            f"does not fit: per GPU ({where}) {need} > {budget}; room for {e['tokens_fit']:,} KV tokens, "
            f"one request needs {e['max_model_len']:,}{fix}"
        )
    conc = f"{e['concurrency_fit']:g} full-length requests at once"
    if e["verdict"] == "tight":
        why = []
        if e["tokens_fit"] < e["tokens_wanted"]:
            why.append(f"the KV cache holds {e['tokens_fit']:,} tokens ({conc}), not {e['tokens_wanted']:,}")
        if e["short_margin"]:
            outside = f"{_gib(e['outside_fraction_bytes'])} outside {flags['fraction']} {e['mem_fraction']:g}"
            asks = _gib(e["margin_bytes"])
            why.append(f"{outside} for activations and CUDA graphs, SGLang's reserve rule asks {asks}")
        return f"tight: per GPU ({where}) {need} vs {budget}: " + "; ".join(why) + fix
    return f"fits: per GPU ({where}) {need} <= {budget}; room for {e['tokens_fit']:,} KV tokens ({conc})"


# ---- the engine's own breakdown, from its start-up log ---------------------------------------------------------------


# The engines' own start-up lines, with the source of each, and the rank a line is from: the profiles'
# fit_breakdown and rank_re (llmfleet.engines.vllm / .sglang).
# How the per-rank figures combine into the deployment's: the rank that limits it.
_PICK = {
    "weights_gib": max,
    "graph_gib": max,
    "state_gib": max,
    "kv_gib": min,
    "kv_tokens": min,
    "max_concurrency": min,
    "max_model_len": max,
    "max_total_num_tokens": min,
    "max_running_requests": min,
}


def _rank_of(line: str, engine: str) -> str:
    m = engines.get(engine).rank_re.search(line)
    return m.group(1).strip() if m else ""


def parse_breakdown(lines: list[str] | str, engine: str) -> dict[str, Any]:
    """The engine's own per-GPU memory figures from its start-up log (GiB as the engine printed them).

    Per rank where the line names one (SGLang logs every rank; vLLM logs weights and graphs once per node, from
    local rank 0); the top level holds the largest weights and graphs and the smallest KV figures over ranks (the
    rank that limits the deployment). Keys absent when the log has no such line."""
    if engine not in ENGINES:
        raise FitError(f"engine {engine!r}: not one of {', '.join(ENGINES)}")
    if isinstance(lines, str):
        lines = lines.splitlines()
    ranks: dict[str, dict[str, Any]] = {}
    for line in lines:
        for rx, fields in engines.get(engine).fit_breakdown:
            m = rx.search(line)
            if not m:
                continue
            r = ranks.setdefault(_rank_of(line, engine), {})
            for key, value in fields(m).items():
                if key.endswith("+"):
                    r[key[:-1]] = round(r.get(key[:-1], 0.0) + value, 2)
                else:
                    r[key] = value
    out: dict[str, Any] = {"engine": engine, "ranks": ranks}
    for key, pick in _PICK.items():
        vals = [r[key] for r in ranks.values() if key in r]
        if vals:
            out[key] = pick(vals)
    return out


def breakdown_message(b: dict[str, Any], est: dict[str, Any] | None = None) -> str:
    """One line: what the engine says it used per GPU, and the estimate's figure beside each where given."""
    if not any(k in b for k in ("weights_gib", "kv_gib", "kv_tokens", "graph_gib")):
        return f"{b['engine']}: no memory lines in the start-up log (looked for the lines in docs/engine-fit.md)"
    parts = []
    if "weights_gib" in b:
        said = f" (estimate {est['weights_per_rank_bytes'] / GIB:.1f})" if est else ""
        parts.append(f"weights {b['weights_gib']:.2f} GiB{said}")
    if "kv_gib" in b or "kv_tokens" in b:
        kv = f"KV cache {b['kv_gib']:.2f} GiB" if "kv_gib" in b else "KV cache"
        if "kv_tokens" in b:
            kv += f", {b['kv_tokens']:,} tokens"
            if est:
                kv += f" (estimate {est['tokens_fit']:,})"
        if "max_concurrency" in b:
            kv += f", {b['max_concurrency']:g}x requests of {b.get('max_model_len', 0):,} tokens"
        parts.append(kv)
    if "state_gib" in b:
        parts.append(f"linear-attention state {b['state_gib']:.2f} GiB")
    if "graph_gib" in b:
        parts.append(f"CUDA graphs {b['graph_gib']:.2f} GiB")
    return f"{b['engine']} reported per GPU: " + ", ".join(parts)


def estimate_checkpoint(directory: str, **kwargs: Any) -> dict[str, Any]:
    """estimate() for a checkpoint directory (reads config.json and the safetensors headers)."""
    return estimate(read_checkpoint(directory), **kwargs)


def gpu_memory_from_smi(text: str) -> int:
    """One GPU's total bytes from `nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits` (MiB per
    line; the smallest GPU when they differ)."""
    vals = []
    for line in text.splitlines():
        v = line.strip().split()[0] if line.strip() else ""
        if v.isdigit():
            vals.append(int(v))
    if not vals:
        raise FitError("nvidia-smi memory.total: no MiB figure; run it with --format=csv,noheader,nounits")
    return min(vals) * MIB


__all__ = [
    "FitError",
    "attention_cost",
    "breakdown_message",
    "default_margin_bytes",
    "estimate",
    "estimate_checkpoint",
    "gpu_memory_from_smi",
    "parse_breakdown",
    "pp_layer_split",
    "read_checkpoint",
    "weights_per_stage",
]
