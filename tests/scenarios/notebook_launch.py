"""Cells of a notebook that tests Compressed3DStrategy's interactive launch inside a real Jupyter kernel.

tests/test_notebooks.py runs them with nbclient, in one kernel: one process (in the kernel), four forked processes
as (1, 2, 2), a second fit in the same kernel as (2, 2, 1), a failing worker, a second fit on a used Trainer, and
one process again. The last cell writes what the test checks to ``REPORT`` as JSON.
"""

SETUP = '''
import json, multiprocessing, os
import pandas as pd, lightning.pytorch as pl, torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning_3d import Compressed3DStrategy
from lightning_3d.recipes import GPT
from lightning_3d.recipes.data import SyntheticLMDataModule

ROOT, REPORT = __ROOT__, __REPORT__
out = {}

def make_trainer(devices, dp, pp, tp, checkpoint=False):
    strategy = Compressed3DStrategy(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                    num_microbatches=2, compression=False)
    return pl.Trainer(accelerator="cpu", devices=devices, max_steps=4, strategy=strategy, log_every_n_steps=1,
                      logger=CSVLogger(ROOT, name="runs"), enable_checkpointing=checkpoint,
                      callbacks=[ModelCheckpoint(save_on_train_epoch_end=True)] if checkpoint else None,
                      enable_progress_bar=False, enable_model_summary=False)

def fit(trainer, dp):
    # The same 8 samples per step in every layout: 8 per replica in one replica, 4 in each of two.
    data = SyntheticLMDataModule(vocab_size=256, seq_length=32, batch_size=8 // dp, num_samples=32, shuffle=False)
    trainer.fit(GPT("tiny", vocab_size=256, seq_length=32, dropout=0.0, warmup_steps=1), datamodule=data)
    return pd.read_csv(os.path.join(trainer.log_dir, "metrics.csv"))["train_loss"].dropna().tolist()

def fds():
    """This kernel's open descriptors by kind (pipes, sockets, files): kinds, not names, since zmq may renew a socket."""
    kinds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed by now
            continue
        kind = target.split(":")[0] if target.startswith(("pipe:", "socket:", "anon_inode:")) else "file"
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds
'''

CELLS = [
    '''
t1 = make_trainer(1, 1, 1, 1)
out["one"] = fit(t1, 1)
out["one_launcher"] = repr(t1.strategy.launcher)
''',
    '''
port = os.environ.get("MASTER_PORT")  # the kernel's own one-process group's
t4 = make_trainer(4, 1, 2, 2, checkpoint=True)
out["four"] = fit(t4, 1)
out["kernel_env_kept"] = os.environ.get("MASTER_PORT") == port
out["four_launcher"] = type(t4.strategy.launcher).__name__
out["four_state"] = [t4.state.fn.value, t4.state.status.value]
out["four_metric"] = float(t4.callback_metrics["train_loss"])
out["four_ckpt"] = t4.checkpoint_callback.best_model_path
out["four_ckpt_exists"] = os.path.isdir(out["four_ckpt"])
out["kernel_initialised_after_fork"] = dist.is_initialized()
out["fds_after_first_fork"] = fds()
''',
    '''
t5 = make_trainer(4, 2, 2, 1)
out["second"] = fit(t5, 2)
out["fds_after_second_fork"] = fds()
''',
    '''
try:
    fit(t5, 2)
except RuntimeError as err:
    out["refit_error"] = str(err)
''',
    '''
try:
    fit(make_trainer(4, 3, 2, 1), 1)  # 3 x 2 x 1 != 4: found in setup_environment, in every worker
except Exception as err:
    out["worker_error"] = type(err).__name__ + ": " + str(err)
''',
    '''
out["again"] = fit(make_trainer(1, 1, 1, 1), 1)
out["children_left"] = len(multiprocessing.active_children())
json.dump(out, open(REPORT, "w"))
''',
]
