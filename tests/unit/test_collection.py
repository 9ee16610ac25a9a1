"""The collection llmfleet.fleet as a site gets it: `ansible-galaxy collection build` on what a clean clone holds
(the tracked and not-ignored files of this checkout, links kept as links), the artifact's size and contents, then
`ansible-galaxy collection install` into an empty collections path and Ansible run from a directory with no llmfleet
ansible.cfg, no ANSIBLE_* settings and no checkout in sight: ansible-doc of a module, a role and the run callback,
playbooks by FQCN (syntax, roles found, a run without an inventory told what to do), our filters and a module run by
FQCN. One build and one install for the module. The lab's run of site.yml from the installed collection as `ops`:
tests/integration/test_collection.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from tests.helpers import collection

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CORE = "2.19"
# "A few MiB": the artifact is about 0.7 MiB (2026-12-04); the package, roles and docs could triple before this trips.
MAX_BYTES = 5 * 2**20

# What never ships: the lab, the tests (but tests/sanity, read by ansible-test where the collection is installed),
# venvs, benchmarks, measurements, reports, the checkout's configuration and its top-level links into plugins/.
FORBIDDEN = [
    r"tests/(?!sanity(/|$))",
    r"bench/",
    r"reports/",
    r"docs/measurements/",
    r"inventory/(lab|overlays|device-h200)/",
    r"roles/[^/]+/molecule/",
    r"collections/",
    r"(library|module_utils|action_plugins|filter_plugins|doc_fragments)(/|$)",
    r"playbooks/callback_plugins(/|$)",
    r"\.(venv|venv-vllm|git|whl|ci|config|pytest_cache|ruff_cache)(/|$)",
    r"(.*/)?__pycache__/",
    r".*\.pyc$",
    r"ansible\.cfg$",
    r"Makefile$",
    r"pyproject\.toml$",
    r"llmfleet\.egg-info/",
    r".*\.tar\.gz$",
]


def _galaxy() -> dict:
    return yaml.safe_load((ROOT / "galaxy.yml").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(artifact, installed collection dir, a site's env, a work dir outside the checkout)."""
    base = tmp_path_factory.mktemp("collection")
    artifact, installed = collection.build_and_install(base)
    home, work = base / "home", base / "work"
    for d in (home, work):
        d.mkdir()
    return artifact, installed, collection.site_env(installed.parents[2], home=str(home)), work


def _ansible(tool: str, args: list[str], built, check: bool = True) -> subprocess.CompletedProcess:
    _, _, env, work = built
    r = subprocess.run([str(BIN / tool), *args], check=False, cwd=work, env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    if check:
        assert r.returncode == 0, f"{tool} {' '.join(args)}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def test_version_is_pyprojects():
    """galaxy.yml and pyproject.toml carry one version (the collection and the CLI's package are the same code)."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert str(_galaxy()["version"]) == pyproject["project"]["version"]


def test_galaxy_names_the_collection():
    g = _galaxy()
    assert (g["namespace"], g["name"]) == ("llmfleet", "fleet")
    runtime = yaml.safe_load((ROOT / "meta/runtime.yml").read_text(encoding="utf-8"))
    assert re.match(rf">={re.escape(CORE)}(\.0)?(,|$)", runtime["requires_ansible"]), runtime["requires_ansible"]
    # ansible-test sanity (make sanity) reads the ignore file of the running ansible-core's version.
    assert (ROOT / "tests/sanity" / f"ignore-{CORE}.txt").is_file()


def test_artifact_is_small(built):
    size = built[0].stat().st_size
    assert size < MAX_BYTES, f"{built[0].name} is {size / 2**20:.1f} MiB: what grew? (tar tzvf | sort -k3 -n)"


def test_artifact_ships_no_lab_tests_venvs_or_links(built):
    with tarfile.open(built[0]) as tar:
        members = tar.getmembers()
    links = [m.name for m in members if m.issym() or m.islnk()]
    assert not links, f"links in the artifact (build_ignore them; the checkout's links into plugins/): {links}"
    names = [m.name.removeprefix("./") for m in members]
    bad = sorted(n for n in names if any(re.match(p, n) for p in FORBIDDEN))
    assert not bad, f"galaxy.yml's build_ignore lets these ship: {bad[:20]}"


def test_artifact_ships_every_plugin_role_and_playbook(built):
    """build_ignore drops nothing users need: every tracked plugin, role file and playbook is in the artifact."""
    with tarfile.open(built[0]) as tar:
        names = {m.name.removeprefix("./") for m in tar.getmembers() if m.isfile()}
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "plugins", "roles", "playbooks", "meta"],
                             check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
    wanted = {
        p for p in tracked
        if not re.match(r"roles/[^/]+/molecule/|playbooks/callback_plugins/", p) and (ROOT / p).is_file()
        and not (ROOT / p).is_symlink()
    }  # fmt: skip
    assert wanted - names == set()
    for must in ("plugins/modules/llmfleet_model_stage.py", "plugins/callback/llmfleet_run.py",
                 "playbooks/site.yml", "meta/runtime.yml", "LICENSE", "README.md", f"tests/sanity/ignore-{CORE}.txt"):  # fmt: skip
        assert must in names
    manifest = json.loads((built[1] / "MANIFEST.json").read_text())
    assert manifest["collection_info"]["version"] == _galaxy()["version"]


def test_ansible_doc_of_module_role_and_callback(built):
    out = _ansible("ansible-doc", ["llmfleet.fleet.llmfleet_model_stage"], built).stdout
    assert "llmfleet.fleet.llmfleet_model_stage" in out and str(built[1]) in out
    out = _ansible("ansible-doc", ["-t", "role", "llmfleet.fleet.engine"], built).stdout
    assert "ENTRY POINT: main" in re.sub(r"\x1b\[[0-9;]*m", "", out)
    out = _ansible("ansible-doc", ["-t", "callback", "llmfleet.fleet.llmfleet_run"], built).stdout
    assert "run record" in out
    listed = _ansible("ansible-doc", ["-l", "llmfleet.fleet", "--json"], built).stdout
    assert set(json.loads(listed)) == {f"llmfleet.fleet.{p.stem}" for p in (ROOT / "plugins/modules").glob("*.py")}


@pytest.mark.parametrize("inventory", [True, False], ids=["with-inventory", "without-inventory"])
def test_every_playbook_syntax_checks_by_fqcn(built, inventory):
    """Every playbook by FQCN, as a site runs them: the roles they name (short names) are the collection's."""
    installed, work = built[1], built[3]
    args = []
    if inventory:
        (work / "hosts.yml").write_text("llmfleet_nodes:\n  hosts:\n    node1:\n    node2:\n", encoding="utf-8")
        args = ["-i", str(work / "hosts.yml")]
    books = sorted(p.stem for p in (installed / "playbooks").glob("*.yml"))
    assert "site" in books
    r = _ansible("ansible-playbook", [*args, "--syntax-check", *[f"llmfleet.fleet.{b}" for b in books]], built)
    assert f"playbook: {installed}/playbooks/site.yml" in r.stdout


def test_roles_resolve_in_the_collection_not_a_roles_path(built, tmp_path):
    """A site's own role named like ours (`engine`) on its roles path does not replace the collection's in the
    collection's playbooks: short role names in a collection's playbook look in that collection first."""
    decoy = tmp_path / "roles" / "engine" / "tasks"
    decoy.mkdir(parents=True)
    (decoy / "main.yml").write_text("- name: The site's own engine role\n  ansible.builtin.meta: noop\n")
    _, _, env, work = built
    (work / "two.yml").write_text("llmfleet_nodes:\n  hosts:\n    node1:\n", encoding="utf-8")
    r = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(work / "two.yml"), "--list-tasks", "llmfleet.fleet.engine"],
        check=False, cwd=work, env={**env, "ANSIBLE_ROLES_PATH": str(tmp_path / "roles")}, capture_output=True,
        text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "The site's own engine role" not in r.stdout
    assert "engine : " in r.stdout, r.stdout[-2000:]


def test_a_run_without_inventory_says_what_to_do(built):
    r = _ansible("ansible-playbook", ["llmfleet.fleet.site"], built, check=False)
    assert r.returncode != 0
    assert "No node in the group llmfleet_nodes: pass your inventory with -i" in r.stdout


def test_a_run_of_the_installed_collection_names_its_report_dir(built):
    """The default report directory (beside the playbooks) would be inside the installed collection."""
    work = built[3]
    (work / "nodes.yml").write_text("llmfleet_nodes:\n  hosts:\n    node1:\n", encoding="utf-8")
    r = _ansible("ansible-playbook", ["-i", str(work / "nodes.yml"), "llmfleet.fleet.site"], built, check=False)
    assert r.returncode != 0
    assert "set llmfleet_report_dir" in r.stdout


def test_filters_and_a_module_by_fqcn_from_the_installed_collection(built):
    """The filter plugins and a module (with the package it imports from the collection's module_utils, sent by
    AnsiballZ) run from the installed collection."""
    work = built[3]
    play = work / "fqcn.yml"
    play.write_text(
        """- name: Filters and a module of llmfleet.fleet
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Filters
      ansible.builtin.assert:
        that:
          - "{'a': '10.0.0.1', 'b': '10.0.0.1', 'c': '10.0.0.2'} | llmfleet.fleet.llmfleet_duplicates == {'10.0.0.1': ['a', 'b']}"
          - "'main' | llmfleet.fleet.llmfleet_revision_problem is search('llmfleet_model_revision')"
    - name: A module
      llmfleet.fleet.llmfleet_node_info:
        nvme_path: /tmp
        shared_path: /tmp
      vars:
        ansible_python_interpreter: "{{ ansible_playbook_python }}"
      register: info
    - name: Its result
      ansible.builtin.assert:
        that: info.node.cpus | int > 0
""",
        encoding="utf-8",
    )
    _ansible("ansible-playbook", ["-i", "localhost,", "-c", "local", str(play)], built)


def test_roles_reach_only_into_the_collection(built):
    """The roles' paths outside themselves (the runtime the base role ships, the package acceptance runs on the
    ops host) point into the installed collection, and no role names tests/ or bench/ of the checkout."""
    installed = built[1]
    base = yaml.safe_load((installed / "roles/base/defaults/main.yml").read_text())["base_runtime_src"]
    assert base == "{{ role_path }}/../../plugins/module_utils/llmfleet"
    assert (installed / "roles/base/../../plugins/module_utils/llmfleet/__init__.py").resolve().is_file()
    escapes = []
    for f in (installed / "roles").rglob("*"):
        if f.suffix in (".yml", ".j2") and f.is_file():
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                for m in re.finditer(r"(role_path|playbook_dir)\s*\}\}(/[^\s\"'}]*)", line):
                    target = m.group(2)
                    # The report directory's default beside the playbooks: inventory_check.yml stops a run of the
                    # installed collection that does not set llmfleet_report_dir (a test above).
                    allowed = (
                        r"/\.\./\.\./plugins/module_utils(/|$)" if m.group(1) == "role_path" else r"/\.\./reports$"
                    )
                    if target.startswith("/../") and not re.match(allowed, target):
                        escapes.append(f"{f.relative_to(installed)}:{n}: {m.group(0)}")
                if re.search(r"\b(tests|bench)/", line) and "lookup(" in line:
                    escapes.append(f"{f.relative_to(installed)}:{n}: {line.strip()}")
    assert escapes == []


def _tasks(items, env=None):
    """(task, the environment it runs with) for every task under items (blocks, rescue, always)."""
    for t in items or []:
        if not isinstance(t, dict):
            continue
        here = {**(env or {}), **(t.get("environment") or {})}
        if any(k in t for k in ("block", "rescue", "always")):
            for k in ("block", "rescue", "always"):
                yield from _tasks(t.get(k), here)
        else:
            yield t, here


def test_the_package_runs_from_beside_the_roles_on_the_ops_host():
    """Tasks that run the llmfleet package on the ops host (`python -m llmfleet accept|report|status|bundle|why`)
    take it from the collection (PYTHONPATH <collection>/plugins/module_utils), not from whatever `llmfleet` the ops
    host's Python may have: a site that installs only the collection has none, and a pip-installed one can be
    another version than the roles."""
    files = sorted((ROOT / "roles").glob("*/tasks/*.yml")) + sorted((ROOT / "playbooks").glob("*.yml"))
    runs, wrong = 0, []
    for f in files:
        doc = yaml.safe_load(f.read_text(encoding="utf-8")) or []
        plays = doc if f.parent.name == "playbooks" else [{"tasks": doc}]
        for play in plays:
            if not isinstance(play, dict):
                continue
            for task, env in _tasks(play.get("tasks"), play.get("environment")):
                text = json.dumps({k: task.get(k) for k in ("ansible.builtin.command", "vars")})
                if not re.search(r"'-m', 'llmfleet'|\"-m\", \"llmfleet\"|_oncall_argv", text):
                    continue
                if "_oncall_argv" in text and "ansible.builtin.command" not in task:
                    continue
                runs += 1
                if not re.search(
                    r"(role_path|playbook_dir) \}\}/(\.\./)+plugins/module_utils$", env.get("PYTHONPATH", "")
                ):
                    wrong.append(f"{f.relative_to(ROOT)}: {task.get('name')}")
    assert runs >= 5  # acceptance, report, status, bundle (bundle and why)
    assert wrong == []


def test_installs_from_a_requirements_file_as_docs_say(tmp_path):
    """A site's requirements.yml naming a clone (`type: dir`, as docs/install.md shows) installs the same collection:
    build_ignore applies, no links."""
    src = tmp_path / "llmfleet"
    collection.clean_clone(src)
    req = tmp_path / "requirements.yml"
    req.write_text(f"---\ncollections:\n  - name: {src}\n    type: dir\n", encoding="utf-8")
    dest = tmp_path / "collections"
    env = collection.site_env(dest, home=str(tmp_path))
    r = subprocess.run([str(BIN / "ansible-galaxy"), "collection", "install", "-r", str(req), "-p", str(dest)],
                       check=False, cwd=tmp_path, env=env, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    installed = dest / "ansible_collections" / "llmfleet" / "fleet"
    assert (installed / "plugins/modules/llmfleet_model_stage.py").is_file()
    assert [p for p in installed.rglob("*") if p.is_symlink()] == []
    assert not (installed / "tests/unit").exists() and not (installed / "library").exists()
