"""Hugging Face interop: exact weight mapping, export of real sharded checkpoints, GPT-2 import under 3D layouts.

Everything is built locally with random weights (no downloads). fp32 logits/losses agree within the summation-order
bound of tests/tolerance.py (relative to the logits' scale).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from lightning_3d.checkpoint.files import META_FILE, write_manifest
from lightning_3d.cli import main
from lightning_3d.recipes import GPT
from lightning_3d.recipes.data.tokenizer import ByteTokenizer, load_tokenizer
from lightning_3d.recipes.gpt.model import GPTModel
from lightning_3d.recipes.hf import (
    config_from_hparams,
    export_checkpoint,
    gpt_from_pretrained,
    gpt_to_hf_state_dict,
    hf_config_for,
    hf_to_gpt_state_dict,
)
from tests.launch import run_scenario
from tests.scenarios.common import Tokens
from tests.tolerance import gpt_tolerance, loss_tolerance, scaled_error

SMALL = dict(vocab_size=300, seq_length=16, num_layers=2, hidden_size=32, num_heads=4, dropout=0.0)
# Every GPT here has 2 blocks of hidden size 32: the longest reduction is the MLP's 4 x 32 = 128.
TOL = gpt_tolerance(2, 128)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> bool:
    """Two implementations (or layouts) of the same network: equal up to summation order (see tests/tolerance.py)."""
    return scaled_error(a, b) <= tol


def tiny_gpt(**overrides) -> GPT:
    """A materialised tiny GPT with random weights (norms and biases randomised too)."""
    module = GPT("tiny", **{**SMALL, **overrides})
    module.configure_model()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    return module


def tiny_hf(path: Path, tie: bool = True, key_bias: bool = True, **config) -> GPT2LMHeadModel:
    """A random GPT-2 saved with ``save_pretrained``: vocab 300, 16 positions, non-zero biases."""
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=300, n_positions=16, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=tie,
                     bos_token_id=0, eos_token_id=0, **config)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.1)
                if "c_attn" in name and not key_bias:
                    p[32:64] = 0.0
    model.save_pretrained(path)
    return model.eval()


def logits_of(hf_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return GPT2LMHeadModel.from_pretrained(hf_dir).eval()(input_ids).logits


def write_checkpoint(path: Path, state: dict, hparams: dict | None) -> Path:
    """A single-process DCP checkpoint laid out as Compressed3DStrategy writes it."""
    dcp.save({"model": state}, checkpoint_id=str(path), no_dist=True)
    torch.save({"hyper_parameters": hparams} if hparams is not None else {"epoch": 0}, path / META_FILE)
    return write_manifest(path)


# ----- weight mapping ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [True, False])
def test_exported_weights_give_our_logits(tie: bool) -> None:
    module = tiny_gpt(tie_embeddings=tie)
    assert module.model.padded_vocab == 384
    hf = GPT2LMHeadModel(hf_config_for(module.config)).eval()
    hf.load_state_dict(gpt_to_hf_state_dict(module.model.state_dict(), module.config), strict=True)
    x = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = module.model(x), hf(x).logits
    assert torch.isinf(ours[..., 300:]).all()
    assert close(theirs, ours[..., :300])


@pytest.mark.parametrize("tie,key_bias", [(True, True), (False, True), (True, False)])
def test_import_then_export_is_exact(tmp_path: Path, tie: bool, key_bias: bool) -> None:
    hf = tiny_hf(tmp_path / "hf", tie=tie, key_bias=key_bias)
    state, config = hf_to_gpt_state_dict(hf.state_dict(), hf.config)
    assert config.key_bias is key_bias and config.tie_embeddings is tie and state["embed.wte.weight"].shape[0] == 384
    assert not state["embed.wte.weight"][300:].any()
    # The module path: PretrainedGPT.init_weights reads the saved files.
    module = gpt_from_pretrained(tmp_path / "hf")
    module.configure_model()
    assert module.config == config
    ours = module.model.state_dict()
    assert set(ours) == set(state) and all(torch.equal(ours[k], state[k]) for k in state)
    back = gpt_to_hf_state_dict(ours, module.config)
    original = hf.state_dict()
    assert set(back) == set(original)
    assert all(torch.equal(back[k], original[k]) for k in original)
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert close(hf(x).logits, module.model.eval()(x)[..., :300])


def test_single_process_checkpoint_export_with_tokenizers(tmp_path: Path) -> None:
    module = tiny_gpt()
    ckpt = write_checkpoint(tmp_path / "ckpt", {"model." + k: v for k, v in module.model.state_dict().items()}, dict(module.hparams))
    texts = ["def f(x):\n    return x + 1\n", "héllo wörld\tagain 😀"] * 20
    bpe = load_tokenizer("bpe", vocab_size=300, cache_dir=tmp_path / "cache", texts=lambda: iter(texts), fingerprint="t")
    bpe_file = next((tmp_path / "cache").rglob("tokenizer.json"))
    for name, tokenizer, reference in (("bpe", bpe_file, bpe), ("bytes", "bytes", ByteTokenizer())):
        out = export_checkpoint(ckpt, tmp_path / name, tokenizer=tokenizer)
        tok = AutoTokenizer.from_pretrained(out)
        assert tok.eos_token == tok.bos_token == "<|endoftext|>" and tok.eos_token_id == reference.eos_token_id
        assert GPT2Config.from_pretrained(out).eos_token_id == reference.eos_token_id
        for text in texts[:2]:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert ids == reference.encode_batch([text])[0]
            assert tok.decode(ids, skip_special_tokens=True) == reference.decode(ids)
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert close(logits_of(tmp_path / "bpe", x), module.model(x)[..., :300])


# ----- real sharded checkpoints and import under the strategy (one 2-process run) --------------------------------
@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf_scenario")
    tiny_hf(root / "hf")
    report = run_scenario(2, "export_ckpt", ["--world", "2", "--extra", str(root / "hf")], root / "report.json", timeout=300)
    return {**report, "root": root}


def reference_logits(ckpt: Path, tmp_path: Path, x: torch.Tensor) -> torch.Tensor:
    """Our model loaded with the checkpoint's full state through DCP's own converter."""
    dcp_to_torch_save(ckpt, tmp_path / "full.pt")
    state = {k.removeprefix("model."): v for k, v in torch.load(tmp_path / "full.pt", weights_only=False)["model"].items()}
    config = config_from_hparams(torch.load(ckpt / META_FILE, weights_only=False)["hyper_parameters"])
    model = GPTModel(config, state["embed.wte.weight"].shape[0]).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"head.weight"}  # a tied head may be saved once, as the embedding
    with torch.no_grad():
        return model(x)[..., : config.vocab_size]


@pytest.mark.parametrize("name", ["gpt_112", "pretrained_121", "pretrained_112"])
def test_export_of_sharded_checkpoints(scenario: dict, name: str, tmp_path: Path, capsys) -> None:
    ckpt = Path(scenario[name]["path"])
    out = tmp_path / "hf"
    main(["export", "--checkpoint", str(ckpt), "--output", str(out)])
    assert capsys.readouterr().out.strip().endswith(str(out))
    batch = Tokens(32, seed=1)[0:8]
    x = batch["input_ids"]
    exported = logits_of(out, x)
    assert close(exported, reference_logits(ckpt, tmp_path, x))
    if "val_loss" in scenario[name]:  # the distributed model's own validation loss on this batch
        loss = F.cross_entropy(exported.flatten(0, 1), batch["labels"].flatten()).item()
        assert abs(loss - scenario[name]["val_loss"]) <= loss_tolerance(TOL, exported)


def test_pretrained_weights_under_pipeline_and_tensor_parallelism(scenario: dict) -> None:
    hf = GPT2LMHeadModel.from_pretrained(scenario["root"] / "hf").eval()
    batch = Tokens()[0:8]
    with torch.no_grad():
        logits = hf(batch["input_ids"]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
    for name in ("pretrained_121", "pretrained_112"):
        run = scenario[name]
        assert run["weight_err"] == 0.0 and run["checked"] > 0 and run["key_bias"]
        assert abs(run["first_loss"] - expected) <= loss_tolerance(TOL, logits), (name, run["first_loss"], expected)
        assert run["hparams"]["vocab_size"] == 300 and run["hparams"]["num_layers"] == 2
        assert run["hparams"]["pretrained_path"] == str(scenario["root"] / "hf")


# ----- errors --------------------------------------------------------------------------------------------------
def test_export_errors(tmp_path: Path, scenario: dict, capsys) -> None:
    with pytest.raises(FileNotFoundError, match="not a lightning_3d checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out")
    with pytest.raises(SystemExit) as exit_info:  # the CLI: a one-line error and exit code 2
        main(["export", "--checkpoint", str(tmp_path), "--output", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "not a lightning_3d checkpoint" in capsys.readouterr().err
    module = tiny_gpt()
    state = {"model." + k: v for k, v in module.model.state_dict().items()}
    no_meta = write_checkpoint(tmp_path / "no_meta", state, {})
    (no_meta / META_FILE).unlink()
    with pytest.raises(ValueError, match=r"damaged: files \['lightning_meta.pt'\] listed in its manifest.json are missing"):
        export_checkpoint(no_meta, tmp_path / "out")
    other = write_checkpoint(tmp_path / "other", {"net.0.weight": torch.zeros(2, 2)}, {"hidden": 8, "lr": 0.1})
    with pytest.raises(ValueError, match=r"not a checkpoint of the GPT recipe.*\['hidden', 'lr'\]"):
        export_checkpoint(other, tmp_path / "out")
    with pytest.raises(ValueError, match="hyper-parameters none"):
        export_checkpoint(write_checkpoint(tmp_path / "plain", {"x": torch.zeros(1)}, None), tmp_path / "out")
    foreign = write_checkpoint(tmp_path / "foreign", state, {**module.hparams, "_class_path": "torch.nn.Linear"})
    with pytest.raises(ValueError, match="class torch.nn.Linear"):
        export_checkpoint(foreign, tmp_path / "out")
    partial = {k: v for k, v in state.items() if ".layers.1." not in k}
    with pytest.raises(ValueError, match=r"incomplete.*missing \['layers.1.ln1.weight'"):
        export_checkpoint(write_checkpoint(tmp_path / "partial", partial, dict(module.hparams)), tmp_path / "out")
    copy = shutil.copytree(scenario["pretrained_121"]["path"], tmp_path / "copy")
    next(copy.glob("*.distcp")).unlink()
    with pytest.raises(ValueError, match=r"damaged: files \['__[01]_0.distcp'\] listed in its manifest.json are missing"):
        export_checkpoint(copy, tmp_path / "out")
    good = write_checkpoint(tmp_path / "good", state, dict(module.hparams))
    with pytest.raises(ValueError, match="neither 'bytes', 'bpe' nor an existing local path"):
        export_checkpoint(good, tmp_path / "out", tokenizer="missing.json")
    big = load_tokenizer("bpe", vocab_size=400, cache_dir=tmp_path / "c", texts=lambda: iter(["ab cd ef"] * 9), fingerprint="b")
    big.tokenizer.add_tokens([f"tok{i}" for i in range(200)])
    with pytest.raises(ValueError, match=r"tokenizer has \d+ tokens but the model only vocab_size=300"):
        export_checkpoint(good, tmp_path / "out", tokenizer=big)
    assert not (tmp_path / "out").exists()  # nothing was written by any failed call


def test_import_errors(tmp_path: Path) -> None:
    tiny_hf(tmp_path / "hf")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        gpt_from_pretrained(tmp_path)
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    with pytest.raises(ValueError, match="model_type='llama'"):
        gpt_from_pretrained(other)
    with pytest.raises(ValueError, match=r"num_layers=3 was requested .* num_layers=2"):
        gpt_from_pretrained(tmp_path / "hf", num_layers=3)
    with pytest.raises(ValueError, match=r"vocab_size=512 was requested .* vocab_size=300"):
        gpt_from_pretrained(tmp_path / "hf", vocab_size=512)
    with pytest.raises(ValueError, match=r"seq_length=32 was requested .* only 16 positions"):
        gpt_from_pretrained(tmp_path / "hf", seq_length=32)
    assert gpt_from_pretrained(tmp_path / "hf", seq_length=8, learning_rate=1e-4).config.seq_length == 8
    tiny_hf(tmp_path / "relu", activation_function="relu")
    with pytest.raises(ValueError, match="activation_function='relu'"):
        gpt_from_pretrained(tmp_path / "relu")
    with pytest.raises(ValueError, match="model_type='bert'"):
        hf_to_gpt_state_dict({}, {"model_type": "bert"})


# ----- checkpoints of `lightning-3d fit` -----------------------------------------------------------------------
def test_t5_checkpoint_exports_the_tokenizer_its_data_module_stored(tmp_path: Path, capsys) -> None:
    """What `lightning-3d fit --config t5_tiny --data.tokenizer=bytes` records (hyper-parameters with the CLI-linked
    ids, the data module's stored tokenizer): export needs no --tokenizer and says where it wrote it."""
    from lightning_3d.recipes import T5
    from lightning_3d.recipes.data import Seq2SeqDataModule

    data = Seq2SeqDataModule(tokenizer="bytes", cache_dir=str(tmp_path / "cache"))
    module = T5("tiny", vocab_size=data.vocab_size, pad_token_id=data.pad_token_id, eos_token_id=data.eos_token_id,
                num_layers=1, hidden_size=32, num_heads=2, ffn_hidden_size=64)
    module.configure_model()
    ckpt = tmp_path / "t5.ckpt"
    dcp.save({"model": {"model." + k: v for k, v in module.model.state_dict().items()}}, checkpoint_id=str(ckpt), no_dist=True)
    meta = {"hyper_parameters": {**dict(module.hparams), "_class_path": "lightning_3d.recipes.T5"},
            "Seq2SeqDataModule": data.state_dict()}
    torch.save(meta, ckpt / META_FILE)
    write_manifest(ckpt)
    main(["export", "--checkpoint", str(ckpt), "--output", str(tmp_path / "hf")])
    assert f"tokenizer: {tmp_path / 'hf' / 'tokenizer.json'} (stored in the checkpoint" in capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer("hé", add_special_tokens=False).input_ids == [104, 195, 169]  # the byte tokenizer it trained with
    assert (tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids("<extra_id_0>")) == (257, 258)
