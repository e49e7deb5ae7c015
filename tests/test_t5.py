"""The T5 recipe on one process: transformers logits, import/export round trips, errors, seq2seq data and the CLI.

Everything is built locally with random weights (no downloads). fp32 logits agree within the summation-order bound
of tests/tolerance.py (relative to the logits' scale); import-then-export reproduces transformers' tensors bit for bit.
The (dp, pp, tp) layouts run in
tests/test_distributed.py (scenario tests/scenarios/t5_layouts.py).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from safetensors.torch import load_file
from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration

from lightning_3d.checkpoint.files import META_FILE, write_manifest
from lightning_3d.cli import build_cli, main
from lightning_3d.recipes import T5
from lightning_3d.recipes.data import Seq2SeqDataModule
from lightning_3d.recipes.data.span_corruption import span_lengths
from lightning_3d.recipes.hf_t5 import export_t5_checkpoint, hf_to_t5_state_dict, t5_from_pretrained
from tests.tolerance import loss_tolerance, scaled_error, t5_tolerance

TOL = 1e-5  # two evaluations of the same model in the same code (same summation order): only loss logging differs
SMALL = dict(vocab_size=300, num_layers=2, num_decoder_layers=3, hidden_size=32, num_heads=4, head_dim=8,
             ffn_hidden_size=64, relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout=0.0)
VARIANTS = {"v1.0": dict(feed_forward="relu", tie_embeddings=True), "v1.1": dict(feed_forward="gated-gelu", tie_embeddings=False)}


# SMALL: 2 encoder and 3 decoder blocks; the longest reduction is the FFN's 64 (inputs() has 40 positions).
LOGITS_TOL = t5_tolerance(2, 3, 64)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = LOGITS_TOL) -> bool:
    """Transformers' logits against ours: the same network summed in another order (see tests/tolerance.py)."""
    return scaled_error(a, b) <= tol


def tiny_t5(variant: str, **overrides) -> T5:
    """A materialised tiny T5 with random weights (norms randomised too)."""
    module = T5("tiny", **{**SMALL, **VARIANTS[variant], **overrides})
    module.configure_model()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in module.model.parameters():
            if p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + 1.0)
    return module.eval()


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Encoder inputs of 40 tokens (two samples padded), decoder inputs of 30; relative distances beyond 16."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, 25:], mask[2, 5:] = 0, 0
    return {"input_ids": torch.randint(0, 300, (3, 40), generator=g) * mask, "attention_mask": mask,
            "decoder_input_ids": torch.randint(0, 300, (3, 30), generator=g)}


def hf_logits(model: T5ForConditionalGeneration, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**batch).logits


def ours(module: T5, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return module.model.eval()(batch["input_ids"], batch["decoder_input_ids"], batch["attention_mask"])


def write_checkpoint(path: Path, state: dict, hparams: dict | None) -> Path:
    """A single-process DCP checkpoint laid out as Compressed3DStrategy writes it."""
    dcp.save({"model": state}, checkpoint_id=str(path), no_dist=True)
    torch.save({"hyper_parameters": hparams} if hparams is not None else {"epoch": 0}, path / META_FILE)
    return write_manifest(path)


def checkpoint_of(module: T5, path: Path) -> Path:
    return write_checkpoint(path, {"model." + k: v for k, v in module.model.state_dict().items()}, dict(module.hparams))


def tiny_hf(path: Path, variant: str, **config) -> T5ForConditionalGeneration:
    """A random transformers T5 saved with ``save_pretrained`` (every weight random, norms included)."""
    torch.manual_seed(0)
    tied = VARIANTS[variant]["tie_embeddings"]
    cfg = T5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                   feed_forward_proj=VARIANTS[variant]["feed_forward"], tie_word_embeddings=tied, **config)
    model = T5ForConditionalGeneration(cfg)
    with torch.no_grad():
        if not tied:  # transformers 5 ties lm_head to the embedding at construction whatever the config says
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return model.eval()


# ----- logits and weights ------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_exported_checkpoint_gives_our_logits_in_transformers(tmp_path: Path, variant: str, capsys) -> None:
    module = tiny_t5(variant, pad_token_id=257, eos_token_id=256, vocab_size=358)  # the byte tokenizer's layout
    assert module.model.padded_vocab == 384
    out = tmp_path / "hf"
    main(["export", "--checkpoint", str(checkpoint_of(module, tmp_path / "ckpt")), "--output", str(out), "--tokenizer", "bytes"])
    assert capsys.readouterr().out.strip().endswith(str(out))
    hf = T5ForConditionalGeneration.from_pretrained(out)
    assert (hf.lm_head.weight is hf.shared.weight) == (variant == "v1.0")
    assert hf.config.feed_forward_proj == VARIANTS[variant]["feed_forward"]
    assert (hf.config.pad_token_id, hf.config.eos_token_id, hf.config.decoder_start_token_id) == (257, 256, 257)
    batch = {k: v.clamp_max(357) for k, v in inputs().items()}
    logits = ours(module, batch)
    assert torch.isinf(logits[..., 358:]).all()
    assert close(hf_logits(hf, batch), logits[..., :358])
    tok = AutoTokenizer.from_pretrained(out)  # bytes, then <pad> and the sentinels of Seq2SeqDataModule("bytes")
    vocab = Seq2SeqDataModule(tokenizer="bytes", input_length=16).vocab
    assert tok.pad_token_id == vocab.pad_token_id == 257 and len(tok) == vocab.vocab_size == 358
    assert [tok.convert_tokens_to_ids(f"<extra_id_{k}>") for k in range(100)] == list(vocab.sentinel_ids)
    assert tok("héllo", add_special_tokens=False)["input_ids"] == list("héllo".encode())
    again = Seq2SeqDataModule(tokenizer=str(out), input_length=16).vocab  # a local T5-style tokenizer keeps its ids
    assert (again.pad_token_id, again.eos_token_id, again.sentinel_ids, again.vocab_size) == (257, 256, vocab.sentinel_ids, 358)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_import_then_export_round_trips_exactly(tmp_path: Path, variant: str) -> None:
    hf = tiny_hf(tmp_path / "hf", variant)
    state, config = hf_to_t5_state_dict(hf.state_dict(), hf.config)
    module = t5_from_pretrained(tmp_path / "hf", learning_rate=1e-4)
    module.configure_model()
    assert module.config == config and config.tie_embeddings == VARIANTS[variant]["tie_embeddings"]
    mine = dict(module.model.named_parameters())
    assert set(mine) | {"lm_head.weight"} == set(state) and all(torch.equal(mine[k], state[k]) for k in mine)
    assert close(hf_logits(hf, inputs()), ours(module, inputs())[..., :300])
    ckpt = checkpoint_of(module, tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "hf_moved", ignore_errors=True)
    (tmp_path / "hf").rename(tmp_path / "hf_moved")  # the checkpoint's hparams are enough to export
    out = export_t5_checkpoint(ckpt, tmp_path / "exported")
    original, exported = load_file(tmp_path / "hf_moved" / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(original) == set(exported) and all(torch.equal(original[k], exported[k]) for k in original)


# ----- errors ------------------------------------------------------------------------------------------------
def test_export_errors(tmp_path: Path, capsys) -> None:
    with pytest.raises(FileNotFoundError, match="not a lightning_3d checkpoint"):
        export_t5_checkpoint(tmp_path, tmp_path / "out")
    module = tiny_t5("v1.0")
    state = {"model." + k: v for k, v in module.model.state_dict().items()}
    gpt = write_checkpoint(tmp_path / "gpt", {"model.x": torch.zeros(1)}, {"preset_name": "tiny", "seq_length": 16, "key_bias": False})
    with pytest.raises(ValueError, match=r"not a checkpoint of the T5 recipe.*\['key_bias'"):
        export_t5_checkpoint(gpt, tmp_path / "out")
    other = write_checkpoint(tmp_path / "other", {"net.w": torch.zeros(2)}, {"hidden": 8, "lr": 0.1})
    with pytest.raises(SystemExit) as exit_info:  # the CLI names both recipes it knows
        main(["export", "--checkpoint", str(other), "--output", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "Nor is it one of the T5 recipe" in capsys.readouterr().err
    foreign = write_checkpoint(tmp_path / "foreign", state, {**module.hparams, "_class_path": "torch.nn.Linear"})
    with pytest.raises(ValueError, match=r"class torch.nn.Linear.*known classes: .*never imported"):
        export_t5_checkpoint(foreign, tmp_path / "out")
    partial = write_checkpoint(tmp_path / "partial", {k: v for k, v in state.items() if ".decoder.2." not in k}, dict(module.hparams))
    with pytest.raises(ValueError, match=r"incomplete for its 2\+3-layer T5: missing \['decoder.2.self_attn_norm.weight'"):
        export_t5_checkpoint(partial, tmp_path / "out")
    copy = shutil.copytree(checkpoint_of(module, tmp_path / "good"), tmp_path / "copy")
    next(copy.glob("*.distcp")).unlink()
    with pytest.raises(ValueError, match=r"damaged: files \['__0_0.distcp'\] listed in its manifest.json are missing"):
        export_t5_checkpoint(copy, tmp_path / "out")
    with pytest.raises(ValueError, match=r"tokenizer has 257 tokens, so <pad> cannot get the model's pad_token_id=0"):
        export_t5_checkpoint(tmp_path / "good", tmp_path / "out", tokenizer="bytes")
    assert not (tmp_path / "out").exists()  # nothing was written by any failed call


def test_import_errors(tmp_path: Path) -> None:
    tiny_hf(tmp_path / "hf", "v1.1")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        t5_from_pretrained(tmp_path)
    for name, config, message in (
        ("gpt2", {"model_type": "gpt2", "n_embd": 32}, "model_type='gpt2'; only T5"),
        ("silu", {"model_type": "t5", "feed_forward_proj": "gated-silu"}, "feed_forward_proj='gated-silu'"),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            t5_from_pretrained(tmp_path / name)
    with pytest.raises(ValueError, match=r"num_layers=3 was requested but the T5 model at .* has num_layers=2"):
        t5_from_pretrained(tmp_path / "hf", num_layers=3)
    with pytest.raises(ValueError, match=r"feed_forward='relu' was requested .* feed_forward='gated-gelu'"):
        t5_from_pretrained(tmp_path / "hf", feed_forward="relu")
    assert t5_from_pretrained(tmp_path / "hf", dropout=0.1, learning_rate=1e-4).config.dropout == 0.1
    # A config that does not describe its weights: the tensor and both shapes are named.
    shutil.copytree(tmp_path / "hf", tmp_path / "wrong")
    config = json.loads((tmp_path / "wrong" / "config.json").read_text())
    (tmp_path / "wrong" / "config.json").write_text(json.dumps({**config, "d_ff": 48}))
    with pytest.raises(ValueError, match=r"encoder.block.0.layer.1.DenseReluDense.wi_0.weight has shape \[64, 32\] but"
                                         r" its config implies \[48, 32\]"):
        t5_from_pretrained(tmp_path / "wrong").configure_model()
    (tmp_path / "wrong" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True,
                                                                "scale_decoder_outputs": True}))
    with pytest.raises(ValueError, match="stores a different lm_head.weight"):
        t5_from_pretrained(tmp_path / "wrong")


def test_batch_check_names_ids_outside_the_vocabulary() -> None:
    """check_pipeline_batch, which the strategy runs on every rank before a step: ignored labels (-100) pass, an id
    outside the vocabulary in any input, or labels that do not match the decoder inputs, raise with the value."""
    module = T5("tiny", **SMALL)  # the check reads the config only: no weights needed
    batch = {**inputs(), "labels": torch.randint(0, 300, (3, 30)), "attention_mask": None}
    batch["labels"][:, 20:] = -100
    module.check_pipeline_batch(batch)
    for name, value, message in (("input_ids", 300, "input_ids holds token id 300, outside the model's vocabulary of 300"),
                                 ("decoder_input_ids", -1, "decoder_input_ids holds token id -1"),
                                 ("labels", 301, "labels holds token id 301")):
        bad = {k: v.clone() if v is not None else None for k, v in batch.items()}
        bad[name][1, 2] = value
        with pytest.raises(ValueError, match=message):
            module.check_pipeline_batch(bad)
    with pytest.raises(ValueError, match=r"labels have shape \(3, 29\) but decoder_input_ids \(3, 30\)"):
        module.check_pipeline_batch({**batch, "labels": batch["labels"][:, 1:]})


# ----- seq2seq data ------------------------------------------------------------------------------------------
def fake_trainer(num_replicas: int, rank: int) -> SimpleNamespace:
    kwargs = {"num_replicas": num_replicas, "rank": rank}
    return SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs=kwargs))


def test_span_corruption_on_the_offline_corpus(tmp_path: Path) -> None:
    dm = Seq2SeqDataModule(tokenizer="bytes", input_length=64, batch_size=4, cache_dir=str(tmp_path),
                           max_corpus_bytes=60_000, val_fraction=0.05)
    raw, target = span_lengths(64, 0.15, 3.0)
    assert (raw, target, dm.target_length) == (70, 14, 14) and span_lengths(512, 0.15, 3.0) == (568, 114)
    dm.setup("fit")
    vocab, blocks = dm.vocab, dm.text.train_dataset
    assert (vocab.pad_token_id, vocab.eos_token_id, vocab.vocab_size, vocab.sentinel_ids[:2]) == (257, 256, 358, (258, 259))
    noise_counts = set()
    for index in range(0, len(dm.train_dataset), 7):
        sample = dm.train_dataset[index]
        ids, labels = sample["input_ids"].tolist(), sample["labels"].tolist()
        assert len(ids) == 64 and len(labels) == 14 and sample["attention_mask"].all()
        assert ids[-1] == labels[-1] == vocab.eos_token_id
        assert sample["decoder_input_ids"].tolist() == [vocab.pad_token_id] + labels[:-1]
        sentinels = [t for t in ids if t in vocab.sentinel_ids]
        assert sentinels == list(vocab.sentinel_ids[: len(sentinels)])  # in order, each once
        assert [t for t in labels if t in vocab.sentinel_ids] == sentinels
        rebuilt, spans = [], {}  # the target's spans, put back in place of their sentinels, give the raw block
        for t in labels[:-1]:
            spans.setdefault(t, []) if t in vocab.sentinel_ids else spans[next(reversed(spans))].append(t)
        for t in ids[:-1]:
            rebuilt += spans[t] if t in vocab.sentinel_ids else [t]
        block = blocks[index]
        assert rebuilt == torch.cat([block["input_ids"], block["labels"][-1:]]).tolist()
        noise_counts.add(sum(len(s) for s in spans.values()))
        assert torch.equal(dm.train_dataset[index]["input_ids"], sample["input_ids"])  # a pure function of the index
    assert noise_counts == {round(raw * 0.15)}
    assert not torch.equal(dm.train_dataset[0]["labels"], dm.train_dataset[1]["labels"])
    assert dm.val_dataset is not None and len(dm.val_dataset) >= 1
    seen = {}
    for rank in (0, 1):  # data-parallel replicas see disjoint samples; a resumable loader
        dm.trainer = fake_trainer(2, rank)
        seen[rank] = {tuple(r) for b in dm.train_dataloader() for r in b["input_ids"].tolist()}
    assert seen[0] and seen[1] and not seen[0] & seen[1]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_pairs_from_files(tmp_path: Path, fmt: str, monkeypatch) -> None:
    rows = [{"input": f"question {i}", "target": "yes" if i % 2 else "a longer answer"} for i in range(10)]
    path = tmp_path / f"pairs.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    kwargs = dict(data_files=str(path), objective="pairs", tokenizer="bytes", input_length=8, target_length=6,
                  val_fraction=0.2, cache_dir=str(tmp_path / "cache"), batch_size=2)
    dm = Seq2SeqDataModule(**kwargs)
    dm.setup("fit")
    assert len(dm.train_dataset) == 8 and len(dm.val_dataset) == 2
    pad, eos = dm.pad_token_id, dm.eos_token_id
    first, second = dm.train_dataset[0], dm.train_dataset[1]
    assert first["input_ids"].tolist() == list(b"questio") + [eos] and first["attention_mask"].all()  # truncated
    assert first["labels"].tolist() == list(b"a lon") + [eos]  # truncated, EOS kept
    assert second["input_ids"].tolist() == list(b"questio") + [eos]
    assert second["labels"].tolist() == list(b"yes") + [eos, -100, -100]
    assert second["decoder_input_ids"].tolist() == [pad] + list(b"yes") + [eos, pad]  # transformers' _shift_right
    short = Seq2SeqDataModule(**{**kwargs, "input_length": 16})
    short.setup("fit")
    assert short.train_dataset[0]["input_ids"].tolist() == list(b"question 0") + [eos] + [pad] * 5
    assert short.train_dataset[0]["attention_mask"].tolist() == [1] * 11 + [0] * 5
    monkeypatch.setitem(sys.modules, "datasets", None)  # the second run reads only the cache
    again = Seq2SeqDataModule(**kwargs)
    again.setup("fit")
    assert torch.equal(again.train_dataset[1]["labels"], second["labels"])


def test_seq2seq_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="objective='pairs' needs data_files"):
        Seq2SeqDataModule(objective="pairs")
    with pytest.raises(ValueError, match="objective='masking' is not one of"):
        Seq2SeqDataModule(objective="masking")
    with pytest.raises(ValueError, match=r"target_length=10 is shorter than the 14 target tokens"):
        Seq2SeqDataModule(input_length=64, target_length=10)
    with pytest.raises(ValueError, match="noise_density"):
        Seq2SeqDataModule(noise_density=1.5)
    text = tmp_path / "a.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match=r"reads json, jsonl or parquet files, not \.txt"):
        Seq2SeqDataModule(data_files=str(text), objective="pairs")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    dm = Seq2SeqDataModule(data_files=str(wrong), objective="pairs", tokenizer="bytes", cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"no column\(s\) \['input', 'target'\] \(columns: \['question', 'answer'\]\)"):
        dm.setup("fit")
    with pytest.raises(ValueError, match="Unknown T5 preset 'huge'"):
        T5("huge")
    with pytest.raises(ValueError, match="feed_forward='swiglu' is not supported"):
        T5("tiny", feed_forward="swiglu")


# ----- the CLI: fit, validate (loss and perplexity), export of its checkpoint ------------------------------------
@pytest.mark.parametrize("name", ["t5_tiny", "t5_770m_3d"])
def test_packaged_t5_configs_parse(name: str, capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", ["lightning-3d"])
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", name, "--print_config"])
    assert exc.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path: lightning_3d.recipes.T5" in printed and "class_path: lightning_3d.recipes.data.Seq2SeqDataModule" in printed
    assert ("precision: 32-true" if name == "t5_tiny" else "precision: bf16-mixed") in printed
    if name == "t5_770m_3d":
        assert "pipeline_parallel_size: 2" in printed and "tensor_parallel_size: 2" in printed and "preset_name: 770m" in printed


def test_t5_tiny_config_fits_validates_and_exports(tmp_path: Path, single_process, capfd, caplog) -> None:
    """As the README runs it: the packaged config with its model summary and progress bar (the summary's FLOPs per
    token once crashed on T5's two-length signature), then the validate command the fit prints, run as printed."""
    common = ["--config", "t5_tiny", f"--data.cache_dir={tmp_path / 'cache'}", "--data.tokenizer=bytes",
              "--data.max_corpus_bytes=100000", "--data.input_length=32", "--data.batch_size=4",
              "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path / 'runs'}"]
    with caplog.at_level("INFO"):
        fit = build_cli(["fit", *common, "--trainer.max_steps=3", "--trainer.val_check_interval=3"])
    assert fit.model.config.vocab_size == 358 and fit.model.config.pad_token_id == 257  # linked from the data
    metrics = fit.trainer.callback_metrics
    assert math.isfinite(float(metrics["val_loss"]))
    assert float(metrics["val_ppl"]) == pytest.approx(math.exp(float(metrics["val_loss"])), rel=1e-6)
    (ckpt,) = (Path(fit.trainer.log_dir) / "checkpoints").iterdir()
    out, err = capfd.readouterr()
    # One process: no distributed banner (the strategy's gloo group of one is an implementation detail).
    logged = out + err + caplog.text
    assert "Starting with 1 processes" not in logged and "MEMBER: 1/1" not in logged and "Tip:" not in logged, logged[-2000:]
    assert "Seed set to 1234" in caplog.text  # Lightning's log lines reach caplog: the checks above can fail
    data = fit.datamodule
    flops = get_human_readable_count(int(fit.model.flops_per_token(data.input_length, data.target_length)))
    assert re.search(rf"Training FLOPs per token\W+{re.escape(flops)}\s", out), out[-3000:]
    assert "Epoch 0 " in out and "Epoch 0/" not in out and "v_num" not in out, out[-3000:]
    printed = re.search(r"^  lightning-3d validate (.+)$", out, re.M).group(1)
    assert printed == shlex.join([*common, "--trainer.max_steps=3", "--trainer.val_check_interval=3",
                                  "--ckpt_path", str(ckpt)]), printed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        val = build_cli(["validate", *shlex.split(printed)])  # the sharded checkpoint restores the same model
    assert not [w for w in caught if "dirpath has changed" in str(w.message)]  # validate writes no checkpoint
    assert float(val.trainer.callback_metrics["val_loss"]) == pytest.approx(float(metrics["val_loss"]), rel=TOL)
    main(["export", "--checkpoint", str(ckpt), "--output", str(tmp_path / "hf"), "--tokenizer", "bytes"])
    hf = T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    batch = next(iter(fit.datamodule.val_dataloader()))
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    decoder_input_ids=batch["decoder_input_ids"]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).item()
    # The trained model's own validation loss, computed by transformers: t5_tiny has 2 + 2 blocks, FFN width 512.
    assert abs(loss - float(metrics["val_loss"])) <= loss_tolerance(t5_tolerance(2, 2, 512), logits)
    assert hf.config.vocab_size == 358
