"""The per-step choice among micro-batchings (``choose_step``, ``microbatching="auto"``) and packed dynamic
micro-batches (``plan_packed_step``), single process, CPU.

The choice must pick the cheapest candidate under its own cost model: each candidate's predicted step time is
recomputed here outside ``choose_step`` (the fixed ones from the recipes' packing and token-budget planners, block
counts from dense masks, ``evaluate`` and the pipeline simulator) and the chosen one must be their minimum; a batch
of many short samples picks packed rows, a long-tailed one with costly attention picks the dynamic partition.
Packed costs must be what runs: FlexAttention's computed blocks counted against a brute-force count over the mask,
the attention read off a cost model equal to the analytic model's own attention term. Multi-process exactness is in
tests/scenarios/multitask.py (2 processes) and tests/scenarios/dynamic.py (4 processes).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from lightning_3d.costs.analytic import ATTENTION_EFFICIENCY, BACKWARD_ATTENTION, AnalyticCostModel
from lightning_3d.costs.model import ModelShape
from lightning_3d.dynamic import DynamicMicroBatcher, PlanWaits
from lightning_3d.dynamic.choice import choose_step, default_candidates, parse_candidates
from lightning_3d.dynamic.packed import FLEX_BLOCK, attention_ratio, causal_blocks, document_blocks
from lightning_3d.dynamic.packed_plan import plan_packed_step
from lightning_3d.dynamic.plan import plan_step
from lightning_3d.dynamic.stage_costs import causal_attention_seconds, evaluate, stage_layers
from lightning_3d.pipeline.schedules import build_schedule
from lightning_3d.pipeline.timing import simulate
from lightning_3d.recipes.data.multitask_batching import StepCollator, plan_packing, plan_token_budget, sample_input_length
from lightning_3d.recipes.training import IGNORE_INDEX
from tests.scenarios.dynamic_costs import TINY, ToyCostModel

BIG = 1e12  # a memory budget nothing reaches: these tests are about time


def short_batch(n: int = 64, seed: int = 0) -> np.ndarray:
    """Many short samples of 3..13 tokens: rounded to multiples of 8, padded samples waste about a third."""
    return np.random.default_rng(seed).integers(3, 14, n)


def long_tailed(seed: int = 0) -> np.ndarray:
    """Forty short samples and four of 400..1023 tokens."""
    g = np.random.default_rng(seed)
    return np.concatenate([g.integers(8, 40, 40), g.integers(400, 1024, 4)])


def mask_blocks(docs: list[int], row_len: int, block: int = FLEX_BLOCK) -> int:
    """Brute force: blocks of the dense (same document, key <= query) mask holding at least one allowed pair."""
    ids = np.repeat(np.arange(len(docs) + 1), [*docs, row_len - sum(docs)])
    allowed = (ids[:, None] == ids[None, :]) & np.tri(row_len, dtype=bool)
    nb = -(-row_len // block)
    return sum(bool(allowed[i * block:(i + 1) * block, j * block:(j + 1) * block].any())
               for i in range(nb) for j in range(nb))


@pytest.mark.parametrize("seed", range(6))
def test_flex_block_counts_equal_a_brute_force_count_over_the_mask(seed: int) -> None:
    g = np.random.default_rng(seed)
    row_len = int(g.integers(1, 6)) * FLEX_BLOCK - int(g.integers(0, 40))
    docs, left = [], row_len
    while left > 0 and g.random() < 0.9:
        d = int(min(left, g.integers(1, 300)))
        docs.append(d)
        left -= d
    assert document_blocks(docs, row_len, "flex") == mask_blocks(docs, row_len)
    nb = -(-row_len // FLEX_BLOCK)
    assert document_blocks(docs, row_len, "dense") == nb * nb
    assert document_blocks([row_len], row_len, "flex") == causal_blocks(row_len)  # one document: causal attention


def test_attention_read_off_the_cost_model_is_the_analytic_models_attention_term() -> None:
    """2 (f(b, s) - f(2b, s / 2)) isolates the quadratic term: for the analytic model above its launch floor it
    equals its attention FLOPs over its attention rate, forward and backward, to fp64 rounding (relative 1e-9: a
    difference of two terms within a factor of ten of each other loses at most one digit of fp64's sixteen); on the
    floor, where attention changes nothing, it is zero."""
    shape = ModelShape("gpt", num_layers=24, hidden_size=2048, num_heads=16, ffn_hidden_size=8192, vocab_size=32000)
    model = AnalyticCostModel(shape, warn=False)  # large enough that its layers run above the launch floor
    seq, rows = np.array([1024.0, 2048.0, 4096.0]), np.array([8.0, 4.0, 2.0])
    fwd, bwd = causal_attention_seconds(model, "block", rows, seq, recompute=False, tp=1)
    d = model.device
    rate = d.peak_flops * d.gemm_efficiency * ATTENTION_EFFICIENCY
    flops = 4 * rows * seq * seq * shape.hidden_size * 0.5  # causal: half the (query, key) pairs
    np.testing.assert_allclose(fwd, flops / rate, rtol=1e-9)
    np.testing.assert_allclose(bwd, BACKWARD_ATTENTION * flops / rate, rtol=1e-9)
    floor = causal_attention_seconds(AnalyticCostModel(TINY, warn=False), "block", 1, 64, recompute=False, tp=1)
    assert floor == (0.0, 0.0)


def independent_fixed(kind: str, size: int, lengths: np.ndarray, cost_model, seq_len: int, attention: str,
                      pp: int = 1) -> float:
    """A fixed candidate's step time at dp = 1, without ``choose_step``: the recipes' own packing / token-budget
    groups, attention ratios from brute-force block counts, per-stage costs and 1F1B simulated in list order."""
    pairs = [(int(x), 0) for x in lengths]
    if kind == "packing":
        rows = plan_packing(pairs, (seq_len, 0))
        groups = [rows[k:k + size] for k in range(0, len(rows), size)]
        shape = (np.array([len(g) for g in groups]), np.full(len(groups), seq_len))
        ratio = np.array([sum(mask_blocks([int(lengths[i]) for i in row], seq_len) if attention == "flex"
                              else (-(-seq_len // FLEX_BLOCK)) ** 2 for row in g) / (len(g) * causal_blocks(seq_len))
                          for g in groups])
    else:
        groups = plan_token_budget(pairs, size)
        shape = (np.array([len(g) for g in groups]), np.array([max(int(lengths[i]) for i in g) for g in groups]))
        ratio = None
    mask = shape[0] * shape[1] ** 2.0 if kind == "packing" and attention == "dense" else None
    costs = evaluate(cost_model, stage_layers(TINY, pp), *shape, None, recompute=False, tp=1, attention_ratio=ratio,
                     mask_bytes=mask)
    orders = [build_schedule("1f1b", pp, 1, len(groups), r) for r in range(pp)]
    return simulate(orders, pp, lambda a: (costs.forward if a.kind == "F" else costs.backward)[a.stage, a.microbatch],
                    check=False).makespan


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("attention", ["flex", "dense"])
def test_the_choice_is_the_minimum_of_its_candidates_computed_independently(pp: int, attention: str) -> None:
    toy = ToyCostModel()
    lengths = short_batch()
    candidates = ["dynamic", "packed_dynamic", "packing@1", "packing@4", "token_budget@64", "token_budget@256"]
    choice = choose_step(lengths, candidates=candidates, cost_model=toy, shape=TINY, dp=1, pp=pp, memory_budget=BIG,
                         max_seq_len=64, packed_attention=attention)
    options = dict(cost_model=toy, shape=TINY, dp=1, pp=pp, memory_budget=BIG, max_seq_len=64)
    expected = {"dynamic": plan_step(lengths, **options).makespan,
                "packed_dynamic": plan_packed_step(lengths, packed_attention=attention, **options).makespan}
    for name in candidates[2:]:
        kind, size = name.split("@")
        expected[name] = independent_fixed(kind, int(size), lengths, toy, 64, attention, pp)
    assert list(choice.predicted) == candidates and not choice.refused
    for name in candidates:  # the same arithmetic in another order: fp64 rounding only
        assert choice.predicted[name] == pytest.approx(expected[name], rel=1e-12), name
    assert choice.chosen == min(candidates, key=lambda n: (expected[n], candidates.index(n)))
    assert choice.plan.makespan == choice.predicted[choice.chosen]


def test_many_short_samples_pick_packed_rows_and_a_long_tail_picks_the_dynamic_partition() -> None:
    toy = ToyCostModel()
    fixed = ["dynamic", "packing@2", "packing@8", "token_budget@64"]
    short = choose_step(short_batch(), candidates=fixed, cost_model=toy, shape=TINY, dp=1, pp=1, memory_budget=BIG,
                        max_seq_len=64, packed_attention="flex")
    assert short.chosen == "packing@8"  # rows of 64 tokens, no padding, fewest micro-batches
    assert short.predicted["dynamic"] > 1.1 * short.predicted["packing@8"]  # a third of dynamic's tokens are padding
    both = choose_step(short_batch(), candidates=["dynamic", "packed_dynamic", *fixed[1:]], cost_model=toy, shape=TINY,
                       dp=1, pp=1, memory_budget=BIG, max_seq_len=64, packed_attention="flex")
    assert both.chosen == "packed_dynamic" and both.plan.replicas[0].microbatches[0].rows is not None
    # Attention-heavy costs: packing long samples with short ones costs whole blocks of the long documents, and the
    # pipeline's fill and drain favour small first and last micro-batches.
    tail = choose_step(long_tailed(), candidates=default_candidates(1024), cost_model=ToyCostModel(per_pair=2e-8),
                       shape=TINY, dp=1, pp=2, memory_budget=BIG, max_seq_len=1024, packed_attention="flex")
    assert tail.chosen == "dynamic"
    assert min(v for k, v in tail.predicted.items() if k != "dynamic") > 1.04 * tail.predicted["dynamic"]


def test_dense_masks_make_packing_pay_for_whole_rows() -> None:
    """The same packed rows cost more attention under SDPA's dense mask than under FlexAttention's block mask,
    and the dense mask's bytes count in memory: a budget between the two peaks refuses dense packing only."""
    toy = ToyCostModel(per_pair=2e-8)
    lengths = long_tailed()
    kw = dict(candidates=["packing@2"], cost_model=toy, shape=TINY, dp=1, pp=1, max_seq_len=1024)
    flex = choose_step(lengths, memory_budget=BIG, packed_attention="flex", **kw)
    dense = choose_step(lengths, memory_budget=BIG, packed_attention="dense", **kw)
    assert dense.predicted["packing@2"] > 1.3 * flex.predicted["packing@2"]
    assert dense.plan.peak_memory - flex.plan.peak_memory == pytest.approx(2 * 1024**2)  # 2 rows of 1024^2 bytes
    budget = (flex.plan.peak_memory + dense.plan.peak_memory) / 2
    assert choose_step(lengths, memory_budget=budget, packed_attention="flex", **kw).chosen == "packing@2"
    with pytest.raises(ValueError, match=r"No micro-batching candidate fits memory_budget=.*packing@2: its simulated"
                                         r" peak of .* bytes of activations exceeds"):
        choose_step(lengths, memory_budget=budget, packed_attention="dense", **kw)


def test_a_candidate_over_the_memory_budget_is_refused_and_the_others_compete() -> None:
    toy = ToyCostModel()
    lengths = short_batch()
    kw = dict(cost_model=toy, shape=TINY, dp=1, pp=1, max_seq_len=64)
    free = choose_step(lengths, candidates=["packing@8", "packing@1"], memory_budget=BIG, **kw)
    one_row = choose_step(lengths, candidates=["packing@1"], memory_budget=BIG, **kw).plan.peak_memory
    tight = choose_step(lengths, candidates=["packing@8", "packing@1"], memory_budget=one_row, **kw)
    assert free.chosen == "packing@8" and tight.chosen == "packing@1"  # 8 rows a micro-batch hold 8 rows' bytes
    assert tight.predicted["packing@8"] == float("inf") and "exceeds memory_budget" in tight.refused["packing@8"]


def test_packed_micro_batches_reach_a_multiple_by_halving_then_dealing_rows() -> None:
    """Halving first (the micro-batch of most rows, the first on ties), then the row of most documents dealt into two
    rows of balanced tokens in the row's order; the error once every micro-batch is one row of one document."""
    from lightning_3d.dynamic.packed import packed_groups_to_multiple, split_row

    tokens = [50, 10, 40, 30, 20, 5, 7]
    # by tokens 50, 40, 30, 20, 10: 50 left; 40, 30 right (70); 20 left (70); the tie puts 10 left
    assert split_row([0, 1, 2, 3, 4], tokens) == ([0, 1, 4], [2, 3])
    groups = packed_groups_to_multiple([[[0, 1], [2]], [[3]]], tokens, 4)
    assert groups == [[[0]], [[1]], [[2]], [[3]]]  # halve the two-row micro-batch, then deal row [0, 1]
    assert packed_groups_to_multiple([[[5], [6]], [[0, 1, 2]]], tokens, 3) == [[[5]], [[6]], [[0, 1, 2]]]
    with pytest.raises(ValueError, match="3 micro-batches cannot become a multiple of 2: every micro-batch holds one"
                                         " row of one document"):
        packed_groups_to_multiple([[[0]], [[1]], [[2]]], tokens, 2)
    with pytest.raises(ValueError, match="a row of 1 document"):
        split_row([3], tokens)


def test_interleaved_packing_candidates_split_rows_as_the_data_module_does() -> None:
    """packing@1 under an interleaved schedule: auto prices the rows the data module trains (halved, then dealt to a
    multiple of pp), so the candidate competes instead of being refused; its token-budget candidates are halved to
    the multiple as the data module halves them."""
    from lightning_3d.dynamic.packed import packed_groups_to_multiple

    lengths = short_batch()
    rows = plan_packing([(int(x), 0) for x in lengths], (64, 0))
    if len(rows) % 2 == 0:  # an odd count, so that one row has to be dealt
        lengths = lengths[:-1]
        rows = plan_packing([(int(x), 0) for x in lengths], (64, 0))
    assert len(rows) % 2 == 1
    choice = choose_step(lengths, candidates=["packing@1"], cost_model=ToyCostModel(), shape=TINY, dp=1, pp=2,
                         virtual_stages=2, schedule="interleaved_1f1b", memory_budget=BIG, max_seq_len=64)
    assert not choice.refused
    planned = [list(map(list, mb.rows)) for mb in choice.plan.replicas[0].microbatches]
    assert planned == packed_groups_to_multiple([[row] for row in rows], [int(x) for x in lengths], 2)
    assert len(planned) == len(rows) + 1
    assert sorted(i for group in planned for row in group for i in row) == list(range(len(lengths)))
    # The data module's micro-batches of the same samples hold the same rows: each sample's tokens are its index + 1,
    # read back per document of each collated row (the padding tail, pad id 0, left out).
    samples = [{"tokens": np.full(int(n) + 1, i + 1), "prompt": 1} for i, n in enumerate(lengths)]
    collated = StepCollator("gpt", "packing", 1, 0, seq_length=64, target_length=0, pad_id=0, micro_batch_size=1,
                            token_budget=None, microbatch_multiple=2).microbatches(samples)
    trained = []
    for mb in collated:
        trained.append([[int(ids[docs == d][0]) - 1 for d in docs.unique().tolist() if ids[docs == d][0] != 0]
                        for ids, docs in zip(mb["input_ids"], mb["document_ids"], strict=True)])
    assert trained == planned
    # Padded token-budget micro-batches: halved to the multiple the same way on both sides (the data module's
    # split_to_multiple on tensors), compared by each micro-batch's samples; a budget that makes an odd count.
    def token_budget(multiple: int) -> list:
        return StepCollator("gpt", "token_budget", 1, 0, seq_length=64, target_length=0, pad_id=0, micro_batch_size=1,
                            token_budget=72, microbatch_multiple=multiple)(samples)

    assert len(token_budget(1)) % 2 == 1
    budget = choose_step(lengths, candidates=["token_budget@72"], cost_model=ToyCostModel(), shape=TINY, dp=1, pp=2,
                         virtual_stages=2, schedule="interleaved_1f1b", memory_budget=BIG, max_seq_len=64)
    padded = token_budget(2)
    assert len(padded) == len(token_budget(1)) + 1 and not budget.refused
    assert [sorted(mb.samples) for mb in budget.plan.replicas[0].microbatches] == [
        sorted(int(row[0]) - 1 for row in mb["input_ids"]) for mb in padded]


@pytest.mark.parametrize("layout", [dict(dp=1, pp=2), dict(dp=2, pp=1), dict(dp=2, pp=2),
                                    dict(dp=1, pp=2, virtual_stages=2, schedule="interleaved_1f1b")])
@pytest.mark.parametrize("t5", [False, True])
def test_packed_dynamic_plans_cover_every_sample_once_in_rows_that_fit(layout: dict, t5: bool) -> None:
    from tests.scenarios.dynamic_costs import T5_TINY

    g = np.random.default_rng(3)
    inputs = g.integers(1, 100, 40)
    targets = g.integers(1, 30, 40) if t5 else None
    plan = plan_packed_step(inputs, target_lengths=targets, cost_model=ToyCostModel(), shape=T5_TINY if t5 else TINY,
                            memory_budget=3e6, max_seq_len=128, max_target_len=32 if t5 else None,
                            packed_attention="dense", **layout)
    seen = []
    for replica in plan.replicas:
        assert replica.microbatches and max(replica.peak_memory) <= 3e6
        if layout.get("virtual_stages"):
            assert len(replica.microbatches) % layout["pp"] == 0
        for mb in replica.microbatches:
            assert mb.rows is not None and mb.samples == tuple(i for row in mb.rows for i in row)
            for row in mb.rows:
                assert sum(inputs[list(row)]) <= mb.seq_len <= 128 and mb.seq_len % 8 == 0
                if t5:
                    assert sum(targets[list(row)]) <= mb.target_len <= 32
            seen += mb.samples
    assert sorted(seen) == list(range(40))
    assert plan == plan_packed_step(inputs, target_lengths=targets, cost_model=ToyCostModel(),
                                    shape=T5_TINY if t5 else TINY, memory_budget=3e6, max_seq_len=128,
                                    max_target_len=32 if t5 else None, packed_attention="dense", **layout)


@pytest.mark.parametrize("t5", [False, True])
def test_full_packed_rows_are_the_fill_rows_at_the_model_length(t5: bool) -> None:
    """``packed_row_length="full"`` (a compiled model's): the same rows as "fill", every one at ``max_seq_len`` (and
    ``max_target_len``), priced at that length; the choice hands it to packed_dynamic only."""
    from tests.scenarios.dynamic_costs import T5_TINY

    g = np.random.default_rng(5)
    inputs = g.integers(1, 100, 40)
    targets = g.integers(1, 30, 40) if t5 else None
    kw = dict(target_lengths=targets, cost_model=ToyCostModel(), shape=T5_TINY if t5 else TINY, dp=2, pp=1,
              memory_budget=BIG, max_seq_len=128, max_target_len=32 if t5 else None, packed_attention="dense")
    fill, full = (plan_packed_step(inputs, packed_row_length=n, **kw) for n in ("fill", "full"))
    rows = [[row for mb in r.microbatches for row in mb.rows] for r in (*fill.replicas, *full.replicas)]
    assert sorted(map(tuple, rows[0] + rows[1])) == sorted(map(tuple, rows[2] + rows[3]))  # one packing, two lengths
    assert any(mb.seq_len < 128 for r in fill.replicas for mb in r.microbatches)
    for mb in (mb for r in full.replicas for mb in r.microbatches):
        assert mb.seq_len == 128 and mb.target_len == (32 if t5 else None)
    assert full.makespan >= fill.makespan  # longer rows cost no less under a cost that grows with the length
    for name, plan in (("fill", fill), ("full", full)):
        assert choose_step(inputs, candidates=["packed_dynamic"], packed_row_length=name, **kw).plan == plan
    both = [choose_step(inputs, candidates=["packed_dynamic", "packing@2"], packed_row_length=n, **kw).predicted
            for n in ("fill", "full")]
    assert both[0]["packing@2"] == both[1]["packing@2"]  # the packing candidate's rows are full either way
    assert (both[0]["packed_dynamic"], both[1]["packed_dynamic"]) == (fill.makespan, full.makespan)
    for call in (lambda: plan_packed_step(inputs, packed_row_length="static", **kw),
                 lambda: choose_step(inputs, candidates=["packed_dynamic"], packed_row_length="static", **kw)):
        with pytest.raises(ValueError, match=r"packed_row_length='static': use 'fill' \(rows as long as a micro-batch's"
                                             r" fullest, rounded up\) or 'full'"):
            call()


def test_flex_rows_round_to_the_block_size_and_short_documents_cost_less_than_causal_rows() -> None:
    """Under FlexAttention a row's padded length is a multiple of its block (few block-mask shapes), and a row of
    short documents computes about two blocks per block row (the diagonal, and the one a document crossing the
    block boundary reaches back into) instead of causal attention's triangle."""
    lengths = short_batch(400)
    plan = plan_packed_step(lengths, cost_model=ToyCostModel(), shape=TINY, dp=1, pp=1, memory_budget=BIG,
                            max_seq_len=2048, packed_attention="flex")
    mbs = plan.replicas[0].microbatches
    assert {mb.seq_len % FLEX_BLOCK for mb in mbs} == {0}
    for mb in mbs:
        docs = [[int(lengths[i]) for i in row] for row in mb.rows]
        ratio = attention_ratio(docs, mb.seq_len, "flex")
        assert ratio == sum(mask_blocks(d, mb.seq_len) for d in docs) / (len(docs) * causal_blocks(mb.seq_len))
        nb = mb.seq_len // FLEX_BLOCK
        assert ratio <= (2 * nb - 1) / (nb * (nb + 1) / 2) < 0.5


@pytest.mark.parametrize(("names", "message"), [
    ("dynamic", r"candidates='dynamic': give a non-empty list"),
    ([], r"give a non-empty list"),
    (["dynamic", "padding@4"], r"candidate 'padding@4': use one of dynamic, packed_dynamic, packing@N"),
    (["dynamic@2"], r"candidate 'dynamic@2': dynamic takes no size"),
    (["packing"], r"candidate 'packing': packing needs a positive size after @, e.g. packing@2"),
    (["packing@0"], r"needs a positive size"),
    (["token_budget@100"], r"candidate 'token_budget@100': a token budget below the longest sample \(128 tokens\)"
                           r" cannot hold it; use token_budget@128 or more"),
    (["packing@2", "packing@2"], r"names a candidate twice"),
])
def test_bad_candidates_name_the_value_and_the_fix(names, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_candidates(names, 128)


def test_default_candidates_reach_32_rows_and_16_longest_samples() -> None:
    assert default_candidates(100) == (
        "dynamic", "packed_dynamic", "packing@1", "packing@2", "packing@4", "packing@8", "packing@16", "packing@32",
        "token_budget@100", "token_budget@200", "token_budget@400", "token_budget@800", "token_budget@1600")
    assert parse_candidates(default_candidates(100), 100)  # every default parses at that longest sample


def test_bad_batcher_and_data_module_options_are_refused(tmp_path) -> None:
    from lightning_3d.recipes.data.multitask import MultiTaskDataModule

    kw = dict(shape=TINY, dp=1, pp=1, dp_rank=0, memory_budget=BIG, max_seq_len=64)
    collate = StepCollator("gpt", "padding", 1, 0, seq_length=64, target_length=0, pad_id=0, micro_batch_size=2,
                           token_budget=None).collate
    with pytest.raises(ValueError, match=r"include packed rows: pass collate_packed"):
        DynamicMicroBatcher(collate, candidates=["dynamic", "packing@2"], **kw)
    with pytest.raises(ValueError, match=r"packed_attention='flash': use 'flex'"):
        DynamicMicroBatcher(collate, candidates=["dynamic"], packed_attention="flash", **kw)
    with pytest.raises(ValueError, match=r"packed_row_length='padded': use 'fill'"):
        DynamicMicroBatcher(collate, candidates=["dynamic"], packed_row_length="padded", **kw)
    with pytest.raises(ValueError, match=r"candidates need max_seq_len"):
        DynamicMicroBatcher(collate, candidates=["dynamic"], **{**kw, "max_seq_len": None})
    with pytest.raises(ValueError, match=r"auto_candidates=\['packing@2'\] applies to microbatching='auto' only, not"
                                         r" 'dynamic'"):
        MultiTaskDataModule(microbatching="dynamic", auto_candidates=["packing@2"], cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"candidate 'token_budget@100': a token budget below the longest sample"):
        MultiTaskDataModule(microbatching="auto", auto_candidates=["token_budget@100"], seq_length=256,
                            cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"microbatching='fastest': use one of"):
        MultiTaskDataModule(microbatching="fastest", cache_dir=str(tmp_path))


def gpt_samples(n: int, seed: int = 0) -> list[dict]:
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        inputs, targets = g.integers(1, 300, g.integers(1, 12)), g.integers(1, 300, g.integers(1, 6))
        out.append({"tokens": np.concatenate([inputs, targets, [0]]), "prompt": len(inputs)})
    return out


def test_the_batcher_collates_the_choice_and_plan_waits_record_it() -> None:
    """Every replica chooses the same candidate and together they score every target token once; packed choices
    arrive as rows with document ids; ``PlanWaits`` records the chosen candidate and its prediction per step."""
    samples = gpt_samples(24)
    expected = sum(len(s["tokens"]) - s["prompt"] for s in samples)
    waits, firsts = PlanWaits(), []
    for candidates in (["packing@2"], ["token_budget@64"], list(default_candidates(32))):
        steps = []
        for rank in range(2):
            collator = StepCollator("gpt", "auto", 2, rank, seq_length=32, target_length=0, pad_id=0,
                                    micro_batch_size=2, token_budget=None)
            collator.dynamic = DynamicMicroBatcher(
                collator.collate, shape=TINY, dp=2, pp=1, dp_rank=rank, memory_budget=BIG, cost_model=ToyCostModel(),
                max_seq_len=32, candidates=candidates, collate_packed=collator.collate_packed, packed_attention="dense",
                input_length=sample_input_length)
            steps.append(collator(samples))
        assert steps[0].choice == steps[1].choice and steps[0].choice.chosen in candidates
        packed = steps[0].choice.chosen.partition("@")[0] in ("packing", "packed_dynamic")
        assert all(("document_ids" in mb) == packed for s in steps for mb in s)
        assert sum(int((mb["labels"] != IGNORE_INDEX).sum()) for s in steps for mb in s) == expected
        crossed = pickle.loads(pickle.dumps(steps[0]))  # as from a DataLoader worker: the record travels along
        assert crossed.choice == steps[0].choice and len(crossed) == len(steps[0])
        list(waits.wrap(iter([crossed])))
        firsts.append(steps[0])
    assert waits.choices == [s.choice.chosen for s in firsts]
    assert waits.choices[:2] == ["packing@2", "token_budget@64"]
    assert waits.predicted_s == [s.choice.predicted[s.choice.chosen] for s in firsts]
    assert waits.summary()["choices"] == {name: waits.choices.count(name) for name in set(waits.choices)}


def test_the_choice_is_deterministic_across_processes() -> None:
    """The choice is a pure function of the batch: a fresh interpreter computes the same predictions bit for bit."""
    import json
    import subprocess
    import sys

    script = ("import json, numpy as np; from lightning_3d.dynamic.choice import choose_step, default_candidates;"
              " from tests.scenarios.dynamic_costs import TINY, ToyCostModel;"
              " c = choose_step(np.random.default_rng(1).integers(1, 200, 60), candidates=default_candidates(256),"
              " cost_model=ToyCostModel(), shape=TINY, dp=2, pp=2, memory_budget=1e7, max_seq_len=256,"
              " packed_attention='flex'); print(json.dumps([c.chosen, {k: v.hex() for k, v in c.predicted.items()}]))")
    root = Path(__file__).resolve().parent.parent
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=root).stdout
            for _ in range(2)]
    assert runs[0] == runs[1]
    chosen, predicted = json.loads(runs[0])
    assert chosen == min(predicted, key=lambda k: float.fromhex(predicted[k]))


@pytest.mark.parametrize(("model_type", "asked", "priced"), [("gpt", "auto", "dense"), ("gpt", "flex", "flex"),
                                                             ("gpt", "sdpa", "dense"), ("t5", None, "dense")])
def test_the_data_module_prices_packed_rows_as_the_model_runs_them(tmp_path, model_type: str, asked, priced) -> None:
    """GPT's packed rows are priced as the model resolves ``packed_attention`` on its device (on CPU "auto" is the
    dense SDPA mask; "flex" is priced as flex, and refused by the strategy before training on CPU); T5's are dense.
    The planner gets the data module's candidates, budget and lengths."""
    from types import SimpleNamespace

    import torch

    from lightning_3d.recipes import GPT, T5
    from lightning_3d.recipes.data.multitask import MultiTaskDataModule

    flan = Path(__file__).parent / "data" / "multitask" / "flan_tiny.jsonl"
    dm = MultiTaskDataModule(model_type=model_type, data_files=str(flan), tokenizer="bytes", seq_length=256,
                             target_length=64, global_batch_size=8, microbatching="auto", memory_budget_gb=0.02,
                             auto_candidates=["packing@2", "dynamic"], val_fraction=0.1, cache_dir=str(tmp_path))
    dm.setup("fit")
    model = (GPT("tiny", vocab_size=dm.vocab_size, seq_length=256, packed_attention=asked) if model_type == "gpt"
             else T5("tiny", vocab_size=dm.vocab_size, pad_token_id=dm.pad_token_id, eos_token_id=dm.eos_token_id))
    strategy = SimpleNamespace(dims=SimpleNamespace(dp=2, pp=1, tp=1), schedule="1f1b", virtual_stages=1,
                               pipeline_layer_split=None, root_device=torch.device("cpu"))
    dm.trainer = SimpleNamespace(lightning_module=model, strategy=strategy, precision="32-true")
    batcher = dm.collator(2, 1).dynamic
    assert batcher.packed_attention == priced and batcher.candidates == ("packing@2", "dynamic")
    assert batcher.options["memory_budget"] == 0.02 * 2**30 and batcher.options["max_seq_len"] == 256
    assert batcher.options["max_target_len"] == (64 if model_type == "t5" else None)
    step = dm.collator(2, 1)([dm.train_dataset[i] for i in range(8)])
    assert step.choice.chosen in ("packing@2", "dynamic") and set(step.choice.predicted) == {"packing@2", "dynamic"}
    # Packed rows at each micro-batch's own length, unless the model compiles its blocks: then full rows.
    assert batcher.packed_row_length == "fill"
    model.hparams["compile"] = True
    assert dm.collator(2, 1).dynamic.packed_row_length == "full"
