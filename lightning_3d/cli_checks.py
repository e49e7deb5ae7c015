"""Checks and short messages of ``lightning-3d`` that read the parsed configuration before any class is built.

- :func:`trainer_config_error`: settings that cannot run here, said before the model and data module are built (the
  data module builds its corpus and tokenizer) and before Lightning or torch raise their own, longer errors:
  ``accelerator="gpu"`` on a machine without a usable CUDA GPU, and ``precision="16-mixed"`` with
  ``Compressed3DStrategy`` (which Lightning would turn into bf16 on a CPU without a word to the strategy).
- :func:`value_error`: a value of the wrong type for a typed option (a word for ``data_parallel_size``), which
  jsonargparse reports as a nested union report, as one line naming the option, the value and what it accepts.
"""

from __future__ import annotations

import re
from typing import Any

import torch

_STRATEGY = ("lightning_3d.Compressed3DStrategy", "lightning_3d.strategies.compressed_3d.Compressed3DStrategy",
             "compressed_3d")


def _get(node: Any, key: str) -> Any:
    if node is None:
        return None
    return node.get(key) if hasattr(node, "get") else getattr(node, key, None)


def trainer_config_error(trainer: Any) -> str | None:
    """The message for a trainer configuration that cannot run on this machine or with this strategy, else None."""
    accelerator = _get(trainer, "accelerator")
    if isinstance(accelerator, str) and accelerator.lower() in ("gpu", "cuda") and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
        return (f"trainer.accelerator={accelerator!r}, but this machine has no usable CUDA GPU (torch"
                f" {torch.__version__}, {build}; torch.cuda.is_available() is False). Use --trainer.accelerator=cpu"
                " (or auto), or run on a GPU machine with a CUDA build of torch.")
    strategy = _get(trainer, "strategy")
    name = strategy if isinstance(strategy, str) else _get(strategy, "class_path")
    precision = str(_get(trainer, "precision"))
    if name in _STRATEGY and precision in ("16-mixed", "16"):
        return (f"trainer.precision={precision!r} (fp16 with loss scaling) is not supported by Compressed3DStrategy:"
                " the loss scale and its overflow checks would have to span every pipeline stage and tensor shard. Use"
                " --trainer.precision=bf16-mixed (no loss scaling needed) or 32-true.")
    return None


_TYPES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "NoneType": "null"}


def _accepted(subtypes: str) -> list[str]:
    out = []
    for item in re.findall(r"<class '([\w.]+)'>|typing\.Literal\[([^\]]*)\]|(None)", subtypes):
        cls, literal, none = item
        out.append(_TYPES.get(cls.rsplit(".", 1)[-1], cls) if cls else literal if literal else "null")
    return out


def value_error(message: str) -> str | None:
    """``data_parallel_size='two'`` is not ... : the innermost typed option jsonargparse refused, with the value and
    the types it accepts, or None when the message is not about an option's value."""
    starts = [m.start() for m in re.finditer(r'Parser key "', message)] + [len(message)]
    inner = []
    for start, end in zip(starts, starts[1:]):  # each key's own report, up to the next (nested) key
        found = re.match(r'Parser key "([\w.]+)":\s*Does not validate against any of the Union subtypes\s*'
                         r"Subtypes: \[(.*?)\]\s*Errors:.*?Given value type: [^\n]*\n\s*Given value: ([^\n]*)",
                         message[start:end], re.S)
        errors = message[start:end].split("Errors:", 1)[-1].split("Given value type:", 1)[0]
        only_types = all(line.strip().startswith("- Expected a ") for line in errors.splitlines() if line.strip())
        if found and only_types:  # a value of the wrong type, not a class that refused its arguments
            inner.append(found)
    if not inner:
        return None
    key, subtypes, given = inner[-1].groups()
    accepted = _accepted(subtypes)
    if not accepted:
        return None
    outer = re.match(r'Parser key "([\w.]+)"', message)
    path = f"{outer.group(1)}.init_args.{key}" if outer and outer.group(1) != key else key
    return (f"{path}={given.strip()!r} is not accepted: it must be {' or '.join(accepted)}"
            f" (e.g. --{path}={_example(accepted)}).")


def _example(accepted: list[str]) -> str:
    if "an integer" in accepted:
        return "2"
    if "a number" in accepted:
        return "1.0"
    return accepted[0].strip("'\"")
