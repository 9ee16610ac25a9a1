"""The engine role's fit check (tasks/0015-fit.yml) on localhost through ansible-playbook, with the real `llmfleet`
command (the venv's entry point standing in for the node's /usr/local/bin/llmfleet), the real `llmfleet fit` and a
checkpoint of safetensors headers (the 743.9 B FP8 model of docs/engine-fit.md, tests/unit/test_fit.py): the
verdict per engine_fit_check, the skips and why, bad input, check mode, and the variable's choices.

Not covered here (lab only): the start-up scan after the gate and the engine record (tasks/0030-ready.yml)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_fit import GLM_REV, glm_checkpoint

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).parent / "llmfleet"
REV = GLM_REV
PLAY = """
- name: The engine role's plan and fit check on localhost
  hosts: all
  gather_facts: false
  tasks:
    - name: The node's topology (an empty sysfs tree here, as on a node without GPUs or HCAs)
      llmfleet.fleet.llmfleet_topology_facts:
        sysfs_root: "{{ out_dir }}"
        use_nvml: false

    - name: Plan (the role's first tasks)
      ansible.builtin.include_role:
        name: engine
        tasks_from: 0010-plan.yml
        public: true

    - name: Fit check (the role's next tasks)
      ansible.builtin.include_role:
        name: engine
        tasks_from: 0015-fit.yml
        public: true

    - name: What the record and the report get
      ansible.builtin.copy:
        content: "{{ {'fit': _engine_fit | default(none), 'warnings': engine_report_warnings | default([])} | to_json }}"
        dest: "{{ out_dir }}/out.json"
        mode: "0644"
      check_mode: false
      changed_when: false  # the test's own output, not the role's
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """<root>/glm/<revision>/ with the checkpoint's headers, and current -> it (as model_stage leaves it)."""
    return glm_checkpoint(tmp_path_factory)


def play(tmp_path, model, *flags, **extra):
    (tmp_path / "play.yml").write_text(PLAY)
    (tmp_path / "inventory.yml").write_text(
        "all: {children: {llmfleet_nodes: {children: {head: {hosts: {localhost: {llmfleet_fabric_ip: 127.0.0.1}}}}}}}\n"
    )
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": f"{bindir}:{os.environ['PATH']}",
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp")}  # fmt: skip
    extra_vars = {
        "llmfleet_deployment": "demo", "engine_served_model_name": "glm", "ansible_host": "127.0.0.1",
        "engine_profile": "vllm", "llmfleet_tp_size": 8, "engine_context_length": 4096, "engine_host": "127.0.0.1",
        "engine_model_path": str(model / "current"), "llmfleet_cli": str(CLI),
        "llmfleet_engine_python": sys.executable, "out_dir": str(tmp_path),
        "ansible_python_interpreter": sys.executable, **extra,
    }  # fmt: skip
    (tmp_path / "out.json").unlink(missing_ok=True)
    cp = subprocess.run(
        [f"{bindir}/ansible-playbook", "-i", str(tmp_path / "inventory.yml"), "-c", "local", str(tmp_path / "play.yml"),
         "-e", json.dumps(extra_vars), *flags],
        capture_output=True, text=True, check=False, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    out = cp.stdout + cp.stderr
    assert "Traceback" not in out, out[-3000:]
    got = json.loads((tmp_path / "out.json").read_text()) if (tmp_path / "out.json").exists() else None
    return cp.returncode, " ".join(out.split()), got


def test_a_model_that_does_not_fit_is_a_warning_by_default(tmp_path, model):
    """743.9 B FP8 at TP8 on 96 GiB GPUs: the weights alone exceed what vLLM may use (docs/engine-fit.md)."""
    rc, out, got = play(tmp_path, model, engine_gpu_memory_gib=96)
    assert rc == 0, out[-3000:]
    assert "WARNING: localhost: llmfleet fit: " in out and "does not fit" in out, out[-3000:]
    fit = got["fit"]
    assert fit["level"] == "error" and fit["verdict"] == "does_not_fit" and fit["rc"] == 1
    assert fit["architecture_known"] is True and fit["engine_version"] is None  # no vllm in this Python
    assert "checked against the newest captured registry" in fit["message"]
    assert [w for w in got["warnings"] if "llmfleet fit" in w]


def test_with_engine_fit_check_error_it_stops_the_play_naming_the_node_and_the_switch(tmp_path, model):
    rc, out, _ = play(tmp_path, model, engine_gpu_memory_gib=96, engine_fit_check="error")
    assert rc == 2, out[-3000:]
    assert "localhost: " in out and "does not fit" in out
    assert "engine_fit_check is error: change the deployment as the message says, or set engine_fit_check: warn" in out


def test_a_model_that_fits_says_so_without_a_warning(tmp_path, model):
    rc, out, got = play(tmp_path, model, engine_gpu_memory_gib=200, engine_fit_check="error")
    assert rc == 0, out[-3000:]
    assert got["fit"]["level"] == "ok" and got["fit"]["verdict"] == "fits", got
    assert "localhost: llmfleet fit: " in out and "WARNING: localhost: llmfleet fit" not in out


def test_the_planned_command_line_sizes_the_check(tmp_path, model):
    """The context length comes from the argv the units will run (engine_context_length -> --max-model-len)."""
    _, _, small = play(tmp_path, model, engine_gpu_memory_gib=200, engine_context_length=4096)
    _, _, big = play(tmp_path, model, engine_gpu_memory_gib=200, engine_context_length=1_000_000,
                     engine_extra_args=["--max-num-seqs", "64"])  # fmt: skip
    assert small["fit"]["verdict"] == "fits" and big["fit"]["verdict"] != "fits", big


@pytest.mark.skipif(bool(__import__("shutil").which("nvidia-smi")), reason="this machine has nvidia-smi")
def test_without_a_gpu_figure_the_check_is_skipped_with_a_note(tmp_path, model):
    """The lab: no nvidia-smi and engine_gpu_memory_gib 0."""
    rc, out, got = play(tmp_path, model, engine_fit_check="error")
    assert rc == 0, out[-3000:]
    assert "fit check skipped on localhost: no nvidia-smi here and engine_gpu_memory_gib is 0" in out
    assert got["fit"] is None


def test_custom_and_skip_do_not_run_it(tmp_path, model):
    rc, out, got = play(tmp_path, model, engine_profile="custom", engine_custom_argv=["/opt/x/serve"],
                        engine_gpu_memory_gib=96, engine_fit_check="error")  # fmt: skip
    assert rc == 0 and "fit check skipped: engine_profile=custom runs engine_custom_argv" in out, out[-3000:]
    assert got["fit"] is None
    rc, out, got = play(tmp_path, model, engine_gpu_memory_gib=96, engine_fit_check="skip")
    # Task names mention the check; its messages say "fit check skipped ..." or "llmfleet fit: ...".
    assert rc == 0 and "fit check skipped" not in out and "llmfleet fit: " not in out and got["fit"] is None


def test_bad_input_fails_even_in_warn_mode(tmp_path, model):
    broken = tmp_path / "broken" / "m"
    (broken / REV).mkdir(parents=True)  # a revision directory without config.json
    (broken / "current").symlink_to(REV)
    rc, out, _ = play(tmp_path, broken, engine_gpu_memory_gib=96)
    assert rc == 2, out[-3000:]
    assert f"localhost: llmfleet fit could not judge {broken}/{REV}: llmfleet fit: " in out and "config.json" in out


def test_a_missing_llmfleet_command_is_named(tmp_path, model):
    rc, out, _ = play(tmp_path, model, engine_gpu_memory_gib=96, llmfleet_cli="/nonexistent/bin/llmfleet")
    assert rc == 2 and "localhost: llmfleet fit could not judge" in out, out[-3000:]
    assert "running llmfleet_cli /nonexistent/bin/llmfleet: " in out


@pytest.mark.parametrize("bad", [{"engine_health_failures": 0}, {"engine_health_interval": 0},
                                 {"engine_health_timeout": -1}])  # fmt: skip
def test_serving_health_settings_that_could_never_probe_are_refused_before_anything_is_installed(tmp_path, model, bad):
    rc, out, got = play(tmp_path, model, engine_gpu_memory_gib=96, **bad)
    assert rc == 2 and got is None, out[-3000:]
    assert "engine_health_failures at least 1" in out, out[-3000:]
    rc, out, _ = play(tmp_path, model, engine_gpu_memory_gib=96, engine_health=False, **bad)
    assert rc == 0, out[-3000:]


def test_check_mode_runs_the_check_and_changes_nothing(tmp_path, model):
    rc, out, got = play(tmp_path, model, "--check", engine_gpu_memory_gib=96)
    assert rc == 0 and "changed=0" in out, out[-3000:]
    assert got["fit"]["verdict"] == "does_not_fit"


def test_engine_fit_check_off_is_refused_by_the_argument_spec():
    """`off` in YAML is false: the choices are warn, error, skip (the role's entry point validates its spec)."""
    from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

    from tests.unit.test_engine_role import spec

    opts = spec()
    given = {k: o["default"] for k, o in opts.items() if "default" in o}
    given.update(engine_model_path="/m", engine_served_model_name="m", engine_fit_check=False)
    errors = ArgumentSpecValidator(opts).validate(given, validate_role_argument_spec=True).error_messages
    assert any("engine_fit_check must be one of: warn, error, skip, got: False" in e for e in errors), errors
    given.update(engine_fit_check="warn", engine_speculative={"method": "nextn", "num_steps": 3})
    errors = ArgumentSpecValidator(opts).validate(given, validate_role_argument_spec=True).error_messages
    assert any("method must be one of: eagle, eagle3, mtp, ngram, draft_model" in e for e in errors), errors
