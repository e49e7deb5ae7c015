"""The benchmark scripts on CPU (gloo, tiny model): they must keep working, because GPU time is scarce and a
broken script wastes a lease. Timings are not checked (never timed assertions in tests); results are."""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_train_throughput_runs_variants_in_one_process_group(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/parallel/train_throughput.py"), "--accelerator", "cpu", "--preset", "tiny",
           "--seq-length", "32", "--micro-batch-size", "2", "--num-microbatches", "4", "--layouts", "1,2,1",
           "--steps", "2", "--warmup", "1", "--precision", "32-true", "--timeout", "300",
           "--compression", "off", "cb", "cb-every", "all+allcb", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=600)
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["off", "cb", "cb-every", "all+allcb"]
    assert all(r["error"] is None and r["step_ms"]["n"] == 2 for r in rows.values()), rows
    bytes_ = {v: r["comm_bytes_last_step"] for v, r in rows.items()}
    grad = 2 * 32 * 128 * 4  # samples x tokens x hidden x fp32: one micro-batch's gradient, sent back by stage 1
    grads = 4 * grad  # 4 micro-batches
    factors = (2 * 32 + 128) * 16 * 4  # P (tokens x 16) + Q (hidden x 16), fp32: ratio 8192 / 3072 >= 2, compressed
    assert bytes_["off"]["backward_activation_grads"] == {"before": grads, "after": grads}
    # CB shrinks exactly the backward gradients; the forward is unchanged. By default (cb_epilogue_only=True) 1F1B's
    # stage 1 of 2 compresses only its cool-down send (its last pp - 1 = 1 backward); cb-every compresses all 4.
    expected = {"cb": 3 * grad + factors, "cb-every": 4 * factors, "all+allcb": 3 * grad + factors}
    for variant, after in expected.items():
        assert bytes_[variant]["backward_activation_grads"] == {"before": grads, "after": after}, variant
        assert bytes_[variant]["forward_activations"] == bytes_["off"]["forward_activations"]


def test_train_throughput_of_t5_on_synthetic_pairs(tmp_path: Path) -> None:
    """--model t5: synthetic (input, target) pairs through a 2-stage pipeline; tokens are inputs + targets and the
    FLOPs T5's per (input + target) token; the +throughput variant's monitor counts the same tokens in the real run."""
    import csv

    from lightning_3d.recipes.t5.config import preset

    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/parallel/train_throughput.py"), "--model", "t5", "--accelerator", "cpu",
           "--preset", "tiny", "--vocab-size", "512", "--seq-length", "32", "--target-length", "8",
           "--micro-batch-size", "2", "--num-microbatches", "2", "--layouts", "1,2,1", "--steps", "2", "--warmup", "1",
           "--precision", "32-true", "--timeout", "300", "--compression", "off", "off+throughput", "--compile", "default",
           "--profile", "--out", str(out)]
    env = {**os.environ, "L3D_COMPILE_BACKEND": "aot_eager"}  # compiled blocks in both stages, no C++ build on CI
    run = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    # --profile: rank 0's two profiler tables reach the driver's stdout, once per variant (a remote job returns
    # stdout, not the worker logs).
    assert run.stdout.count("PROFILE (2 steps, rank 0) by device time") == 2, run.stdout[-2000:]
    assert run.stdout.count("PROFILE by CPU time") == 2
    report = json.loads(out.read_text())
    assert report["config"]["compile"] == "default"
    flops_per_token = preset("tiny", vocab_size=512).flops_per_token(32, 8)
    assert report["model_name"] == "t5" and report["flops_per_token"] == flops_per_token
    for row in report["results"]:
        assert row["error"] is None and row["step_ms"]["n"] == 2, row
        assert row["tokens_per_step"] == 2 * 2 * (32 + 8) and row["target_length"] == 8
        assert abs(row["tflops_per_gpu"] - flops_per_token * row["tokens_per_s"] / 2 / 1e12) <= 1e-9 * row["tflops_per_gpu"]
        assert row["final_loss"] == row["final_loss"]  # not NaN
    logged = out.with_name("r_logs") / "dp1_pp2_tp1.off+throughput.logs" / "metrics.csv"
    rows = [r for r in csv.DictReader(logged.open()) if r.get("train/tokens")]
    assert rows and all(float(r["train/tokens"]) == float(r["train/samples"]) * (32 + 8) for r in rows)


def test_compression_kernels_report(tmp_path: Path) -> None:
    out = tmp_path / "k.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/compression/compression_kernels.py"), "--device", "cpu", "--hidden", "64",
           "--tokens", "128", "--ranks", "4", "8", "--repeats", "3", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["results"]
    assert [(r["hidden"], r["tokens"], r["rank"]) for r in rows] == [(64, 128, 4), (64, 128, 8)]
    for r in rows:  # sent = P (tokens x rank) + Q (hidden x rank), fp32
        assert abs(r["sent_MB"] - (128 + 64) * r["rank"] * 4 / 1e6) < 1e-12
        assert abs(r["ratio"] - 128 * 64 / ((128 + 64) * r["rank"])) < 1e-9


def test_peers_timeout_dumps_stacks_and_leaves_no_worker_behind(tmp_path: Path) -> None:
    """A system over --timeout is reported as an error, its log holds every worker's Python stack at that moment, and
    no worker survives it (torchrun starts them in sessions of their own: killing torchrun alone left them holding
    the GPUs through the next systems' measurements)."""
    out = tmp_path / "t.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/speed/peers.py"), "--accelerator", "cpu", "--preset", "tiny",
           "--vocab-size", "4096", "--seq-length", "32", "--gpus", "2", "--systems", "ours@1,2,1",
           "--num-microbatches", "2", "--warmup", "1", "--steps", "1000000", "--timeout", "45", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=300)
    (row,) = json.loads(out.read_text())["results"]
    assert row["error"].startswith("exit timeout"), row
    log = (tmp_path / "t_logs" / "00.log").read_text()
    # the ranks' stacks (both ranks write to one log, so their lines may interleave)
    assert "most recent call first" in log.lower() and "run_worker" in log, log[-3000:]
    leftover = [p for p in Path("/proc").glob("[0-9]*/cmdline")
                if str(tmp_path) in p.read_bytes().decode(errors="replace")] if Path("/proc").exists() else []
    assert not leftover, leftover


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text``."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                pids.append(int(cmdline.parent.name))
        except OSError:  # ended meanwhile
            pass
    return pids


def test_train_throughput_stopped_by_sigterm_leaves_no_worker_behind(tmp_path: Path) -> None:
    """`timeout` stops the driver with SIGTERM; its workers lead sessions of their own, so without the driver's
    cleanup they would go on holding the GPUs through the next measurements (and outlive the job)."""
    import signal
    import time

    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/parallel/train_throughput.py"), "--accelerator", "cpu", "--preset", "tiny",
           "--seq-length", "32", "--micro-batch-size", "2", "--num-microbatches", "2", "--layouts", "1,2,1",
           "--steps", "1000000", "--warmup", "1", "--precision", "32-true", "--out", str(out)]
    driver = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len([p for p in _processes_naming(str(tmp_path)) if p != driver.pid]) < 2:  # both workers started
            assert time.monotonic() < deadline and driver.poll() is None, "the workers never started"
            time.sleep(0.05)  # often: a stop that lands while the driver is still starting a worker counts too
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 128 + signal.SIGTERM
        assert not _processes_naming(str(tmp_path))
    finally:  # a failure here must not leave workers training on for the rest of the suite
        for pid in _processes_naming(str(tmp_path)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_peers_train_the_same_model_on_the_same_tokens(tmp_path: Path) -> None:
    """benchmarks/speed/peers.py: a plain loop, Lightning's ModelParallelStrategy (FSDP2 + TP, vocab-parallel loss), our
    strategy (two stages, each compiled as one graph, with the fused head/loss), transformers' GPT-2 compiled whole and
    our model compiled whole with its loss start from the same weights and see the same first tokens, so their
    first-step losses agree (bf16), also when every system's samples are collated by a worker process."""
    out = tmp_path / "p.json"
    systems = ["plain", "fsdp@1,2", "ours@1,2,1+compile+stage+fusedce", "hf+compile", "plain+whole"]
    cmd = [sys.executable, str(ROOT / "benchmarks/speed/peers.py"), "--accelerator", "cpu", "--preset", "tiny",
           "--vocab-size", "4096", "--seq-length", "32", "--micro-batch-size", "2", "--num-microbatches", "2",
           "--gpus", "2", "--systems", *systems, "--warmup", "1", "--steps", "2", "--num-workers", "1",
           "--trace", "--timeout", "300", "--out", str(out)]
    env = {**os.environ, "L3D_COMPILE_BACKEND": "aot_eager"}  # compiled systems without a C++ build on CI
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=900, env=env)
    rows = {r["label"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == systems
    for index, row in enumerate(rows.values()):
        # --trace records two more steps after the timed ones and keeps them out of the timings
        assert row["error"] is None and row["step_ms"]["n"] == 2, row
        with gzip.open(tmp_path / "p_logs" / f"{index:02d}.trace.json.gz", "rt") as f:
            names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
        assert any("aten::mm" in n or "aten::addmm" in n for n in names), sorted(names)[:20]
        assert row["tokens_per_step"] == 1 * 2 * 2 * 32
        assert abs(row["first_loss"] - rows["plain"]["first_loss"]) <= 1e-3 * rows["plain"]["first_loss"], rows
    for label in ("ours@1,2,1+compile+stage+fusedce", "hf+compile", "plain+whole"):  # one graph each, unbroken
        assert rows[label]["compile"] == {"unique_graphs": 1, "graph_breaks": 0, "recompiles": 0}, rows[label]


def test_sc_kernels_times_both_implementations(tmp_path: Path) -> None:
    out = tmp_path / "sc.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/compression/sc_kernels.py"), "--device", "cpu", "--preset", "tiny",
           "--bucket-mb", "0.05", "--ranks", "2", "4", "--repeats", "1", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["results"]
    assert [r["rank"] for r in rows] == [2, 4]
    for r in rows:
        assert r["torch_hook_ms"] > 0 and r["ours_ms"] > 0 and r["ours_fp32_ms"] > 0
        # on CPU the TF32 flag changes nothing; a rank-r approximation of random gradients leaves most out
        assert r["precision_effect"]["tf32_vs_fp32"] == 0.0 and 0.5 < r["precision_effect"]["compression_error"] < 1
        assert r["buckets"]["torch_hook"] > 1 and r["buckets"]["ours"] == 1  # 50 kB DDP buckets; SC: the whole stage
        assert 0 < r["bytes_after"] < r["bytes_before"]
    assert rows[0]["bytes_after"] < rows[1]["bytes_after"]  # rank 2 sends less than rank 4


def test_convergence_places_concurrent_modes_on_their_own_gpus() -> None:
    from benchmarks.compression.convergence import gpu_placement

    assert gpu_placement(3, 2, ["0", "1", "2", "3"]) == ["0,1", "2,3", "0,1"]  # (1,2,1) on 4 GPUs: two copies
    assert gpu_placement(2, 2, ["4", "6", "5", "7"]) == ["4,6", "5,7"]  # names as CUDA_VISIBLE_DEVICES gave them
    assert gpu_placement(2, 4, ["0", "1", "2", "3"]) == [None, None]  # one copy: both modes share all four
    assert gpu_placement(2, 2, []) == [None, None]  # CPU


def _tiny_blocks(folder: Path) -> Path:
    """A packed-blocks folder as ``convergence.py prepare`` writes it: 200 random blocks of 17 tokens."""
    import numpy as np

    folder.mkdir()
    np.save(folder / "blocks.npy", np.random.default_rng(0).integers(0, 256, size=(200, 17), dtype=np.int32))
    (folder / "meta.json").write_text(json.dumps({"vocab_size": 256, "seq_length": 16, "num_blocks": 200}))
    return folder


def _convergence_cmd(data: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "benchmarks/compression/convergence.py"), "run", "--data", str(data), "--layout", "1,1,1",
            "--preset", "tiny", "--steps", str(steps), "--batch-size", "2", "--num-microbatches", "1", "--val-every",
            "2", "--val-batches", "1", "--log-every", "1", "--accelerator", "cpu", "--precision", "32-true",
            "--out", str(out), *extra]


def test_convergence_seeds_and_a_stop_by_sigterm(tmp_path: Path) -> None:
    """--seed changes the initial weights and the data order (the first logged loss differs), 0 is the default, and
    the summary records it; the run goes end to end (torchrun worker, curves, validation, JSON) on CPU.

    `timeout` stops the driver with SIGTERM. torchrun runs its workers in sessions of their own; before, they went
    on training (holding GPUs and a fixed port) after the driver was gone, and the next launch on the machine hung.
    Two concurrent modes; the driver is stopped mid-training; every process it started must be gone. That launch is
    also the explicit --seed 0 run: its first logged loss (in the curve file of its first validation) is the
    default run's, bit for bit (the first loss is computed before any step, so its longer --steps changes nothing)."""
    import signal
    import time

    from benchmarks.tools.processes import descendants

    data = _tiny_blocks(tmp_path / "data")
    first_loss = {}
    # The two seeds' runs side by side (torchrun --standalone: each its own port); most of a run is its processes'
    # imports, which use one core each.
    runs = {}
    for seed in (None, 1):
        out = tmp_path / f"seed{seed}.json"
        cmd = _convergence_cmd(data, out, 2, "--modes", "off", *([] if seed is None else ["--seed", str(seed)]))
        runs[seed] = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for seed, run in runs.items():
            output = run.communicate(timeout=600)[0]
            assert run.returncode == 0, (seed, output[-4000:])
    finally:  # a failed or hung run must not leave the other one training
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
    for seed in runs:
        summary = json.loads((tmp_path / f"seed{seed}.json").read_text())
        assert summary["seed"] == (seed or 0)
        curve = summary["curves"]["off"]
        assert curve["done"] and len(curve["val"]) == 1 and [s for s, _ in curve["train"]] == [1, 2]
        first_loss[seed] = curve["train"][0][1]
    assert first_loss[1] != first_loss[None]

    cmd = _convergence_cmd(data, tmp_path / "r.json", 100000, "--modes", "off", "sc", "--concurrent", "--seed", "0")
    driver = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, started = time.monotonic() + 300, []
    while time.monotonic() < deadline:  # until both launches train: a result file is written at each validation
        started = descendants(driver.pid)
        if all((tmp_path / f"r_{m}.json").exists() for m in ("off", "sc")):
            break
        assert driver.poll() is None, "the run ended before it was stopped"
        time.sleep(0.5)
    else:
        pytest.fail("the two modes did not start training within 300 s")
    assert len(started) >= 4  # two torchrun agents and their workers
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=60) == 128 + signal.SIGTERM
    time.sleep(1)
    alive = [pid for pid in started if Path(f"/proc/{pid}").exists()
             and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert alive == []
    seed0 = json.loads((tmp_path / "r_off.json").read_text())
    assert seed0["train"][0][0] == 1
    assert seed0["train"][0][1] == first_loss[None]  # the default is seed 0: the same run, bit for bit on CPU


def test_all_stages_mode_compresses_every_stage() -> None:
    from benchmarks.parallel.train_throughput import mode_options

    assert mode_options("all-stages", 3) == {"compression": True, "compressed_stages": [0, 1, 2]}
    assert mode_options("all", 3) == {"compression": True}  # the library default: every stage but the last
    assert mode_options("all-stages-fp32", 2) == {"compression": True, "compressed_stages": [0, 1],
                                                  "sc_matmul_precision": "fp32"}


def test_user_gpt_peer_is_its_own_model_and_takes_the_recipes_weights() -> None:
    """The ``user`` peer: parsed as a one-GPU system of its own suffixes; with the recipe's initial weights copied in
    (+ourinit), in fp32 (no autocast, so the residual streams' dtypes cannot differ), its loss equals the recipe
    model's on the same tokens, and its default initialisation gives other weights."""
    import argparse

    import torch

    from benchmarks.speed.hf_peers import build_recipe_model
    from benchmarks.speed.peers import parse_system
    from benchmarks.speed.user_gpt import UserGPT, user_peer, user_vocab
    from lightning_3d.recipes.training import summed_token_cross_entropy

    system = parse_system("user+whole+ourinit", gpus=1)
    assert (system["name"], system["world"], system["whole"], system["ourinit"]) == ("user", 1, True, True)
    for bad, message in (("user+compile", r"takes \+whole, \+ourinit and \+torchinit only"),
                         ("user@2,1,1", r"user runs on one GPU"),
                         ("user+ourinit+torchinit", r"two initialisations; pick one"),
                         ("plain+ourinit", r"\+ourinit is for user only, not plain")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse_system(bad, gpus=1)
    assert user_vocab(50257) == 50304 and user_vocab(4096) == 4096
    args = argparse.Namespace(model="gpt", preset="tiny", vocab_size=4096, seq_length=32, num_microbatches=1)
    torch.manual_seed(0)
    ids = torch.randint(0, 4096, (2, 32))
    labels = torch.randint(0, 4096, (2, 32))
    step_loss, optimizer = user_peer(args, parse_system("user+ourinit", gpus=1), torch.device("cpu"))
    recipe = build_recipe_model(args, parse_system("plain", gpus=1), torch.device("cpu"), compile=False)
    ours = summed_token_cross_entropy(recipe.model(input_ids=ids), labels)
    mine = step_loss({"input_ids": ids, "labels": labels})
    torch.testing.assert_close(mine, ours, rtol=1e-5, atol=1e-4)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"]
    plain_user, _ = user_peer(args, parse_system("user", gpus=1), torch.device("cpu"))
    assert not torch.allclose(plain_user({"input_ids": ids, "labels": labels}), ours)
    tied = UserGPT(64, 8, 1, 16, 2)
    assert tied.head.weight is tied.wte.weight


def test_peers_system_suffixes() -> None:
    import argparse

    from benchmarks.speed.peers import parse_system

    system = parse_system("ours@2,1,1+compile+fp32res", gpus=2)
    assert (system["world"], system["compile"], system["fp32res"], system["cc"]) == (2, True, True, False)
    assert parse_system("plain+fp32res", gpus=1)["fp32res"] and not parse_system("plain", gpus=1)["fp32res"]
    assert parse_system("ours@1,1,1+nofuse", gpus=1)["nofuse"] and not system["nofuse"]
    from benchmarks.speed.peer_workers import fusion_option

    assert [fusion_option(parse_system(t, gpus=1)) for t in ("ours@1,1,1", "ours@1,1,1+fuse", "ours@1,1,1+nofuse")] == [
        "auto", True, False]
    with pytest.raises(argparse.ArgumentTypeError, match=r"\+fuse and \+nofuse are two gradient-accumulation fusion"):
        parse_system("ours@1,1,1+fuse+nofuse", gpus=1)
    for bad in ("plain+cc", "ddp+cc", "fsdp@1,1+nofuse", "hf+nofuse", "plain+fuse"):
        with pytest.raises(argparse.ArgumentTypeError, match="for ours only"):
            parse_system(bad, gpus=1)
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected NAME\[@sizes\]"):
        parse_system("ours@1,1,1+fast", gpus=1)
    # the peers a user would pick instead: transformers' models compiled whole or not, plain compiled whole
    hf = parse_system("hf+compile", gpus=1)
    assert (hf["name"], hf["world"], hf["compile"], hf["whole"]) == ("hf", 1, True, False)
    assert parse_system("plain+whole", gpus=1)["whole"] and parse_system("ours@1,1,1+fusedce", gpus=1)["fusedce"]
    assert parse_system("ours@1,1,1+compile+stage", gpus=1)["stage"]
    gc_rows = [parse_system(t, gpus=1) for t in ("ours@1,1,1", "ours@1,1,1+pygc", "ours@1,1,1+compile+gc1")]
    assert [(r["pygc"], r["gc1"]) for r in gc_rows] == [(False, False), (True, False), (False, True)]
    # +nocheck: ours without the non-finite check (the bound on its cost); without it, the default "skip"
    from benchmarks.speed.peer_workers import ours_strategy

    knobs = argparse.Namespace(num_microbatches=1, schedule="1f1b")
    assert ours_strategy(knobs, parse_system("ours@1,1,1+nocheck", gpus=1)).on_nonfinite == "ignore"
    assert ours_strategy(knobs, parse_system("ours@1,1,1", gpus=1)).on_nonfinite == "skip"
    assert parse_system("plain+whole+explicit", gpus=1)["explicit"]
    assert parse_system("plain+whole+autotune", gpus=1)["autotune"]  # the whole model's compile, autotuned
    assert not parse_system("plain+whole", gpus=1)["explicit"]
    # +torchsdpa / +nocudnn: our recipes under sdpa_backends="torch" / "no_cudnn"; without them the recipes' default
    # "auto", resolved when the model is built (static here: "torch")
    from benchmarks.speed.hf_peers import build_recipe_model, recipe_module

    for model, preset in (("gpt", "tiny"), ("t5", "tiny")):
        args = argparse.Namespace(model=model, preset=preset, vocab_size=300, seq_length=32)
        for text, value in (("ours@1,1,1+compile+stage+torchsdpa", "torch"), ("plain+torchsdpa", "torch"),
                            ("ours@1,1,1+nocudnn", "no_cudnn"), ("plain+nocudnn", "no_cudnn"), ("plain", "auto")):
            assert recipe_module(args, parse_system(text, gpus=1)).config.sdpa_backends == value, (model, text)
        built = build_recipe_model(args, parse_system("plain", gpus=1), "cpu")
        assert {m.sdpa_backends for m in built.model.modules() if hasattr(m, "sdpa_backends")} == {"torch"}
    from benchmarks.speed.peer_workers import make_gpt

    args = argparse.Namespace(model="gpt", preset="tiny", vocab_size=300, seq_length=32)
    assert make_gpt(args, parse_system("fsdp@1,1+torchsdpa", gpus=1)).config.sdpa_backends == "torch"  # FSDP's GPT
    assert make_gpt(args, parse_system("fsdp@1,1+nocudnn", gpus=1)).config.sdpa_backends == "no_cudnn"
    for bad, message in (("ours@1,1,1+whole", r"\+whole is for plain and user, not ours"),
                         ("hf+ckpt", r"\+ckpt is for plain and ddp and fsdp and ours and megatron, not hf"),
                         ("ddp+fusedce", r"\+fusedce is for plain and ours, not ddp"),
                         ("plain+whole+compile", r"\+whole compiles the whole model; drop"),
                         ("ours@1,1,1+stage", r"\+stage sets what one compiled graph covers; add \+compile"),
                         ("plain+compile+stage", r"\+stage is for ours only, not plain"),
                         ("hf+explicit", r"\+explicit is for plain and ours, not hf"),
                         ("hf+torchsdpa", r"\+torchsdpa is for plain and ddp and fsdp and ours, not hf"),
                         ("plain+explicit+torchsdpa", r"\+torchsdpa picks SDPA's backends and \+explicit runs no SDPA"),
                         ("plain+explicit+nocudnn", r"\+nocudnn picks SDPA's backends and \+explicit runs no SDPA"),
                         ("plain+torchsdpa+nocudnn", r"\+torchsdpa and \+nocudnn are two SDPA backend choices"),
                         ("hf+nocudnn", r"\+nocudnn is for plain and ddp and fsdp and ours, not hf"),
                         ("plain+pygc", r"\+pygc is for ours only, not plain"),
                         ("plain+whole+nocheck", r"\+nocheck is for ours only, not plain"),
                         ("ours@1,1,1+pygc+gc1", r"\+pygc and \+gc1 are two garbage-collection settings; pick one"),
                         ("plain+compile+cudagraphs", r"\+cudagraphs replays the whole-model compile; add \+whole"),
                         ("ours@1,1,1+fuse+cudagraphs", r"cuda_graphs=True refuses gradient_accumulation_fusion=True;"
                                                        r" drop \+fuse")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse_system(bad, gpus=1)


def test_single_gpu_speed_script_on_cpu(tmp_path: Path) -> None:
    """benchmarks/speed/single_gpu_speed.sh (the one-GPU comparison) on CPU with tiny presets, its T5 variants part (t5v):
    every system runs, the peers start from the same weights and tokens (first losses agree to bf16), T5 counts inputs
    plus targets, and the compiled systems report torch.compile's counts: no graph break and no recompilation in ours
    (SDPA or explicit attention, fused or not) or in the whole-model compiles (transformers', our model's); per stage,
    ours is one graph for the stage and one for the loss."""
    # The t5v part only (the GPT parts' systems run in test_peers_train_the_same_model_on_the_same_tokens), and of its
    # list the systems whose code paths contain the others' (ours+stage+nofuse and plain+whole are the cudagraphs rows
    # without the CUDA-graph mode, which CPU ignores): each launch costs a process start and a compile, and the suite's
    # time is shared.
    expected = {"t5v": ["hf+compile", "ours@1,1,1+compile+stage", "ours@1,1,1+compile+stage+explicit",
                        "plain+whole+cudagraphs", "ours@1,1,1+compile+stage+nofuse+cudagraphs"]}
    env = {**os.environ, "SPEED_CPU": "1", "SPEED_BUDGET_S": "1500", "T5V_SYSTEMS": " ".join(expected["t5v"])}
    run = subprocess.run(["bash", str(ROOT / "benchmarks/speed/single_gpu_speed.sh"), str(tmp_path), "t5v"], check=True,
                         cwd=ROOT, capture_output=True, text=True, timeout=1500, env=env)
    for label in expected["t5v"]:  # the profile digest reaches stdout (a remote job returns its output first)
        assert f"  {label}:\n    Self CPU time total: " in run.stdout, label
    for part, labels in expected.items():
        report = json.loads((tmp_path / f"speed_{part}.json").read_text())
        rows = {r["label"]: r for r in report["results"]}
        assert list(rows) == labels
        for label, row in rows.items():
            assert row["error"] is None, row
            assert row["tokens_per_step"] == 2 * 2 * (32 + 8) and row["mfu"] is None  # no MFU on CPU
            assert set(row["step_ms"]) >= {"median", "p10", "p90", "min", "max", "mean"}
            assert len(row["gc"]["collections"]) == 3 and row["gc"]["ms_per_step"] >= 0  # GC inside the timed steps
            assert row["compile"]["unique_graphs"] >= 1, label  # every system here is compiled
            assert row["compile"]["graph_breaks"] == 0 and row["compile"]["recompiles"] == 0, (label, row["compile"])
            if "+stage" in label:
                assert row["compile"]["unique_graphs"] == 2, (label, row["compile"])
            first = rows[labels[0]]["first_loss"]
            assert abs(row["first_loss"] - first) <= 1e-3 * first, (label, row["first_loss"], first)


def test_trace_summary_accounts_every_microsecond(tmp_path: Path) -> None:
    from benchmarks.tools.trace_summary import summarize

    def kernel(name: str, ts: float, dur: float, corr: int) -> dict:
        return {"cat": "kernel", "ph": "X", "name": name, "ts": ts, "dur": dur, "tid": 7, "args": {"correlation": corr}}

    events = [
        {"cat": "cpu_op", "ph": "X", "name": "aten::mm", "ts": 0, "dur": 50, "tid": 1},
        {"cat": "cpu_op", "ph": "X", "name": "aten::add_", "ts": 60, "dur": 20, "tid": 1},
        {"cat": "cuda_runtime", "ph": "X", "name": "cudaLaunchKernel", "ts": 10, "dur": 5, "tid": 1,
         "args": {"correlation": 1}},
        {"cat": "cuda_runtime", "ph": "X", "name": "cudaLaunchKernel", "ts": 65, "dur": 5, "tid": 1,
         "args": {"correlation": 2}},
        kernel("nvjet_sm90_gemm", 1000, 3000, 1),  # 1.0-4.0 ms
        kernel("void at::native::vectorized_elementwise_kernel<add>", 3500, 1000, 2),  # 3.5-4.5 ms, overlaps the GEMM
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 4000, 2000, 3),  # 4.0-6.0 ms: 1.5 ms of it alone
        kernel("triton_poi_fused_add_0", 8000, 1000, 4),  # after 2 ms idle
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarize(path)
    assert s["kernels"] == 4 and s["span_ms"] == 8.0
    assert s["compute_ms"] == 4.5  # 1.0-4.5 and 8.0-9.0
    assert s["nccl_ms"] == 2.0 and s["nccl_only_ms"] == 1.5 and s["idle_ms"] == 2.0
    assert s["compute_by_family_ms"] == {"gemm": 3.0, "elementwise/copy/reduce": 1.0, "triton": 1.0}
    assert s["largest_other_ms"] == {"aten::add_: void at::native::vectorized_elementwise_kernel<add>": 1.0}


def test_trace_summary_gaps_name_the_late_kernel_and_the_hosts_wait(tmp_path: Path) -> None:
    """--gaps: the idle stretch between two kernels, the operator of the kernel after it, how late the host issued
    it, and the host's operators and waits inside the gap; every wait counted by the operator that waited."""
    from benchmarks.tools.trace_summary import summarize

    def op(name: str, ts: float, dur: float) -> dict:
        return {"cat": "cpu_op", "ph": "X", "name": name, "ts": ts, "dur": dur, "tid": 1}

    def rt(name: str, ts: float, dur: float, corr: int) -> dict:
        return {"cat": "cuda_runtime", "ph": "X", "name": name, "ts": ts, "dur": dur, "tid": 1,
                "args": {"correlation": corr}}

    def kernel(name: str, ts: float, dur: float, corr: int) -> dict:
        return {"cat": "kernel", "ph": "X", "name": name, "ts": ts, "dur": dur, "tid": 7, "args": {"correlation": corr}}

    events = [
        op("aten::mm", 0, 50), rt("cudaLaunchKernel", 10, 5, 1), kernel("nvjet_sm90_gemm", 100, 1000, 1),  # 0.1-1.1 ms
        op("aten::add_", 60, 20), rt("cudaLaunchKernel", 65, 5, 2), kernel("elementwise_kernel<add>", 1100, 400, 2),
        # 1.5 ms: the host waits for the device inside aten::item (0.5 ms), runs a long operator, then issues the mm.
        op("aten::item", 1450, 600), rt("cudaStreamSynchronize", 1460, 500, 3), op("Optimizer.step", 0, 10000),
        op("aten::linear", 2100, 1200), op("aten::mm", 2900, 300), rt("cudaLaunchKernel", 3000, 5, 4),
        kernel("nvjet_sm90_gemm", 3100, 500, 4),  # 1.6 ms idle before it (1.5-3.1)
        kernel("elementwise_kernel<mul>", 3700, 100, 5),  # 0.1 ms idle: not over 0.1 ms
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarize(path, gaps=1)
    assert s["idle_ms"] == pytest.approx(1.7) and s["gaps_total_ms"] == pytest.approx(1.7)
    assert s["gaps_over_0.1ms"] == 1
    (gap,) = s["gaps"]
    assert gap["ms"] == pytest.approx(1.6) and gap["at_ms"] == pytest.approx(1.4)
    assert gap["after"] == "aten::add_" and gap["before"] == "aten::mm"
    assert gap["issued_late_ms"] == pytest.approx(1.5)  # launched at 3.0 ms, the gap began at 1.5 ms
    assert gap["host_ops"] == ["aten::linear 1.00", "aten::item 0.55", "aten::mm 0.20"]  # ms inside the gap
    assert gap["host_waits"] == ["cudaStreamSynchronize 0.50"]
    assert s["waits"] == {"cudaStreamSynchronize in aten::item": 1}
    assert "gaps" not in summarize(path)  # only when asked


def test_host_microbatch_probe_times_both_counts_per_size(tmp_path: Path) -> None:
    """benchmarks/planner/host_microbatch_probe.py (the planner's host term): per model and micro-batch size, the steps with 1 and 4
    micro-batches timed --steps times each, and the per-micro-batch seconds their medians' difference over 3."""
    out = tmp_path / "probe.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/planner/host_microbatch_probe.py"), "--device", "cpu", "--preset", "tiny",
           "--layers", "2", "--models", "tiny", "--sizes", "1", "2", "--warmup", "1", "--steps", "2", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["layers"], r["microbatch_size"]) for r in rows] == [("tiny", 2, 1), ("tiny", 2, 2)]
    for r in rows:
        assert r["timed_steps"] == [2, 2]
        assert r["per_microbatch_s"] == pytest.approx((r["step_4_s"] - r["step_1_s"]) / 3, rel=1e-12)


def test_host_microbatch_probe_refuses_a_size_below_one(capsys: pytest.CaptureFixture) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("host_microbatch_probe", ROOT / "benchmarks/planner/host_microbatch_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    with pytest.raises(SystemExit):
        probe.main(["--device", "cpu", "--sizes", "1", "0"])
    assert "--sizes [1, 0]: micro-batch sizes are positive" in capsys.readouterr().err


def test_host_time_t5_counts_the_fused_accumulations(tmp_path: Path) -> None:
    """benchmarks/speed/host_time_t5.py (T5's host time per step) at one block per side: with fusion every fused
    layer (6 per encoder block, 10 per decoder block) accumulates once per micro-batch, in the timed steps and as op
    calls in the profiled one; without it none does; both train the same (fp32: summation order only)."""
    out = tmp_path / "host.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/speed/host_time_t5.py"), "--layers", "1", "--num-microbatches", "2",
           "--steps", "1", "--warmup", "1", "--profile", "--gc-report", "--out", str(out)]
    run = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert "fusion on - off:" in run.stdout
    on, off = json.loads(out.read_text())["results"]
    assert on["fusion"] and not off["fusion"]
    assert on["fused_accumulations_per_step"] == 2 * 16 and off["fused_accumulations_per_step"] == 0
    assert on["profiled_op_calls"]["accumulate_weight_grad"] == 2 * 16
    assert off["profiled_op_calls"]["accumulate_weight_grad"] == 0 and off["profiled_op_calls"]["aten"] > 0
    assert on["wall_ms"] > 0 and on["cpu_ms"] > 0 and on["profile"] and off["profile"]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(on["losses"], off["losses"], strict=True))
    # --gc-report: one garbage count per timed step; the freeze holds what was tracked (a few objects may be born or
    # die between the two counts, so only its order of magnitude is checked).
    for r in (on, off):
        assert len(r["gc"]["garbage_per_step"]) == 1 and r["gc"]["garbage_per_step"][0]["objects"] >= 0
        assert r["gc"]["frozen_objects"] > r["gc"]["tracked_objects"] // 2 > 0


def test_graphed_peak_adds_the_pool_bytes_the_allocator_does_not_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/tools/graph_memory.py: without graphs the counted peak; with them, the larger of the first step's counted
    peak (the captures) and the later steps' counted peak plus the pool's uncounted bytes."""
    import types

    import torch

    from benchmarks.tools.graph_memory import GraphedPeak

    counted = {"peak": 0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counted["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: counted.update(peak=-1))

    class Graphs:
        def memory(self) -> dict:
            return {"reserved": 700, "allocated": 200}

    def trainer(step: int, graphs) -> types.SimpleNamespace:
        strategy = types.SimpleNamespace(root_device="cuda:0", pipeline_runtime=types.SimpleNamespace(graphs=graphs))
        return types.SimpleNamespace(global_step=step, strategy=strategy)

    eager = GraphedPeak()
    counted["peak"] = 1000
    eager.on_train_batch_end(trainer(1, None), None, None, None, 0)
    eager.on_train_end(trainer(3, None), None)
    assert eager.peak("cuda:0") == 1000 and eager.pool_bytes == 0 and counted["peak"] == 1000  # nothing reset
    for first, later, resident in ((1000, 900, 1400), (2000, 900, 2000)):
        graphed = GraphedPeak()
        counted["peak"] = first
        graphed.on_train_batch_end(trainer(1, Graphs()), None, None, None, 0)
        assert counted["peak"] == -1  # reset after the captures' step
        counted["peak"] = later
        graphed.on_train_batch_end(trainer(2, Graphs()), None, None, None, 1)  # later steps reset nothing
        assert counted["peak"] == later
        graphed.on_train_end(trainer(3, Graphs()), None)
        assert graphed.peak("cuda:0") == resident and graphed.pool_bytes == 700  # max(first, later + 700 - 200)


def test_the_whole_model_compiles_in_the_mode_its_suffixes_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    """plain+whole: torch.compile's mode from +cudagraphs and +autotune (under inductor; the CPU tests' backend takes
    no mode)."""
    import argparse

    import torch

    import benchmarks.speed.hf_peers as hf
    from benchmarks.speed.peers import parse_system

    modes = []
    monkeypatch.setattr(hf, "COMPILE_BACKEND", "inductor")
    monkeypatch.setattr(torch, "compile", lambda fn, backend=None, mode=None: modes.append((backend, mode)) or fn)
    args = argparse.Namespace(model="gpt", preset="tiny", vocab_size=300, seq_length=32)
    for text, mode in (("plain+whole", None), ("plain+whole+cudagraphs", "reduce-overhead"),
                       ("plain+whole+autotune", "max-autotune-no-cudagraphs"),
                       ("plain+whole+autotune+cudagraphs", "max-autotune")):
        modes.clear()
        hf.plain_peer(args, parse_system(text, gpus=1), torch.device("cpu"))
        assert modes[-1] == ("inductor", mode), text


def test_peers_time_a_step_from_its_start_to_the_next_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """peers' StepTimer: a step's time includes what the loop does after its last batch (Lightning's hooks, the next
    batch's fetch) up to the next step's start, as the plain loop's steps do; warm-up steps are not timed, and the
    run has one step more than it times, whose start ends the last timed step."""
    from types import SimpleNamespace

    import benchmarks.speed.peer_workers as workers

    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(workers.time, "perf_counter", lambda: next(clock))
    # GC_TIME's collection callback reads the same clock while its timing is on: kept off, a collection during the test
    # cannot take ticks.
    monkeypatch.setattr(workers.GC_TIME, "timing", lambda on: None)
    args = SimpleNamespace(warmup=1, steps=2, profile=False, trace=False)
    assert workers.total_steps(args) == 4
    profiled = []  # (step the profiler was asked about, steps timed by then)
    profiler = SimpleNamespace(at_step=lambda step, rank: profiled.append((step, len(timer.step_s))))
    timer = workers.StepTimer(2, args, profiler)
    cpu = SimpleNamespace(root_device=workers.torch.device("cpu"))
    trainer = SimpleNamespace(global_step=0, global_rank=0, strategy=cpu)
    gap = {0: 7, 1: 5, 2: 9, 3: 0}  # clock ticks spent between a step's end and the next step's start
    for step in range(workers.total_steps(args)):
        trainer.global_step = step
        for idx in (2 * step, 2 * step + 1):
            timer.on_train_batch_start(trainer, None, None, idx)
            timer.on_train_batch_end(trainer, None, workers.torch.tensor(1.0), None, idx)
        for _ in range(gap[step]):
            next(clock)
    # A step's start reads the clock to end the step before (if timed) and again to start its own; batch ends read
    # none. Steps 1 and 2 are timed, from their starts to the next ones': their gaps and one tick each.
    assert timer.step_s == [6.0, 10.0] and len(timer.losses) == 4  # the warm-up step's 7 + 1 ticks are not timed
    # The profiler hears of a step after the step before it is timed (its start-up stays out of the timings).
    assert profiled == [(0, 0), (1, 0), (2, 1), (3, 2)]


def test_soak_summary_tells_a_one_time_jump_from_steady_growth() -> None:
    """benchmarks/tools/soak.py's goal check: the change from the first window to the last against 5 % for RSS and
    step time (window medians), and the RSS slope over the last half of the windows, which stays near zero after a
    one-time jump and stays positive under a leak however small the change so far."""
    from benchmarks.tools.soak import summary

    def rows(rss_of_step, step_ms_of_step):
        return [{"step": s, "ranks": [{"rank": 0, "rss_mib": rss_of_step(s), "step_ms_median": step_ms_of_step(s),
                                       "cpu_ms": 10.0}]} for s in range(100, 1001, 100)]

    flat = summary(rows(lambda s: 500.0, lambda s: 100.0))["ranks"][0]
    assert flat["rss_goal_met"] and flat["step_time_goal_met"] and flat["rss_slope_mib_per_100"] == 0
    jump = summary(rows(lambda s: 500.0 if s < 300 else 550.0, lambda s: 100.0))
    assert jump["slope_windows"] == [600, 1000]
    assert not jump["ranks"][0]["rss_goal_met"] and jump["ranks"][0]["rss_change_pct"] == pytest.approx(10.0)
    assert jump["ranks"][0]["rss_slope_mib_per_100"] == pytest.approx(0.0)
    leak = summary(rows(lambda s: 500.0 + s / 100, lambda s: 100.0 + s / 10))["ranks"][0]
    assert leak["rss_goal_met"] and leak["rss_change_pct"] == pytest.approx(100 * 9 / 501)  # within 5 % at step 1,000 ...
    assert leak["rss_slope_mib_per_100"] == pytest.approx(1.0)  # ... but growing by 1 MiB per 100 steps
    assert leak["rss_slope_pct_per_100"] == pytest.approx(100 / 501)
    assert not leak["step_time_goal_met"] and leak["step_time_change_pct"] == pytest.approx(100 * 90 / 110)


def test_soak_hides_the_hosts_gpus_from_its_cpu_ranks_unless_kept() -> None:
    """soak.py: the CPU ranks see no GPU (torch.distributed.checkpoint's first save would load the CUDA driver into
    each of them on a GPU host), unless --keep-gpus."""
    from benchmarks.tools.soak import hide_gpus

    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    hide_gpus(True, env)
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    hide_gpus(False, env)
    assert env == {"CUDA_VISIBLE_DEVICES": ""}
    fresh: dict = {}
    hide_gpus(False, fresh)
    assert fresh == {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread CPU time is read from Linux's /proc")
def test_soak_thread_cpu_counts_the_busy_thread() -> None:
    """soak.py --threads: a thread that spun for 0.3 s of CPU shows with at least half of it (clock ticks of 10 ms or
    less), the idle main thread with less than it, and an ended thread leaves the table once the OS has reaped it."""
    import threading

    from benchmarks.tools.soak import _thread_cpu

    main = threading.get_native_id()
    before = _thread_cpu()
    assert main in before and isinstance(before[main][0], str)
    spun, release = threading.Event(), threading.Event()

    def spin() -> None:
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        spun.set()
        release.wait()

    busy = threading.Thread(target=spin)
    busy.start()
    assert spun.wait(timeout=60)
    found = _thread_cpu()  # read while it is alive: an ended thread leaves /proc
    release.set()
    busy.join()
    assert found[busy.native_id][1] >= 0.15, found[busy.native_id]
    assert found[main][1] - before[main][1] < 0.3
    # join() returns once Python's thread state is released, a moment before the OS thread exits and leaves /proc:
    # wait for that, bounded, rather than read /proc at once.
    deadline = time.monotonic() + 30
    while busy.native_id in _thread_cpu() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert busy.native_id not in _thread_cpu()


def test_peers_megatron_system_parsing_and_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron@DP,PP,TP parses as ours does (same replicas, so the same tokens per step), takes +ckpt only, is refused
    on CPU and for T5, and a missing megatron-core fails before any launch with the install command."""
    import argparse

    from benchmarks.speed import megatron_peer
    from benchmarks.speed.peers import parse_args, parse_system, sample_tokens, summarize

    system = parse_system("megatron@2,2,1+ckpt", gpus=4)
    assert (system["name"], system["dp"], system["pp"], system["tp"], system["world"], system["ckpt"]) == (
        "megatron", 2, 2, 1, 4, True)
    for bad, message in (("megatron@1,1", "megatron takes @DP,PP,TP"), ("megatron@1,1,1+compile", r"\+ckpt only"),
                         ("megatron@1,1,1+cc", "for ours only")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse_system(bad, gpus=1)
    args = argparse.Namespace(micro_batch_size=2, num_microbatches=3, seq_length=64, model="gpt", target_length=None)
    ours, megatron = (summarize(args, parse_system(f"{n}@2,1,2", gpus=4), {"error": "x"}, 1.0) for n in ("ours", "megatron"))
    assert megatron["tokens_per_step"] == ours["tokens_per_step"] == 2 * 2 * 3 * sample_tokens(args)

    monkeypatch.setitem(sys.modules, "megatron", None)  # as if megatron-core were not installed
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(ImportError, match="pip install megatron-core"):
        megatron_peer.megatron_version()
    with pytest.raises(SystemExit):
        parse_args(["--systems", "megatron@1,1,1"])
    parse_args(["--systems", "plain", "ours@1,1,1"])  # no megatron system: megatron-core is never imported
    monkeypatch.undo()
    if importlib.util.find_spec("megatron") is not None:
        for argv in (["--accelerator", "cpu"], ["--model", "t5"]):
            with pytest.raises(SystemExit):
                parse_args([*argv, "--systems", "megatron@1,1,1"])


MEGATRON_MODEL = r"""
import argparse, json, torch, torch.distributed as dist
from benchmarks.speed.megatron_peer import MISSING, build_gpt, megatron_version, transformer_config
from benchmarks.speed.peers import table
dist.init_process_group("gloo", init_method="file://" + __import__("sys").argv[1], rank=0, world_size=1)
from megatron.core import parallel_state
parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
args = argparse.Namespace(preset="tiny", vocab_size=int(__import__("sys").argv[2]), seq_length=64)
system = {"dp": 1, "pp": 1, "tp": 1, "ckpt": False}
from megatron.core.transformer.module import Float16Module
config = transformer_config(args, system, cpu_init=True)
model = build_gpt(args, system, config)
wrapped = Float16Module(config, model)  # as the worker wraps it: bf16 throughout
layer = model.decoder.layers[0]
row = {"label": "megatron@1,1,1", "world": 1, "tokens_per_s": 1.0, "tflops_per_gpu": 0.0, "mfu": None,
       "step_ms": dict(median=1.0, p10=1.0, p90=1.0, min=1.0, max=1.0), "peak_mem_gb": 0.0, "first_loss": 6.2,
       "megatron_core": megatron_version(), "megatron_missing": MISSING}
print(json.dumps({
    "parameters": sum(p.numel() for p in model.parameters()),
    "dtypes": sorted({str(p.dtype) for p in wrapped.parameters()}),
    "vocab_rows": model.embedding.word_embeddings.weight.shape[0],
    "tied": model.share_embeddings_and_output_weights and model.output_layer.weight is None,
    "classes": [type(m).__name__ for m in (layer.self_attention.linear_qkv, layer.self_attention.core_attention,
                                           layer.input_layernorm, layer.mlp.linear_fc1)],
    "activation": str(model.config.activation_func), "version": megatron_version(), "table": table([row], "h")}))
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("vocab", [512, 500])
def test_megatron_peer_builds_the_presets_shape_from_the_local_spec(tmp_path: Path, vocab: int) -> None:
    """The megatron peer's model is our tiny preset's shape in Megatron's local (TransformerEngine-free) layers: our
    parameter count with the key bias Megatron's QKV carries, the vocabulary padded to 128 as ours, tied embeddings,
    bf16, the tanh GELU; the table names the version and what the missing TE/apex rules out. Megatron-core's forward,
    DDP, optimizer and schedules allocate on CUDA (megatron_peer.py), so the CPU test stops at the built model."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install --no-deps megatron-core)")
    from lightning_3d.recipes.gpt.config import preset

    out = subprocess.run([sys.executable, "-c", MEGATRON_MODEL, str(tmp_path / "store"), str(vocab)], check=True,
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    built = json.loads(out.strip().splitlines()[-1])
    ours = preset("tiny", vocab_size=vocab, seq_length=64)
    padding = (ours.padded_vocab_size(1) - vocab) * ours.hidden_size
    assert built["vocab_rows"] == ours.padded_vocab_size(1) == 512
    assert built["parameters"] == preset("tiny", vocab_size=vocab, seq_length=64, key_bias=True).num_parameters() + padding
    assert built["parameters"] - ours.num_parameters() - padding == ours.num_layers * ours.hidden_size  # the key bias
    assert built["tied"] and built["dtypes"] == ["torch.bfloat16"]
    assert built["classes"] == ["ColumnParallelLinear", "DotProductAttention", "LayerNorm", "ColumnParallelLinear"]
    assert "approximate='tanh'" in built["activation"]
    footnote = built["table"].splitlines()[-1]
    assert footnote.startswith(f"megatron: megatron-core {built['version']}, without TransformerEngine and apex")
    assert "no fused Adam" in footnote and "fused attention" in footnote
