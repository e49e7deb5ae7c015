"""Dynamic micro-batching's attention measurements: the benchmarks that time what a new micro-batch shape costs
(benchmarks/dynamic/multitask_microbatching.py, benchmarks/dynamic/dynamic_shapes.py) count shapes exactly, parse their variants,
and run a variant under the backend order they name without changing results or leaving the order behind; packed
rows still equal their documents alone. Which kernel runs on a GPU is what the benchmarks measure (docs/dynamic.md).
"""

from __future__ import annotations

import pytest
import torch

from lightning_3d.recipes.gpt.config import preset
from lightning_3d.recipes.gpt.model import GPTModel, document_mask


def flags() -> dict[str, bool]:
    return {"flash": torch.backends.cuda.flash_sdp_enabled(), "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "math": torch.backends.cuda.math_sdp_enabled()}


def tiny_model() -> GPTModel:
    torch.manual_seed(0)
    config = preset("tiny", vocab_size=97, seq_length=32, num_layers=2, dropout=0.0)
    model = GPTModel(config)
    model.init_weights(1234)
    return model


def test_packed_rows_still_match_their_documents_alone():
    """A packed row under the document mask computes each document as the document alone does."""
    model = tiny_model()
    a, b = torch.randint(0, 97, (1, 6)), torch.randint(0, 97, (1, 10))
    packed = model(torch.cat([a, b], 1), document_ids=torch.tensor([[0] * 6 + [1] * 10]))
    torch.testing.assert_close(packed[:, :6], model(a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 6:], model(b), rtol=1e-5, atol=1e-5)
    assert document_mask(torch.tensor([[0, 0, 1]]))[0, 0, 2].tolist() == [False, False, True]



# ----- the benchmarks that measure it (the GPU command) ---------------------------------------------------------------
def test_multitask_benchmark_counts_shapes_and_runs_under_the_named_order():
    from benchmarks.dynamic.multitask_microbatching import DIRECT_SDPA, parse_variant, sdpa_context, shape_counts, table

    def mb(b, s):
        return {"input_ids": torch.zeros(b, s, dtype=torch.long), "labels": torch.zeros(b, s, dtype=torch.long)}

    seen: set = set()
    # step 1: shapes (4, 8) twice and (2, 16): 2 distinct, 2 new; step 2: (2, 16) again and (1, 32): 2 distinct, 1 new
    assert shape_counts([[mb(4, 8), mb(4, 8), mb(2, 16)], [mb(2, 16), mb(1, 32)]], seen) == (2.0, 1.5)
    assert shape_counts([[mb(1, 32)]], seen) == (1.0, 0.0)  # seen in this process before: not new
    assert parse_variant("packing@2") == ("packing", 2)
    assert parse_variant("dynamic@analytic") == ("dynamic", None)
    for bad in ("dynamic@3", "padding@0", "padding@x", "ring@2"):
        with pytest.raises(SystemExit, match="variant"):
            parse_variant(bad)
    # --sdpa sets the recipe's sdpa_backends on every attention (flash_first: "torch" inside the flash-first order,
    # every backend enabled); results do not depend on it on CPU (one kernel there); leaving the context restores the
    # attentions' value and the flags.
    # The model is built outside a Trainer, where the recipes' "auto" is "torch": hence the engine's own default,
    # DIRECT_SDPA, "no_cudnn", what "auto" picks for the changing shapes of most variants.
    assert DIRECT_SDPA == "no_cudnn"
    model = tiny_model()
    attentions = [m for m in model.modules() if hasattr(m, "sdpa_backends")]
    assert len(attentions) == 2 and {m.sdpa_backends for m in attentions} == {"torch"}
    ids = torch.randint(0, 97, (2, 8))
    before = flags()
    reference = model(ids)
    for name, value in (("no_cudnn", "no_cudnn"), ("flash_first", "torch"), ("torch", "torch")):
        with sdpa_context(model, name):
            assert {m.sdpa_backends for m in attentions} == {value}
            torch.testing.assert_close(model(ids), reference, rtol=0, atol=0)
        assert flags() == before and {m.sdpa_backends for m in attentions} == {"torch"}
    with pytest.raises(ValueError, match=r"--sdpa 'cudnn': choose from \['no_cudnn', 'torch', 'flash_first'\]"):
        sdpa_context(model, "cudnn")
    rows = [{"variant": "dynamic", "sdpa": "flash_first", "attention": "sdpa causal", "error": None,
             "useful_tokens_per_s": 12345, "step_s_mean": 0.5, "padding_fraction": 0.095, "compiles_timed": 0},
            {"variant": "padding@4", "sdpa": "torch", "attention": "sdpa causal", "error": "out of memory: x"}]
    lines = table(rows).splitlines()
    assert len(lines) == 4 and "| dynamic | flash_first | sdpa causal | 12,345 |" in lines[2] and "9.5%" in lines[2]
    assert lines[2].endswith("| 0 |  |")  # no compile in the timed steps; no choices (only auto records them)
    assert lines[3].startswith("| padding@4 | torch | sdpa causal | error: out of memory")


def test_multitask_benchmark_names_each_variants_packed_attention():
    """packing@N runs the recipe's default (FlexAttention on CUDA), packing@N:sdpa the dense mask, packing@N:flex
    FlexAttention; only packing variants take an attention, and the table says what each variant ran."""
    from benchmarks.dynamic.multitask_microbatching import attention_label, packed_attention_of, parse_variant

    assert parse_variant("packing@2:sdpa") == ("packing", 2) and packed_attention_of("packing@2:sdpa") == "sdpa"
    assert packed_attention_of("packing@4") == "auto" and packed_attention_of("packing@1:flex") == "flex"
    for bad in ("packing@2:dense", "padding@4:flex", "dynamic:sdpa"):
        with pytest.raises(SystemExit, match="only packing takes an attention, one of"):
            parse_variant(bad)
    assert attention_label("gpt", "packing", "auto", "cuda", 0.0, 64) == "flex block mask"
    assert attention_label("gpt", "packing", "auto", "cpu", 0.0, 64) == "sdpa dense mask"
    assert attention_label("gpt", "packing", "auto", "cuda", 0.0, 8) == "sdpa dense mask"  # heads too narrow for flex
    assert attention_label("gpt", "packing", "sdpa", "cuda", 0.0, 64) == "sdpa dense mask"
    assert attention_label("gpt", "dynamic", "auto", "cuda", 0.0, 64) == "sdpa causal"
    # T5: the recipe's own attention (its default runs scores, softmax and value mix apart) and the mask kind
    assert attention_label("t5", "packing", "explicit", "cuda", 0.0, 64) == "explicit+doc mask"
    assert attention_label("t5", "auto", "sdpa", "cuda", 0.0, 64) == "sdpa+pad mask or sdpa+doc mask"


def test_dynamic_shapes_gives_distinct_shapes_of_about_the_token_count():
    from benchmarks.dynamic.dynamic_shapes import shapes

    out = shapes(4096, 24, 2048, seed=1)
    assert len(out) == len(set(out)) > 12
    for b, s in out:
        assert s % 8 == 0 and 16 <= s <= 2048 and b == max(1, 4096 // s)
    assert shapes(4096, 24, 2048, seed=1) == out and shapes(4096, 24, 2048, seed=2) != out
