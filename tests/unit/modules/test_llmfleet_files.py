"""llmfleet_files: a role's directories and small files in one module run - created, corrected, left alone when
right; check mode changing nothing; a diff of what a file becomes; links never written or read through."""

import grp
import os
import pwd
import stat

import pytest

import llmfleet_files as mod
from tests.unit.modules.util import fail, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")

USER, GROUP = pwd.getpwuid(os.geteuid()).pw_name, grp.getgrgid(os.getegid()).gr_name


def spec(tmp_path, content="A=1\n"):
    return {"directories": [{"path": str(tmp_path / "etc" / "engine"), "owner": USER, "group": GROUP, "mode": "0755"},
                            {"path": str(tmp_path / "var" / "d"), "owner": USER, "group": GROUP, "mode": "0750"}],
            "files": [{"path": str(tmp_path / "etc" / "engine" / "x.env"), "content": content}]}  # fmt: skip


def test_created_then_left_alone_then_corrected(tmp_path):
    res = run(mod, spec(tmp_path))
    env = tmp_path / "etc" / "engine" / "x.env"
    assert res["changed_paths"] == [str(tmp_path / "etc" / "engine"), str(tmp_path / "var" / "d"), str(env)]
    assert env.read_text() == "A=1\n" and stat.S_IMODE(env.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "var" / "d").stat().st_mode) == 0o750 and not undocumented(mod, res)
    again = run(mod, spec(tmp_path))
    assert again["changed"] is False and again["changed_paths"] == []
    os.chmod(env, 0o666)
    assert run(mod, spec(tmp_path))["changed_paths"] == [str(env)]
    assert stat.S_IMODE(env.stat().st_mode) == 0o644
    assert run(mod, spec(tmp_path, "A=2\n"))["changed_paths"] == [str(env)] and env.read_text() == "A=2\n"


def test_check_mode_changes_nothing_and_diff_shows_the_new_content(tmp_path):
    res = run(mod, {**spec(tmp_path), "_ansible_diff": True}, check=True)
    assert len(res["changed_paths"]) == 3 and not (tmp_path / "etc").exists()
    assert res["diff"] == [{"before_header": str(tmp_path / "etc" / "engine" / "x.env"),
                            "after_header": str(tmp_path / "etc" / "engine" / "x.env"), "before": "",
                            "after": "A=1\n"}]  # fmt: skip
    run(mod, spec(tmp_path))
    res = run(mod, {**spec(tmp_path, "A=2\n"), "_ansible_diff": True})
    assert (res["diff"][0]["before"], res["diff"][0]["after"]) == ("A=1\n", "A=2\n")
    assert "diff" not in run(mod, {**spec(tmp_path, "A=2\n"), "_ansible_diff": True})  # unchanged: no diff


def test_a_link_at_a_file_name_is_replaced_and_its_target_neither_read_nor_written(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("do not show\n")
    (tmp_path / "etc" / "engine").mkdir(parents=True)
    (tmp_path / "etc" / "engine" / "x.env").symlink_to(secret)
    res = run(mod, {**spec(tmp_path), "_ansible_diff": True})
    assert res["diff"][0]["before"] == "" and secret.read_text() == "do not show\n"
    assert not (tmp_path / "etc" / "engine" / "x.env").is_symlink()


def test_a_directory_link_another_user_planted_is_refused(tmp_path):
    (tmp_path / "var").mkdir()
    os.chmod(tmp_path / "var", 0o1777)  # a directory anybody can write, like /tmp
    os.symlink("/etc", tmp_path / "var" / "d")
    os.lchown(tmp_path / "var" / "d", 65534, 65534)  # the link belongs to nobody, not root
    res = fail(mod, spec(tmp_path))
    assert "root does not follow symlinks another user could have planted" in res["msg"]
    assert res["changed_paths"] == [str(tmp_path / "etc" / "engine")]


@pytest.mark.parametrize(
    ("over", "text"),
    [({"mode": "rw-r--r--"}, "is not an octal mode"), ({"owner": "no-such-user-x"}, "does not exist on this node")],
)
def test_bad_entries_are_named(tmp_path, over, text):
    args = spec(tmp_path)
    args["directories"][1].update(over)
    res = fail(mod, args)
    assert text in res["msg"] and str(tmp_path / "var" / "d") in res["msg"]
