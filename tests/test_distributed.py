"""Distributed behaviour on CPU (gloo): each process group runs many checks. The scenarios of one world size share
one launch (tests/scenarios/group.py; module-scoped fixtures below): starting a group costs about as much as a
scenario's checks. Each test still reads only its own scenario's report.

Tolerances: fp32 losses and final parameters within 1e-5 relative of the single-process reference
(see tests/scenarios/common.py for why the reference's Adam uses eps=1e-6).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import clean_env
from tests.launch import ROOT, run_scenario
from tests.scenarios.group import run_group
from tests.tolerance import loss_tolerance, scaled_error, t5_tolerance

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """World 2: the layouts, T5's layouts (with the transformers T5 they import) and the bad inputs (last: they
    end with a healthy fit of their own, and leave nothing the others read)."""
    folder = tmp_path_factory.mktemp("two_ranks")
    hf_dir = folder / "hf_t5"
    hf = _tiny_hf_t5(hf_dir)  # before the launch: the scenario imports it
    reports = run_group(2, [("layouts", ""), ("t5_layouts", str(hf_dir)), ("errors", "")], folder, timeout=1100)
    return {**reports, "hf": hf}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """World 4: the layouts, Optimus-CC's compression, the features (plain module, evaluation, resume) and T5's
    layouts."""
    folder = tmp_path_factory.mktemp("four_ranks")
    return run_group(4, [("layouts", ""), ("compression", ""), ("features", ""), ("t5_layouts", str(folder / "no_hf"))],
                  folder, timeout=1100)


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """World 8: the (2,2,2) layouts and compression stack, then the resharding checkpoints saved at (2,2,2)."""
    folder = tmp_path_factory.mktemp("eight_ranks")
    reports = run_group(8, [("layouts", ""), ("reshard", f"save,{folder / 'ckpt'}")], folder, timeout=1100)
    return {**reports, "ckpt": folder / "ckpt"}


GROUPED = {2: "two_ranks", 4: "four_ranks", 8: "eight_ranks"}


def _check(results: list[dict]) -> None:
    bad = [r for r in results if not (r["loss_err"] <= TOLERANCE and r["param_err"] <= TOLERANCE)]
    assert not bad, f"layouts off the reference: {bad}"


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_layout_and_schedule_matches_single_process_training(world: int, tmp_path: Path,
                                                                   request: pytest.FixtureRequest) -> None:
    if world in GROUPED:
        report = request.getfixturevalue(GROUPED[world])["layouts"]
    else:
        report = run_scenario(world, "layouts", ["--world", str(world)], tmp_path / "report.json", timeout=900)
    results = report["results"]
    _check(results)
    layouts = {(r["dp"], r["pp"], r["tp"]) for r in results}
    expected = {(dp, pp, world // (dp * pp)) for dp in range(1, world + 1) for pp in range(1, world + 1) if world % (dp * pp) == 0}
    assert layouts == ({(2, 2, 2)} if world == 8 else expected)
    if world == 8:  # the compression stack at (2,2,2): exact at full rank, and compressing while it learns
        exact = report["exact_222"]
        assert exact["loss_err"] <= TOLERANCE and exact["param_err"] <= TOLERANCE and exact["compressed_sends"] > 0, exact
        full = report["full_stack_222"]
        assert full["losses"][-1] < full["losses"][0] - 0.05, full["losses"]
        for kind in ("backward_activation_grads", "dp_gradients"):
            before, after = full["bytes"][kind]
            assert 0 < after < before / 2, (kind, full["bytes"])
        assert full["bytes"]["forward_activations"][0] == full["bytes"]["forward_activations"][1] > 0  # never compressed
        assert full["bytes"]["embedding_sync"][0] > 0  # FE: the tied embedding travels in its own all-reduce
        sharded = report["sharded_222"]  # shard_optimizer_state at (2,2,2); tests/test_sharded_optimizer.py has the rest
        assert sharded["loss_err"] <= TOLERANCE and sharded["param_err"] <= TOLERANCE and sharded["bytes_off"] == 0.0, sharded
    for layout in layouts:
        if layout[1] > 1:  # every schedule ran for every pipelined layout
            expected_schedules = {"gpipe", "1f1b", "interleaved_1f1b"} | ({"zb_h1", "zb_interleaved"} if world != 8 else set())
            assert {r["schedule"] for r in results if (r["dp"], r["pp"], r["tp"]) == layout} >= expected_schedules
    zero_bubble = [r for r in results if r["schedule"] in ("zb_h1", "zb_interleaved")]
    assert all(r["w_ran"] == 1.0 for r in zero_bubble), zero_bubble  # split backwards ran (W actions) on ranks > 0
    # fused layers split themselves; with fusion off the plain nn.Linear layers became split layers; tensor-parallel
    # (DTensor) weights keep their gradients in B (docs/extending.md), and the run is still exact
    assert all(r["split_layers"] > 0 if r.get("fusion") is False else r["fused_layers"] > 0 for r in zero_bubble
               if r["tp"] == 1)
    assert all(r["split_layers"] == r["fused_layers"] == 0 for r in zero_bubble if r["tp"] > 1)
    for schedule in ("zb_h1", "zb_interleaved"):  # split plain layers ran with each zero-bubble schedule
        assert world not in (2, 4) or any(r.get("fusion") is False for r in zero_bubble if r["schedule"] == schedule)
    if world == 4:  # zero bubble with CB at full rank (B's sends compressed) and with ZeRO-1, both exact
        sharded = report["zb_sharded"]
        for cb in (report["zb_cb"], report["zbi_cb"]):  # zb_h1, zb_interleaved
            assert cb["loss_err"] <= TOLERANCE and cb["param_err"] <= TOLERANCE and cb["compressed_sends"] > 0, cb
        assert sharded["loss_err"] <= TOLERANCE and sharded["param_err"] <= TOLERANCE and sharded["bytes_off"] == 0.0, sharded
    if world in (2, 4):  # sequence parallel, accumulation and variable micro-batch shapes/counts were covered
        assert any(r.get("sp") for r in results) and any(r.get("variable") for r in results)
        assert world != 2 or any(r.get("ordered") is True for r in results)  # an explicit per-step schedule ran
        assert world != 2 or any(r["schedule"] == "reverse_gpipe" for r in results)  # tests/schedule_example.py
        assert world != 2 or any(r.get("mixed_fusion") is True for r in results)  # fused and unfused weights at dp = 2
        if world == 2:  # the default num_microbatches (= pp) ran, and only stage 0 recomputed its blocks
            derived = [r for r in results if r.get("stage_ac")]
            # (and zero bubble, plain and interleaved, recomputed each checkpointed block once, in B: W reuses what B
            # saved)
            assert [(r["m"], r["microbatches_run"], r["recomputed_as_asked"]) for r in derived] == [
                (2, 2.0, True), (4, 4.0, True), (4, 4.0, True)], derived


def test_bad_inputs_raise_on_every_rank_before_any_collective(two_ranks: dict) -> None:
    report = two_ranks["errors"]
    failed = [c for c in report["cases"] if not c["ok"]]
    assert not failed, failed
    assert len(report["cases"]) == 12
    assert len(report["healthy_losses"]) == 2


def test_plain_module_validation_test_and_exact_resume(four_ranks: dict) -> None:
    report = four_ranks["features"]
    assert report["plain"]["param_err"] <= TOLERANCE
    evaluation = report["evaluation"]
    assert evaluation["rank_spread"] == 0.0  # every rank reports the same loss
    for key in ("val", "test", "val_uneven_microbatches"):
        assert abs(evaluation[key] - evaluation["expected"]) <= TOLERANCE * evaluation["expected"]
    mixed = report["mixed_precision"]
    # stage 0 of (2,2,1): 2 steps x 4 micro-batches of 1 sequence x 16 tokens x 48 hidden, 2 bytes each in bf16
    assert mixed["bf16"]["sent"] == 2 * 4 * 16 * 48 * 2 and mixed["fp32"]["sent"] == 2 * mixed["bf16"]["sent"]
    assert mixed["bf16"]["losses"] == pytest.approx(mixed["fp32"]["losses"], rel=1e-2) and len(mixed["bf16"]["losses"]) == 2
    for run in report["resume"]:
        assert run["checkpoint_is_dir"]
        assert run["resumed"] == run["straight"], run  # bitwise: same data, optimizer, schedule and RNG state
        assert run["max_param_diff"] == 0.0


def test_checkpoint_saved_at_222_resumes_in_other_layouts(tmp_path: Path, eight_ranks: dict) -> None:
    """Same next-step loss after resuming a (2,2,2) checkpoint at (1,4,2), (2,1,1) and (1,1,1), for GPT and T5:
    DTensor shards, pipeline stages, the tied head's optimizer state and the tp-dependent vocabulary padding all
    reshard; for T5 also the relative-bias tables (head-sharded) and stage cuts inside and between the two stacks."""
    folder, saved = eight_ranks["ckpt"], eight_ranks["reshard"]
    losses = {recipe: {"1,4,2": saved[recipe]["1,4,2"]} for recipe in ("gpt", "t5")}
    # The two resumes only read the checkpoint: side by side (3 processes; each launch has its own port and report).
    with ThreadPoolExecutor(2) as pool:
        reports = {layout: pool.submit(run_scenario, world, "reshard",
                                       ["--world", str(world), "--extra", f"resume,{folder},{layout}"],
                                       tmp_path / f"resume{world}.json", timeout=600)
                   for world, layout in ((2, "2,1,1"), (1, "1,1,1"))}
        for layout, report in reports.items():
            for recipe in losses:
                losses[recipe][layout] = report.result()[recipe]
    for recipe, by_layout in losses.items():
        expected = saved[recipe]["straight"][2]
        for layout, loss in by_layout.items():
            assert abs(loss - expected) <= TOLERANCE * expected, (recipe, layout, loss, expected)


def test_torchrun_across_two_nodes(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = clean_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    report = tmp_path / "report.json"
    nodes = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}",
               "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "tests.scenarios.torchrun_job", "--report", str(report)]
        nodes.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in nodes]
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-4000:] for o in outputs)
    result = json.loads(report.read_text())
    assert result["nodes"] == 2
    _check(result["results"])


def test_optimus_cc_compression(four_ranks: dict) -> None:
    """CB + LEP, FE and SC on 4 processes (see tests/scenarios/compression.py)."""
    from lightning_3d.pipeline.schedules import build_schedule

    report = four_ranks["compression"]
    for run in report["exact"]:  # CB at full rank, SC in warm-up, FE: the uncompressed result
        assert run["loss_err"] <= TOLERANCE and run["param_err"] <= TOLERANCE and run["compressed_sends"] > 0, run
    for run in report["epilogue"]:  # compressed sends per stage in one step of 4 stages, 8 micro-batches
        virtual = 3 if run["schedule"] == "interleaved_1f1b" else 1
        expected = [0.0] * 12
        for rank in range(4):
            for a in build_schedule(run["schedule"], 4, virtual, 8, rank):
                if a.kind == "B" and a.stage > 0 and (a.epilogue or not run["epilogue_only"]):
                    expected[a.stage] += 1
        assert run["per_stage"] == expected, run
    assert report["epilogue"][0]["per_stage"][:4] == [0, 3, 2, 1]  # 1F1B: stage r compresses its last pp - r
    # (2,2,1), 4 steps of M=4 micro-batches of 2 x 16 tokens, hidden 48, CB rank 4, SC on stage 0 from step 3.
    steps, m, tokens, hidden, rank = 4, 4, 2 * 16, 48, 4
    for row in report["selective"]["rows"]:
        fwd_b, fwd_a, bwd_b, bwd_a, dp_b, dp_a, emb, sc_on, sc_iter, dp_expected, pp_rank, sc_fp32 = row
        if pp_rank == 0:
            assert fwd_b == fwd_a == steps * m * tokens * hidden * 4 and bwd_b == 0
            assert sc_on == 1 and sc_iter == steps and dp_a == dp_expected < dp_b
            assert sc_fp32 == 1  # the strategy's sc_matmul_precision reached the compressor
        else:
            assert bwd_b == steps * m * tokens * hidden * 4 and bwd_a == steps * m * (tokens + hidden) * rank * 4
            assert sc_on == 0 and dp_a == dp_b == dp_expected  # SC touches only the chosen stage
        assert emb == steps * 384 * hidden * 4  # FE: one all-reduce of the (padded) tied embedding per step
    for name, rows in report["link"].items():  # one measurement, agreed by every rank; SC on stage 0 only if slower
        assert len({row[0] for row in rows}) == 1 and rows[0][0] > 0, rows
        expected_on = name == "infinite_threshold"
        assert [row[1] for row in rows] == [float(expected_on and row[2] == 0) for row in rows], (name, rows)
    learning = report["learning"]
    assert learning["compressed"][-1] < learning["compressed"][0] - 0.05
    assert learning["uncompressed"][-1] < learning["uncompressed"][0] - 0.05


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_failure_on_one_rank_ends_the_job_on_all_ranks(fail_rank: int) -> None:
    """Lightning's launcher starts the second process; whichever rank fails, nobody is left hanging. Without
    OMP_NUM_THREADS, each rank (the launched one too) takes its share of the cores, as Lightning's DDP ranks do."""
    env = clean_env(PYTHONPATH=str(ROOT))
    env.pop("OMP_NUM_THREADS", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "tests/scenarios/crash_job.py", "--fail-rank", str(fail_rank)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode != 0
    assert f"simulated failure on rank {fail_rank}" in proc.stdout + proc.stderr
    share = max(1, len(os.sched_getaffinity(0)) // 2) if hasattr(os, "sched_getaffinity") else max(1, os.cpu_count() // 2)
    for rank in range(2):
        assert f"rank {rank} intra-op threads {share} OMP_NUM_THREADS {share}" in proc.stdout, proc.stdout[-3000:]
    assert time.monotonic() - start < 450  # a hang would run into the timeout; ~20 s on an idle 2-core machine


def _tiny_hf_t5(path: Path):
    """A random transformers T5 (v1.1: gated-GELU, untied) with 2 + 2 blocks, saved with save_pretrained."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                      tie_word_embeddings=False, relative_attention_num_buckets=8, relative_attention_max_distance=16)
    model = T5ForConditionalGeneration(config)
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # transformers 5 ties it anyway
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model.eval()


def _t5_logits_check(ckpt: Path, tmp_path: Path) -> float:
    """Export a sharded T5 checkpoint with the CLI; return the largest logit difference to our model holding the
    checkpoint's full state (DCP's own converter), relative to the logits' scale (see tests/tolerance.py)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import T5ForConditionalGeneration

    from lightning_3d.checkpoint.files import META_FILE
    from lightning_3d.cli import main
    from lightning_3d.recipes.hf_t5 import t5_config_from_hparams
    from lightning_3d.recipes.t5.model import T5Model
    from tests.scenarios.t5_layouts import Pairs

    out = tmp_path / f"{ckpt.name}_hf"
    main(["export", "--checkpoint", str(ckpt), "--output", str(out)])
    dcp_to_torch_save(ckpt, tmp_path / f"{ckpt.name}.pt")
    state = {k.removeprefix("model."): v for k, v in torch.load(tmp_path / f"{ckpt.name}.pt", weights_only=False)["model"].items()}
    config = t5_config_from_hparams(torch.load(ckpt / META_FILE, weights_only=False)["hyper_parameters"])
    ours = T5Model(config, state["shared.weight"].shape[0]).eval()
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    batch = Pairs(16, seed=1)[0:4]
    inputs = (batch["input_ids"], batch["decoder_input_ids"], batch["attention_mask"])
    with torch.no_grad():
        expected = ours(*inputs)[..., : config.vocab_size]
        exported = T5ForConditionalGeneration.from_pretrained(out).eval()(*inputs[:1], decoder_input_ids=inputs[1],
                                                                        attention_mask=inputs[2]).logits
    return scaled_error(exported, expected)


# The layouts' T5 has 4 + 4 blocks (the transformers one 2 + 2), FFN width 64: exported logits equal ours up to
# summation order (tests/tolerance.py), relative to the logits' scale.
T5_LOGITS_TOL = t5_tolerance(4, 4, 64)


@pytest.mark.parametrize("world", [2, 4])
def test_t5_layouts_match_single_process_training(world: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """T5 (v1.0 tied + ReLU, v1.1 untied + gated-GELU) under the foundation layouts, every schedule, sequence
    parallelism, a stage spanning encoder and decoder, and CB + LEP / FE / SC at full rank (exact); on 2 ranks also
    export of sharded (1,2,1) / (1,1,2) checkpoints and import of a transformers T5 under (1,2,1) and (1,1,2)."""
    group = request.getfixturevalue(GROUPED[world])
    report, hf = group["t5_layouts"], group.get("hf")
    results = report["results"]
    _check(results)
    trained = [r for r in results if not r.get("pretrained")]
    layouts = {(r["dp"], r["pp"], r["tp"]) for r in trained}
    schedules = {r["schedule"] for r in trained if (r["dp"], r["pp"], r["tp"]) == ((1, 2, 1) if world == 2 else (1, 4, 1))}
    if world == 2:
        assert layouts == {(1, 2, 1), (2, 1, 1), (1, 1, 2)} and schedules == {"gpipe", "1f1b", "interleaved_1f1b"}
        (validated,) = [r for r in results if r.get("validate")]
        assert abs(validated["val_loss"] - validated["ref_val_loss"]) <= TOLERANCE * validated["ref_val_loss"]
        assert abs(validated["val_ppl"] - math.exp(validated["val_loss"])) <= TOLERANCE * validated["val_ppl"]
        for run in (r for r in results if r.get("save")):
            assert _t5_logits_check(Path(run["path"]), tmp_path) <= T5_LOGITS_TOL, run
        import torch
        import torch.nn.functional as F

        from tests.scenarios.t5_layouts import Pairs

        batch = Pairs()[0:4]
        with torch.no_grad():
            logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        decoder_input_ids=batch["decoder_input_ids"]).logits
        expected = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).item()
        for run in (r for r in results if r.get("pretrained")):
            assert run["weight_err"] == 0.0 and run["checked"] > 0, run
            assert abs(run["first_loss"] - expected) <= loss_tolerance(T5_LOGITS_TOL, logits), (run, expected)
            assert _t5_logits_check(Path(run["path"]), tmp_path) <= T5_LOGITS_TOL, run
    else:
        assert {(1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2)} <= layouts and schedules == {"1f1b", "interleaved_1f1b"}
        compressed = [r for r in results if r.get("compressed")]
        assert compressed and all(r["compressed_sends"] > 0 for r in compressed)
    assert any(r.get("sp") for r in results)
