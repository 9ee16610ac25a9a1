"""llmfleet_engine_probe: one read of the node state the engine role plans from."""

import json
import os

import pytest

import llmfleet_engine_probe as mod
from tests.unit.modules.util import fail, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")


def node(tmp_path):
    """A node as the engine role finds it: a staged revision behind `current`, two claims (one ours), fabric.env,
    credentials of this deployment and of another one."""
    models = tmp_path / "models/m"
    (models / ("a" * 40)).mkdir(parents=True)
    (models / "current").symlink_to("a" * 40)
    claims = tmp_path / "gpus"
    claims.mkdir()
    (claims / "demo.json").write_text(json.dumps({"deployment": "demo", "gpus": [0]}))
    (claims / "left.json").write_text(json.dumps({"deployment": "left", "gpus": [1], "ports": {"api": 30010}}))
    (claims / "notes.txt").write_text("not a claim")
    (tmp_path / "fabric.env").write_text("# topology\nNCCL_SOCKET_IFNAME=eth0\n")
    creds = tmp_path / "credentials"
    creds.mkdir()
    for name in ("demo.api-key", "demo.env-HF_TOKEN", "demolition.env-X", "other.api-key"):
        (creds / name).write_text("secret")
    return {"model_path": str(models / "current"), "claim_dir": str(claims), "claim_path": str(claims / "demo.json"),
            "fabric_env": str(tmp_path / "fabric.env"), "credentials_dir": str(creds), "deployment": "demo"}  # fmt: skip


@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_one_call_reads_the_revision_the_other_claims_fabric_env_and_this_deployments_credentials(tmp_path, check):
    args = node(tmp_path)
    r = run(mod, args, check=check)
    assert r["changed"] is False and not undocumented(mod, r)
    assert r["model"] == {"present": True, "dir": str(tmp_path / "models/m" / ("a" * 40))}
    assert r["claims"] == [{"deployment": "left", "gpus": [1], "ports": {"api": 30010}}]  # not our own, not notes.txt
    assert r["fabric_env"] == "# topology\nNCCL_SOCKET_IFNAME=eth0\n"
    creds = tmp_path / "credentials"
    assert r["credentials"] == [str(creds / "demo.api-key"), str(creds / "demo.env-HF_TOKEN")]  # not demolition's
    assert r["numactl"] == os.path.exists("/usr/bin/numactl")
    assert "router_unit_file" not in r


def test_a_fresh_node_has_nothing_yet_and_that_is_no_error(tmp_path):
    args = {"model_path": str(tmp_path / "models/m/current"), "claim_dir": str(tmp_path / "gpus"),
            "claim_path": str(tmp_path / "gpus/demo.json"), "fabric_env": str(tmp_path / "fabric.env"),
            "credentials_dir": str(tmp_path / "credentials"), "deployment": "demo",
            "router_unit": "llmfleet-demo-router.service"}  # fmt: skip
    r = run(mod, args)
    assert r["model"]["present"] is False and r["claims"] == [] and r["credentials"] == []
    assert r["fabric_env"] is None  # the install stage names the missing file (0020-install.yml)
    assert r["router_unit_file"] is False


def test_a_dangling_current_is_not_a_model(tmp_path):
    args = node(tmp_path)
    os.rmdir(tmp_path / "models/m" / ("a" * 40))
    assert run(mod, args)["model"]["present"] is False


def test_a_router_unit_left_behind_is_seen(tmp_path, monkeypatch):
    args = node(tmp_path)
    units = tmp_path / "units"
    units.mkdir()
    (units / "llmfleet-demo-router.service").write_text("[Unit]\n")
    monkeypatch.setattr(mod, "UNIT_DIR", str(units))
    assert run(mod, {**args, "router_unit": "llmfleet-demo-router.service"})["router_unit_file"] is True


def test_a_damaged_claim_is_named_and_a_planted_link_is_not_read(tmp_path):
    args = node(tmp_path)
    (tmp_path / "gpus/broken.json").write_text("{not json")
    r = fail(mod, args)
    assert "gpus/broken.json is not a JSON object: remove it if its deployment is gone" in r["msg"]
    (tmp_path / "gpus/broken.json").unlink()
    (tmp_path / "gpus/link.json").symlink_to(tmp_path / "gpus/left.json")
    assert len(run(mod, args)["claims"]) == 1  # only regular files are claims
    os.unlink(args["fabric_env"])
    os.symlink("/etc/hostname", args["fabric_env"])
    assert "fabric.env" in fail(mod, args)["msg"]  # never read through a link


def test_it_says_whether_the_engine_account_exists_yet(tmp_path):
    """A --check run of site.yml on a fresh node: the base role has not made the account yet, and the engine role
    says what it would install instead of failing on it."""
    import getpass

    args = node(tmp_path)
    assert run(mod, {**args, "engine_user": getpass.getuser()})["engine_user_exists"] is True
    r = run(mod, {**args, "engine_user": "llmfleet-no-such-account"})
    assert r["engine_user_exists"] is False and not undocumented(mod, r)
    assert "engine_user_exists" not in run(mod, args)
