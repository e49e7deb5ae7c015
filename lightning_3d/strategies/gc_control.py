"""``GarbageCollection``: Python's cyclic garbage collector under the strategy (options ``gc_interval``, ``gc_freeze``).

Automatic collection runs whenever enough container objects were allocated, so it lands at an arbitrary point of an
arbitrary step, on each rank at a different one; a full (generation-2) collection walks every tracked object of the
heap, which after ``torch.compile`` holds the graphs, guards and FX objects of every compiled region. That pause is
one rank's, but every collective of the step waits for it on the others. Here automatic collection is off from the
strategy's ``setup`` to its ``teardown`` and the strategy collects itself, on every rank at the same step, as
Megatron-LM's ``--manual-gc`` and torchtitan's ``gc_freq`` do. Why full collections and why ``gc.freeze``:
docs/speed.md, "Garbage collection".
"""

from __future__ import annotations

import gc

from lightning.pytorch.trainer.states import TrainerFn


def check_gc_options(gc_interval: object, gc_freeze: object) -> None:
    """Raise on a bad value (on every rank, from the strategy's constructor, before any process group exists)."""
    bad_type = isinstance(gc_interval, bool) or not isinstance(gc_interval, int)
    if gc_interval is not None and (bad_type or gc_interval < 1):
        raise ValueError(
            f"`gc_interval={gc_interval!r}` must be a positive number of optimizer steps between the strategy's garbage"
            " collections (e.g. 50), or None to leave Python's automatic collection as it is."
        )
    if not isinstance(gc_freeze, bool):
        raise TypeError(f"`gc_freeze={gc_freeze!r}` must be True or False.")


class GarbageCollection:
    """Automatic collection off during a run, a full collection every ``interval`` steps on every rank.

    ``start(fn)`` at the strategy's ``setup`` (every trainer function), ``stop()`` at its ``teardown``, which
    Lightning also runs when the run raises, so the process's own setting comes back either way. In a fit the
    collection runs before the first batch of every ``interval``-th optimizer step (``trainer.global_step``, equal on
    every rank; once per step under gradient accumulation, and at the same phase after a resume); evaluation loops
    (validation inside a fit, ``validate``, ``test``, ``predict``) collect before every ``interval``-th batch of the
    run, since every rank runs the same number of them.

    With ``freeze``, the first collection of a fit, and the first after each validation (whose compiled graphs are
    new), is followed by ``gc.freeze()``: what survived it moves to the permanent generation that later collections
    do not walk; in an evaluation-only run the first collection freezes. ``stop`` unfreezes. A process that had
    frozen objects itself before the run keeps its own freeze: the strategy then neither freezes nor unfreezes.
    ``interval=None`` changes nothing of Python's behaviour.
    """

    def __init__(self, interval: int | None, freeze: bool) -> None:
        check_gc_options(interval, freeze)
        self.interval, self.freeze = interval, freeze
        self.active = False
        #: optimizer steps (fit) at which this run collected, in order; the tests and benchmarks read it
        self.collected_at_steps: list[int] = []
        self._was_enabled = True
        self._fitting = False
        self._may_freeze = False
        self._froze = False
        self._freeze_next = False
        self._last_step: int | None = None
        self._eval_batches = 0

    def start(self, fn: TrainerFn | str | None) -> None:
        if self.interval is None or self.active:
            return
        self._was_enabled = gc.isenabled()
        self._may_freeze = self.freeze and gc.get_freeze_count() == 0
        self._fitting = fn == TrainerFn.FITTING
        self._froze, self._freeze_next, self._last_step, self._eval_batches = False, True, None, 0
        self.collected_at_steps = []
        gc.disable()
        self.active = True

    def before_train_batch(self, global_step: int) -> None:
        if not self.active or global_step == 0 or global_step % self.interval or global_step == self._last_step:
            return
        self._last_step = global_step
        self.collected_at_steps.append(global_step)
        self._collect(freeze=self._freeze_next)
        self._freeze_next = False

    def before_eval_batch(self) -> None:
        if not self.active:
            return
        self._eval_batches += 1
        if self._fitting:
            self._freeze_next = True  # the training collection after this validation freezes its compiled graphs too
        if self._eval_batches % self.interval == 0:
            self._collect(freeze=not self._fitting and not self._froze)

    def _collect(self, freeze: bool) -> None:
        gc.collect()
        if freeze and self._may_freeze:
            gc.freeze()
            self._froze = True

    def stop(self) -> None:
        """Give the process its collector back as it was (idempotent)."""
        if not self.active:
            return
        self.active = False
        if self._froze:
            gc.unfreeze()
            self._froze = False
        if self._was_enabled:
            gc.enable()
