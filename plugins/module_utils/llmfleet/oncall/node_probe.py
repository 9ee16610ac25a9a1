"""llmfleet's node probe: what one on-call command needs from one node, in one SSH round, as one JSON object.

The ops host pipes this file's source to ``python3 - SPEC`` (``sudo -n -u root -- python3 - SPEC`` when the
host's ansible_become is true), so a node needs no llmfleet install. SPEC is JSON ``{"op": ..., ...}`` holding
unit names, paths and numbers only: argv is visible in ps, so never a secret. The answer is printed on stdout;
a failure is ``{"error": ...}``, never a traceback. Stdlib only, Python >= 3.8, no import of the package.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

VERSION = 1
SHOW_PROPS = (
    "LoadState", "ActiveState", "SubState", "Result", "ExecMainCode", "ExecMainStatus", "ExecMainPID", "MainPID",
    "NRestarts", "ActiveEnterTimestampMonotonic", "StateChangeTimestampMonotonic", "ControlGroup", "InvocationID",
    "ExecStart",
)  # fmt: skip
RECORD_KEYS = (
    "unit", "invocation_id", "started_at", "ended_at", "ended_at_iso", "stop_requested", "killed_after_timeout",
    "child", "exit_code", "verdict", "reason", "oom_kill", "left_over_pids", "phase", "ready", "ready_at",
    "failed_rank", "first_error", "running", "health", "link",
)  # fmt: skip
ROTATED = 5  # the wrapper keeps FILE.1 .. FILE.5
ENV = dict(os.environ, LC_ALL="C", SYSTEMD_PAGER="", SYSTEMD_COLORS="0", PAGER="cat")
PROC = os.environ.get("LLMFLEET_PROBE_PROC_ROOT", "/proc")  # tests point this at a fake tree; sudo drops it
STOPPED = ("inactive", "failed")


def run(argv, timeout=20.0, cap=1 << 20):
    """(rc, last `cap` bytes of stdout cut at a line start, bytes dropped, stderr text). rc None: the command
    is not installed; rc "timeout": killed after `timeout` s. A rolling tail keeps memory bounded."""
    try:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    except OSError as e:
        return None, b"", 0, f"{argv[0]}: {e.strerror}"
    killed = []
    timer = threading.Timer(timeout, lambda: (killed.append(1), p.kill()))
    timer.start()
    err = bytearray()

    def drain():
        for chunk in iter(lambda: p.stderr.read(4096), b""):
            err.extend(chunk)
            del err[:-8192]

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    buf, dropped = bytearray(), 0
    for chunk in iter(lambda: p.stdout.read(1 << 16), b""):
        buf.extend(chunk)
        if len(buf) > cap:
            dropped += len(buf) - cap
            del buf[: len(buf) - cap]
    rc = p.wait()
    timer.cancel()
    t.join(2)
    if dropped and b"\n" in buf:  # start at a whole line
        cut = buf.index(b"\n") + 1
        dropped += cut
        del buf[:cut]
    return ("timeout" if killed else rc), bytes(buf), dropped, err.decode("utf-8", "replace").strip()


def read_file(path, cap=4 << 20):
    """(bytes or None, error or None) of a regular file, not following a final symlink: the engine's user owns
    the state directory, and root must not read what it planted there (a link to /etc/shadow)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{path}: {e.strerror}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, f"{path}: not a regular file"
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(cap), None
    finally:
        os.close(fd)


def read_json(path):
    data, err = read_file(path)
    if data is None:
        return None, err
    try:
        return json.loads(data.decode("utf-8", "replace")), None
    except ValueError as e:
        return None, f"{path}: not JSON ({e})"


def summary(rec):
    return {k: rec.get(k) for k in RECORD_KEYS if k in rec} if isinstance(rec, dict) else None


def show_all(units, props=SHOW_PROPS):
    """{unit: {property: value}} from one `systemctl show U1 U2 ...` (a block per unit, blank-line separated)."""
    argv = ["systemctl", "show", *units, "--no-pager"] + [f"--property={p}" for p in props]
    rc, out, _, err = run(argv, timeout=15)
    if rc != 0:
        return {u: {"_error": err or f"systemctl show exited {rc}"} for u in units}
    blocks, info = [], {}
    for line in [*out.decode("utf-8", "replace").splitlines(), ""]:
        k, sep, v = line.partition("=")
        if sep:
            info[k] = v
        elif not line.strip() and info:
            blocks.append(info)
            info = {}
    if len(blocks) != len(units):  # not one block per unit: ask one unit at a time
        return (
            {u: show_all([u], props)[u] for u in units} if len(units) > 1 else {units[0]: blocks[0] if blocks else {}}
        )
    mono = time.monotonic()
    for info in blocks:
        for k in ("ActiveEnterTimestampMonotonic", "StateChangeTimestampMonotonic"):
            us = info.get(k, "")
            if us.isdigit() and int(us) > 0:  # systemd's CLOCK_MONOTONIC us -> epoch s
                info[k.replace("Monotonic", "Epoch")] = time.time() - (mono - int(us) / 1e6)
    return dict(zip(units, blocks))


def show(unit, props=SHOW_PROPS):
    return show_all([unit], props)[unit]


def shows(spec, props=SHOW_PROPS):
    """Every unit of the spec in one systemctl call; each spec entry keeps its own (unit_files reads it)."""
    got = show_all([u["unit"] for u in spec["units"]], props)
    for u in spec["units"]:
        u["_show"] = got[u["unit"]]
    return got


def listing(spec, got):
    """llmfleet's units on the node, only when the engine unit is not there (to name the deployments that are)."""
    engine = [u["unit"] for u in spec["units"] if u.get("role", "engine") == "engine"]
    if spec.get("list", True) and not any(got[e].get("LoadState") == "loaded" for e in engine):
        return llmfleet_units()
    return []


def exec_argv(exec_start):
    """argv of `systemctl show -p ExecStart` ('{ path=... ; argv[]=A B C ; ignore_errors=no ; ... }')."""
    _, sep, rest = (exec_start or "").partition("argv[]=")
    return rest.split(" ; ")[0].split() if sep else []


def opt(argv, name):
    """The last value of --name VALUE / --name=VALUE in argv, else None."""
    val = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            val = argv[i + 1]
        elif a.startswith(name + "="):
            val = a[len(name) + 1 :]
    return val


def cgroup_paths(pid):
    data, _ = read_file(f"{PROC}/{pid}/cgroup", cap=1 << 16)
    return [ln.split(":", 2)[2] for ln in (data or b"").decode("utf-8", "replace").splitlines() if ln.count(":") >= 2]


def in_unit(pid, cg, unit):
    """The process lives in the unit's cgroup (ControlGroup, or a path naming the unit once it has none)."""
    for path in cgroup_paths(pid):
        if cg and (path == cg or path.startswith(cg.rstrip("/") + "/")):
            return True
        if not cg and unit in path.split("/"):
            return True
    return False


def pids():
    try:
        return [int(p) for p in os.listdir(PROC) if p.isdigit() and int(p) != os.getpid()]
    except OSError:
        return []


def proc_text(pid, name, cap=300):
    data, _ = read_file(f"{PROC}/{pid}/{name}", cap=cap)
    return (data or b"").replace(b"\0", b" ").decode("utf-8", "replace").strip()


def gpu_apps():
    """[(pid, MiB)] from nvidia-smi, or None when there is no nvidia-smi."""
    argv = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    rc, out, _, err = run(argv, timeout=20)
    if rc is None:
        return None, None
    if rc != 0:
        return None, err or f"nvidia-smi exited {rc}"
    apps = []
    for line in out.decode("utf-8", "replace").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            apps.append((int(parts[0]), int(parts[1]) if parts[1].isdigit() else 0))
    return apps, None


def port_open(host, port, timeout=1.0):
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def worker_urls(argv):
    """The replicas' router's members as launched: the URLs after --worker-urls, up to the next option."""
    out, on = [], False
    for a in argv:
        if a == "--worker-urls":
            on = True
        elif on and a.startswith("--"):
            break
        elif on:
            out.append(a)
    return out


def router_members(host, port, argv, timeout=2.0):
    """Who the replicas' router routes to now, from its own worker API on its listen address (sglang-router 0.3.2:
    GET /workers, each with is_healthy; vllm-router 0.1.17: GET /list_workers, URLs only, so health unknown):
    {"listed": [{"url", "healthy"}], "error"}. Both are keyless and answer on the router's own port."""
    import urllib.request

    sglang = bool(argv) and ("sglang" in os.path.basename(argv[0]) or "launch" in argv[1:3])
    where = host if ":" not in host else f"[{host}]"
    url = f"http://{where}:{port}/{'workers' if sglang else 'list_workers'}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a loopback/fabric address, never a proxy
    try:
        with opener.open(url, timeout=timeout) as r:
            doc = json.loads(r.read(1 << 20).decode("utf-8", "replace"))
    except (OSError, ValueError) as e:
        return {"listed": None, "error": f"{url}: {e}"}
    if sglang:
        listed = [{"url": w.get("url"), "healthy": w.get("is_healthy")} for w in doc.get("workers") or []]
    else:
        listed = [{"url": u, "healthy": None} for u in doc.get("urls") or []]
    return {"listed": listed, "error": None}


def unit_files(u, rotated=True):
    """The wrapper's record/status paths: from the unit's ExecStart (--record/--status), else the inventory's."""
    argv = exec_argv(u.get("_show", {}).get("ExecStart", ""))
    record = opt(argv, "--record") or u.get("record")
    return argv, record, opt(argv, "--status") or u.get("status")


def records(path):
    out = []
    for i in range(ROTATED + 1):
        rec, err = read_json(path if i == 0 else f"{path}.{i}")
        if rec is not None or err:
            out.append({"file": i, "record": summary(rec), "error": err})
    return out


def op_status(spec):
    gpu = []  # nvidia-smi takes up to a second on a loaded 8-GPU node: ask it while systemd answers
    t = threading.Thread(target=lambda: gpu.append(gpu_apps()), daemon=True)
    t.start()
    got = shows(spec)
    out = {"units": {}, "gpu_other": None, "llmfleet_units": listing(spec, got)}
    t.join(30)
    apps, out["gpu_error"] = gpu[0] if gpu else (None, "nvidia-smi did not answer in 30 s")
    claimed = set()
    for u in spec["units"]:
        info = u["_show"]
        argv, record, status = unit_files(u)
        st, st_err = read_json(status) if status else (None, None)
        res = {"show": info, "records": records(record) if record else [], "status": summary(st), "errors": []}
        res["errors"] += [st_err] if st_err else []
        cut = argv.index("--") + 1 if "--" in argv else 0  # the engine's argv after the wrapper's
        port = opt(argv[cut:], "--port")
        res["port"] = int(port) if port and port.isdigit() else u.get("default_port")
        if info.get("ActiveState") == "active" and res["port"]:
            host = opt(argv[cut:], "--host") or u.get("host") or ""
            wildcard = host in ("", "0.0.0.0", "::", "[::]", "*")  # noqa: S104 (a listen address, read; checked via loopback)
            host = "127.0.0.1" if wildcard else host.strip("[]")
            res["port_host"], res["port_open"] = host, port_open(host, res["port"])
            if u.get("members") and res["port_open"]:
                res["members"] = dict(router_members(host, res["port"], argv[cut:]), expected=worker_urls(argv[cut:]))
        if apps is not None:
            mine = [(p, m) for p, m in apps if in_unit(p, info.get("ControlGroup", ""), u["unit"])]
            claimed.update(p for p, _ in mine)
            res["gpu_mib"], res["gpu_pids"] = sum(m for _, m in mine), [p for p, _ in mine]
        out["units"][u["unit"]] = res
    if apps is not None:
        out["gpu_other"] = [{"pid": p, "mib": m, "comm": proc_text(p, "comm")} for p, m in apps if p not in claimed]
    return out


def llmfleet_units():
    names = set()
    for argv in (["systemctl", "list-units", "--all"], ["systemctl", "list-unit-files"]):
        rc, out, _, _ = run([*argv, "--no-legend", "--plain", "--no-pager", "llmfleet-*.service"], timeout=15)
        for line in out.decode("utf-8", "replace").splitlines() if rc == 0 else []:
            words = line.split()
            if words and words[0].startswith("llmfleet-") and words[0].endswith(".service"):
                names.add(words[0])
    return sorted(names)


def op_state(spec):
    out, got = {}, shows(spec)
    for u in spec["units"]:
        status = unit_files(u)[2]
        st, _ = read_json(status) if status else (None, None)
        out[u["unit"]] = {"show": u["_show"], "status": summary(st)}
    return {"units": out, "llmfleet_units": listing(spec, got)}


UNTIL_LOOKBACK_S = 3600


def journal_argv(spec, unit=None):
    argv = ["journalctl", "-o", "short-iso", "--no-pager"] + (["-u", unit] if unit else ["-k"])
    since, until, lines = spec.get("since"), spec.get("until"), spec.get("lines")
    if until and lines and not since:
        # journalctl 252 prints "-- No entries --" for -n N with --until and no --since (it counts N back from
        # the journal's end, then drops them as later than --until): read the hour before, keep the last N.
        since, lines = f"@{int(until) - UNTIL_LOOKBACK_S}", None
    argv += ["--since", since] if since else []
    argv += ["--until", f"@{int(until)}"] if until else []
    return argv + (["-n", str(int(lines))] if lines else [])


def last_lines(data, n):
    """The last n lines of journal output (bytes)."""
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-int(n) :]) if n and len(lines) > int(n) else data


def op_logs(spec):
    out, got = {}, shows(spec)
    for u in spec["units"]:
        _, record, _ = unit_files(u)
        rc, data, dropped, err = run(journal_argv(spec, u["unit"]), timeout=60, cap=spec.get("cap", 8 << 20))
        if spec.get("until") and spec.get("lines") and not spec.get("since"):
            data = last_lines(data, spec["lines"])
        out[u["unit"]] = {
            "show": got[u["unit"]],
            "journal": data.decode("utf-8", "replace"),
            "dropped": dropped,
            "error": None if rc == 0 else (err or f"journalctl exited {rc}"),
            "records": records(record) if record and spec.get("records") else [],
        }
    return {"units": out, "llmfleet_units": listing(spec, got)}


def op_bundle(spec):
    """The incident bundle's files of this node (docs/architecture.md), base64, each capped to its newest part."""
    caps, files, units = spec.get("caps", {}), {}, {}
    got = shows(spec, ("LoadState", "ExecStart"))

    def put(name, rc, data, dropped, err, source):  # noqa: PLR0917 (run()'s four results + two)
        files[name] = {"data": base64.b64encode(data).decode(), "dropped": dropped, "source": source,
                       "error": None if rc == 0 else (err or f"exited {rc}")}  # fmt: skip

    for u in spec["units"]:
        unit, info = u["unit"], u["_show"]
        units[unit] = {"show": {"LoadState": info.get("LoadState")}}
        if info.get("LoadState") not in ("loaded", None) and not u.get("always"):
            files[f"unit-{unit}.show"] = {"absent": f"{unit}: LoadState={info.get('LoadState')}"}
            continue
        cap = caps.get("journal", 16 << 20)
        put(f"journal-{unit}.txt", *run(journal_argv(spec, unit), 300, cap), " ".join(journal_argv(spec, unit)))
        put(f"unit-{unit}.show", *run(["systemctl", "show", unit, "--no-pager"], 30, 1 << 20), "systemctl show")
        _, record, status = unit_files(u)
        for name, path in [(f"termination-{unit}.json", record), (f"status-{unit}.json", status)] + [
            (f"termination-{unit}.json.{i}", f"{record}.{i}") for i in range(1, ROTATED + 1) if record
        ]:
            data, err = read_file(path, caps.get("record", 4 << 20)) if path else (None, None)
            if data is not None or err:
                put(name, 0 if data is not None else 1, data or b"", 0, err, path)
    put("kernel.txt", *run(journal_argv(spec), 300, caps.get("kernel", 8 << 20)), " ".join(journal_argv(spec)))
    rc, data, dropped, err = run(["nvidia-smi", "-q"], 60, caps.get("nvidia", 4 << 20))
    if rc is not None:
        put("nvidia-smi.txt", rc, data, dropped, err, "nvidia-smi -q")
    return {"files": files, "units": units, "llmfleet_units": listing(spec, got)}


def wait_stopped(unit, deadline):
    while True:
        state = show(unit, ("ActiveState",)).get("ActiveState")
        if state in STOPPED or time.monotonic() >= deadline:
            return state
        time.sleep(0.2)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    st = proc_text(pid, "stat")
    return not (st and st.rsplit(")", 1)[-1].split()[:1] == ["Z"])


def kill_leftovers(cg, unit):
    """SIGKILL every process still in the unit's cgroup after its stop; what was killed and what survived."""
    found = [p for p in pids() if in_unit(p, cg, unit) and alive(p)]
    killed = [{"pid": p, "comm": proc_text(p, "comm"), "cmdline": proc_text(p, "cmdline")} for p in found]
    for p in found:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    end = time.monotonic() + 3
    while time.monotonic() < end and any(alive(p) for p in found):
        time.sleep(0.05)
    return killed, [p for p in found if alive(p)]


def op_stop(spec):
    """Stop each unit in the order given (systemctl stop --no-block + a deadline, then systemctl kill -s
    SIGKILL), then SIGKILL what is left in its cgroup."""
    out = []
    for u in spec["units"]:
        unit, res = u["unit"], {"unit": u["unit"], "actions": []}
        out.append(res)
        before = show(unit)
        u["_show"] = before
        res["before"] = {k: before.get(k) for k in ("LoadState", "ActiveState", "SubState", "MainPID")}
        if before.get("LoadState") != "loaded":
            res["actions"].append(f"not installed (LoadState={before.get('LoadState')})")
            continue
        cg = before.get("ControlGroup", "")
        t0 = time.monotonic()
        if before.get("ActiveState") not in STOPPED:
            rc, _, _, err = run(["systemctl", "stop", "--no-block", unit], timeout=30)
            if rc != 0:  # not allowed (no become?) or no systemd: waiting would not help
                res["actions"].append(f"systemctl stop failed: {err or rc}")
                res["after"] = show(unit, ("ActiveState", "SubState", "Result", "ExecMainCode", "ExecMainStatus"))
                continue
            res["actions"].append("systemctl stop")
            state = wait_stopped(unit, t0 + float(spec["timeout"]))
            if state not in STOPPED:
                run(["systemctl", "kill", "--signal=SIGKILL", unit], timeout=30)
                res["actions"].append(f"still {state} after {spec['timeout']} s: systemctl kill --signal=SIGKILL")
                res["sigkill_unit"] = True
                state = wait_stopped(unit, time.monotonic() + 10)
            res["stop_s"] = round(time.monotonic() - t0, 2)
        else:
            res["actions"].append(f"already {before.get('ActiveState')}")
        res["killed"], res["survivors"] = kill_leftovers(cg, unit)
        after = show(unit, ("ActiveState", "SubState", "Result", "ExecMainCode", "ExecMainStatus"))
        res["after"] = after
        _, record, _ = unit_files(u)
        rec, _ = read_json(record) if record else (None, None)
        res["record"] = summary(rec)
    return {"units": out}


def op_start(spec):
    out = []
    for u in spec["units"]:
        run(["systemctl", "reset-failed", u["unit"]], timeout=30)  # a start-limit hit would refuse the start
        rc, _, _, err = run(["systemctl", "start", "--no-block", u["unit"]], timeout=30)
        out.append({"unit": u["unit"], "rc": rc, "error": None if rc == 0 else (err or f"exited {rc}")})
    return {"units": out}


def env_file(path):
    data, err = read_file(path, 1 << 20)
    env = {}
    for line in (data or b"").decode("utf-8", "replace").splitlines():
        k, sep, v = line.strip().partition("=")
        if sep and not k.startswith("#"):
            env[k.strip()] = v.strip().strip("\"'")
    return env, err if data is not None or err else f"{path}: no such file"


def op_counters(spec):
    root = os.path.join(spec.get("sysfs_root") or "/sys", "class", "infiniband")
    hcas = {}
    for hca in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        ports_dir = os.path.join(root, hca, "ports")
        for p in sorted(os.listdir(ports_dir)) if os.path.isdir(ports_dir) else []:
            d, vals = os.path.join(ports_dir, p), {}
            for key, rel in (("xmit", "counters/port_xmit_data"), ("rcv", "counters/port_rcv_data"),
                             ("state", "state"), ("link_layer", "link_layer")):  # fmt: skip
                data, _ = read_file(os.path.join(d, rel), 4096)
                text = (data or b"").decode("ascii", "replace").strip()
                if key in ("xmit", "rcv"):
                    vals[key] = int(text) if text.isdigit() else None
                else:
                    vals[key] = text or None
            hcas.setdefault(hca, {})[p] = vals
    env, err = env_file(spec["fabric_env"]) if spec.get("fabric_env") else ({}, None)
    keep = ("NCCL_IB_HCA", "UCX_NET_DEVICES")
    return {"hcas": hcas, "root": root, "env": {k: env[k] for k in keep if k in env}, "env_error": err}


OPS = {"status": op_status, "state": op_state, "logs": op_logs, "bundle": op_bundle, "stop": op_stop,
       "start": op_start, "counters": op_counters}  # fmt: skip


def main(argv):
    t0 = time.monotonic()
    try:
        spec = json.loads(argv[1])
        out = OPS[spec["op"]](spec)
    except Exception as e:  # the ops host shows this line; a node must answer, not print a traceback
        out = {"error": f"{type(e).__name__}: {e}"}
    out.update(probe=VERSION, hostname=socket.gethostname(), time=time.time(), euid=os.geteuid(),
               probe_s=round(time.monotonic() - t0, 3))  # fmt: skip
    sys.stdout.write(json.dumps(out))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
