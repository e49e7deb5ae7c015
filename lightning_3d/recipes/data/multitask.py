"""Multi-task, variable-length data for GPT (causal LM, loss on the target) and T5 ((input, target) pairs).

Samples are (input, target) texts from the offline mix (:mod:`.multitask_mix`, built from the Python installation)
or from FLAN-format JSON-lines files, tokenized once and cached as ragged arrays under a key of everything they
depend on. Each training step reads one *global* batch: the loader's sampler runs with one replica (the global
order, resumable mid-epoch by :mod:`.loader`'s machinery) and its ``collate_fn`` (:class:`StepCollator`) cuts this
data-parallel replica's micro-batches out of it, returning a ``lightning_3d.MicroBatches`` that
``Compressed3DStrategy`` runs as is. ``microbatching`` picks padding, packing (with document masking),
token-budget or dynamic (DynaPipe) micro-batches; docs/multitask.md compares them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_3d.dynamic.choice import parse_candidates
from lightning_3d.dynamic.handoff import PlanWaits, background
from lightning_3d.recipes.data.causal_lm import cache_key, default_cache_dir
from lightning_3d.recipes.data.loader import ResumableDataLoader, ResumableDistributedSampler, data_parallel_rank, worker_options
from lightning_3d.recipes.data.memory_budget import default_memory_budget_gb
from lightning_3d.recipes.data.multitask_batching import (
    MICROBATCHINGS,
    PLANNED,
    Sample,
    StepCollator,
    sample_input_length,
    sample_target_length,
)
from lightning_3d.recipes.data.multitask_mix import TASKS, iter_offline_mix, read_flan_jsonl
from lightning_3d.recipes.data.multitask_planning import check_adaptive_option, check_profile_shape, load_cost_profile, priced_as_trained
from lightning_3d.recipes.data.packing import resolve_data_files
from lightning_3d.recipes.data.span_corruption import Seq2SeqVocab
from lightning_3d.recipes.data.tokenizer import (
    BPE_EOS_TOKEN_ID,
    BYTE_VOCAB_SIZE,
    TextTokenizer,
    files_fingerprint,
    load_tokenizer,
    tokenizer_kind,
)
from lightning_3d.recipes.gpt.model import resolve_packed_attention

MIX_FORMAT_VERSION = 1


class MultiTaskSamples(Dataset):
    """Samples ``indices`` of a cached ragged ``.npz``, cut to the model's lengths (see ``StepCollator``'s sample
    format). GPT: ``input + target + EOS`` (the target keeps at most ``target_length`` tokens, the input the rest of
    ``seq_length + 1``); T5: ``input + EOS`` and ``target + EOS`` within ``seq_length`` / ``target_length``."""

    def __init__(self, path: str, indices: np.ndarray, model_type: str, seq_length: int, target_length: int,
                 eos: int, train_on_inputs: bool) -> None:
        self.path, self.indices, self.model_type, self.eos = path, indices, model_type, eos
        self.seq_length, self.target_length, self.train_on_inputs = seq_length, target_length, train_on_inputs
        self._arrays: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.indices)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}  # workers open the file themselves (see loader.worker_options)

    def arrays(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            with np.load(self.path) as data:
                self._arrays = {k: data[k] for k in data.files}
        return self._arrays

    def raw(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        a, i = self.arrays(), int(self.indices[index])
        return (a["input_ids"][a["input_offsets"][i] : a["input_offsets"][i + 1]].astype(np.int64),
                a["target_ids"][a["target_offsets"][i] : a["target_offsets"][i + 1]].astype(np.int64))

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range 0..{len(self) - 1}")
        inputs, targets = self.raw(index)
        eos = np.array([self.eos], dtype=np.int64)
        if self.model_type == "t5":
            return {"inputs": np.concatenate([inputs[: self.seq_length - 1], eos]),
                    "targets": np.concatenate([targets[: self.target_length - 1], eos])}
        targets = targets[: min(self.target_length, self.seq_length) - 1]
        inputs = inputs[: self.seq_length - len(targets)]  # input + target + EOS = at most seq_length + 1 tokens
        prompt = 0 if self.train_on_inputs else len(inputs)
        return {"tokens": np.concatenate([inputs, targets, eos]), "prompt": prompt}


class _StepLoader(ResumableDataLoader):
    """With workers, steps are taken off the workers in a background thread two steps ahead: receiving a step of
    many micro-batch tensors from a worker costs the receiving process round trips to that worker, which would
    otherwise land on the training loop (``lightning_3d.dynamic.handoff``). ``waits``: a ``PlanWaits`` recording each
    step's fetch (and, for dynamic micro-batching, whether it waited for its plan)."""

    waits: PlanWaits | None = None

    def _batches(self):
        batches = super()._batches()
        if self.num_workers > 0:
            batches = background(batches, ahead=2)
        return self.waits.wrap(batches) if self.waits is not None else batches


class MultiTaskDataModule(L.LightningDataModule):
    """Variable-length multi-task samples, micro-batched per step by ``microbatching``.

    ``model_type``: ``"gpt"`` (sequence = input + target + EOS, loss on the target unless ``train_on_inputs``; at most
    ``seq_length`` tokens, the target at most ``target_length``) or ``"t5"`` (input at most ``seq_length`` tokens and
    target at most ``target_length``, EOS included). ``data_files``: FLAN-format JSON lines (``input_key`` /
    ``target_key``); without them the offline mix of ``tasks`` (``num_samples`` samples). ``truncate=False`` refuses
    (at setup, naming the sample) samples longer than those limits instead of cutting them.

    ``global_batch_size`` samples per optimizer step over all data-parallel replicas. ``microbatching``:
    ``"padding"`` (``micro_batch_size`` samples, padded to the longest), ``"packing"`` (``micro_batch_size`` rows of
    ``seq_length`` tokens, documents masked from each other), ``"token_budget"`` (at most ``token_budget`` padded
    tokens per micro-batch), ``"dynamic"`` (DynaPipe planner; ``memory_budget_gb`` of activations per device, by
    default 80 % of the device's memory minus the rank's model state: recipes/data/memory_budget.py),
    ``"packed_dynamic"`` (the planner over packed rows) or ``"auto"`` (per step the cheapest under the planner's cost
    model of ``auto_candidates``, by default both planners, packing at 1, 2, 4, 8, 16, 32 rows and token budgets of
    1, 2, 4, 8, 16 longest samples: ``lightning_3d.dynamic.choose_step``, docs/dynamic.md; a model that compiles its
    blocks gets full packed rows, docs/dynamic.md "Compiled models"). The planned ones cost micro-batches
    with ``cost_profile`` (a profile JSON written by ``lightning-3d profile`` for this model, read as data, checked
    when the module is built) or, without one, the analytic cost model; ``adaptive_schedule`` says whether their
    pipeline order search also tries the adaptive schedule: ``"auto"`` (where it simulates faster), ``"off"`` or
    ``"only"`` (``lightning_3d.dynamic.adaptive``). ``microbatch_multiple``:
    the largest micro-batches are halved until their count is a multiple of it (interleaved 1F1B needs a multiple of
    the pipeline size); packed single-row micro-batches split their row of most documents into two rows
    (``lightning_3d.dynamic.packed.packed_groups_to_multiple``). ``tokenizer`` as in
    :class:`CausalLMDataModule`; T5's pad (= decoder start) id is appended after the text vocabulary.
    """

    def __init__(
        self,
        model_type: Literal["gpt", "t5"] = "gpt",
        data_files: str | list[str] | None = None,
        val_files: str | list[str] | None = None,
        input_key: str = "inputs",
        target_key: str = "targets",
        tasks: list[str] | None = None,
        num_samples: int = 20000,
        tokenizer: str = "bpe",
        tokenizer_vocab_size: int = 4096,
        seq_length: int = 512,
        target_length: int = 128,
        truncate: bool = True,
        train_on_inputs: bool = False,
        global_batch_size: int = 32,
        microbatching: Literal["padding", "packing", "token_budget", "dynamic", "packed_dynamic", "auto"] = "padding",
        micro_batch_size: int = 4,
        token_budget: int | None = None,
        microbatch_multiple: int = 1,
        memory_budget_gb: float | None = None,
        auto_candidates: list[str] | None = None,
        cost_profile: str | None = None,
        adaptive_schedule: Literal["auto", "off", "only"] = "auto",
        val_fraction: float = 0.02,
        cache_dir: str | None = None,
        num_workers: int = 0,
        seed: int = 1234,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if model_type not in ("gpt", "t5"):
            raise ValueError(f"model_type={model_type!r}: use 'gpt' or 't5'.")
        if microbatching not in MICROBATCHINGS:
            raise ValueError(f"microbatching={microbatching!r}: use one of {list(MICROBATCHINGS)}.")
        limits = (("seq_length", seq_length, 2), ("target_length", target_length, 2), ("num_samples", num_samples, 1),
                  ("global_batch_size", global_batch_size, 1), ("micro_batch_size", micro_batch_size, 1),
                  ("microbatch_multiple", microbatch_multiple, 1),
                  ("num_workers", num_workers, 0))
        for name, value, low in limits:
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}.")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}.")
        longest = seq_length + (target_length if model_type == "t5" else 0)
        if microbatching == "token_budget" and (token_budget is None or token_budget < longest):
            raise ValueError(f"microbatching='token_budget' needs token_budget >= {longest} (the longest sample:"
                             f" seq_length{' + target_length' if model_type == 't5' else ''}), got {token_budget}.")
        if auto_candidates is not None:
            if microbatching != "auto":
                raise ValueError(f"auto_candidates={auto_candidates!r} applies to microbatching='auto' only, not"
                                 f" {microbatching!r}: set microbatching='auto' or drop auto_candidates.")
            parse_candidates(auto_candidates, longest)
        check_adaptive_option(adaptive_schedule, microbatching)
        #: the measured cost model of ``cost_profile`` (None: planned micro-batching uses the analytic one)
        self.cost_model = load_cost_profile(cost_profile, microbatching)
        self.tasks = list(tasks) if tasks is not None else list(TASKS)
        if not self.tasks or set(self.tasks) - set(TASKS):
            raise ValueError(f"tasks={tasks!r}: choose a non-empty subset of {list(TASKS)}.")
        self.train_files = resolve_data_files(data_files, "data_files")
        self.val_files = resolve_data_files(val_files, "val_files")
        for files in (self.train_files, self.val_files):
            if files is not None and files[0].suffix.lower() not in (".jsonl", ".json"):
                raise ValueError(f"data_files must be JSON lines (.jsonl/.json) in FLAN's format, got {files[0]}.")
        self.tokenizer_kind = tokenizer_kind(tokenizer)
        if self.tokenizer_kind == "bpe" and tokenizer_vocab_size < BYTE_VOCAB_SIZE:
            raise ValueError(f"tokenizer_vocab_size must be >= {BYTE_VOCAB_SIZE} for 'bpe',"
                             f" got {tokenizer_vocab_size}.")
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.train_dataset: MultiTaskSamples | None = None
        self.val_dataset: MultiTaskSamples | None = None
        self._tokenizer: TextTokenizer | None = None
        #: the training loader's per-step record (``lightning_3d.dynamic.PlanWaits``), set by ``train_dataloader``
        self.plan_waits: PlanWaits | None = None

    @property
    def varies_microbatch_shapes(self) -> bool:
        """True for padding, token budgets and dynamic micro-batching (each micro-batch padded to its own longest
        sample), False for packing (rows of ``seq_length`` tokens): the recipes' ``sdpa_backends="auto"`` reads it
        (recipes/attention.py) and keeps cuDNN's attention, which plans per shape, away from changing shapes."""
        return self.hparams.microbatching != "packing"

    # ----------------------------------------------------------------- vocabulary
    @property
    def text_vocab_size(self) -> int:
        if self.tokenizer_kind == "bytes":
            return BYTE_VOCAB_SIZE
        if self.tokenizer_kind == "bpe":
            return self.hparams.tokenizer_vocab_size
        return self.load_text_tokenizer().vocab_size

    @property
    def eos_token_id(self) -> int:
        if self.tokenizer_kind == "bytes":
            return BYTE_VOCAB_SIZE - 1
        if self.tokenizer_kind == "bpe":
            return BPE_EOS_TOKEN_ID
        return self.load_text_tokenizer().eos_token_id

    @property
    def vocab_size(self) -> int:
        """GPT: the tokenizer's size; T5: one more, for the pad (decoder start) id."""
        return self.text_vocab_size + (1 if self.hparams.model_type == "t5" else 0)

    @property
    def pad_token_id(self) -> int:
        """T5: the appended pad id (also the decoder start); GPT pads with EOS (its labels are ignored)."""
        return Seq2SeqVocab.appended(self.text_vocab_size, self.eos_token_id, 0).pad_token_id \
            if self.hparams.model_type == "t5" else self.eos_token_id

    # ----------------------------------------------------------------- sources and cache
    def _source(self, split: str) -> dict:
        files = self.train_files if split == "train" else self.val_files
        if files is not None:
            return {"files": files_fingerprint(files), "keys": [self.hparams.input_key, self.hparams.target_key]}
        return {"mix": self.tasks, "num_samples": self.hparams.num_samples, "python": sys.version}

    def _texts(self, split: str):
        """(where, input, target) triples of a split."""
        files = self.train_files if split == "train" else self.val_files
        if files is not None:
            return read_flan_jsonl(files, self.hparams.input_key, self.hparams.target_key)
        mix = iter_offline_mix(self.tasks)
        return ((f"mix:{task}", i, t) for _, (task, i, t) in zip(range(self.hparams.num_samples), mix))

    def samples_path(self, split: str) -> Path:
        hp = self.hparams
        tok = {"spec": hp.tokenizer, "vocab": hp.tokenizer_vocab_size, "train": self._source("train")}
        if self.tokenizer_kind == "local":
            path = Path(hp.tokenizer).expanduser()
            files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
            tok = {"files": files_fingerprint(files)}
        key = cache_key([MIX_FORMAT_VERSION, self._source(split), tok])
        return self.cache_dir / "multitask" / f"{split}-{key}.npz"

    def load_text_tokenizer(self, train_texts: list[tuple[str, str, str]] | None = None) -> TextTokenizer:
        """The text tokenizer ("bpe" is trained on the training inputs and targets once, then cached);
        ``train_texts``: the training triples when already read (the offline mix takes seconds to build)."""
        if self._tokenizer is None:
            triples = (lambda: iter(train_texts)) if train_texts is not None else (lambda: self._texts("train"))
            texts = lambda: (t for _, i, o in triples() for t in (i, o))  # noqa: E731
            self._tokenizer = load_tokenizer(self.hparams.tokenizer, vocab_size=self.hparams.tokenizer_vocab_size,
                                             cache_dir=self.cache_dir, texts=texts,
                                             fingerprint=json.dumps(self._source("train"), sort_keys=True))
        return self._tokenizer

    def _build(self, split: str, path: Path) -> None:
        triples = list(self._texts(split))
        if not triples:
            raise ValueError(f"The {split} data holds no (input, target) pairs.")
        tokenizer = self.load_text_tokenizer(triples if split == "train" else None)
        where, inputs, targets = (list(column) for column in zip(*triples, strict=True))
        arrays: dict[str, np.ndarray] = {}
        for side, texts in (("input", inputs), ("target", targets)):
            rows = tokenizer.encode_batch(texts)
            offsets = np.zeros(len(rows) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([len(r) for r in rows])
            arrays[f"{side}_ids"] = np.fromiter((x for r in rows for x in r), dtype=np.int32, count=int(offsets[-1]))
            arrays[f"{side}_offsets"] = offsets
        arrays["where"] = np.array(where)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.tmp-{os.getpid()}.npz")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)

    # ----------------------------------------------------------------- Lightning hooks
    def prepare_data(self) -> None:
        """Build (once, into the cache) the tokenizer and the tokenized samples of every split that has a source."""
        for split in ("train", "val") if self.val_files is not None else ("train",):
            if not self.samples_path(split).exists():
                self._build(split, self.samples_path(split))

    def _dataset(self, split: str, indices: np.ndarray | None = None) -> MultiTaskSamples:
        hp = self.hparams
        path = str(self.samples_path(split))
        if indices is None:
            with np.load(path) as data:
                indices = np.arange(len(data["input_offsets"]) - 1)
        dataset = MultiTaskSamples(path, indices, hp.model_type, hp.seq_length, hp.target_length, self.eos_token_id,
                                   hp.train_on_inputs)
        if not hp.truncate:
            self._refuse_long(dataset)
        return dataset

    def _refuse_long(self, dataset: MultiTaskSamples) -> None:
        hp, a = self.hparams, dataset.arrays()
        n_in, n_tg = np.diff(a["input_offsets"])[dataset.indices], np.diff(a["target_offsets"])[dataset.indices]
        if hp.model_type == "t5":
            bad = np.flatnonzero((n_in + 1 > hp.seq_length) | (n_tg + 1 > hp.target_length))
            limit = (f"seq_length={hp.seq_length} input and target_length={hp.target_length} target tokens"
                     " (EOS included)")
        else:
            bad = np.flatnonzero((n_in + n_tg > hp.seq_length) | (n_tg + 1 > hp.target_length))
            limit = f"seq_length={hp.seq_length} tokens (input + target + EOS - 1), target_length={hp.target_length}"
        if len(bad):
            i = int(dataset.indices[bad[0]])
            raise ValueError(f"Sample {a['where'][i]} has {n_in[bad[0]]} input and {n_tg[bad[0]]} target tokens,"
                             f" more than {limit} ({len(bad)} such samples). Set truncate=True, or raise the lengths.")

    def setup(self, stage: str | None = None) -> None:
        self.prepare_data()
        if self.val_files is not None:
            self.train_dataset, self.val_dataset = self._dataset("train"), self._dataset("val")
            return
        with np.load(self.samples_path("train")) as data:
            n = len(data["input_offsets"]) - 1
        frac = self.hparams.val_fraction
        # Every k-th sample is held out (not the tail): the offline mix and many files are ordered by source/task.
        held = np.zeros(n, dtype=bool)
        if frac > 0:
            held[max(2, round(1 / frac)) - 1 :: max(2, round(1 / frac))] = True
        if held.all() or not (~held).any():
            raise ValueError(f"Only {n} sample(s): nothing left to train on. Add data or lower val_fraction.")
        self.train_dataset = self._dataset("train", np.flatnonzero(~held))
        self.val_dataset = self._dataset("train", np.flatnonzero(held)) if held.any() else None

    def collator(self, dp: int, rank: int) -> StepCollator:
        """The ``collate_fn`` that turns a global batch into replica ``rank``'s micro-batches."""
        hp = self.hparams
        target = hp.target_length if hp.model_type == "t5" else 0
        collator = StepCollator(hp.model_type, hp.microbatching, dp, rank, seq_length=hp.seq_length,
                                target_length=target, pad_id=self.pad_token_id, micro_batch_size=hp.micro_batch_size,
                                token_budget=hp.token_budget, microbatch_multiple=hp.microbatch_multiple)
        if hp.microbatching in PLANNED:
            collator.dynamic = self._dynamic_planner(collator, dp, rank)
        return collator

    def _dynamic_planner(self, collator: StepCollator, dp: int, rank: int):
        """DynaPipe's planner (``lightning_3d.dynamic``) over each step's global batch, costed by ``cost_profile``
        (refused here if it measured another model) or the analytic model of the trained model's shape. Imported
        here: only this option needs the planner."""
        from lightning_3d.costs import model_shape
        from lightning_3d.dynamic import DynamicMicroBatcher
        from lightning_3d.dynamic.choice import default_candidates

        hp, trainer = self.hparams, self.trainer
        config = getattr(getattr(trainer, "lightning_module", None), "config", None)
        if config is None:
            raise ValueError(f"microbatching={hp.microbatching!r} plans with the model's shape: train a recipe model"
                             " (GPT or T5, which have a .config) with this data module.")
        strategy = trainer.strategy
        budget_gb = hp.memory_budget_gb
        if budget_gb is None:  # derived from the device and this rank's parameters (memory_budget.py)
            held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in trainer.lightning_module.parameters())
            budget_gb = default_memory_budget_gb(strategy.root_device, held, getattr(strategy, "num_processes", 1))
        dims = getattr(strategy, "dims", None)
        pp, tp = (dims.pp, dims.tp) if dims is not None else (1, 1)
        half = any(k in str(trainer.precision) for k in ("16", "bf16"))
        t5 = hp.model_type == "t5"
        longest = hp.seq_length + (hp.target_length if t5 else 0)
        candidates = {"dynamic": None, "packed_dynamic": ("packed_dynamic",),
                      "auto": tuple(hp.auto_candidates or default_candidates(longest))}[hp.microbatching]
        shape = model_shape(config, bytes_per_element=2 if half else 4, tensor_parallel_size=tp)
        if self.cost_model is not None:
            check_profile_shape(self.cost_model, shape, hp.cost_profile)
        hparams = getattr(trainer.lightning_module, "hparams", None) or {}
        compiled = bool(hparams.get("compile", False))
        cost_model = priced_as_trained(self.cost_model, hp.cost_profile, compiled)
        return DynamicMicroBatcher(
            collator.collate, shape=shape, cost_model=cost_model, adaptive_schedule=hp.adaptive_schedule,
            dp=dp, pp=pp, dp_rank=rank, memory_budget=budget_gb * 2**30, tp=tp, seed=hp.seed,
            virtual_stages=getattr(strategy, "virtual_stages", 1) or 1, schedule=getattr(strategy, "schedule", "1f1b"),
            layer_split=getattr(strategy, "pipeline_layer_split", None), max_seq_len=hp.seq_length,
            max_target_len=hp.target_length if t5 else None, input_length=sample_input_length,
            target_length=sample_target_length if t5 else None, candidates=candidates,
            collate_packed=collator.collate_packed, packed_attention=self._packed_attention(config, strategy),
            # A compiled model runs full rows (one shape) at its compiled grids' speed; rows of each micro-batch's own
            # length are shapes its kernels meet one by one (docs/dynamic.md, "Compiled models").
            packed_row_length="full" if compiled else "fill",
        )

    def _packed_attention(self, config, strategy) -> str:
        """What the model runs for packed rows on this device, as the planner prices it: GPT's ``packed_attention``
        resolved as the model resolves it ("flex" or the dense SDPA mask); T5's packed rows use dense masks."""
        if self.hparams.model_type == "t5":
            return "dense"
        module = self.trainer.lightning_module
        asked = getattr(getattr(module, "hparams", None), "packed_attention", "auto")
        device = getattr(strategy, "root_device", torch.device("cpu"))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_heads
        resolved = resolve_packed_attention(asked, device, getattr(config, "dropout", 0.0), head_dim)
        return "flex" if resolved == "flex" else "dense"

    def _loader(self, dataset: Dataset, shuffle: bool, train: bool = False) -> ResumableDataLoader:
        hp = self.hparams
        dp, rank = data_parallel_rank(self.trainer)
        if hp.global_batch_size < dp:
            raise ValueError(f"global_batch_size={hp.global_batch_size} is smaller than the {dp} data-parallel"
                             f" replicas: every replica needs at least one sample per step; raise it to >= {dp}.")
        # One replica in the sampler: every rank reads the same global batch; the collator takes this replica's part.
        sampler = ResumableDistributedSampler(dataset, 1, 0, shuffle=shuffle, seed=hp.seed, drop_last=True)
        loader = _StepLoader(dataset, hp.global_batch_size, sampler, num_workers=hp.num_workers,
                             collate_fn=self.collator(dp, rank), **worker_options(hp.num_workers))
        if train:  # its steps are recorded in ``plan_waits``
            self.plan_waits = loader.waits = PlanWaits()
        if len(loader) == 0:
            raise ValueError(f"{len(dataset)} samples are fewer than global_batch_size={hp.global_batch_size}: add data"
                             " or lower global_batch_size.")
        return loader

    def train_dataloader(self) -> ResumableDataLoader:
        """Resumable loader of global batches; each yields this replica's ``MicroBatches``."""
        if self.train_dataset is None:
            self.setup("fit")
        return self._loader(self.train_dataset, self.hparams.shuffle, train=True)

    def val_dataloader(self) -> DataLoader | list:
        """Held-out global batches in order (the incomplete last one dropped), micro-batched like training."""
        if self.train_dataset is None:
            self.setup("validate")
        if self.val_dataset is None or len(self.val_dataset) < self.hparams.global_batch_size:
            return []
        return self._loader(self.val_dataset, False)
