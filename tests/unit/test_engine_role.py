"""The engine role's secret handling and its root-run writes, on localhost through ansible-playbook:
the plan's checks (open API without a key, secrets in the 0644 env file), what the unit loads (names and
paths, never values) and the exec_start_pre credential copy, run for real against a planted symlink."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from llmfleet import engines
from tests.helpers.once import once

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "engine"
KEY = "sk-llmfleet-unit-0123456789"  # fake secrets the tests look for everywhere
HF = "hf_unit_secret_value_0123456789"
PLAY = """
- name: Engine role pieces on localhost
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

    - name: What the wrapper and the unit get
      ansible.builtin.copy:
        content: "{{ {'secret_args': _engine_wrapper_args.secret, 'credentials': _engine_credentials,
                     'health_args': _engine_wrapper_args.health} | to_json }}"
        dest: "{{ out_dir }}/out.json"
        mode: "0644"

    - name: The unit
      ansible.builtin.template:
        src: "{{ role_dir }}/templates/engine.service.j2"
        dest: "{{ out_dir }}/llmfleet-demo.service"
        mode: "0644"
      vars:
        _engine_facts: {fingerprint: "0123456789abcdef", cache_dir: /mnt/nvme/llmfleet/cache/demo/0123456789abcdef}
        _engine_exec_args: "{{ ['exec'] + _engine_wrapper_args.secret + ['--'] + _engine_plan.argv }}"
"""
BASE_VARS = {
    "llmfleet_deployment": "demo",
    "engine_served_model_name": "m",
    "llmfleet_tp_size": 1,
    "ansible_host": "127.0.0.1",
}


REV_A, REV_B = "a" * 40, "b" * 40


def staged(tmp_path, node="node", rev=REV_A):
    """A staged model as model_stage leaves it: <root>/<model>/<revision>/ and `current` -> it."""
    mdir = tmp_path / "models" / node / "m"
    (mdir / rev).mkdir(parents=True, exist_ok=True)
    (mdir / "current").unlink(missing_ok=True)
    (mdir / "current").symlink_to(rev)
    return mdir


def play(tmp_path, playbook=PLAY, ansible_args=(), **extra):
    extra.setdefault("engine_model_path", str(staged(tmp_path) / "current"))
    (tmp_path / "play.yml").write_text(playbook)
    # localhost as the fleet's one node and head: the fleet contract (a dependency of the role) checks that.
    (tmp_path / "inventory.yml").write_text(
        "all: {children: {llmfleet_nodes: {children: {head: {hosts: {localhost: {llmfleet_fabric_ip: 127.0.0.1}}}}}}}\n"
    )
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": f"{bindir}:{os.environ['PATH']}",
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp")}  # fmt: skip
    extra_vars = {**BASE_VARS, "out_dir": str(tmp_path), "role_dir": str(ROLE),
                  "ansible_python_interpreter": sys.executable, **extra}  # fmt: skip
    cp = subprocess.run(
        [f"{bindir}/ansible-playbook", "-i", str(tmp_path / "inventory.yml"), "-c", "local", str(tmp_path / "play.yml"),
         "-e", json.dumps(extra_vars), *ansible_args],
        capture_output=True, text=True, check=False, timeout=180, cwd=ROOT, env=env,
    )  # fmt: skip
    out = cp.stdout + cp.stderr
    assert "Traceback" not in out, out[-3000:]
    return cp.returncode, " ".join(out.split()), tmp_path


def results(tmp_path):
    return json.loads((tmp_path / "out.json").read_text()), (tmp_path / "llmfleet-demo.service").read_text()


# ---------------------------------------------------------------------------------------------
# The argument spec


def spec():
    """The engine role's options with the fleet contract's (roles/llmfleet, loaded first by every play)."""

    def opts(role):
        path = ROOT / "roles" / role / "meta/argument_specs.yml"
        return yaml.safe_load(path.read_text())["argument_specs"]["main"]["options"]

    return {**opts("llmfleet"), **opts("engine")}


@pytest.mark.parametrize(
    ("var", "choices"),
    [
        ("engine_profile", list(engines.names())),
        ("engine_state", ["started", "stopped", "absent"]),
        ("engine_credential_via", ["load_credential", "exec_start_pre"]),
        ("engine_pd_role", ["", "prefill", "decode"]),
    ],
)
def test_enumerated_variables_have_choices(var, choices):
    assert spec()[var].get("choices") == choices


@pytest.mark.parametrize("var", ["llmfleet_api_key", "engine_secret_env"])
def test_secret_variables_are_no_log(var):
    assert spec()[var].get("no_log") is True


def test_argument_validation_never_shows_the_key():
    from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

    opts = spec()
    given = {k: o["default"] for k, o in opts.items() if "default" in o}
    given.update(engine_model_path="/m", engine_served_model_name="m")
    given.update(llmfleet_api_key=KEY, engine_secret_env={"HF_TOKEN": HF}, engine_profile="bogus")
    res = ArgumentSpecValidator(opts).validate(given, validate_role_argument_spec=True)
    # Ansible masks these values in everything it prints for the validation task.
    assert {KEY, HF} <= res._no_log_values
    assert res.error_messages and not [m for m in res.error_messages if KEY in m or HF in m]


# ---------------------------------------------------------------------------------------------
# No key on every address


@pytest.fixture(scope="module")
def default_play(tmp_path_factory):
    """play() with the base variables alone: one run (per test run) for the tests that read it."""
    d, (rc, out) = once(tmp_path_factory, "engine-role-default-play", lambda d: play(d)[:2])
    return rc, out, d


@pytest.fixture(scope="module")
def default_pd_play(tmp_path_factory):
    """pd_play() with the P/D variables alone: one run (per test run) for the tests that read it."""
    d, (rc, out) = once(tmp_path_factory, "engine-role-default-pd-play", lambda d: pd_play(d)[:2])
    return rc, out, d


def test_open_api_without_a_key_is_a_loud_warning(default_play):
    rc, out, _ = default_play
    assert rc == 0, out[-3000:]
    assert "WARNING: localhost serves the sglang API of demo on 0.0.0.0:30000 with no llmfleet_api_key" in out


def test_open_api_without_a_key_is_an_error_when_required(tmp_path):
    rc, out, _ = play(tmp_path, engine_require_api_key=True)
    assert rc == 2, out[-3000:]
    assert "with no key, and engine_require_api_key is true" in out


@pytest.mark.parametrize(
    "extra",
    [
        {"llmfleet_api_key": KEY},
        {"engine_host": "127.0.0.1"},
        {"engine_host": "", "engine_profile": "sglang"},  # SGLang's default host is 127.0.0.1
    ],
    ids=["key", "private-bind", "sglang-default-host"],
)
def test_no_warning_with_a_key_or_a_private_bind(tmp_path, extra):
    rc, out, _ = play(tmp_path, engine_require_api_key=True, **extra)
    assert rc == 0, out[-3000:]
    assert "WARNING:" not in out and KEY not in out


def test_an_ordered_stop_is_never_blocked_by_these_checks(tmp_path):
    rc, out, _ = play(tmp_path, engine_state="stopped", engine_require_api_key=True, engine_env={"HF_TOKEN": HF})
    assert rc == 0 and "WARNING:" not in out and HF not in out, out[-3000:]


def test_vllm_default_host_is_every_address(tmp_path):
    rc, out, _ = play(tmp_path, engine_profile="vllm", engine_host="")
    assert rc == 0 and "WARNING: localhost serves the vllm API of demo on every address:8000" in out, out[-3000:]


# ---------------------------------------------------------------------------------------------
# Other secrets: credentials, never the 0644 env file


def test_secret_looking_engine_env_is_refused_without_showing_the_value(tmp_path):
    rc, out, _ = play(tmp_path, engine_env={"HF_TOKEN": HF, "NCCL_DEBUG": "INFO", "TOKENIZERS_PARALLELISM": "false"})
    assert rc == 2, out[-3000:]
    assert "engine_env holds HF_TOKEN, which look like secrets" in out and "move them to engine_secret_env" in out
    assert "TOKENIZERS_PARALLELISM" not in out.split("engine_env holds")[1][:60]
    assert HF not in out


def test_secret_env_goes_through_credentials_and_the_wrapper(tmp_path):
    rc, out, d = play(tmp_path, llmfleet_api_key=KEY, engine_secret_env={"WANDB_API_KEY": "w" * 12, "HF_TOKEN": HF})
    assert rc == 0, out[-3000:]
    got, unit = results(d)
    assert got["secret_args"] == ["--secret-config", "config:api-key=api-key", "--secret-env", "HF_TOKEN=env-HF_TOKEN",
                                  "--secret-env", "WANDB_API_KEY=env-WANDB_API_KEY"]  # fmt: skip
    assert got["credentials"] == {
        "api-key": "/etc/llmfleet/credentials/demo.api-key",
        "env-HF_TOKEN": "/etc/llmfleet/credentials/demo.env-HF_TOKEN",
        "env-WANDB_API_KEY": "/etc/llmfleet/credentials/demo.env-WANDB_API_KEY",
    }
    assert re.findall(r"^LoadCredential=.*$", unit, re.M) == [
        "LoadCredential=api-key:/etc/llmfleet/credentials/demo.api-key",
        "LoadCredential=env-HF_TOKEN:/etc/llmfleet/credentials/demo.env-HF_TOKEN",
        "LoadCredential=env-WANDB_API_KEY:/etc/llmfleet/credentials/demo.env-WANDB_API_KEY",
    ]
    assert "--secret-env HF_TOKEN=env-HF_TOKEN" in unit
    for text in (out, unit):
        assert KEY not in text and HF not in text and "w" * 12 not in text


@pytest.mark.parametrize(
    ("extra", "text"),
    [
        (
            {"engine_extra_args": ["--api-key", KEY]},
            "the engine command line carries --api-key: set llmfleet_api_key instead",
        ),
        ({"engine_extra_args": [f"--admin-api-key={HF}"]}, "carries --admin-api-key"),
        (
            {"llmfleet_api_key": KEY, "engine_profile": "custom", "engine_custom_argv": ["serve", f"--token={KEY}"]},
            "the value of llmfleet_api_key appears in the engine command line or engine_env",
        ),
        (
            {"engine_secret_env": {"HF_TOKEN": HF}, "engine_env": {"HF_HOME": f"/x/{HF}"}},
            "the value of HF_TOKEN appears",
        ),
    ],
    ids=["api-key-flag", "admin-key-flag", "key-in-custom-argv", "secret-in-engine-env"],
)
def test_secrets_on_the_command_line_are_refused(tmp_path, extra, text):
    rc, out, _ = play(tmp_path, **extra)
    assert rc == 2 and text in out, out[-3000:]
    assert KEY not in out and HF not in out


@pytest.mark.parametrize("name", ["VLLM_API_KEY", "bad-name"])
def test_bad_secret_env_names_are_refused(tmp_path, name):
    rc, out, _ = play(tmp_path, engine_secret_env={name: HF})
    assert rc == 2 and name in out and HF not in out, out[-3000:]


def test_vllm_gets_the_key_as_an_environment_variable(tmp_path):
    rc, out, d = play(tmp_path, engine_profile="vllm", llmfleet_api_key=KEY, engine_health_timeout=120,
                      engine_health_prompt="Reply with exactly PONG.", engine_health_expect="PONG")  # fmt: skip
    assert rc == 0, out[-3000:]
    got = results(d)[0]
    assert got["secret_args"] == ["--secret-env", "VLLM_API_KEY=api-key"]
    # The health probe gets the key as the same credential (a name, never the value), and the tuned question.
    assert got["health_args"] == [
        "--health-url", "http://127.0.0.1:8000", "--health-model", "m", "--health-interval", "30", "--health-timeout",
        "120", "--health-failures", "3", "--health-prompt", "Reply with exactly PONG.", "--health-expect", "PONG",
        "--health-key", "api-key"]  # fmt: skip
    assert KEY not in json.dumps(got)


def test_the_head_probes_its_serving_health_by_default(default_play):
    rc, out, d = default_play
    assert rc == 0, out[-3000:]
    # SGLang's default host is 127.0.0.1, its port 30000; the gate's question; no key configured, no --health-key.
    assert results(d)[0]["health_args"] == [
        "--health-url", "http://127.0.0.1:30000", "--health-model", "m", "--health-interval", "30", "--health-timeout",
        "20", "--health-failures", "3", "--health-prompt", "What is 37\u00d719? Reply with only the number.",
        "--health-expect", "703"]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# exec_start_pre: root opens the credential, the engine user writes the copy


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: runs the privileged ExecStartPre")
def test_exec_start_pre_copy_never_writes_as_root_into_the_runtime_directory(tmp_path, request):
    rc, out, d = play(tmp_path, llmfleet_api_key=KEY, engine_secret_env={"HF_TOKEN": HF},
                      engine_credential_via="exec_start_pre", llmfleet_user="nobody", llmfleet_group="nogroup")  # fmt: skip
    assert rc == 0, out[-3000:]
    unit = results(d)[1]
    assert KEY not in unit and HF not in unit
    assert "Environment=CREDENTIALS_DIRECTORY=/run/llmfleet-demo" in unit
    pres = re.findall(r"^ExecStartPre=\+(.*)$", unit, re.M)
    assert len(pres) == 2
    # Stand-ins: the root-only credential files, the runtime directory the engine user owns, and a
    # root-owned victim that a link planted in the runtime directory points at.
    top = Path(tempfile.mkdtemp(prefix="llmfleet-test-"))  # the engine user must reach it: not under root's 0700 tmp
    request.addfinalizer(lambda: shutil.rmtree(top, ignore_errors=True))
    top.chmod(0o755)
    creds, run = top / "creds", top / "run"
    creds.mkdir(mode=0o700)
    (creds / "demo.api-key").write_text(KEY)
    (creds / "demo.env-HF_TOKEN").write_text(HF)
    for f in creds.iterdir():
        f.chmod(0o600)
    run.mkdir()
    os.chown(run, 65534, 65534)
    run.chmod(0o700)
    victim = top / "victim"
    victim.write_text("root data\n")
    victim.chmod(0o644)
    (run / "api-key").symlink_to(victim)
    os.lchown(run / "api-key", 65534, 65534)
    for pre in pres:
        argv = systemd_words(pre)
        assert argv[:2] == ["/bin/sh", "-c"] and argv[3:6] == ["sh", "nobody", "nogroup"]
        # The privileged shell only opens the credential (<) and drops to the engine user for the write.
        outer = argv[2]
        assert (
            outer.startswith('exec setpriv --reuid="$1" --regid="$2" --init-groups ')
            and " > " not in outer.split("'")[0]
        )
        argv[6] = argv[6].replace("/run/llmfleet-demo", str(run))
        argv[7] = argv[7].replace("/etc/llmfleet/credentials", str(creds))
        subprocess.run(argv, check=True, timeout=30)
    assert victim.read_text() == "root data\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert victim.stat().st_uid == 0
    for name, value in (("api-key", KEY), ("env-HF_TOKEN", HF)):
        st = (run / name).lstat()
        assert stat.S_ISREG(st.st_mode) and st.st_uid == 65534 and stat.S_IMODE(st.st_mode) == 0o400
        assert (run / name).read_text() == value


def systemd_words(line):
    """The words systemd makes of an Exec line: its quoting is the shell's (double quotes, backslash escapes),
    then $$ and %% stand for $ and % (no variable or specifier is left to expand in our lines)."""
    return [w.replace("$$", "$").replace("%%", "%") for w in shlex.split(line)]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: runs the privileged ExecStartPre")
def test_a_hostile_credentials_path_stays_one_argument_of_the_root_shell(tmp_path, request):
    """Before: `< {{ path }}` sat unquoted inside the root shell's text, so a credentials directory with a space,
    a quote or `;` ran its remainder as root; now every value is an argument of its own."""
    top = Path(tempfile.mkdtemp(prefix="llmfleet-test-"))
    request.addfinalizer(lambda: shutil.rmtree(top, ignore_errors=True))
    top.chmod(0o755)
    canary = top / "canary"
    creds = top / "cred dir 'q' \"d\"; touch canary; $(touch canary) `touch canary` %h"
    rc, out, d = play(tmp_path, llmfleet_api_key=KEY, engine_credential_via="exec_start_pre",
                      engine_credentials_dir=str(creds), llmfleet_user="nobody", llmfleet_group="nogroup")  # fmt: skip
    assert rc == 0, out[-3000:]
    (pre,) = re.findall(r"^ExecStartPre=\+(.*)$", results(d)[1], re.M)
    argv = systemd_words(pre)
    assert argv[3:] == ["sh", "nobody", "nogroup", "/run/llmfleet-demo/api-key", f"{creds}/demo.api-key"], argv
    creds.mkdir(mode=0o700)
    (creds / "demo.api-key").write_text(KEY)
    run = top / "run"
    run.mkdir()
    os.chown(run, 65534, 65534)
    argv[6] = str(run / "api-key")
    subprocess.run(argv, check=True, timeout=30, cwd=top)  # a command run from the path would touch top/canary
    assert (run / "api-key").read_text() == KEY
    assert not canary.exists()
    for tmpl in ("engine.service.j2", "engine-router.service.j2"):  # no other shell line built from text there
        text = (ROLE / "templates" / tmpl).read_text()
        assert "sh -c" not in text.replace("'/bin/sh', '-c'", ""), tmpl


# ---------------------------------------------------------------------------------------------
# Root-run tasks into directories the engine user owns, and getting a unit out of its start limit


def tasks(name):
    return yaml.safe_load((ROLE / "tasks" / name).read_text())


def test_directory_tasks_do_not_follow_links():
    """ansible.builtin.file follows a symlink at path unless follow: false: /var/lib/llmfleet (the
    engine user's) could otherwise turn engine_state_dir into /etc and get it chowned."""
    for f in sorted((ROLE / "tasks").glob("*.yml")):
        for t in yaml.safe_load(f.read_text()) or []:
            args = t.get("ansible.builtin.file")
            if args and args.get("state") == "directory":
                assert args.get("follow") is False, f"{f.name}: {t['name']}"


def test_a_failed_unit_is_reset_before_it_is_started():
    names = [t["name"] for t in tasks("0020-install.yml")]
    reset = next(t for t in tasks("0020-install.yml") if "reset-failed" in str(t.get("ansible.builtin.command")))
    assert names.index(reset["name"]) < names.index(next(n for n in names if n.startswith("Ordered restart")))
    assert "ActiveState" in reset["when"] and "'failed'" in reset["when"]
    assert reset["check_mode"] is False and "ansible_check_mode" in reset["ansible.builtin.command"]["argv"]


def test_credential_tasks_are_no_log():
    for t in tasks("0020-install.yml"):
        text = json.dumps(t)
        if ("llmfleet_api_key }}" in text and "copy" in text) or "item.value" in text:
            assert t.get("no_log") is True, t["name"]


# ---------------------------------------------------------------------------------------------
# vllm_pd: per-host roles, the NIXL side channel, the router unit

PD_PLAY = """
- name: Engine role pieces for a P/D pair on localhost
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

    - name: This node's argv
      ansible.builtin.copy:
        content: "{{ _engine_plan.argv | to_json }}"
        dest: "{{ out_dir }}/{{ inventory_hostname }}.argv.json"
        mode: "0644"

    - name: This node's serving health probe (and the router's)
      ansible.builtin.copy:
        content: "{{ {'engine': _engine_wrapper_args.health, 'router': _engine_wrapper_args.router_health} | to_json }}"
        dest: "{{ out_dir }}/{{ inventory_hostname }}.health.json"
        mode: "0644"

    - name: This node's env file
      ansible.builtin.template:
        src: "{{ role_dir }}/templates/engine.env.j2"
        dest: "{{ out_dir }}/{{ inventory_hostname }}.env"
        mode: "0644"
      vars:
        _engine_facts: {fingerprint: "0123456789abcdef", cache_dir: /mnt/nvme/llmfleet/cache/pd/0123456789abcdef}

    - name: The router unit (on the head)
      ansible.builtin.template:
        src: "{{ role_dir }}/templates/engine-router.service.j2"
        dest: "{{ out_dir }}/llmfleet-pd-router.service"
        mode: "0644"
      vars:
        _engine_router_exec_args: "{{ ['exec'] + _engine_wrapper_args.router_secret + ['--'] + _engine_router_plan.argv }}"
      when: inventory_hostname == _engine_head

    - name: What the gate gets
      ansible.builtin.copy:
        content: "{{ hostvars | llmfleet.fleet.llmfleet_pd_gate_nodes(_engine_nodes) | to_json }}"
        dest: "{{ out_dir }}/gate.json"
        mode: "0644"
      run_once: true
"""
PD_INVENTORY = """
all:
  vars: {ansible_connection: local}
  children:
    llmfleet_nodes:
      hosts:
        pd2: {ansible_host: 10.9.0.2, llmfleet_fabric_ip: 10.0.0.2, engine_pd_role: decode}
      children:
        head:
          hosts:
            pd1: {ansible_host: 10.9.0.1, llmfleet_fabric_ip: 10.0.0.1, engine_pd_role: prefill}
"""
PD_VARS = {"llmfleet_deployment": "pd", "engine_profile": "vllm_pd", "engine_served_model_name": "m",
           "llmfleet_tp_size": 1, "engine_kv_transfer_config": {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}}  # fmt: skip


def pd_play(tmp_path, **extra):
    if "engine_model_path" not in extra:
        for host in ("pd1", "pd2"):
            staged(tmp_path, host)
        extra["engine_model_path"] = str(tmp_path / "models" / "{{ inventory_hostname }}" / "m" / "current")
    # What the topology role writes (the role copies its variables into engine.env, not its comments).
    if "llmfleet_fabric_env" not in extra:
        (tmp_path / "fabric.env").write_text("# WARNING: x\n\nNCCL_SOCKET_IFNAME=eth9\nNCCL_IB_GID_INDEX=3\n")
        extra["llmfleet_fabric_env"] = str(tmp_path / "fabric.env")
    (tmp_path / "play.yml").write_text(PD_PLAY)
    (tmp_path / "inventory.yml").write_text(PD_INVENTORY)
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": f"{bindir}:{os.environ['PATH']}",
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp")}  # fmt: skip
    extra_vars = {**PD_VARS, "out_dir": str(tmp_path), "role_dir": str(ROLE), "ansible_python_interpreter": sys.executable,
                  **extra}  # fmt: skip
    cp = subprocess.run(
        [f"{bindir}/ansible-playbook", "-i", str(tmp_path / "inventory.yml"), str(tmp_path / "play.yml"),
         "-e", json.dumps(extra_vars)],
        capture_output=True, text=True, check=False, timeout=180, cwd=ROOT, env=env,
    )  # fmt: skip
    out = cp.stdout + cp.stderr
    assert "Traceback" not in out, out[-3000:]
    return cp.returncode, " ".join(out.split()), tmp_path


def test_pd_roles_come_from_host_vars_and_each_instance_gets_its_side_channel(default_pd_play):
    rc, out, d = default_pd_play
    assert rc == 0, out[-3000:]
    for host, kv_role in (("pd1", "kv_producer"), ("pd2", "kv_consumer")):
        argv = json.loads((d / f"{host}.argv.json").read_text())
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert kv == {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu", "kv_role": kv_role}
        assert "--nnodes" not in argv and argv[argv.index("--port") + 1] == "8000"
    env1 = (d / "pd1.env").read_text()
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.1\nVLLM_NIXL_SIDE_CHANNEL_PORT=5600\n" in env1
    assert "VLLM_HOST_IP=10.0.0.1" in env1 and "LLMFLEET_PD_ROLE=prefill" in env1 and "UCX_TLS=tcp,cuda_copy" in env1
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.2" in (d / "pd2.env").read_text()
    # Serving health: each instance probes its own API, the head's router wrapper the router.
    for host in ("pd1", "pd2"):
        health = json.loads((d / f"{host}.health.json").read_text())
        assert health["engine"][:4] == ["--health-url", "http://127.0.0.1:8000", "--health-model", "m"], health
    assert json.loads((d / "pd1.health.json").read_text())["router"][:2] == ["--health-url", "http://127.0.0.1:30000"]
    # The gate asks each instance at its SSH address, the router reaches it on the fabric.
    assert [(n["name"], n["rank"], n["api_base"], n["pd_role"]) for n in json.loads((d / "gate.json").read_text())] == [
        ("pd1", 0, "http://10.9.0.1:8000", "prefill"), ("pd2", 1, "http://10.9.0.2:8000", "decode")]  # fmt: skip


def test_pd_router_unit_is_hardened_and_lists_every_instance(tmp_path):
    rc, out, d = pd_play(tmp_path, llmfleet_api_key=KEY, engine_credential_via="exec_start_pre",
                         engine_pd_router_command=["/opt/v/bin/vllm-router"], engine_pd_router_extra_args=["--policy", "round_robin"])  # fmt: skip
    assert rc == 0, out[-3000:]
    unit = (d / "llmfleet-pd-router.service").read_text()
    exec_line = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1)
    assert exec_line == (
        "/usr/local/bin/llmfleet exec --secret-env OPENAI_API_KEY=api-key -- /opt/v/bin/vllm-router --vllm-pd-disaggregation "
        "--host 0.0.0.0 --port 30000 --prefill http://10.0.0.1:8000 --decode http://10.0.0.2:8000 "
        "--worker-startup-timeout-secs 3600 --worker-startup-check-interval 2 --policy round_robin"
    )  # fmt: skip
    for line in ("Type=notify", "User=llmfleet", "NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes",
                 "KillMode=mixed", "Restart=on-failure", "TimeoutStopSec=120", "TimeoutStartSec=3660",
                 "ReadWritePaths=/var/lib/llmfleet/engine/pd -/var/lib/node_exporter/textfile_collector",
                 "After=network-online.target",
                 "Environment=CREDENTIALS_DIRECTORY=/run/llmfleet-pd-router"):  # fmt: skip
        assert re.search(rf"^{re.escape(line)}$", unit, re.M), line
    # Not ordered after the instance: its start job would wait for the instance's READY, the router
    # meanwhile "inactive" and the gate failing on it (found in the lab).
    assert "llmfleet-pd.service" not in "".join(re.findall(r"^(?:After|Requires|BindsTo)=.*$", unit, re.M))
    # The key: a credential copied by the engine user, handed over by the wrapper, never in the unit or argv.
    assert "/etc/llmfleet/credentials/pd.api-key" in unit and KEY not in unit and KEY not in out
    # vllm-router checks no key: on every address it is a warning even with llmfleet_api_key.
    assert "WARNING: pd1 serves the P/D router of pd on 0.0.0.0:30000, and vllm-router does not check API keys" in out
    assert "the router holds it and answers any caller" in out


def test_pd_router_on_every_address_is_an_error_when_keys_are_required(tmp_path):
    rc, out, _ = pd_play(tmp_path, llmfleet_api_key=KEY, engine_require_api_key=True)
    assert rc == 2 and "vllm-router checks no API key, and engine_require_api_key is true" in out, out[-3000:]
    rc, out, _ = pd_play(tmp_path, llmfleet_api_key=KEY, engine_require_api_key=True, engine_pd_router_host="10.0.0.1")
    assert rc == 0 and "serves the P/D router" not in out, out[-3000:]


@pytest.mark.parametrize(
    ("extra", "text"),
    [
        (
            {"engine_kv_transfer_config": {"kv_role": "kv_both"}},
            "engine_kv_transfer_config.kv_role=kv_both contradicts",
        ),
        (
            {"engine_pd_router_port": 8000},
            "engine_pd_router_port (8000, the router on the head) and engine_pd_side_channel_port",
        ),
        (
            {"engine_pd_role": "prefill"},
            "needs at least one node with engine_pd_role=prefill and one with decode in the play",
        ),
    ],
    ids=["kv-role", "router-port", "no-decode"],
)
def test_pd_plan_errors(tmp_path, extra, text):
    rc, out, _ = pd_play(tmp_path, **extra)
    assert rc == 2 and text in out, out[-3000:]


def test_pd_env_starts_with_a_copy_of_the_fabric_env(default_pd_play):
    """A node restarting alone must keep its peers' NCCL environment: the unit reads a copy, not fabric.env."""
    rc, out, d = default_pd_play
    assert rc == 0, out[-3000:]
    env = (d / "pd1.env").read_text()
    assert "\nNCCL_SOCKET_IFNAME=eth9\nNCCL_IB_GID_INDEX=3\n" in env and "WARNING: x" not in env
    assert env.index("NCCL_SOCKET_IFNAME") < env.index("LLMFLEET_DEPLOYMENT")  # the deployment's own values win


def test_the_unit_loads_the_revision_directory_never_current(default_play):
    rc, out, d = default_play
    assert rc == 0, out[-3000:]
    _, unit = results(d)
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert f"/models/node/m/{REV_A}" in exec_start and "current" not in exec_start, exec_start
    assert "EnvironmentFile=/etc/llmfleet/fabric.env" not in unit  # the deployment env holds a copy


def test_the_unit_loads_the_contracts_revision_with_no_model_path_given(tmp_path):
    """The fleet contract's model and revision are enough: the unit names <root>/<model>/<revision>, where staging
    publishes it (a `current` link pointing elsewhere changes nothing), and no deprecation is said."""
    mdir = staged(tmp_path, rev=REV_B)  # current -> REV_B; the contract pins REV_A
    (mdir / REV_A).mkdir()
    rc, out, d = play(tmp_path, engine_model_path="", llmfleet_model="m", llmfleet_model_revision=REV_A,
                      llmfleet_model_root=str(mdir.parent))  # fmt: skip
    assert rc == 0, out[-3000:]
    _, unit = results(d)
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert f"{mdir}/{REV_A}" in exec_start and REV_B not in exec_start, exec_start
    assert "DEPRECATED" not in out


def test_check_mode_does_not_pretend_a_revision_no_play_of_the_run_stages(tmp_path):
    """engine.yml --check alone on a node without the revision: no model_stage play predicted it, so the check
    fails as the real run would, naming the directory and the nodes."""
    root = tmp_path / "empty-nvme"
    rc, out, _ = play(tmp_path, ansible_args=["--check"], engine_model_path="", llmfleet_model="m",
                      llmfleet_model_revision=REV_A, llmfleet_model_root=str(root))  # fmt: skip
    assert rc != 0
    assert f"the model directory {root}/m/{REV_A} does not exist on localhost: stage the model there first" in out, out[
        -3000:
    ]
    # ... and where the model_stage play of the same --check run predicted it (its fact), the plan goes on with it
    rc, out, _ = play(tmp_path, ansible_args=["--check"], engine_model_path="", llmfleet_model="m",
                      llmfleet_model_revision=REV_A, llmfleet_model_root=str(root),
                      model_stage_check_publishes=f"{root}/m/{REV_A}")  # fmt: skip
    assert rc == 0, out[-3000:]
    assert f"check mode: localhost do not hold {root}/m/{REV_A} yet" in out, out[-3000:]


def test_no_model_at_all_is_named_before_anything_runs(tmp_path):
    rc, out, _ = play(tmp_path, engine_model_path="")
    assert rc != 0
    assert "no model to load: set llmfleet_model and llmfleet_model_revision" in out, out[-3000:]


def test_a_model_path_through_current_still_works_with_a_deprecation(default_play):
    rc, out, _ = default_play
    assert rc == 0, out[-3000:]
    assert "DEPRECATED: engine_model_path=" in out and "goes through the `current` link" in out, out[-3000:]


def test_nodes_that_would_load_different_revisions_are_refused(tmp_path):
    staged(tmp_path, "pd1", REV_A)
    staged(tmp_path, "pd2", REV_B)
    rc, out, _ = pd_play(
        tmp_path, engine_model_path=str(tmp_path / "models" / "{{ inventory_hostname }}" / "m" / "current")
    )
    assert rc != 0
    assert "the nodes would load different revisions" in out, out[-3000:]
    assert f"pd1 -> {tmp_path}/models/pd1/m/{REV_A}" in out and f"pd2 -> {tmp_path}/models/pd2/m/{REV_B}" in out, out[
        -3000:
    ]


def test_a_model_path_missing_on_a_node_is_named(tmp_path):
    staged(tmp_path, "pd1", REV_A)
    rc, out, _ = pd_play(
        tmp_path, engine_model_path=str(tmp_path / "models" / "{{ inventory_hostname }}" / "m" / "current")
    )
    assert rc != 0
    assert f"{tmp_path}/models/{{{{ inventory_hostname }}}}/m/current does not exist on pd2" in out or (
        "does not exist on pd2: stage the model there first" in out
    ), out[-3000:]


# A standalone engine.yml run: nothing has discovered the topology yet, so the plan's own topology include must
# come before the command line is rendered (it once came after, and the NUMA flags were rendered without facts).
PLAN_ALONE = """
- name: The engine plan with no topology discovered yet
  hosts: all
  gather_facts: false
  tasks:
    - name: Plan (the role's first tasks)
      ansible.builtin.include_role:
        name: engine
        tasks_from: 0010-plan.yml
        public: true

    - name: The command line
      ansible.builtin.copy:
        content: "{{ _engine_plan.argv | to_json }}"
        dest: "{{ out_dir }}/argv.json"
        mode: "0644"
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the topology role writes fabric.env as root")
def test_a_standalone_plan_binds_numa_from_the_topology_it_discovers_first(tmp_path):
    from tests.helpers.fakesys import FakeSys

    # 8 GPUs, 0-3 on NUMA node 0 and 4-7 on node 1, no HCA (the socket fallback); the fabric IP is localhost's
    # own (the module reads addresses from the host, interfaces from the fake sysfs).
    fs = FakeSys(tmp_path / "sys")
    for numa in (0, 1):
        fs.numa(numa, f"{numa * 8}-{numa * 8 + 7}")
    for g in range(8):
        numa, bus = g // 4, 0x17 + g * 0x10
        rc, rp = f"pci0000:{bus - 2:02x}", f"0000:{bus - 2:02x}:01.0"
        fs.gpu([rc, rp, f"0000:{bus:02x}:00.0"], numa, f"{numa * 8}-{numa * 8 + 7}")
    fs.netdev("lo", None, mac="00:00:00:00:00:00")
    rc, out, _ = play(tmp_path, playbook=PLAN_ALONE, engine_profile="sglang", llmfleet_tp_size=8,
                      topology_sysfs_root=str(tmp_path / "sys"), topology_use_nvml=False,
                      llmfleet_fabric_env=str(tmp_path / "etc/fabric.env"),
                      llmfleet_report_dir=str(tmp_path / "reports"))  # fmt: skip
    assert rc == 0, out[-3000:]
    argv = json.loads((tmp_path / "argv.json").read_text())
    i = argv.index("--numa-node")
    assert argv[i + 1 : i + 9] == ["0", "0", "0", "0", "1", "1", "1", "1"], argv


@pytest.mark.skipif(os.geteuid() != 0, reason="the topology role writes fabric.env as root")
@pytest.mark.skipif(os.path.exists("/usr/bin/numactl"), reason="needs a host without numactl")
def test_every_failing_plan_check_is_named_at_once(tmp_path):
    """The launch plan's checks are one task: a GPU list given twice, vLLM's NUMA binding without numactl and a key
    on the command line are all named in its one failure (the values never)."""
    from tests.helpers.fakesys import FakeSys

    fs = FakeSys(tmp_path / "sys")
    for numa in (0, 1):
        fs.numa(numa, f"{numa * 8}-{numa * 8 + 7}")
    for g in range(2):  # GPU 0 on NUMA node 0, GPU 1 on node 1: vLLM gets --numa-bind
        bus = 0x17 + g * 0x80
        fs.gpu(
            [f"pci0000:{bus - 2:02x}", f"0000:{bus - 2:02x}:01.0", f"0000:{bus:02x}:00.0"], g, f"{g * 8}-{g * 8 + 7}"
        )
    fs.netdev("lo", None, mac="00:00:00:00:00:00")
    rc, out, _ = play(tmp_path, playbook=PLAN_ALONE, engine_profile="vllm", llmfleet_tp_size=2, llmfleet_gpus=[0, 1],
                      engine_env={"CUDA_VISIBLE_DEVICES": "0,1"}, engine_extra_args=["--api-key", KEY],
                      topology_sysfs_root=str(tmp_path / "sys"), topology_use_nvml=False,
                      llmfleet_fabric_env=str(tmp_path / "etc/fabric.env"),
                      llmfleet_report_dir=str(tmp_path / "reports"))  # fmt: skip
    assert rc == 2, out[-3000:]
    msg = out[out.index("Check the launch plan") :]
    assert "localhost: engine_env sets CUDA_VISIBLE_DEVICES and llmfleet_gpus names the GPUs: drop it" in msg, msg[
        :3000
    ]
    assert "/usr/bin/numactl is missing: install it" in msg and "engine_numa_bind: 'off'" in msg, msg[:3000]
    assert "the engine command line carries --api-key: set llmfleet_api_key instead" in msg, msg[:3000]
    assert KEY not in out


def test_pd_ports_that_clash_and_a_refused_open_router_are_named(tmp_path):
    rc, out, _ = pd_play(tmp_path, engine_pd_side_channel_port=8000, engine_require_api_key=True,
                         llmfleet_api_key=KEY)  # fmt: skip
    assert rc == 2, out[-3000:]
    assert "engine_pd_side_channel_port (8000, NIXL) must differ from the instance's API port 8000 (engine_port)" in out
    rc, out, _ = pd_play(tmp_path, engine_require_api_key=True, llmfleet_api_key=KEY)
    assert rc == 2, out[-3000:]
    assert "pd1 would serve the P/D router of pd on 0.0.0.0:30000, vllm-router checks no API key" in out, out[-3000:]
    assert KEY not in out
