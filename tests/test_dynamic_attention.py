"""The GPT recipe's SDPA backend order for causal attention (issue 21: micro-batches whose shapes change every time,
as padding, token-budget and dynamic micro-batching make them, must not pay a per-shape set-up in attention).

What CPU can check: the order is in force exactly during the unmasked causal call and restored after it, masked
(packed) attention keeps torch's order, the default order disables no backend (every input keeps a kernel) and puts
flash attention first, training results do not depend on the order beyond the kernels' rounding, and the order
compiles without a graph break. Which kernel runs on a GPU is measured by benchmarks/dynamic_shapes.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from lightning_3d.recipes.gpt import model as gpt_model
from lightning_3d.recipes.gpt.config import preset
from lightning_3d.recipes.gpt.model import GPTModel, document_mask


def flags() -> dict[str, bool]:
    return {"flash": torch.backends.cuda.flash_sdp_enabled(), "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "math": torch.backends.cuda.math_sdp_enabled()}


@pytest.fixture
def recorded(monkeypatch):
    """The backend flags in force at every SDPA call (then the real call)."""
    seen: list[tuple[bool, dict[str, bool]]] = []
    real = F.scaled_dot_product_attention

    def record(*args, **kwargs):
        seen.append((kwargs.get("attn_mask") is None, flags()))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    return seen


def tiny_model() -> GPTModel:
    torch.manual_seed(0)
    config = preset("tiny", vocab_size=97, seq_length=32, num_layers=2, dropout=0.0)
    model = GPTModel(config)
    model.init_weights(1234)
    return model


def test_default_order_puts_flash_first_and_disables_nothing():
    order = gpt_model.CAUSAL_SDPA_BACKENDS
    assert order[0] == SDPBackend.FLASH_ATTENTION
    assert set(order) == {SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                          SDPBackend.MATH}


def test_order_in_force_only_for_unmasked_causal_calls(monkeypatch, recorded):
    before = flags()
    monkeypatch.setattr(gpt_model, "CAUSAL_SDPA_BACKENDS", [SDPBackend.MATH])
    model = tiny_model()
    ids = torch.randint(0, 97, (2, 16))
    model(ids)  # plain rows: causal, no mask
    assert len(recorded) == 2 and all(causal for causal, _ in recorded)
    assert all(f == {"flash": False, "efficient": False, "cudnn": False, "math": True} for _, f in recorded)
    assert flags() == before  # restored after each call
    recorded.clear()
    documents = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])
    model(ids, document_ids=documents)  # packed rows: the mask path keeps torch's order
    assert len(recorded) == 2 and not any(causal for causal, _ in recorded)
    assert all(f == before for _, f in recorded)


def test_none_leaves_torchs_order(monkeypatch, recorded):
    before = flags()
    monkeypatch.setattr(gpt_model, "CAUSAL_SDPA_BACKENDS", None)
    tiny_model()(torch.randint(0, 97, (1, 8)))
    assert len(recorded) == 2 and all(f == before for _, f in recorded)


def test_loss_and_gradients_do_not_depend_on_the_order(monkeypatch):
    """fp32 on CPU: the default order runs torch's CPU flash kernel, [MATH] the math kernel; both sum at most 16 keys
    per query in fp32 in different orders, so outputs differ by a few units of rounding (~16 x 6e-8 relative), and
    the loss and gradients of two layers by less than 1e-5 relative."""
    ids = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(3))
    results = []
    for order in (gpt_model.CAUSAL_SDPA_BACKENDS, [SDPBackend.MATH]):
        monkeypatch.setattr(gpt_model, "CAUSAL_SDPA_BACKENDS", order)
        model = tiny_model()
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=0)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-7, msg=name)


def test_packed_rows_still_match_their_documents_alone():
    """The unmasked path (flash-first order) and the masked path (torch's order) compute the same document."""
    model = tiny_model()
    a, b = torch.randint(0, 97, (1, 6)), torch.randint(0, 97, (1, 10))
    packed = model(torch.cat([a, b], 1), document_ids=torch.tensor([[0] * 6 + [1] * 10]))
    torch.testing.assert_close(packed[:, :6], model(a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 6:], model(b), rtol=1e-5, atol=1e-5)
    assert document_mask(torch.tensor([[0, 0, 1]]))[0, 0, 2].tolist() == [False, False, True]


def test_compiles_without_graph_break():
    """Compiled code keeps torch's order (no context manager traced): fullgraph, a graph break would raise."""
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    compiled = torch.compile(gpt_model.causal_sdpa, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v, 0.0), F.scaled_dot_product_attention(q, k, v, is_causal=True))


# ----- the benchmarks that measure it (issue 21's GPU command) ------------------------------------------------------
def test_multitask_benchmark_counts_shapes_and_switches_the_order():
    from benchmarks.multitask_microbatching import parse_variant, sdpa_order, shape_counts, table

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
    default = gpt_model.CAUSAL_SDPA_BACKENDS
    restore = sdpa_order("torch")
    assert gpt_model.CAUSAL_SDPA_BACKENDS is None and restore == default
    sdpa_order("model")
    assert gpt_model.CAUSAL_SDPA_BACKENDS == default
    gpt_model.CAUSAL_SDPA_BACKENDS = restore
    rows = [{"variant": "dynamic", "sdpa": "model", "error": None, "useful_tokens_per_s": 12345, "step_s_mean": 0.5,
             "padding_fraction": 0.095},
            {"variant": "padding@4", "sdpa": "torch", "error": "out of memory: x"}]
    lines = table(rows).splitlines()
    assert len(lines) == 4 and "| dynamic | model | 12,345 |" in lines[2] and "9.5%" in lines[2]
    assert lines[3].startswith("| padding@4 | torch | error: out of memory")


def test_dynamic_shapes_gives_distinct_shapes_of_about_the_token_count():
    from benchmarks.dynamic_shapes import shapes

    out = shapes(4096, 24, 2048, seed=1)
    assert len(out) == len(set(out)) > 12
    for b, s in out:
        assert s % 8 == 0 and 16 <= s <= 2048 and b == max(1, 4096 // s)
    assert shapes(4096, 24, 2048, seed=1) == out and shapes(4096, 24, 2048, seed=2) != out
