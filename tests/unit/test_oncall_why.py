"""`llmfleet why` without --bundle: a bundle collected from the inventory's (fake) nodes into a private temporary
directory, then the same triage; with --bundle: the bundle on disk; never both."""

from __future__ import annotations

import argparse
import json
import tempfile

from test_oncall_fakes import three_nodes

from llmfleet.oncall import why as oncall_why


def _why(f, capsys, *argv: str) -> tuple[int, str, str]:
    p = argparse.ArgumentParser()
    oncall_why.add_arguments(p)
    rc = oncall_why.run(p.parse_args(["-i", str(f.inventory), *argv]), transport=f.transport())
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_collects_then_names_the_failed_node(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the private bundle goes
    f = three_nodes(tmp_path)
    for n in f.names:
        f.journal(n, f"2026-11-29T10:00:00+0000 {n} llmfleet-demo[1]: hello\n")
        f.kernel(n, f"2026-11-29T10:00:01+0000 {n} kernel: eth0: link up\n")
    f.record("node2", verdict="exit-code")
    rc, out, err = _why(f, capsys, "--json")
    report = json.loads(out)
    assert rc == 1 and report["failed"] and report["first_failure"]["node"] == "node2", out[-2000:]
    assert "WARNING" not in err, err  # Ansible's display is happy with the captured stdout
    assert report["bundle"].startswith(f"{tmp_path}/llmfleet-why-")
    assert not list(tmp_path.glob("llmfleet-why-*"))  # and it is gone


def test_keep_leaves_the_bundle(tmp_path, capsys):
    f = three_nodes(tmp_path)
    keep = tmp_path / "kept"
    _, out, _ = _why(f, capsys, "-o", str(keep))
    assert (keep / "bundle.json").is_file() and f"(the bundle is kept in {keep})" in out


def test_bundle_and_inventory_exclude_each_other(tmp_path, capsys):
    f = three_nodes(tmp_path)
    rc, _, err = _why(f, capsys, "--bundle", str(tmp_path))
    assert rc == 2 and "give one or the other" in err
