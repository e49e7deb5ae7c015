"""Loss curves with and without Optimus-CC compression on real text (the paper's Table 2 in miniature).

Step 1 (CPU, where `datasets` is installed) packs the extended offline corpus (Python documentation plus the
installed packages' docstrings) into token blocks:

    python benchmarks/compression/convergence.py prepare --data benchmarks/.data --seq-length 512 --vocab 8192

Step 2 (GPU machine, no `datasets` needed: it reads the packed blocks) trains once per compression mode in
fresh processes started by torchrun, validating every --val-every steps, and writes curves, the final
validation losses and a PNG:

    python benchmarks/compression/convergence.py run --data benchmarks/.data --layout 2,2,1 --steps 2000 --modes off all
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
from benchmarks.tools.processes import kill_launch  # noqa: E402

# "all" is the library's defaults: CB on the cool-down sends only, without LEP, FE, and SC only where the measured
# data-parallel link is slower than sc_max_link_gbps (so not on one NVLink host). "all-sc" is the same with SC forced
# on as on a slow link, "all-lep" the defaults until LEP went off by default (2026-11-22): LEP on, SC on every stage but the last.
# The other modes pin every option they are about, so their meaning does not move with the defaults: CB on the
# cool-down sends with and without LEP, every send at rank 16 (the default before cb_epilogue_only=True), rank 64.
# GPT-125M, (1,2,1), 2000 steps, final val loss: off 4.332, every 4.859, epilogue 4.464, rank64 4.576.
ANY_LINK = dict(sc_max_link_gbps=float("inf"))
MODES = {"off": dict(compression=False, fused_embedding_sync=False), "all": dict(compression=True),
         "all-sc": dict(compression=True, **ANY_LINK),
         "all-lep": dict(compression=True, cb_lazy_error_propagation=True, **ANY_LINK),
         "epilogue": dict(compression=True, cb_epilogue_only=True, cb_lazy_error_propagation=True, **ANY_LINK),
         "sc": dict(compression=True, compressed_backprop=False, fused_embedding_sync=False, **ANY_LINK),
         "epilogue-nolep": dict(compression=True, cb_epilogue_only=True, cb_lazy_error_propagation=False, **ANY_LINK),
         "every": dict(compression=True, cb_epilogue_only=False, cb_lazy_error_propagation=True, **ANY_LINK),
         "rank64": dict(compression=True, cb_rank=64, cb_epilogue_only=False, cb_lazy_error_propagation=True, **ANY_LINK)}


def steps_or_fraction(text: str) -> int | float:
    """`4` means four steps and `0.1` a tenth of the run, as the strategy's ``sc_warmup`` reads them."""
    return float(text) if any(c in text for c in ".eE") else int(text)


def prepare(args: argparse.Namespace) -> None:
    from lightning_3d.recipes.data import CausalLMDataModule

    cache = args.data / "cache"
    data = CausalLMDataModule(extended_corpus=True, tokenizer="bpe", tokenizer_vocab_size=args.vocab,
                              seq_length=args.seq_length, cache_dir=str(cache), val_fraction=0.01)
    data.prepare_data()
    data.setup("fit")
    train = data.packed_path("train")
    shutil.copy(train, args.data / "blocks.npy")
    shutil.copy(train.with_suffix(".json"), args.data / "blocks.json")
    data.load_text_tokenizer().save(args.data)
    meta = {"vocab_size": data.vocab_size, "seq_length": args.seq_length, "num_blocks": data.meta["num_blocks"]}
    (args.data / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(cache)
    print(f"{meta['num_blocks']} blocks of {args.seq_length + 1} tokens, vocabulary {meta['vocab_size']} -> {args.data}")


def worker(args: argparse.Namespace) -> None:
    import multiprocessing

    import lightning.pytorch as pl
    import torch

    from lightning_3d import Compressed3DStrategy
    from lightning_3d.recipes import GPT
    from lightning_3d.recipes.data.loader import build_eval_loader, build_train_loader
    from lightning_3d.recipes.data.packing import PackedBlocks
    from lightning_3d.strategies.config import nest_options

    meta = json.loads((args.data / "meta.json").read_text())
    dp, pp, tp = (int(x) for x in args.layout.split(","))
    n, n_val = meta["num_blocks"], max(1, meta["num_blocks"] // 100)

    # The loaders' workers (two per loader, started again at every validation) fork from a fork server
    # (worker_options in lightning_3d/recipes/data/loader.py); the server imports the data package once, so that a
    # worker starts with torch and Lightning already imported instead of importing them itself.
    multiprocessing.set_forkserver_preload(["__main__", "lightning_3d.recipes.data.packing"])

    class Blocks(pl.LightningDataModule):
        def train_dataloader(self):
            data = PackedBlocks(args.data / "blocks.npy", 0, n - n_val)
            return build_train_loader(data, args.batch_size, trainer=self.trainer, seed=args.seed, shuffle=True,
                                      num_workers=2)

        def val_dataloader(self):
            return build_eval_loader(PackedBlocks(args.data / "blocks.npy", n - n_val, n), args.batch_size,
                                     trainer=self.trainer, num_workers=2)

    class Curves(pl.Callback):
        """Records the curves and rewrites the result file at every validation, so that a run stopped by a time
        limit still leaves its curves up to the last validation (``done`` says whether it reached --steps)."""

        def __init__(self) -> None:
            self.train, self.val, self.start = [], [], time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if trainer.global_step % args.log_every == 0:
                self.train.append((trainer.global_step, float(outputs["loss"])))

        def on_validation_end(self, trainer, module) -> None:
            if not trainer.sanity_checking:
                self.val.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))
                self.write(trainer, done=False)

        def on_train_end(self, trainer, module) -> None:
            self.write(trainer, done=True)

        def write(self, trainer, done: bool) -> None:
            if trainer.global_rank == 0:
                result = {"train": self.train, "val": self.val, "done": done,
                          "seconds": round(time.perf_counter() - self.start, 1)}
                args.result.with_suffix(".tmp").write_text(json.dumps(result))
                args.result.with_suffix(".tmp").replace(args.result)

    curves = Curves()
    strategy = Compressed3DStrategy(**nest_options(dict(
        data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp, num_microbatches=args.num_microbatches,
        sc_warmup=args.sc_warmup, compression_seed=args.seed, **MODES[args.mode])))
    trainer = pl.Trainer(accelerator=args.accelerator, devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
                         precision=args.precision, max_steps=args.steps, val_check_interval=args.val_every,
                         check_val_every_n_epoch=None, limit_val_batches=args.val_batches, gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0,
                         callbacks=[curves], use_distributed_sampler=False)
    torch.manual_seed(args.seed)
    model = GPT(args.preset, vocab_size=meta["vocab_size"], seq_length=meta["seq_length"], learning_rate=args.lr,
                init_seed=1234 + args.seed,
                min_learning_rate=args.lr / 10, warmup_steps=args.steps // 20, decay_steps=args.steps)
    trainer.fit(model, datamodule=Blocks())


def run(args: argparse.Namespace) -> None:
    dp, pp, tp = (int(x) for x in args.layout.split(","))
    results, procs = {}, {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    gpus = visible_gpus() if args.accelerator == "gpu" and args.concurrent else []
    placement = gpu_placement(len(args.modes), dp * pp * tp, gpus)
    failures = []
    try:
        for i, mode in enumerate(args.modes):
            result = args.out.with_name(f"{args.out.stem}_{mode}.json")
            if placement[i] is not None:
                env = {**env, "CUDA_VISIBLE_DEVICES": placement[i]}
            # --standalone: a free port per launch, so concurrent modes, and launches that a stopped run left behind
            # on the same machine, never meet at one rendezvous.
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dp * pp * tp}",
                   __file__, "worker", "--mode", mode, "--result", str(result), *sys.argv[2:]]
            with open(args.out.with_name(f"{args.out.stem}_{mode}.log"), "w") as log:  # kept next to the results
                procs[mode] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True), result)
            if not args.concurrent:  # one after the other; --concurrent shares the GPUs (loss curves only, no timing)
                procs[mode][0].wait()
        for mode, (proc, result) in procs.items():  # every mode runs to its end, even when another failed
            if proc.wait() != 0:
                log = args.out.with_name(f"{args.out.stem}_{mode}.log").read_text(errors="replace")
                failures.append(f"mode {mode} failed with exit code {proc.returncode}; the end of its log:\n"
                                + "\n".join(log.splitlines()[-40:]))
                continue
            results[mode] = json.loads(result.read_text())
            print(mode, "final val loss", results[mode]["val"][-1], flush=True)
    finally:  # also when this driver is stopped (SIGTERM from `timeout`, Ctrl-C): no worker may outlive it
        for proc, _ in procs.values():
            if proc.poll() is None:
                kill_launch(proc)
    if not results:
        raise SystemExit("\n\n".join(failures))
    finals = {m: r["val"][-1][1] for m, r in results.items()}
    summary = {"command": " ".join(sys.argv), "layout": args.layout, "steps": args.steps, "seed": args.seed,
               "final_val_loss": finals,
               "relative_to_off": {m: v / finals["off"] - 1 for m, v in finals.items()} if "off" in finals else None,
               "curves": results}
    args.out.write_text(json.dumps(summary, indent=1))
    plot(results, args.out.with_suffix(".png"))
    print(json.dumps({k: summary[k] for k in ("final_val_loss", "relative_to_off")}, indent=1))
    if failures:
        raise SystemExit("\n\n".join(failures))


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (without initialising CUDA here)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_placement(modes: int, world: int, gpus: list[str]) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES per mode of a --concurrent run: when the GPUs hold several copies of the layout, mode i
    gets copy i mod copies (modes beyond the copies share them); otherwise None: every mode uses all GPUs."""
    copies = len(gpus) // world
    if copies < 2:
        return [None] * modes
    return [",".join(gpus[(i % copies) * world : (i % copies + 1) * world]) for i in range(modes)]


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot written (the JSON has the curves)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, r in results.items():
        for key, style in (("train", dict(alpha=0.35)), ("val", dict(marker="o"))):
            if r[key]:  # a short run may have logged no training loss (--log-every) or no validation
                steps, losses = zip(*r[key])
                ax.plot(steps, losses, label=f"{mode} {'train' if key == 'train' else 'validation'}", **style)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("prepare", "run", "worker"))
    parser.add_argument("--data", type=Path, default=Path("benchmarks/.data"))
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--layout", default="2,2,1")
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per replica per step")
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--seed", type=int, default=0,
                        help="another run of the same experiment: initial weights (init_seed 1234 + seed), data order and"
                             " compression's random start all change; 0 is the runs recorded before it existed")
    parser.add_argument("--sc-warmup", type=steps_or_fraction, default=0.1,
                        help="plain all-reduce before PowerSGD: steps (an integer) or a fraction of --steps")
    parser.add_argument("--val-every", type=int, default=250)
    parser.add_argument("--log-every", type=int, default=10, help="record the training loss every N steps")
    parser.add_argument("--val-batches", type=int, default=20)
    parser.add_argument("--concurrent", action="store_true",
                        help="train all modes at once; when the GPUs hold several copies of the layout, each mode gets its own"
                             " (round-robin), else they share them all")
    parser.add_argument("--accelerator", default="gpu", help="cpu runs a gloo smoke test of the script")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--modes", nargs="+", default=["off", "all"], choices=tuple(MODES))
    parser.add_argument("--out", type=Path, default=Path("convergence.json"))
    parser.add_argument("--mode", default="off", choices=tuple(MODES))
    parser.add_argument("--result", type=Path)
    args = parser.parse_args()
    if args.command == "run":  # `timeout` stops the driver with SIGTERM: exit through run's cleanup of the workers
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    {"prepare": prepare, "run": run, "worker": worker}[args.command](args)


if __name__ == "__main__":
    main()
