"""Starting Compressed3DStrategy's processes from Jupyter, IPython or any interactive Python session.

A script run starts its other ranks by running the script again (Lightning's subprocess launcher). A notebook has no
script to run again, so there (detected as Lightning detects it: ``sys.ps1`` or ``python -i``):

- one process needs no launcher: the kernel itself trains, as with ``Trainer(devices=1)``;
- several processes are forked from the kernel, as Lightning's ``strategy="ddp_notebook"`` does; the forked workers
  share the kernel's imports and objects (the module, the data module, callbacks) without pickling them;
- what cannot work fails before any process starts, with the fix: a platform without ``fork``, CUDA already
  initialised in the kernel (CUDA does not survive ``fork``), several nodes.

Rank 0 sends back what the notebook reads after ``trainer.fit``: the trainer's state, ``callback_metrics`` and
``logged_metrics``, each ``ModelCheckpoint``'s paths and scores, and the return value (``validate``/``test``
results, ``predict`` outputs). The trained weights stay in the workers: under pipeline or tensor parallelism each
rank holds a shard, so Lightning's way (rank 0's ``state_dict`` loaded into the notebook's module) would bring back
one shard of DTensors bound to the workers' process groups. Read the weights from the strategy's sharded
checkpoints instead (``ModelCheckpoint``; ``lightning-3d export`` makes a ``transformers`` directory), and evaluate
in a new run with ``ckpt_path=``. See docs/notebooks.md.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerState, TrainerStatus
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_3d.utils.compat import set_num_threads_if_needed

# ModelCheckpoint's attributes a notebook reads after fit (ckpt_path="best" / "last" resolves through them).
_CHECKPOINT_FIELDS = ("dirpath", "best_model_path", "best_model_score", "last_model_path", "kth_best_model_path",
                      "kth_value", "best_k_models")


def is_interactive() -> bool:
    """Whether this is an interactive session (Jupyter/IPython kernel, ``python -i``): Lightning's own test, the one
    behind its refusal of script launchers there."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive)


def interactive_launcher(strategy: Any, release: Callable[[], None]) -> ForkLauncher | None:
    """The launcher for ``strategy`` in an interactive session: None for one process, else a ``ForkLauncher``.

    ``release`` destroys this process's own process groups; it runs before every fork (see ``ForkLauncher``).
    Raises, naming the fix, where forking cannot work.
    """
    if strategy.num_nodes > 1:
        raise RuntimeError(
            f"Compressed3DStrategy cannot start a {strategy.num_nodes}-node job from an interactive session: a notebook"
            " forks processes on its own machine only. Use num_nodes=1 here, or launch the multi-node job as a script"
            " (torchrun, SLURM, `lightning-3d fit`)."
        )
    if strategy.num_processes <= 1:
        return None
    return ForkLauncher(strategy, release)


def check_can_fork(num_processes: int, device_type: str) -> None:
    """Raise where forking ``num_processes`` workers from this process cannot work."""
    methods = mp.get_all_start_methods()
    if "fork" not in methods:
        raise RuntimeError(
            f"Compressed3DStrategy starts {num_processes} processes from an interactive session by forking it, and"
            f" this platform cannot fork (start methods: {', '.join(methods)}). Use devices=1 in the notebook, or run"
            " the code as a script (`python train.py`, `lightning-3d fit`), which starts fresh processes."
        )
    if device_type == "cuda" and torch.cuda.is_initialized():
        raise RuntimeError(
            f"Compressed3DStrategy cannot fork {num_processes} GPU processes from this session: CUDA is already"
            " initialised in it (a tensor or model was put on a GPU, or a torch.cuda call created a context, before"
            " trainer.fit), and a forked process cannot use CUDA then. Restart the kernel and leave every GPU to the"
            " Trainer (no .cuda()/.to('cuda') before fit), or run the code as a script."
        )


class ForkLauncher:
    """Fork one worker per device from this process, run the trainer's function in each, join them all, and bring
    rank 0's results back (Lightning's ``_MultiProcessingLauncher`` with ``start_method="fork"``, minus the weights:
    see the module docstring). Lightning calls ``launch`` and ``kill`` and reads ``is_interactive_compatible``."""

    is_interactive_compatible = True

    def __init__(self, strategy: Any, release: Callable[[], None]) -> None:
        check_can_fork(strategy.num_processes, strategy.root_device.type)
        self._strategy = strategy
        self._release = release
        self._fitted = False
        self.procs: list[Any] = []

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        n = self._strategy.num_processes
        check_can_fork(n, self._strategy.root_device.type)  # again: CUDA may have been touched since Trainer(...)
        if self._fitted and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise RuntimeError(
                "trainer.fit was already called on this Trainer from the notebook; its workers' progress and weights"
                " stayed in them. Create a new Trainer and continue with fit(..., ckpt_path=<a checkpoint of the first"
                " run>) (trainer.checkpoint_callback.best_model_path names it)."
            )
        # Forked workers copy this process whole: a default group left by an earlier one-process run here would make
        # them believe they are initialised, with none of its threads and sockets. Destroyed first (locally).
        self._release()
        # One rendezvous port for all workers, chosen here before they exist (as Lightning's launcher does), but set
        # in the workers only: the kernel's environment stays as it was, so a job it starts later picks its own.
        port = self._strategy.cluster_environment.main_port
        if trainer is not None:
            _fix_logger_versions(trainer)
        out_dir = tempfile.mkdtemp(prefix="lightning_3d_fork_")
        try:
            context = mp.start_processes(
                self._worker, args=(n, port, trainer, function, args, kwargs, out_dir), nprocs=n, start_method="fork",
                join=False,
            )
            self.procs = context.processes
            try:
                while not context.join():  # raises with the worker's traceback if one fails (the others are stopped)
                    pass
            except BaseException:  # also an interrupted cell (KeyboardInterrupt): no worker outlives the call
                for proc in self.procs:
                    if proc.is_alive():
                        proc.kill()
                raise
            finally:
                for proc in self.procs:  # each holds a pipe to its child until closed: one run's descriptors each fit
                    proc.join()
                    proc.close()
                self.procs = []
            # Our own file, written a moment ago by our own worker: weights_only all the same (nothing executes).
            payload = torch.load(os.path.join(out_dir, "rank0.pt"), weights_only=True)
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        if trainer is not None:
            self._fitted |= trainer.state.fn == TrainerFn.FITTING
            _restore(trainer, payload)
        return payload["results"]

    def _worker(self, index: int, n: int, port: int, trainer: pl.Trainer | None, function: Callable, args: Any,
                kwargs: Any, out_dir: str) -> None:
        os.environ["LOCAL_RANK"], os.environ["MASTER_PORT"] = str(index), str(port)
        set_num_threads_if_needed(num_processes=n)  # n workers on the kernel's cores, not n x all cores each
        results = function(*args, **kwargs)
        if index == 0:
            torch.save(_collect(trainer, results), os.path.join(out_dir, "rank0.pt"))

    def kill(self, signum: int) -> None:
        for proc in self.procs:
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, signum)
                except ProcessLookupError:
                    pass


def _fix_logger_versions(trainer: pl.Trainer) -> None:
    """Resolve each CSV/TensorBoard logger's version here, before forking: left to the workers, the notebook's copy
    of the logger would later pick the *next* free version and point ``trainer.log_dir`` at an empty directory."""
    for logger in trainer.loggers:
        if isinstance(logger, (CSVLogger, TensorBoardLogger)):
            _ = logger.version


def _to_cpu(value: Any) -> Any:
    return apply_to_collection(value, Tensor, lambda t: t.detach().cpu())


def _collect(trainer: pl.Trainer | None, results: Any) -> dict[str, Any]:
    """Rank 0's results in types ``torch.load(weights_only=True)`` reads back (enums as their string values)."""
    payload: dict[str, Any] = {"results": _to_cpu(results)}
    if trainer is None:
        return payload
    state = trainer.state
    payload["state"] = [state.fn.value if state.fn else None, state.status.value, state.stage.value if state.stage else None]
    payload["callback_metrics"] = _to_cpu(dict(trainer.callback_metrics))
    payload["logged_metrics"] = _to_cpu(dict(trainer.logged_metrics))
    payload["checkpoints"] = [
        {name: _to_cpu(getattr(cb, name)) for name in _CHECKPOINT_FIELDS} for cb in _model_checkpoints(trainer)
    ]
    return payload


def _restore(trainer: pl.Trainer, payload: dict[str, Any]) -> None:
    fn, status, stage = payload["state"]
    trainer.state = TrainerState(
        fn=TrainerFn(fn) if fn else None, status=TrainerStatus(status), stage=RunningStage(stage) if stage else None
    )
    trainer.callback_metrics.update(payload["callback_metrics"])
    trainer.logged_metrics.update(payload["logged_metrics"])
    for cb, fields in zip(_model_checkpoints(trainer), payload["checkpoints"], strict=True):
        for name, value in fields.items():
            setattr(cb, name, value)


def _model_checkpoints(trainer: pl.Trainer) -> list[ModelCheckpoint]:
    return [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
