"""Data damaged in transit, with real gloo ranks on this host: a receiver's result is damaged after the
collective while every contribution stays right, and the verdict names what the wrong elements'
positions can honestly say - the path, the receiver or the sender - and never a contributor."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def world(*args, nproc=3):
    cp = subprocess.run([sys.executable, "-m", "llmfleet.checks.nccl_check", "local", "--backend", "gloo", "--compact",
                         "--nproc", str(nproc), "--iters", "1", "--warmup", "0", "--sizes", "1K", "--dtypes", "bf16",
                         "--deadline", "120", *args], capture_output=True, text=True, timeout=180, check=False)  # fmt: skip
    return cp.returncode, json.loads(cp.stdout)


def test_one_damaged_path_is_named_not_the_contributor():
    rc, v = world("--ops", "all_reduce,all_gather", "--corrupt-transit", "1:2")
    assert rc == 1 and not v["ok"]
    assert v["culprit_ranks"] == [] and v["wrong_ranks"] == [1]
    assert v["bad_transfers"] == [[2, 1]] and v["damaged_sources"] == v["bad_receivers"] == []
    assert v["verdict"] == "FAIL: wrong values on ranks [1]; wrong on the way 2->1"
    assert v["attribution"] == ["all_gather: rank 2's data arrived wrong at rank 1",
                                "all_reduce: rank 2's data arrived wrong at rank 1"]  # fmt: skip
    (res,) = [x for x in v["ranks"][1]["results"] if x["op"] == "all_reduce"]
    assert res["wrong_from"] == {"2": 1} and res["first_wrong"][0]["from"] == 2
    assert v["wrong_by_rank"] == {"0": 0, "1": 2, "2": 0}


def test_data_that_arrives_wrong_everywhere_names_its_sender():
    rc, v = world("--ops", "all_reduce", "--corrupt-transit", "*:2")
    assert rc == 1 and v["culprit_ranks"] == [] and v["damaged_sources"] == [2]
    assert "rank(s) [2] sent data that arrived wrong everywhere (their send side)" in v["verdict"]


def test_a_receiver_that_gets_everything_wrong_is_named():
    rc, v = world("--ops", "all_gather", "--corrupt-transit", "1:*")
    assert rc == 1 and v["bad_receivers"] == [1] and v["bad_transfers"] == [] and v["culprit_ranks"] == []
    assert "rank(s) [1] received wrong data from several ranks (their receive side)" in v["verdict"]


def test_the_ring_names_the_link_into_the_damaged_receiver():
    rc, v = world("--ops", "sendrecv", "--corrupt-transit", "2:*")
    assert rc == 1 and v["bad_transfers"] == [[1, 2]] and v["culprit_ranks"] == []


def test_a_wrong_contribution_is_the_contributors_and_nothing_else():
    rc, v = world("--ops", "all_reduce,all_gather,sendrecv", "--corrupt-rank", "2")
    assert rc == 1 and v["culprit_ranks"] == [2]
    assert v["damaged_sources"] == v["bad_receivers"] == v["bad_transfers"] == []
    assert v["verdict"].startswith("FAIL: wrong values on ranks [0, 1, 2]; the contribution of rank(s) [2] is wrong")
    flagged = [x for r in v["ranks"] if r["rank"] == 2 for x in r["results"] if x.get("contribution_ok") is False]
    assert {x["op"] for x in flagged} == {"all_reduce", "all_gather", "sendrecv"}
