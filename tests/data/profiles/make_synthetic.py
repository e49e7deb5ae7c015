"""Regenerates gpt_synthetic.json: a profile in the ``lightning-3d profile`` format whose numbers come from the
analytic model on an H100 (rounded), with the largest shape marked out of memory (null) without checkpointing.

    python tests/data/profiles/make_synthetic.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lightning_3d.costs import AnalyticCostModel, ModelShape, device_spec, new_profile

SHAPE = ModelShape("gpt", num_layers=8, hidden_size=1024, num_heads=16, ffn_hidden_size=4096, vocab_size=32768)
MBS, SEQ = [1, 2, 4, 8], [256, 512, 1024, 2048]


def build() -> dict:
    device = device_spec("h100")
    model = AnalyticCostModel(SHAPE, device)
    doc = new_profile(SHAPE, device, precision="bf16-mixed", note="synthetic (analytic numbers), for tests")
    b, s = np.meshgrid(np.array(MBS, float), np.array(SEQ, float), indexing="ij")
    for kind in ("embedding", "block", "head"):
        doc["layers"][kind] = []
        for tp in (1, 2):
            for rc in ((False, True) if kind == "block" else (False,)):
                f, bw = model.layer_time(kind, b, s, recompute=rc, tp=tp)
                st, pk = model.layer_memory(kind, b, s, recompute=rc, tp=tp)
                grids = {q: [[float(f"{v:.6g}") for v in row] for row in a.tolist()]
                         for q, a in (("forward", f), ("backward", bw), ("stored", st), ("peak", pk))}
                if kind == "block" and not rc and tp == 1:
                    for q in grids:
                        grids[q][-1][-1] = None  # out of memory at the largest shape
                doc["layers"][kind].append({"tp": tp, "recompute": rc, "microbatch_size": MBS, "seq_len": SEQ,
                                            "target_len": None, **grids})
    return doc


if __name__ == "__main__":
    path = Path(__file__).with_name("gpt_synthetic.json")
    path.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {path}")
