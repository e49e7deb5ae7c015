"""Several scenarios in one process group, one after another, each exactly as it runs alone.

A launch's start (the launcher's imports, every rank's first fit) costs about as much as a scenario's checks, so
tests of one world size share a launch (tests/test_distributed.py). ``--extra`` lists the parts as ``NAME[:EXTRA]``
separated by ``;``: each part's ``main`` runs with its own ``--extra`` and writes its own report,
``part_report(<this launch's report>, NAME)``. A part that fails ends the launch; the launch's failure names it.
"""

from __future__ import annotations

import importlib
import multiprocessing
import sys
from pathlib import Path

from tests.scenarios.common import parse_args, write_report


def part_report(report: Path, name: str) -> Path:
    return report.with_name(f"{report.stem}.{name}.json")


def run_group(world: int, parts: list[tuple[str, str]], folder: Path, timeout: float) -> dict[str, dict]:
    """For tests: run ``parts`` ((scenario, its --extra)) one after another in one launch of ``world`` ranks
    (tests/launch.py); each part's report by name."""
    import json

    from tests.launch import run_scenario

    report = folder / "group.json"
    run_scenario(world, "group", ["--world", str(world), "--extra", ";".join(f"{n}:{e}" for n, e in parts)], report,
                 timeout=timeout)
    return {name: json.loads(part_report(report, name).read_text()) for name, _ in parts}


def parts(extra: str) -> list[tuple[str, str]]:
    return [(name, part_extra) for name, _, part_extra in (p.partition(":") for p in extra.split(";"))]


def main() -> None:
    args = parse_args()
    # the data-loader workers' fork server imports every part once (tests/launch.py preloads only this module)
    multiprocessing.set_forkserver_preload([f"tests.scenarios.{name}" for name, _ in parts(args.extra)])
    done = []
    for name, extra in parts(args.extra):
        sys.argv = [f"tests.scenarios.{name}", "--report", str(part_report(args.report, name)), "--world",
                    str(args.world), "--extra", extra]
        print(f"== part {name} {extra}", flush=True)
        importlib.import_module(f"tests.scenarios.{name}").main()
        done.append(name)
        write_report(args.report, {"parts": done})


if __name__ == "__main__":
    main()
