"""FlexAttention document masking for packed GPT rows (``GPT(packed_attention=...)``), single process, CPU.

torch has no FlexAttention backward on CPU: its public ``flex_attention`` refuses inputs that require grad there. The
fixture ``flex_on_cpu`` (tests/conftest.py, tests/flex_cpu.py) lifts that one check (``_validate_device``) and
compiles with "aot_eager" (the same dynamo capture and autograd tracing as on the GPU, torch's reference math kernels
for the forward and the backward), so the CPU suite checks everything but the fused Triton kernel: the mask
(mask_mod), its plumbing through the blocks, activation checkpointing, compiled blocks, and the gradients. The reference
math path evaluates mask_mod on
every score and never reads the block tables (which blocks are skipped, which run without mask_mod): those are
checked by counts and by the fused CPU kernel (inductor, forward only, without grad) over several blocks.

Tolerances (:func:`order_bound`, :func:`fp32_bounds`), derived from fp32's unit roundoff u and the shapes, not from a
run. Flex and the dense mask (and compiled against eager) are fp32 softmax attention over the same scores, so they
differ only in the order of their sums. A sum of n terms accumulated in blocks or trees, as torch's CPU kernels
reduce (vectorised lanes, blocked GEMM micro-kernels, cascade sums), is within ⌈log2 n⌉·u·Σ|terms| of the exact sum
(Higham, Accuracy and Stability of Numerical Algorithms, §4.2), so two such orders differ by 2·⌈log2 n⌉·u relative to
Σ|terms|; the online softmax of a fused kernel adds one rounding per key block when it rescales, counted as one more
reduction per attention. A logit ends a chain of such reductions (10 per block, 2 after them); normed blocks keep the
chain from amplifying, as tests/tolerance.py assumes. That is tighter than tests/tolerance.py's bound for any order
(n·u per reduction), so a real error in the mask or in its gradients (a key of another document let in, a gradient
lost), which moves results by the size of an attention weight, fails, while reassociation does not.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_mask

import lightning_3d.recipes.gpt.model as gpt_model_module
import lightning_3d.recipes.training as training
from lightning_3d.recipes import GPT
from lightning_3d.recipes.gpt.config import preset
from lightning_3d.recipes.gpt.model import GPTModel, document_block_mask, document_mask, packing_inputs, resolve_packed_attention
from lightning_3d.recipes.training import IGNORE_INDEX, compile_blocks, summed_token_cross_entropy
from tests.flex_cpu import allow_flex_backward_on_cpu, count_flex_calls
from tests.test_multitask import VOCAB, collator, random_samples
from tests.tolerance import loss_tolerance, scaled_error

U = torch.finfo(torch.float32).eps / 2  # fp32 unit roundoff


def order_bound(reductions: int, longest: int) -> float:
    """Largest difference, relative to the result's scale, between two summation orders of a chain of ``reductions``
    blocked reductions of at most ``longest`` terms each: 2·⌈log2 longest⌉·u a reduction (module docstring)."""
    return reductions * 2 * math.ceil(math.log2(longest)) * U


def logits_chain(m: GPTModel, seq: int) -> tuple[int, int]:
    """(reductions, widest reduction) from the embeddings to ``m``'s logits over rows of ``seq`` tokens (see
    :func:`fp32_bounds`)."""
    config = m.config
    return 10 * config.num_layers + 2, max(config.hidden_size, config.ffn_size, seq, config.head_dim)


def fp32_bounds(m: GPTModel, mb: dict, logits: torch.Tensor, loss: torch.Tensor) -> tuple[float, float, float]:
    """(logits, summed loss, gradients) bounds for two evaluations of ``m`` on ``mb`` that differ in summation order
    only; ``logits`` and ``loss`` are the reference's.

    Logits, relative to their scale: per block 10 reductions (layer norm, qkv projection, scores, softmax sum, its
    online rescaling, value mix, output projection, layer norm, MLP in, MLP out), then the final norm and the head,
    each of at most the widest of hidden size, MLP width, keys per row and head width. Summed loss, absolute: each
    scored token's cross-entropy moves by at most twice the largest logit difference (tests/tolerance.py's
    loss_tolerance) and by the log-sum-exp's own sum over the vocabulary (2·⌈log2 V⌉·u, absolute on a logarithm);
    then the sum over the scored tokens (positive terms: relative to the loss). Gradients, relative to each
    parameter's: the backward runs the chain transposed (each GEMM's input gradient reduces over its output width)
    after the forward chain that made the activation a weight gradient multiplies, and the weight gradient sums over
    every token position: 2·chain + 1 reductions, of at most the widest above, the vocabulary (the loss's softmax) and
    the positions. That takes a gradient's scale as that of its per-token terms' sum (tokens do not cancel wholesale),
    as the per-token logits bound takes the logits'."""
    rows, seq = mb["input_ids"].shape
    n_tokens = int((mb["labels"] != IGNORE_INDEX).sum())
    chain, widest = logits_chain(m, seq)
    logits_bound = order_bound(chain, widest)
    vocab = logits.shape[-1]
    loss_bound = (n_tokens * (loss_tolerance(logits_bound, logits) + order_bound(1, vocab))
                  + order_bound(1, n_tokens) * abs(float(loss)))
    grads_bound = order_bound(2 * chain + 1, max(widest, vocab, rows * seq))
    return logits_bound, loss_bound, grads_bound


def model(packed_attention: str = "flex", **kw) -> GPTModel:
    m = GPTModel(preset("tiny", vocab_size=VOCAB, seq_length=32, num_layers=2, hidden_size=32, num_heads=4),
                 packed_attention=packed_attention, **kw)
    m.init_weights(7)
    return m


def packed_microbatch(seed: int = 0) -> dict:
    mb = collator("gpt", "packing").microbatches(random_samples("gpt", 12, seed))[0]
    assert int(mb["document_ids"].max()) >= 2  # rows really hold several documents (and a padding tail)
    return mb


def loss_and_grads(m: GPTModel, mb: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    m.zero_grad()
    logits = m(mb["input_ids"], mb["position_ids"], mb["document_ids"])[..., :VOCAB]
    loss = summed_token_cross_entropy(logits, mb["labels"])
    loss.backward()
    return loss.detach(), logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def test_block_mask_is_the_dense_document_mask_and_skips_blocks_across_documents():
    docs = packed_microbatch()["document_ids"]
    block = document_block_mask(docs)
    assert isinstance(block, BlockMask) and block.shape == (*docs.shape[:1], 1, docs.shape[1], docs.shape[1])
    dense = create_mask(block.mask_mod, docs.shape[0], 1, docs.shape[1], docs.shape[1])
    assert torch.equal(dense, document_mask(docs))
    # Four documents of 128 tokens in a 512-token row, blocks of 128: only the 4 diagonal blocks run (causal alone
    # would run 10 of the 16), all of them partial (causal inside); in a row of one document, 10 run, 4 of them partial.
    four = torch.arange(4).repeat_interleave(128)[None]
    mask = document_block_mask(four)
    assert mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum() == 4 and mask.full_kv_num_blocks.sum() == 0
    one = document_block_mask(torch.zeros(1, 512, dtype=torch.long))
    assert (one.kv_num_blocks.sum(), one.full_kv_num_blocks.sum()) == (4, 6)


def test_the_compiled_block_mask_builder_gives_the_eager_tables_and_reuses_its_graph_for_new_documents():
    """On CUDA document_block_mask builds with create_block_mask compiled (eagerly it materialises int64 (batch, seq,
    seq) intermediates): inductor's build (here its CPU kernel) gives exactly the eager block tables over several
    blocks, and other documents of the same shape compile nothing new."""
    from torch._dynamo.utils import counters

    def tables(block: BlockMask) -> list[torch.Tensor]:
        return [block.kv_num_blocks, block.kv_indices, block.full_kv_num_blocks, block.full_kv_indices]

    seq = 320
    build = gpt_model_module._compiled_create_block_mask("inductor")
    for k, rows in enumerate(([[300, 15], [100, 20, 130, 40]], [[40, 200, 60], [310]])):
        docs = torch.stack([torch.cat([torch.arange(len(r)).repeat_interleave(torch.tensor(r)),
                                       torch.full((seq - sum(r),), len(r))]) for r in rows])
        eager = document_block_mask(docs)  # CPU: the eager build
        compiled = build(eager.mask_mod, 2, None, seq, seq, device=docs.device)
        assert all(torch.equal(c, e) for c, e in zip(tables(compiled), tables(eager), strict=True))
        if k == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs


def test_auto_resolves_to_flex_on_cuda_only_and_packing_inputs_builds_that_mask():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_packed_attention("auto", cuda, 0.0, 64) == "flex"
    assert resolve_packed_attention("auto", cuda, 0.0, 16) == "flex"  # the narrowest head inductor's kernel takes
    assert resolve_packed_attention("auto", cpu, 0.0, 64) == "sdpa"
    assert resolve_packed_attention("auto", cuda, 0.1, 64) == "sdpa"  # flex has no attention dropout
    assert resolve_packed_attention("auto", cuda, 0.0, 8) == "sdpa"  # inductor's CUDA flex kernel refuses head_dim < 16
    assert resolve_packed_attention("flex", cpu, 0.0, 8) == "flex"  # CPU's kernel takes them (forward)
    assert resolve_packed_attention("sdpa", cuda, 0.0, 64) == "sdpa"
    with pytest.raises(ValueError, match=r"packed_attention='flex' with head_dim=8 on cuda: torch's fused FlexAttention"
                                         r" kernel needs head_dim >= 16. Use packed_attention='auto' or 'sdpa'"):
        resolve_packed_attention("flex", cuda, 0.0, 8)
    mb = packed_microbatch()
    assert isinstance(packing_inputs(mb, "flex")[1], BlockMask)
    assert torch.equal(packing_inputs(mb, "auto")[1], document_mask(mb["document_ids"]))  # CPU: the dense mask
    assert packing_inputs({"input_ids": mb["input_ids"]}, "flex") == (None, None)  # plain rows: no mask at all


def test_the_model_and_its_stages_resolve_with_their_own_dropout_and_head_dim(monkeypatch):
    """GPTModel and GPTStage hand their config's dropout and head width to the resolution ("auto" must not pick
    flex for heads inductor's CUDA kernel refuses)."""
    from lightning_3d.recipes.gpt.parallelize import GPTStage

    seen = []
    monkeypatch.setattr(gpt_model_module, "resolve_packed_attention",
                        lambda attention, device, dropout, head_dim: seen.append((attention, dropout, head_dim)) or "sdpa")
    mb = packed_microbatch()
    m = model("auto")
    m(mb["input_ids"], mb["position_ids"], mb["document_ids"])
    GPTStage(m, range(2), first=True, last=True)(microbatch=mb)
    assert seen == [("auto", 0.0, 8)] * 2  # hidden_size 32 over 4 heads


def test_flex_equals_the_dense_mask_in_loss_and_every_gradient(flex_on_cpu):
    mb = packed_microbatch()
    flex, dense = model("flex"), model("sdpa")
    loss_f, logits_f, grads_f = loss_and_grads(flex, mb)
    loss_d, logits_d, grads_d = loss_and_grads(dense, mb)
    logits_bound, loss_bound, grads_bound = fp32_bounds(dense, mb, logits_d, loss_d)
    assert scaled_error(logits_f, logits_d) <= logits_bound
    assert abs(loss_f.item() - loss_d.item()) <= loss_bound
    assert grads_f.keys() == grads_d.keys()
    for name, grad in grads_d.items():
        assert scaled_error(grads_f[name], grad) <= grads_bound, name
    # Not vacuous: the documents matter (plain causal attention over the row gives other logits): a model that let
    # other documents' keys in would fail the logits check above.
    assert scaled_error(flex(mb["input_ids"], mb["position_ids"])[..., :VOCAB], logits_d) > logits_bound


def test_recomputation_runs_flex_again_and_changes_nothing(flex_on_cpu, monkeypatch):
    calls = count_flex_calls(monkeypatch.setattr)
    mb = packed_microbatch()
    loss, _, grads = loss_and_grads(model("flex"), mb)
    assert calls[0] == 2  # one per block
    loss_ac, _, grads_ac = loss_and_grads(model("flex", activation_checkpointing=True), mb)
    assert calls[0] == 2 + 4  # the forward and the recomputation of both blocks
    assert torch.equal(loss_ac, loss)
    for name, grad in grads.items():
        assert torch.equal(grads_ac[name], grad), name


def test_compiled_blocks_trace_flex_into_their_graph_without_recompiling_per_microbatch(flex_on_cpu, monkeypatch):
    from torch._dynamo.utils import counters

    calls = count_flex_calls(monkeypatch.setattr)
    eager = model("flex")
    compiled = model("flex")
    compile_blocks(compiled.layers.values())  # the recipe's compile=True
    torch._dynamo.reset()
    mb, other = packed_microbatch(0), packed_microbatch(1)
    assert not torch.equal(mb["document_ids"], other["document_ids"])
    loss, logits, grads = loss_and_grads(eager, mb)
    graphs = counters["stats"]["unique_graphs"]
    loss_and_grads(eager, other)  # eager blocks, flex compiled on its own: other documents, no recompile either
    assert counters["stats"]["unique_graphs"] == graphs
    eager_calls = calls[0]
    loss_c, logits_c, grads_c = loss_and_grads(compiled, mb)
    assert calls[0] == eager_calls  # inside the compiled blocks flex is part of their graph, not a nested compile
    logits_bound, loss_bound, grads_bound = fp32_bounds(eager, mb, logits, loss)
    assert scaled_error(logits_c, logits) <= logits_bound
    assert abs(loss_c.item() - loss.item()) <= loss_bound
    for name, grad in grads.items():
        assert scaled_error(grads_c[name], grad) <= grads_bound, name
    graphs = counters["stats"]["unique_graphs"]
    loss_and_grads(compiled, other)  # same shape, other documents: the block mask is an input, not a guard
    assert counters["stats"]["unique_graphs"] == graphs


def test_fused_cpu_kernel_forward_equals_the_dense_mask(monkeypatch):
    """Inductor's compiled flex (the fused kernel; CPU runs it without grad) against the dense mask."""
    monkeypatch.setattr(training, "COMPILE_BACKEND", "inductor")
    mb = packed_microbatch()
    with torch.no_grad():
        fused = model("flex")(mb["input_ids"], mb["position_ids"], mb["document_ids"])[..., :VOCAB]
        dense_model = model("sdpa")
        dense = dense_model(mb["input_ids"], mb["position_ids"], mb["document_ids"])[..., :VOCAB]
    assert scaled_error(fused, dense) <= order_bound(*logits_chain(dense_model, mb["input_ids"].shape[1]))


def test_fused_cpu_kernel_uses_the_block_tables_like_the_dense_mask_over_several_blocks(monkeypatch):
    """The reference math path (aot_eager, every training test here) evaluates mask_mod on every score and never
    reads the block tables; the fused kernel reads only them to skip blocks and runs full blocks without mask_mod.
    Rows of 320 tokens (three blocks of 128, the last one partial) with a long document (full blocks below the
    diagonal), short ones (blocks skipped) and a padding tail, through inductor's CPU kernel (forward), against SDPA's
    dense mask. Tolerance: one attention in two fp32 summation orders (module docstring): scores over head_dim, the
    softmax sum, its online rescaling and the value mix over at most the row's keys."""
    monkeypatch.setattr(training, "COMPILE_BACKEND", "inductor")
    seq, rows = 320, [[300, 15], [100, 20, 130, 40]]
    docs = torch.stack([torch.cat([torch.arange(len(r)).repeat_interleave(torch.tensor(r)),
                                   torch.full((seq - sum(r),), len(r))]) for r in rows])
    block = document_block_mask(docs)
    # Not vacuous: row 0's second query block (tokens 128-255, document 0) sees key block 0 in full; row 1's third
    # query block (tokens 256-319: document 3 and padding) skips key block 0 (documents 0 to 2).
    assert block.full_kv_num_blocks[0, 0].tolist() == [0, 1, 0] and block.kv_num_blocks[1, 0].tolist()[2] == 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, seq, 16, generator=g) for _ in range(3))
    with torch.no_grad():
        fused = gpt_model_module.flex_document_attention(q, k, v, block)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs))
    assert scaled_error(fused, dense) <= order_bound(4, max(seq, q.shape[-1]))


def test_bad_values_and_what_flex_cannot_do_give_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"packed_attention='dense': use one of \('auto', 'flex', 'sdpa'\)"):
        GPT("tiny", packed_attention="dense")
    with pytest.raises(ValueError, match=r"packed_attention='flex' with dropout=0.1: FlexAttention has no attention"
                                         r" dropout. Use dropout=0.0, or packed_attention='sdpa'"):
        GPT("tiny", dropout=0.1, packed_attention="flex")
    with pytest.raises(ValueError, match="packed_attention='Flex'"):
        model("Flex")
    GPT("tiny", dropout=0.1, packed_attention="auto")  # auto takes the SDPA mask with dropout
    # Training with flex on CPU: torch's refusal, with the option that avoids it.
    mb = packed_microbatch()
    with pytest.raises(NotImplementedError, match=r"packed_attention='flex' on cpu: FlexAttention does not support"
                                                  r" backward on CPU.* Use packed_attention='auto'"):
        model("flex")(mb["input_ids"], mb["position_ids"], mb["document_ids"])
    # The strategy's check before every step (every rank, before any collective) refuses it first, naming the fix;
    # auto and sdpa pass, and so does flex where torch's device check allows the backward (the fixture's lifting).
    with pytest.raises(ValueError, match=r"packed_attention='flex' cannot train packed rows on cpu: FlexAttention does"
                                         r" not support backward on CPU.* Use packed_attention='auto'"):
        GPT("tiny", packed_attention="flex").check_pipeline_batch(mb)
    GPT("tiny", packed_attention="auto").check_pipeline_batch(mb)
    GPT("tiny", packed_attention="sdpa").check_pipeline_batch(mb)
    with torch.no_grad():  # inference: flex's forward runs on CPU
        GPT("tiny", packed_attention="flex").check_pipeline_batch(mb)
    allow_flex_backward_on_cpu(monkeypatch.setattr)
    GPT("tiny", packed_attention="flex").check_pipeline_batch(mb)
    # Context parallelism attends over whole sequences: a block mask is refused like the dense mask.
    attn = model("flex").layers["0"].attn
    attn.context = (None, "contiguous", "ring")
    with pytest.raises(ValueError, match="packed documents .* need context_parallel_size=1"):
        attn(torch.zeros(1, 32, 32), mask=document_block_mask(torch.zeros(1, 32, dtype=torch.long)))


def test_cli_reaches_packed_attention(tmp_path: Path, monkeypatch):
    from lightning_3d.cli import build_cli
    from tests.test_multitask import FLAN

    monkeypatch.setattr("sys.argv", ["lightning-3d"])
    cli = build_cli(["--config", "gpt_multitask_tiny", "--model.packed_attention=flex", f"--data.data_files={FLAN}",
                     "--data.tokenizer=bytes", f"--trainer.default_root_dir={tmp_path}",
                     f"--data.cache_dir={tmp_path / 'cache'}"], run=False)
    cli.model.configure_model()
    assert cli.model.hparams.packed_attention == "flex" and cli.model.model.packed_attention == "flex"


def test_tensor_sequence_and_pipeline_parallel_flex_train_like_one_process(tmp_path: Path):
    """GPT with packed_attention='flex' at tp=2 with sequence parallelism (heads sharded: the block mask is head-free;
    eager and compiled blocks) and at pp=2 with activation checkpointing equals plain single-process training on the
    same global batches, padded, within the 1e-5 relative tolerance that every training-equality scenario of the
    suite uses (tests/test_distributed.py, tests/test_multitask.py). Unlike the single-step bounds above it is not
    derived from summation orders alone: after an Adam step a parameter moves by lr·g/(|g| + eps), so a rounding
    difference in a gradient near zero moves it by up to lr/eps times that difference; the scenarios' adam_eps=1e-6
    keeps that small (tests/scenarios/common.py) without bounding it. The gradients themselves are held to the
    derived bounds by the single-process tests above, through the same flex code."""
    from tests.launch import run_scenario

    report = run_scenario(2, "flex_packing", [], tmp_path / "report.json", timeout=600)
    assert report.pop("calls") > 0  # flex really ran in the fits
    assert set(report) == {"gpt_tp2_sp_flex", "gpt_tp2_sp_compiled_flex", "gpt_pp2_ac_flex"}
    for name, result in report.items():
        assert result["loss_err"] <= 1e-5 and result["param_err"] <= 1e-5, (name, result)


def test_a_compiled_flex_stage_equals_the_eager_model_in_logits_loss_and_every_gradient(flex_on_cpu):
    """compile_scope="stage" (the whole stage one compiled region, flex traced into it, the block mask built by the
    compiler-disabled document_block_mask) against the eager model with the same weights: logits, loss and every
    parameter's gradient within the fp32 summation-order bounds of the eager flex/dense comparison above."""
    from lightning_3d.recipes.gpt.parallelize import GPTStage

    mb = packed_microbatch()
    eager = model("flex")
    loss, logits, grads = loss_and_grads(eager, mb)
    stage = GPTStage(model("flex"), range(2), first=True, last=True)
    compile_blocks([stage])  # compile_scope="stage"
    logits_c = stage(microbatch=mb)[..., :VOCAB]
    loss_c = summed_token_cross_entropy(logits_c, mb["labels"])
    loss_c.backward()
    logits_bound, loss_bound, grads_bound = fp32_bounds(eager, mb, logits, loss)
    assert scaled_error(logits_c.detach(), logits) <= logits_bound
    assert abs(loss_c.item() - loss.item()) <= loss_bound
    stage_grads = {n: p.grad for n, p in stage.named_parameters()}
    assert stage_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert scaled_error(stage_grads[name], grad) <= grads_bound, name


def test_flex_packing_check_script_runs_every_variant_on_cpu():
    """benchmarks/dynamic/flex_packing_check.py (the GPU check of every flex path against the dense mask) on CPU: every
    variant runs, is within its fp32 bound, and a second pass over other documents compiles nothing."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, str(root / "benchmarks/dynamic/flex_packing_check.py"), "--device", "cpu", "--seq-length", "128",
           "--hidden-size", "32", "--num-layers", "1", "--samples", "48"]
    out = subprocess.run(cmd, check=True, cwd=root, capture_output=True, text=True, timeout=600).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    variants = {r["variant"]: r for r in rows if "variant" in r}
    assert list(variants) == ["sdpa", "flex", "flex+ac", "flex+compiled_blocks", "flex+ac+compiled_blocks",
                              "flex+compiled_stage", "head_dim_8"]
    assert rows[-1] == {"summary": "ok", "failed": []}
    for name, r in variants.items():
        if name.startswith("flex"):
            assert r["ok"] and r["recompiles"] == 0 and r["logits"] > 0, (name, r)  # > 0: flex really ran
    assert variants["head_dim_8"]["auto_resolves_to"] == "sdpa"
