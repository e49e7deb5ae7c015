"""The pipeline transport: one ordered stream per pipeline (lightning_3d/pipeline/{rounds,exchange,p2p}.py).

``lockstep_rounds`` is checked on every registered schedule and micro-batch count: both ends of every message post
it in the same round, before the round in which it is used, and a rank's actions keep their order. The scenario
``tests/scenarios/transport.py`` runs the runtime on three processes and checks what only a run shows: the transport
creates one process group per pipeline, neighbours issue mirrored sequences of batches, and the results equal one process's.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from lightning_3d.pipeline.rounds import destination, lockstep_rounds
from lightning_3d.pipeline.schedules import SCHEDULES, Action, build_forward_only, build_schedule, check_schedule
from tests.launch import run_scenario


def _cases():
    for name, spec in sorted(SCHEDULES.items()):
        for pp in (2, 3, 4):
            for v in ((2, 3) if spec.interleaved else (1,)):
                for m in range(1, 2 * pp * v + 1):
                    if spec.microbatch_multiple_of_pp and m % pp:
                        continue
                    yield name, pp, v, m, [build_schedule(name, pp, v, m, r) for r in range(pp)]
                    if name == "gpipe" or spec.interleaved:
                        yield "forward", pp, v, m, [build_forward_only(pp, v, m, r) for r in range(pp)]


def test_rounds_post_both_ends_of_every_message_together_and_before_its_use() -> None:
    cases = 0
    for name, pp, v, m, orders in _cases():
        num_stages = pp * v
        check_schedule(orders, num_stages, m, train=name != "forward")
        rounds = lockstep_rounds(orders, num_stages)
        sent, received, used = {}, {}, {}
        for rank, mine in enumerate(rounds):
            assert [r.action for r in mine if r.action is not None] == list(orders[rank]), (name, pp, v, m, rank)
            assert [r.index for r in mine] == sorted({r.index for r in mine})
            for r in mine:
                for message in r.receives:
                    assert destination(message[0], message[1], num_stages, pp) == rank
                    received[message] = (r.index, rank)
                a = r.action
                if a is None:
                    continue
                if destination(a.kind, a.stage, num_stages, pp) is not None:
                    sent[(a.kind, a.stage, a.microbatch)] = (r.index, rank)
                need = ("F", a.stage - 1, a.microbatch) if a.kind == "F" else ("B", a.stage + 1, a.microbatch)
                if 0 <= need[1] < num_stages:
                    used[need] = r.index
        # Same round on both ends (so both post it in their batch of that round), used strictly later.
        assert {k: t for k, (t, _) in sent.items()} == {k: t for k, (t, _) in received.items()}, (name, pp, v, m)
        assert all(used[k] > t for k, (t, _) in sent.items()), (name, pp, v, m)
        # A rank sends at most one message per round, so a round's receives from one neighbour are one message.
        per_round = Counter((t, rank) for t, rank in sent.values())
        assert max(per_round.values(), default=1) == 1
        cases += 1
    assert cases > 100


def test_rounds_reject_a_deadlocking_order() -> None:
    F, B = (lambda s, m: Action("F", s, m)), (lambda s, m: Action("B", s, m))
    # Rank 0 waits for the gradient of micro-batch 1 before sending its activation: nothing can ever move.
    with pytest.raises(ValueError, match="deadlocks"):
        lockstep_rounds([[B(0, 0), F(0, 0)], [F(1, 0), B(1, 0)]], 2)


def test_transport_creates_one_group_per_pipeline_and_neighbours_issue_mirrored_batches(tmp_path: Path) -> None:
    """Three processes (pp = 3), gloo. Fails on the transport it replaced: there every rank created one group per
    (kind, direction) of every pipeline (``transport_calls`` 6 here, with two stages per rank; 2·dp·tp·pp in general),
    and in 1F1B with three micro-batches a rank posted its receive of gradient 1 before its send of activation 2
    while its neighbour posted its receive of activation 2 before its send of gradient 1: on one stream each waits
    for the other. At pp = 3 the middle rank receives from both neighbours in one round (one batch, waited once)."""
    report = run_scenario(3, "transport", [], tmp_path / "report.json", timeout=600)
    for rank in report["ranks"]:
        # One group per pipeline (dp·tp = 1 here), of which the rank is a member.
        assert rank["transport_calls"] == 1 and rank["transport_member"] == 1, rank
        assert [r["exact"] for r in rank["results"]] == [True] * 4, rank["results"]
    assert [p["pair"] for p in report["pairs"]] == [[0, 1], [1, 2], [2, 0]]
    assert all(p["data"] and p["headers"] for p in report["pairs"]), report["pairs"]
    assert min(p["batches"] for p in report["pairs"][:2]) > 10  # the adjacent ranks exchanged every step's messages
