"""Tests for lightning_3d.recipes.data: corpus, tokenizers, packing, distributed and resumable loading."""

from __future__ import annotations

import importlib
import json
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_3d.recipes.data.causal_lm as causal_lm
import lightning_3d.recipes.data.tokenizer as tokenizer_mod
from lightning_3d.recipes.data import (
    CausalLMDataModule,
    ResumableDataLoader,
    ResumableDistributedSampler,
    SyntheticLMDataModule,
    SyntheticSeq2SeqDataModule,
    build_python_docs_corpus,
    load_tokenizer,
)
from lightning_3d.recipes.data.corpus import iter_pydoc_topics, iter_stdlib_docstrings

EOS = 256  # the "bytes" tokenizer's EOS


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Every test runs as on a machine without network access to the Hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def write_docs(directory: Path, fmt: str, docs: list[str], column: str = "text") -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "txt":  # one document per file
        paths = [directory / f"doc{i}.txt" for i in range(len(docs))]
        for path, doc in zip(paths, docs):
            path.write_text(doc, encoding="utf-8")
        return [str(p) for p in paths]
    path = directory / f"docs.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({column: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({column: docs}), path)
    return [str(path)]


def make_dm(tmp_path: Path, **kwargs) -> CausalLMDataModule:
    defaults = dict(tokenizer="bytes", val_fraction=0.0, shuffle=False, cache_dir=str(tmp_path / "cache"))
    return CausalLMDataModule(**{**defaults, **kwargs})


def ready(dm: CausalLMDataModule) -> CausalLMDataModule:
    dm.prepare_data()
    dm.setup("fit")
    return dm


def blocks_of(dataset) -> list[list[int]]:
    return [torch.cat([s["input_ids"], s["labels"][-1:]]).tolist() for s in (dataset[i] for i in range(len(dataset)))]


def byte_stream(docs: list[str]) -> list[int]:
    return [t for d in docs for t in [*d.encode("utf-8"), EOS]]


# ----------------------------------------------------------------------------- corpus
def test_stdlib_docstrings_filtering_and_order(tmp_path):
    long = "x" * 200
    files = {
        "b.py": f'"""{long}B module"""\nclass C:\n    """{long}C class"""\n    def f(self):\n        """short"""\n',
        "a.py": f'"""{long}A module"""\nasync def g():\n    """{long}A module"""\n',  # duplicate kept once
        "broken.py": f'"""{long}broken"""\ndef (:\n',
        "test/t.py": f'"""{long}test"""',
        "pkg/tests/t.py": f'"""{long}tests"""',
        "idlelib/i.py": f'"""{long}idle"""',
        "site-packages/s.py": f'"""{long}site"""',
        "pkg/m.py": f'"""{long}pkg"""',
    }
    for rel, src in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    docs = list(iter_stdlib_docstrings(tmp_path))
    assert [d[200:] for d in docs] == ["A module", "B module", "C class", "pkg"]


def test_build_python_docs_corpus_is_capped_and_deterministic(tmp_path):
    a = build_python_docs_corpus(tmp_path / "a.jsonl", max_bytes=5000)
    b = build_python_docs_corpus(tmp_path / "b.jsonl", max_bytes=5000)
    assert a.read_bytes() == b.read_bytes()
    texts = [json.loads(line)["text"] for line in a.read_text(encoding="utf-8").splitlines()]
    assert sum(len(t.encode()) for t in texts) == 5000
    topics = list(iter_pydoc_topics())
    assert texts[:-1] == topics[: len(texts) - 1] and topics[len(texts) - 1].startswith(texts[-1])
    with pytest.raises(ValueError, match="max_bytes"):
        build_python_docs_corpus(tmp_path / "c.jsonl", max_bytes=0)


def test_offline_default_corpus_labels_and_eos(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_3D_CACHE", str(tmp_path / "envcache"))
    dm = CausalLMDataModule(tokenizer="bytes", seq_length=64, batch_size=4, max_corpus_bytes=20_000, shuffle=False)
    ready(dm)
    corpus = dm.corpus_path()
    assert corpus.is_relative_to(tmp_path / "envcache") and corpus.exists()
    docs = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    assert len(docs) > 1 and sum(len(d.encode()) for d in docs) == 20_000
    stream = byte_stream(docs)
    n = len(stream) // 65
    assert dm.meta["num_blocks"] == n and dm.meta["num_tokens"] == len(stream)
    n_val = max(1, int(n * 0.02))
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (n - n_val, n_val)
    # Packed blocks are exactly the EOS-separated document stream, cut into seq_length + 1 pieces.
    assert blocks_of(dm.train_dataset) + blocks_of(dm.val_dataset) == [stream[i * 65 : (i + 1) * 65] for i in range(n)]
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (4, 64) and batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    val = next(iter(dm.val_dataloader()))
    assert val["input_ids"][0].tolist() == stream[(n - n_val) * 65 : (n - n_val) * 65 + 64]


# ----------------------------------------------------------------------------- file formats
@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
def test_file_formats_give_exact_byte_ids(tmp_path, fmt):
    files = write_docs(tmp_path / "data", fmt, ["hé", "llo"])
    dm = ready(make_dm(tmp_path, data_files=files, seq_length=3, batch_size=2))
    assert blocks_of(dm.train_dataset) == [[104, 195, 169, EOS], [108, 108, 111, EOS]]
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].tolist() == [[104, 195, 169], [108, 108, 111]]
    assert batch["labels"].tolist() == [[195, 169, EOS], [108, 111, EOS]]
    assert np.load(dm.packed_path("train")).dtype == np.uint16


def test_glob_text_column_and_max_corpus_bytes(tmp_path):
    write_docs(tmp_path / "data", "jsonl", ["hé", "llo", "unused"], column="body")
    dm = ready(make_dm(tmp_path, data_files=str(tmp_path / "data" / "*.jsonl"), text_column="body",
                       seq_length=2, max_corpus_bytes=4))
    # "hé" is 3 bytes, so the 4-byte cap keeps it and cuts "llo" to "l".
    assert blocks_of(dm.train_dataset) == [[104, 195, 169], [EOS, 108, EOS]]
    with pytest.raises(ValueError, match="text_column='text'.*columns are"):
        make_dm(tmp_path, data_files=str(tmp_path / "data" / "docs.jsonl")).prepare_data()


def test_val_files_and_val_fraction(tmp_path):
    train = write_docs(tmp_path / "train", "jsonl", ["abcdefghijklmnopqrstuvwxyz" * 4])
    val = write_docs(tmp_path / "val", "txt", ["xyz"])
    dm = ready(make_dm(tmp_path, data_files=train, val_files=val, seq_length=3, batch_size=2))
    assert blocks_of(dm.val_dataset) == [[120, 121, 122, EOS]]
    assert len(dm.train_dataset) == (104 + 1) // 4
    held = ready(make_dm(tmp_path, data_files=train, seq_length=3, val_fraction=0.1))
    assert (len(held.train_dataset), len(held.val_dataset)) == (24, 2)
    assert blocks_of(held.val_dataset) == blocks_of(dm.train_dataset)[24:]
    held.train_dataset[0]  # opens the memory map
    assert pickle.loads(pickle.dumps(held.train_dataset))._blocks is None  # workers get the path, not data
    assert make_dm(tmp_path, data_files=train, seq_length=3).val_dataloader() == []


def test_second_prepare_reuses_cache_and_needs_no_datasets(tmp_path, monkeypatch):
    files = write_docs(tmp_path / "data", "jsonl", ["hello world"] * 10)
    dm = ready(make_dm(tmp_path, data_files=files, seq_length=8))
    packed = dm.packed_path("train")
    mtime = packed.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("tokenized again although the cache exists")

    monkeypatch.setattr(causal_lm, "pack_documents", fail)
    monkeypatch.setitem(sys.modules, "datasets", None)  # a cached run must not even read the files
    again = ready(make_dm(tmp_path, data_files=files, seq_length=8))
    assert again.packed_path("train") == packed and packed.stat().st_mtime_ns == mtime
    assert blocks_of(again.train_dataset) == blocks_of(dm.train_dataset)
    # Different packing parameters get a different cache entry.
    assert make_dm(tmp_path, data_files=files, seq_length=9).packed_path("train") != packed


# ----------------------------------------------------------------------------- tokenizers
def test_bpe_trains_once_reloads_and_respects_vocab(tmp_path, monkeypatch):
    calls = []
    real_train = tokenizer_mod._train_bpe

    def counting_train(texts, vocab_size):
        calls.append(vocab_size)
        return real_train(texts, vocab_size)

    monkeypatch.setattr(tokenizer_mod, "_train_bpe", counting_train)
    kwargs = dict(tokenizer="bpe", tokenizer_vocab_size=400, seq_length=32, max_corpus_bytes=30_000)
    dm = make_dm(tmp_path, **kwargs)
    assert (dm.vocab_size, dm.eos_token_id) == (400, 0) and calls == []  # cheap path, no training
    ready(dm)
    tok = dm.load_text_tokenizer()
    assert calls == [400] and tok.vocab_size == 400 and tok.eos_token_id == 0
    blocks = np.load(dm.packed_path("train"))
    assert blocks.max() < 400 and (blocks == 0).any()
    assert tok.decode(tok.encode_batch(["Return the value."])[0]) == "Return the value."
    ready(make_dm(tmp_path, **kwargs))  # second run: loads the cached tokenizer.json
    assert calls == [400]
    # Too little text for all merges: the trained vocabulary is smaller, ids stay below vocab_size.
    small = load_tokenizer("bpe", vocab_size=400, cache_dir=tmp_path / "c2", texts=lambda: ["ab ab"], fingerprint="x")
    assert small.vocab_size < 400 and small.eos_token_id == 0
    # The cached tokenizer.json is a valid local-path spec.
    saved = next((tmp_path / "cache" / "tokenizers").glob("bpe-400-*"))
    local = load_tokenizer(str(saved))
    assert local.encode_batch(["Return"]) == tok.encode_batch(["Return"]) and local.eos_token_id == 0
    with pytest.raises(ValueError, match="tokenizer_vocab_size must be >= 257.*got 100"):
        make_dm(tmp_path, tokenizer="bpe", tokenizer_vocab_size=100)


def test_bytes_and_local_tokenizers(tmp_path):
    tok = load_tokenizer("bytes")
    assert (tok.vocab_size, tok.eos_token_id) == (257, 256)
    assert tok.encode_batch(["é!"]) == [[195, 169, 33]] and tok.decode([195, 169, 33, 256]) == "é!"
    tok.save(tmp_path / "bytes_tok")
    assert isinstance(load_tokenizer(str(tmp_path / "bytes_tok")), type(tok))

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2, "</s>": 3}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.save(str(tmp_path / "tokenizer.json"))
    fast = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (fast.vocab_size, fast.eos_token_id, fast.encode_batch(["hello world"])) == (4, 3, [[1, 2]])
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path / "hf")
    hf = load_tokenizer(str(tmp_path / "hf"))
    assert (hf.vocab_size, hf.eos_token_id, hf.encode_batch(["hello world"])) == (4, 3, [[1, 2]])
    files = write_docs(tmp_path / "data", "txt", ["hello world hello"])
    dm = ready(make_dm(tmp_path, data_files=files, tokenizer=str(tmp_path / "hf"), seq_length=3))
    assert (dm.vocab_size, dm.eos_token_id) == (4, 3)
    assert blocks_of(dm.train_dataset) == [[1, 2, 1, 3]]


def test_hub_names_are_refused_offline(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"'gpt2'.*local path.*'bpe'.*'bytes'"):
        load_tokenizer("gpt2")
    with pytest.raises(ValueError, match="'gpt2'"):  # HF_HUB_OFFLINE=1 wins over allow_download
        load_tokenizer("gpt2", allow_download=True)
    with pytest.raises(ValueError, match="'gpt2'"):
        make_dm(tmp_path, tokenizer="gpt2")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(ValueError, match="'gpt2'"):  # online, but no explicit opt-in
        load_tokenizer("gpt2")
    with pytest.raises(ValueError, match="dataset_name='wikitext'"):
        make_dm(tmp_path, dataset_name="wikitext", allow_download=True)  # HF_DATASETS_OFFLINE=1


# ----------------------------------------------------------------------------- errors
def test_bad_inputs_raise_clear_errors(tmp_path):
    files = write_docs(tmp_path / "data", "jsonl", ["abc"])
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        make_dm(tmp_path, data_files=str(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError, match=r"nothing\*\.txt"):
        make_dm(tmp_path, data_files=str(tmp_path / "nothing*.txt"))
    (tmp_path / "a.txt").write_text("abc")
    with pytest.raises(ValueError, match=r"mixed extensions \['.jsonl', '.txt'\]"):
        make_dm(tmp_path, data_files=[files[0], str(tmp_path / "a.txt")])
    (tmp_path / "a.csv").write_text("text\nabc\n")
    with pytest.raises(ValueError, match="'.csv'"):
        make_dm(tmp_path, val_files=str(tmp_path / "a.csv"))
    with pytest.raises(ValueError, match="seq_length must be >= 1, got 0"):
        make_dm(tmp_path, data_files=files, seq_length=0)
    with pytest.raises(ValueError, match="val_fraction"):
        make_dm(tmp_path, data_files=files, val_fraction=1.0)
    with pytest.raises(ValueError, match="not both"):
        make_dm(tmp_path, data_files=files, dataset_name="x")
    with pytest.raises(ValueError, match=r"only 4 tokens.*seq_length \+ 1 = 9"):
        make_dm(tmp_path, data_files=files, seq_length=8).prepare_data()
    assert not list((tmp_path / "cache" / "packed").glob("*.npy"))  # nothing half-written
    with pytest.raises(ValueError, match="Only 1 packed block"):
        ready(make_dm(tmp_path, data_files=files, seq_length=3, val_fraction=0.5))
    with pytest.raises(ValueError, match="batch_size=2"):
        ready(make_dm(tmp_path, data_files=files, seq_length=3, batch_size=2)).train_dataloader()


# ----------------------------------------------------------------------------- distributed sampling
def fake_trainer(num_replicas: int, rank: int) -> SimpleNamespace:
    kwargs = {"num_replicas": num_replicas, "rank": rank}
    return SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs=kwargs))


def sample_ids(loader) -> list[list[int]]:
    return [row[:3] for batch in loader for row in batch["input_ids"].tolist()]


def test_data_parallel_replicas_disjoint_and_model_parallel_ranks_identical(tmp_path):
    loaders = {}
    for dp_rank in (0, 1):
        for pp_rank in (0, 1):  # pipeline/tensor ranks of one replica report the same dp rank
            dm = SyntheticLMDataModule(vocab_size=1000, seq_length=4, batch_size=3, num_samples=20, seed=7)
            dm.trainer = fake_trainer(2, dp_rank)
            loaders[dp_rank, pp_rank] = dm.train_dataloader()
    assert loaders[0, 0].sampler.num_replicas == 2 and len(loaders[0, 0]) == 3  # 10 samples each, 3 full batches
    seen = {key: sample_ids(loader) for key, loader in loaders.items()}
    assert seen[0, 0] == seen[0, 1] and seen[1, 0] == seen[1, 1]
    assert not {tuple(s) for s in seen[0, 0]} & {tuple(s) for s in seen[1, 0]}
    # The real data module uses the same split; here every block is one document "000".."039" + EOS.
    files = write_docs(tmp_path / "data", "jsonl", [f"{i:03d}" for i in range(40)])

    def docs_seen(dp_rank: int, **kwargs) -> list[str]:
        dm = ready(make_dm(tmp_path, data_files=files, seq_length=3, batch_size=2, **{"shuffle": True, **kwargs}))
        dm.trainer = fake_trainer(2, dp_rank)
        loader = dm.train_dataloader()
        assert isinstance(loader, ResumableDataLoader) and len(loader) == 10
        # Workers come from a fork server, never a fork of the (threaded) training process: see worker_options.
        context = loader.multiprocessing_context
        assert (context is None) if loader.num_workers == 0 else (context.get_start_method() == "forkserver")
        return [bytes(row).decode() for batch in loader for row in batch["input_ids"].tolist()]

    rank0, rank1 = docs_seen(0), docs_seen(1)
    assert sorted(rank0 + rank1) == [f"{i:03d}" for i in range(40)]
    assert docs_seen(0, num_workers=2) == rank0  # worker processes do not change the order
    other_seed = docs_seen(0, seed=99)
    assert other_seed != rank0 and sorted(other_seed + docs_seen(1, seed=99)) == sorted(rank0 + rank1)
    assert docs_seen(1, shuffle=False) == [f"{i:03d}" for i in range(1, 40, 2)]
    synthetic = SyntheticLMDataModule(vocab_size=1000, seq_length=4, batch_size=2, num_samples=6, shuffle=False)
    first = next(iter(synthetic.train_dataloader()))["input_ids"]
    assert torch.equal(first, torch.stack([synthetic.train_dataset[i]["input_ids"] for i in (0, 1)]))


def test_lightning_keeps_our_sampler(tmp_path):
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.connectors.data_connector import _process_dataloader
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(), logger=False, default_root_dir=tmp_path)
    assert trainer._accelerator_connector.is_distributed
    dm = SyntheticLMDataModule(vocab_size=50, seq_length=4, batch_size=2, num_samples=8)
    dm.trainer = fake_trainer(4, 3)
    ours = dm.train_dataloader()
    assert _process_dataloader(trainer, TrainerFn.FITTING, RunningStage.TRAINING, ours) is ours
    plain = DataLoader(dm.train_dataset, batch_size=2, shuffle=True)  # control: this one does get replaced
    assert _process_dataloader(trainer, TrainerFn.FITTING, RunningStage.TRAINING, plain) is not plain


# ----------------------------------------------------------------------------- resumption
def test_sampler_state_round_trip_mid_epoch_and_across_epochs():
    data = list(range(23))
    sampler = ResumableDistributedSampler(data, num_replicas=2, rank=1, seed=3)
    assert len(sampler) == 11
    epochs = []
    for epoch in (0, 1, 2):
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
    assert epochs[0] != epochs[1] and sorted(set(epochs[0])) == sorted(epochs[0])
    for epoch, consumed in [(0, 4), (1, 0), (0, 11)]:
        sampler.set_epoch(epoch)
        it = iter(sampler)
        head = [next(it) for _ in range(consumed)]
        state = sampler.state_dict()
        assert state["consumed"] == 2 * consumed
        fresh = ResumableDistributedSampler(data, num_replicas=2, rank=1, seed=3)
        fresh.load_state_dict(state)
        fresh.set_epoch(epoch)  # Lightning re-announces the same epoch after loading
        assert head + list(fresh) == epochs[epoch]
        assert len(fresh) == 11
        skipping = ResumableDistributedSampler(data, num_replicas=2, rank=1, seed=3)
        skipping.load_state_dict(state)
        skipping.set_epoch(epoch + 1)  # Lightning moved on: the next epoch starts from its beginning
        assert list(skipping) == epochs[epoch + 1]
    with pytest.raises(ValueError, match="seed=4"):
        ResumableDistributedSampler(data, 2, 1, seed=4).load_state_dict(sampler.state_dict())
    padded = ResumableDistributedSampler(list(range(5)), num_replicas=2, rank=1, shuffle=False, drop_last=False)
    assert list(padded) == [1, 3, 0] and len(padded) == 3


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_state_resumes_with_exactly_the_next_batch(num_workers):
    dm = SyntheticLMDataModule(vocab_size=1000, seq_length=4, batch_size=3, num_samples=30, seed=5,
                               num_workers=num_workers)
    dm.trainer = fake_trainer(2, 0)
    full = []
    reference = dm.train_dataloader()
    for epoch in (0, 1):
        reference.sampler.set_epoch(epoch)
        full.append([b["input_ids"].tolist() for b in reference])
    assert len(full[0]) == 5 and full[0] != full[1]
    for epoch, stop in [(0, 2), (1, 4), (0, 5)]:
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(epoch)
        it = iter(loader)
        head = [next(it)["input_ids"].tolist() for _ in range(stop)]  # workers have fetched further ahead
        state = loader.state_dict()
        del it
        resumed = dm.train_dataloader()
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state
        it = iter(resumed)
        resumed.sampler.set_epoch(epoch)  # Lightning calls set_epoch after iter()
        assert head + [b["input_ids"].tolist() for b in it] == full[epoch]
    # Saved at the end of epoch 0; Lightning then announces epoch 1 after calling iter().
    next_epoch = dm.train_dataloader()
    next_epoch.load_state_dict(state)
    it = iter(next_epoch)
    next_epoch.sampler.set_epoch(1)
    assert [next(it)["input_ids"].tolist() for _ in range(2)] == full[1][:2]
    assert (next_epoch.state_dict()["epoch"], next_epoch.state_dict()["consumed"]) == (1, 2 * 3 * 2)


class BatchRecorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[list[int]] = []
        self.val_seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"][:, 0].tolist())
        return self.weight * batch["labels"].float().mean()

    def validation_step(self, batch, batch_idx):
        self.val_seen.append(batch["input_ids"][:, 0].tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path: Path, datamodule, max_steps: int, ckpt_path=None, callbacks=()) -> BatchRecorder:
    model = BatchRecorder()
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, enable_checkpointing=True, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=list(callbacks), default_root_dir=tmp_path)
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    return model


def test_lightning_mid_epoch_resume_sees_the_same_batches(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def datamodule():
        return SyntheticLMDataModule(vocab_size=10_000, seq_length=4, batch_size=4, num_samples=40, seed=11)

    ckpts = tmp_path / "ckpts"
    every_step = ModelCheckpoint(dirpath=ckpts, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    full = fit(tmp_path, datamodule(), max_steps=25, callbacks=[every_step]).seen
    assert len(full) == 25 and full[:10] != full[10:20]  # 10 batches per epoch, reshuffled each epoch
    for step in (7, 10, 13):  # mid epoch 0, at the epoch boundary, mid epoch 1
        resumed = fit(tmp_path, datamodule(), max_steps=25, ckpt_path=ckpts / f"step={step}.ckpt").seen
        assert resumed == full[step:], f"resume from step {step}"


def test_lightning_resume_with_causal_lm_and_validation(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    files = write_docs(tmp_path / "data", "jsonl", [f"document number {i} " * 3 for i in range(12)])

    def datamodule():
        return make_dm(tmp_path, data_files=files, seq_length=15, batch_size=4, shuffle=True, val_fraction=0.1)

    dm = ready(datamodule())
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (37, 4)  # 9 batches per epoch, 1 val batch
    full = fit(tmp_path / "a", datamodule(), max_steps=12)
    assert len(full.seen) == 12 and full.val_seen == [[b[0] for b in blocks_of(dm.val_dataset)]]
    stop = ModelCheckpoint(dirpath=tmp_path / "b", filename="stop", every_n_train_steps=5)
    assert fit(tmp_path / "b", datamodule(), max_steps=5, callbacks=[stop]).seen == full.seen[:5]
    resumed = fit(tmp_path / "b", datamodule(), max_steps=12, ckpt_path=tmp_path / "b" / "stop.ckpt")
    assert resumed.seen == full.seen[5:] and resumed.val_seen == full.val_seen


def test_package_and_synthetic_work_without_datasets(monkeypatch):
    import lightning_3d.recipes

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    monkeypatch.setattr(lightning_3d.recipes, "data", lightning_3d.recipes.data)  # restored after the re-import
    for name in [m for m in sys.modules if m.startswith("lightning_3d.recipes.data")]:
        monkeypatch.delitem(sys.modules, name)
    fresh = importlib.import_module("lightning_3d.recipes.data")
    dm = fresh.SyntheticLMDataModule(vocab_size=100, seq_length=6, batch_size=2, num_samples=10, seed=1)
    batches = list(dm.train_dataloader())
    twin = fresh.SyntheticLMDataModule(vocab_size=100, seq_length=6, batch_size=2, num_samples=10, seed=1)
    again = list(twin.train_dataloader())
    assert len(batches) == 5 and all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, again))
    assert torch.equal(batches[0]["input_ids"][:, 1:], batches[0]["labels"][:, :-1])
    assert max(b["labels"].max().item() for b in batches) < 100
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        fresh.SyntheticLMDataModule(num_samples=0)
    assert (dm.vocab_size, dm.eos_token_id) == (100, 99)


def test_extended_corpus_adds_installed_packages_docstrings(tmp_path, monkeypatch) -> None:
    import sysconfig

    from lightning_3d.recipes.data import corpus

    stdlib, purelib = tmp_path / "stdlib", tmp_path / "site-packages"
    (stdlib / "mod").mkdir(parents=True)
    (stdlib / "mod" / "a.py").write_text('"""' + "standard library prose " * 20 + '"""\n')
    (purelib / "pkg").mkdir(parents=True)
    (purelib / "pkg" / "b.py").write_text('"""' + "installed package prose " * 20 + '"""\n')
    (purelib / "pkg-1.0.dist-info").mkdir()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(stdlib), "purelib": str(purelib)})
    monkeypatch.setattr(corpus, "iter_pydoc_topics", lambda: iter(()))
    plain = [json.loads(line)["text"] for line in corpus.build_python_docs_corpus(tmp_path / "p.jsonl").read_text().splitlines()]
    extended = corpus.build_python_docs_corpus(tmp_path / "e.jsonl", include_installed_packages=True).read_text().splitlines()
    assert plain == ["standard library prose " * 20]
    assert [json.loads(line)["text"] for line in extended] == plain + ["installed package prose " * 20]


@pytest.mark.parametrize(
    "make,bad",
    [
        (SyntheticLMDataModule, dict(vocab_size=1)),
        (SyntheticLMDataModule, dict(num_workers=-1)),
        (SyntheticSeq2SeqDataModule, dict(target_length=0)),
        (SyntheticSeq2SeqDataModule, dict(batch_size=0)),
    ],
)
def test_synthetic_modules_refuse_bad_sizes(make, bad: dict) -> None:
    (name, value), = bad.items()
    with pytest.raises(ValueError, match=f"{name} must be >= \\d+, got {value}"):
        make(**bad)


def test_synthetic_pairs_are_t5_batches_with_shifted_decoder_inputs() -> None:
    dm = SyntheticSeq2SeqDataModule(vocab_size=50, input_length=6, target_length=4, batch_size=2, num_samples=4)
    sample = dm.train_dataset[1]
    assert sample["input_ids"].shape == (6,) and sample["labels"].shape == (4,) and sample["attention_mask"].all()
    assert sample["decoder_input_ids"].tolist() == [dm.pad_token_id, *sample["labels"][:-1].tolist()]
    assert torch.equal(SyntheticSeq2SeqDataModule(vocab_size=50, input_length=6, target_length=4).train_dataset[1]["labels"],
                       sample["labels"])  # sample i depends only on (seed, i)
    assert dm.vocab_size == 50


# ----------------------------------------------------------------------------- unreadable files
def test_malformed_jsonl_and_binary_txt_name_the_file_and_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    bad_json = data / "docs.jsonl"
    bad_json.write_text('{"text": "fine"}\n\n{"text": "also fine"}\n{"text": "cut off\n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{bad_json}, line 4: not valid JSON"):
        make_dm(tmp_path, data_files=[str(bad_json)]).prepare_data()
    not_object = data / "list.jsonl"
    not_object.write_text('{"text": "fine"}\n[1, 2]\n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{not_object}, line 2: a JSON list, not an object"):
        make_dm(tmp_path, data_files=[str(not_object)]).prepare_data()
    binary = data / "image.txt"
    binary.write_bytes(b"first line\nsecond\n\x89PNG\x00\xff\n")
    with pytest.raises(ValueError, match=rf"{binary}, line 3: byte 0x89 at offset 18 is not UTF-8"):
        make_dm(tmp_path, data_files=[str(binary)]).prepare_data()
    # The same messages without `datasets` (tokenizer training reads files itself).
    with pytest.raises(ValueError, match=rf"{binary}, line 3"):
        load_tokenizer("bpe", training_files=[binary], vocab_size=300, cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match=rf"{bad_json}, line 4"):
        load_tokenizer("bpe", training_files=[bad_json], vocab_size=300, cache_dir=tmp_path / "c")


def test_checkpoint_state_of_a_cached_bpe_tokenizer_reads_no_documents(tmp_path, monkeypatch):
    """A rank that did not run ``prepare_data`` (every rank but each node's first) builds the checkpoint's tokenizer
    entry from the cached tokenizer.json: it must neither import ``datasets`` nor load and keep the training corpus
    (on a long run that was a one-time jump of that rank's memory at its first checkpoint, held for good)."""
    files = write_docs(tmp_path / "data", "jsonl", ["hello world, hello text"] * 20)
    kwargs = dict(data_files=files, tokenizer="bpe", tokenizer_vocab_size=300, seq_length=8)
    expected = ready(make_dm(tmp_path, **kwargs)).state_dict()  # local rank 0: trains and caches the tokenizer
    monkeypatch.setitem(sys.modules, "datasets", None)  # importing it now raises
    other = make_dm(tmp_path, **kwargs)
    other.setup("fit")
    assert other.state_dict() == expected
    assert other._documents_cache == {}


@pytest.mark.parametrize("spec", ["bytes", "bpe", "hf"])
def test_data_module_stores_its_tokenizer_in_checkpoints(tmp_path, spec):
    from lightning_3d.recipes.data.tokenizer import TOKENIZER_STATE_KEY, write_tokenizer_files

    files = write_docs(tmp_path / "data", "txt", ["hello world hello", "world of text"])
    if spec == "hf":
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        raw = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2, "</s>": 3}, unk_token="<unk>"))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path / "hf")
        spec = str(tmp_path / "hf")
    dm = make_dm(tmp_path, data_files=files, tokenizer=spec, tokenizer_vocab_size=300)
    state = dm.state_dict()
    stored = state[TOKENIZER_STATE_KEY]
    assert stored and all(isinstance(v, bytes) for v in stored.values())
    restored = load_tokenizer(str(write_tokenizer_files(stored, tmp_path / "restored")))
    original = dm.load_text_tokenizer()
    assert restored.encode_batch(["hello world, text"]) == original.encode_batch(["hello world, text"])
    assert restored.eos_token_id == original.eos_token_id
    dm.load_state_dict(state)  # accepted; nothing to restore
    with pytest.raises(ValueError, match="not a plain relative file name"):
        write_tokenizer_files({"../escape.json": b"{}"}, tmp_path / "evil")
