"""Launched by torchrun (two 'nodes' on localhost): Lightning sees TorchElastic and spans the mesh across them."""

from __future__ import annotations

import os

from tests.scenarios.common import parse_args, write_report
from tests.scenarios.layouts import run


def main() -> None:
    args = parse_args()
    assert "TORCHELASTIC_RUN_ID" in os.environ, "expected to run under torchrun"
    # tp stays inside a node (2 local ranks), the pipeline crosses the node boundary.
    results = [run(dict(dp=1, pp=2, tp=2, schedule="1f1b", m=4)), run(dict(dp=2, pp=2, tp=1, schedule="interleaved_1f1b", m=4))]
    write_report(args.report, {"results": results, "nodes": int(os.environ["GROUP_WORLD_SIZE"])})


if __name__ == "__main__":
    main()
