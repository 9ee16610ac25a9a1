"""DeepGEMM kernels compiled before an SGLang engine starts (engine_deepgemm_precompile): the command, the
once-per-fingerprint runner the unit's ExecStartPre uses, and the plan's refusal for other engines."""

import argparse
import sys
from pathlib import Path

import pytest

from llmfleet.engine import helpflags, precompile
from llmfleet.engine.command import PlanError
from llmfleet.engine.plan import node_plan
from tests.unit.test_engine_role import play, results

HELP = Path(__file__).resolve().parents[1] / "fixtures" / "engines" / "sglang-0.5.23.serve-help.txt"
SPEC = {"profile": "sglang", "model_path": "/mnt/nvme/models/glm/" + "b" * 40, "served_model_name": "glm", "tp": 8,
        "pp": 2, "nnodes": 2, "head_addr": "10.0.0.11", "dist_port": 50080, "host": "0.0.0.0", "port": 30000,  # noqa: S104 (the serve binds it)
        "deepgemm_precompile": True, "python": "/opt/sglang/bin/python", "start_timeout": 3600}  # fmt: skip


def test_the_compile_runs_the_serves_own_arguments_on_loopback():
    plan = node_plan(SPEC, 1)
    pre = plan["precompile"]
    assert pre[:3] == ["/opt/sglang/bin/python", "-m", "sglang.compile_deep_gemm"]
    assert pre[-4:] == ["--host", "127.0.0.1", "--timeout", "3600"] and pre.count("--host") == 1
    serve = plan["argv"][2:]
    assert [a for a in pre[3:-4]] == [a for i, a in enumerate(serve) if a != "--host" and serve[i - 1] != "--host"]
    assert "--node-rank" in pre and pre[pre.index("--node-rank") + 1] == "1"  # every node compiles its own share
    # Every server flag is one SGLang's serve (ServerArgs, which compile_deep_gemm parses too) accepts.
    assert helpflags.unknown_flags(["x", "y", *pre[3:-2]], HELP.read_text(), "sglang", skip=2) == []


def test_off_by_default_and_sglang_only():
    assert node_plan({**SPEC, "deepgemm_precompile": False}, 0)["precompile"] is None
    with pytest.raises(PlanError, match="engine_deepgemm_precompile is SGLang's"):
        node_plan({**SPEC, "profile": "vllm"}, 0)


def run(stamp, *cmd):
    return precompile.run(argparse.Namespace(stamp=str(stamp), cmd=["--", *cmd]))


def test_once_per_fingerprint_and_a_failure_stops_the_start(tmp_path, capsys):
    (tmp_path / "fp").mkdir()  # the fingerprint's cache directory (the engine role's)
    stamp = tmp_path / "fp" / "deep_gemm" / ".llmfleet-precompiled"
    assert run(stamp, sys.executable, "-c", "raise SystemExit(3)") == 3 and not stamp.exists()
    assert "exited 3" in capsys.readouterr().err
    # the compile makes its cache directory (DG_JIT_CACHE_DIR), the stamp goes in it
    compile_ = f"import os; os.mkdir({str(stamp.parent)!r}); print('compiled')"
    assert run(stamp, sys.executable, "-c", compile_) == 0 and stamp.exists()
    assert run(stamp, "/nonexistent/python") == 0  # done for this fingerprint: not run again
    assert "already done for this fingerprint" in capsys.readouterr().out
    assert run(tmp_path / "other" / "stamp", "/nonexistent/python") == 2
    assert "cannot run /nonexistent/python" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()  # no directory is made for a stamp


def test_the_unit_compiles_before_the_engine_as_the_engine_user(tmp_path):
    rc, out, _ = play(tmp_path, engine_deepgemm_precompile=True, llmfleet_engine_python="/opt/sglang/bin/python")
    assert rc == 0, out[-3000:]
    _, unit = results(tmp_path)
    line = next(x for x in unit.splitlines() if x.startswith("ExecStartPre=") and "precompile" in x)
    assert line.startswith("ExecStartPre=/usr/local/bin/llmfleet precompile --stamp "
                           "/mnt/nvme/llmfleet/cache/demo/0123456789abcdef/deep_gemm/.llmfleet-precompiled -- "
                           "/opt/sglang/bin/python -m sglang.compile_deep_gemm ")  # fmt: skip
    assert unit.index(line) < unit.index("ExecStart=") and "ExecStartPre=+" not in line
    rc, out, _ = play(tmp_path, engine_deepgemm_precompile=True, engine_profile="vllm")
    assert rc == 2 and "engine_deepgemm_precompile is SGLang's" in out
