"""Preflight judging: consistent values pass, the odd node is named, thresholds hold."""

import pytest

from llmfleet.checks import preflight


def node(**over):
    m = {
        "gpu_count": 8, "gpu_models": ["NVIDIA H20"], "driver_version": "580.159.04", "cuda_version": "13.0",
        "persistence_mode": ["Enabled"], "mig_mode": ["Disabled"], "ecc_uncorrected": 0, "retired_pages_pending": False,
        "nvswitch": True, "fabricmanager_active": True, "peermem_loaded": True, "hca_active_ports": 8,
        "hca_link_layers": ["Ethernet"], "hca_rates": ["400 Gb/sec (4X NDR)"], "default_memlock": "infinity",
        "nvme_free_bytes": 4 * 2**40, "clock_offset_s": 0.0002, "resolves": {}, "nccl_version": "2.28.9",
    }  # fmt: skip
    m.update(over)
    return m


FLEET = {f"n{i}": node() for i in range(1, 5)}
CFG = {"gpus_per_node": 8, "expect_rdma": True, "min_free_bytes": 2 * 2**40, "engine_python": "/opt/engine/bin/python",
       "fabric_ips": {f"n{i}": f"10.0.0.{i}" for i in range(1, 5)}}  # fmt: skip


def judge(**changes):
    fleet = {n: dict(m) for n, m in FLEET.items()}
    for n, over in changes.items():
        fleet[n].update(over)
    rows = preflight.evaluate(fleet, CFG)
    return rows, preflight.summary(rows)


def test_a_healthy_fleet_passes():
    rows, s = judge()
    assert s == {"status": "pass", "failed_nodes": [], "failed_checks": []}
    assert {r["check"] for r in rows} >= {"gpu_count", "driver_version", "nccl_version", "ecc", "fabricmanager",
                                          "nvidia_peermem", "memlock_units", "nvme_free", "clock_sync", "hca_rate"}  # fmt: skip


@pytest.mark.parametrize(
    ("node_over", "check"),
    [
        ({"driver_version": "570.86.10"}, "driver_version"),
        ({"cuda_version": "12.8"}, "cuda_version"),
        ({"nccl_version": "2.21.5"}, "nccl_version"),
        ({"gpu_count": 7}, "gpu_count"),
        ({"gpu_models": ["NVIDIA H200"]}, "gpu_models"),
        ({"mig_mode": ["Enabled"]}, "mig_disabled"),
        ({"ecc_uncorrected": 3}, "ecc"),
        ({"retired_pages_pending": True}, "ecc"),
        ({"fabricmanager_active": False}, "fabricmanager"),
        ({"peermem_loaded": False}, "nvidia_peermem"),
        ({"hca_active_ports": 7}, "hca_active_ports"),
        ({"hca_rates": ["200 Gb/sec (4X HDR)"]}, "hca_rate"),
        ({"hca_link_layers": ["InfiniBand"]}, "hca_link_layer"),
        ({"nvme_free_bytes": 2**40}, "nvme_free"),
        ({"nvme_free_bytes": None}, "nvme_free"),
        ({"clock_offset_s": -0.8}, "clock_sync"),
        ({"resolves": {"n1": ["10.0.0.99"]}}, "names_resolve"),
    ],
)
def test_the_odd_node_is_named(node_over, check):
    rows, s = judge(n3=node_over)
    assert s["status"] == "fail" and s["failed_nodes"] == ["n3"], s
    assert check in s["failed_checks"]
    bad = [r for r in rows if r["status"] == "fail"]
    assert all(r["node"] == "n3" for r in bad) and all(r["message"] for r in bad)


def test_warnings_do_not_fail():
    rows, s = judge(n2={"persistence_mode": ["Disabled"], "default_memlock": "8388608", "clock_offset_s": None})
    assert s["status"] == "warn" and s["failed_nodes"] == []
    assert {r["check"] for r in rows if r["status"] == "warn"} == {"persistence_mode", "memlock_units", "clock_sync"}


def test_lab_without_gpus_is_a_warning_only_when_declared():
    fleet = {n: node(gpu_count=0, gpu_models=None, driver_version=None, cuda_version=None, nvswitch=False)
             for n in ("a", "b")}  # fmt: skip
    strict = preflight.summary(preflight.evaluate(fleet, {}))
    lab = preflight.summary(preflight.evaluate(fleet, {"expect_gpus": False}))
    assert strict["status"] == "fail" and "gpu_count" in strict["failed_checks"]
    assert lab["status"] == "warn"


def test_blocked_port_names_the_target_node():
    ports = {
        "n1": {"n2": {"50080": "open"}, "n3": {"50080": "timeout"}},
        "n2": {"n1": {"50080": "open"}, "n3": {"50080": "timeout"}},
        "n3": {"n1": {"50080": "open"}, "n2": {"50080": "open"}},
    }
    fleet = {n: node() for n in ("n1", "n2", "n3")}
    rows = preflight.evaluate(fleet, {**CFG, "ports": ports})
    s = preflight.summary(rows)
    assert s["failed_nodes"] == ["n3"] and s["failed_checks"] == ["ports_reachable"]
    (row,) = [r for r in rows if r["status"] == "fail"]
    assert "50080 from n1: timeout" in row["message"] and "50080 from n2: timeout" in row["message"]


def test_own_name_on_loopback_is_a_warning():
    rows, s = judge(n1={"resolves": {"n1": ["127.0.1.1"], "n2": ["10.0.0.2"]}})
    assert s["status"] == "warn"
    assert [r["node"] for r in rows if r["check"] == "own_name"] == ["n1"]


@pytest.mark.parametrize(
    ("chrony", "timesync", "offset"),
    [
        ("System time     : 0.000012 seconds fast of NTP time", None, 0.000012),
        ("System time     : 0.5 seconds slow of NTP time", None, -0.5),
        (None, "       Offset: +1.234ms", 0.001234),
        (None, "       Offset: -250us", -0.00025),
        (None, None, None),
    ],
)
def test_clock_offset_parsing(chrony, timesync, offset):
    got = preflight.clock_offset_s(chrony, timesync)
    assert got == pytest.approx(offset) if offset is not None else got is None


def test_driver_version_and_gpu_query_parsing():
    text = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu Oct 30 2026\nGCC version: gcc 12"
    assert preflight.parse_driver_version(text) == "580.159.04"
    assert preflight.parse_driver_version("garbage") is None
    q = preflight.parse_gpu_query(
        "NVIDIA H200, 580.159.04, Enabled, Disabled, 0, No\nNVIDIA H200, 580.159.04, Enabled, Disabled, 0, No\n"
    )
    assert len(q) == 2 and q[0]["name"] == "NVIDIA H200" and q[1]["retired_pages.pending"] == "No"


def test_table_lists_problems_first():
    rows, _ = judge(n4={"driver_version": "570.86.10"})
    lines = preflight.table(rows).splitlines()
    assert lines[0].startswith("check") and "FAIL" in lines[1] and "n4" in lines[1]


def test_a_wrong_gpu_count_names_the_variable_the_role_reads():
    fleet = {n: node(gpu_count=c) for n, c in (("a", 8), ("b", 4))}
    rows = preflight.evaluate(fleet, {**CFG, "gpus_per_node": 8})
    (bad,) = [r for r in rows if r["check"] == "gpu_count" and r["status"] == "fail"]
    assert bad["node"] == "b" and "llmfleet_gpus_per_node" in bad["message"]


def test_the_same_nccl_error_on_every_node_fails():
    # A python without torch (or a CPU torch) gives the same error everywhere: consistent, but no
    # NCCL version. This passed before: an identical error string counted as agreement.
    err = "error: ModuleNotFoundError: No module named 'torch'"
    rows, s = judge(**{n: {"nccl_version": err} for n in FLEET})
    assert s["status"] == "fail" and s["failed_nodes"] == sorted(FLEET)
    bad = [r for r in rows if r["check"] == "nccl_version"]
    assert len(bad) == 4 and all(r["status"] == "fail" and "llmfleet_engine_python" in r["message"] for r in bad)


# `ldconfig -p` as printed on an Ubuntu 22.04 GPU node (driver 580 packages: only libcuda.so.1 is installed),
# with the 32-bit entry the i386 driver package adds.
LDCONFIG = """\
1654 libs found in cache `/etc/ld.so.cache'
\tlibcudart.so.12 (libc6,x86-64) => /usr/local/cuda/lib64/libcudart.so.12
\tlibcuda.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libcuda.so.1
\tlibcuda.so.1 (libc6) => /lib/i386-linux-gnu/libcuda.so.1
\tlibc.so.6 (libc6,x86-64, OS ABI: Linux 3.2.0) => /lib/x86_64-linux-gnu/libc.so.6
"""
WITH_LINK = LDCONFIG.replace(
    "\tlibcuda.so.1 (libc6,x86-64)",
    "\tlibcuda.so (libc6,x86-64) => /lib/x86_64-linux-gnu/libcuda.so\n\tlibcuda.so.1 (libc6,x86-64)",
)
STUB = LDCONFIG + "\tlibcuda.so (libc6,x86-64) => /usr/local/cuda-13.0/targets/x86_64-linux/lib/stubs/libcuda.so\n"


def test_libcuda_state_from_the_linker_cache(tmp_path):
    st = preflight.libcuda_state(LDCONFIG, exists=lambda p: False)
    assert st == {"dirs": ["/lib/x86_64-linux-gnu"], "missing_unversioned": ["/lib/x86_64-linux-gnu"], "stubs": []}
    linked = {"/lib/x86_64-linux-gnu/libcuda.so"}
    assert preflight.libcuda_state(WITH_LINK, exists=linked.__contains__)["missing_unversioned"] == []
    assert preflight.libcuda_state(STUB, exists=lambda p: False)["stubs"] == [
        "/usr/local/cuda-13.0/targets/x86_64-linux/lib/stubs/libcuda.so"
    ]
    assert preflight.libcuda_state(None) is None


@pytest.mark.parametrize(
    ("text", "linked", "fix"),
    [
        (LDCONFIG, set(), "ln -s libcuda.so.1 /lib/x86_64-linux-gnu/libcuda.so && ldconfig"),
        (STUB, {"/lib/x86_64-linux-gnu/libcuda.so"}, "stubs/libcuda.so is in the linker cache"),
        ("0 libs found in cache\n", set(), "libcuda.so.1 is not in the linker cache"),
    ],
)
def test_a_node_without_a_usable_libcuda_fails_with_the_fix(text, linked, fix):
    rows, s = judge(n2={"libcuda": preflight.libcuda_state(text, exists=linked.__contains__)})
    assert s["failed_nodes"] == ["n2"] and s["failed_checks"] == ["libcuda"], s
    (bad,) = [r for r in rows if r["status"] == "fail"]
    assert fix in bad["message"] and "-lcuda" in bad["message"]


def test_libcuda_passes_with_the_link_and_is_not_judged_without_gpus():
    ok = preflight.libcuda_state(WITH_LINK, exists={"/lib/x86_64-linux-gnu/libcuda.so"}.__contains__)
    rows, s = judge(n1={"libcuda": ok})
    assert s["status"] == "pass" and [r["status"] for r in rows if r["check"] == "libcuda"] == ["pass"]
    lab = preflight.libcuda_state("0 libs found in cache\n")
    rows, _ = judge(n1={"libcuda": lab, "gpu_count": 0})
    assert not [r for r in rows if r["check"] == "libcuda" and r["node"] == "n1"]
