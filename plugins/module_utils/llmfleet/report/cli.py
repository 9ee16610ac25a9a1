"""`llmfleet report [--dir REPORT_DIR] [--deployment NAME] [--max-age HOURS] [--json]`: the deployment report
from the newest run's record files in REPORT_DIR (docs/report.md: every record carries its run's id). Writes
REPORT_DIR/<deployment>/<UTC stamp>/{report.html,report.md,report.json}, points REPORT_DIR/<deployment>/latest
there, prints the page's path and pass/fail per step. Exit 0 when a report was written (a failed deployment's
too), 2 on bad input (no such directory, no deployment to report on, a bad name).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .build import MAX_AGE_S, ReportError, collect, infer_deployment, publish, summary_lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir",
        default="reports",
        help="the directory the roles write records to (llmfleet_report_dir; default ./reports)",
    )
    p.add_argument(
        "--deployment", help="llmfleet_deployment to report on (default: the only deployment with records in --dir)"
    )
    p.add_argument(
        "--max-age",
        type=float,
        default=MAX_AGE_S / 3600,
        metavar="HOURS",
        help="records of the steps before the engine older than this before its gate are an earlier run's and left "
        "out (default 24)",
    )
    p.add_argument("--json", action="store_true", help="print the paths, verdict and steps as JSON")
    p.add_argument("--show", action="store_true", help="print the latest report's path and steps; write nothing new")


def run(args: argparse.Namespace) -> int:
    try:
        if args.max_age <= 0:
            raise ReportError(f"--max-age {args.max_age:g}: give a number of hours above 0")
        deployment = args.deployment or infer_deployment(args.dir)
        if args.show:
            return _show(Path(args.dir) / deployment / "latest")
        model = collect(args.dir, deployment, max_age_s=args.max_age * 3600)
        out = publish(args.dir, deployment, model)
    except ReportError as e:
        print(f"llmfleet report: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the directory is not writable, the disk is full, ...
        print(f"llmfleet report: cannot write the report under {args.dir}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("llmfleet report: interrupted", file=sys.stderr)
        return 130
    if not model["has_own_records"]:
        others = ", ".join(model["other_deployments"]) or "none"
        print(f"llmfleet report: note: no endpoint, engine, acceptance or bench record of {deployment} in "
              f"{model['report_dir']} (deployments with records: {others})", file=sys.stderr)  # fmt: skip
    if args.json:
        keys = ("deployment", "status", "verdict", "failure", "steps", "problems", "generated_at", "run")
        paths = {"html": str(out / "report.html"), "markdown": str(out / "report.md"), "json": str(out / "report.json"),
                 "latest": str(out.parent / "latest")}  # fmt: skip
        print(json.dumps({"paths": paths, **{k: model[k] for k in keys}, "summary": summary_lines(model)}, indent=2))
        return 0
    print(out / "report.html")
    print("\n".join(summary_lines(model)))
    return 0


def _show(latest: Path) -> int:
    """The report the last run published (the `latest` link): its page and steps, as the run printed them."""
    try:
        model = json.loads((latest / "report.json").read_text(encoding="utf-8"))
        lines = summary_lines(model)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"llmfleet report: no readable report at {latest}/report.json ({e}); run `llmfleet report` to write one",
              file=sys.stderr)  # fmt: skip
        return 2
    print(latest.resolve() / "report.html")
    print("\n".join(lines))
    return 0
