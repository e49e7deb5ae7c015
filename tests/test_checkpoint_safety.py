"""Checkpoint safety: files never run code, interrupted saves keep a loadable checkpoint, damage is an error.

The distributed checks run in one 2-process scenario (tests/scenarios/ckpt_safety.py); export and the allow-list
are checked in this process.
"""

from __future__ import annotations

import argparse
import pickle
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_3d.checkpoint import files as ckpt
from lightning_3d.recipes.export import export_checkpoint
from tests.launch import run_scenario
from tests.scenarios.ckpt_safety import STAGES, Payload


# ----- one 2-process run: crashes at every step of a save, damaged copies ----------------------------------------
@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ckpt_safety")
    return run_scenario(2, "ckpt_safety", ["--world", "2", "--extra", str(root)], root / "report.json", timeout=600)


def test_a_save_interrupted_at_any_step_leaves_a_checkpoint_that_resumes_exactly(scenario: dict) -> None:
    report = scenario["crashes"]
    straight = report["straight"]  # 4 uninterrupted steps
    assert len(straight) == 4 and report["rank_state"] == ["rank0.pt", "rank1.pt"]
    for stage in STAGES:
        run = report[stage]
        assert all(c is not None and f"injected crash after {stage}" in c[1] for c in run["crash"]), (stage, run["crash"])
        # Before the swap the step-2 checkpoint is still last.ckpt; after the exchange, or the second rename, the
        # step-3 one is; after the fallback's first rename last.ckpt is missing and the complete step-3 checkpoint
        # beside it is loaded.
        expected_start = 2 if stage in ("written", "manifest") else 3
        assert run["resumed_from"] == expected_start, (stage, run)
        assert ("last.ckpt" in run["after_crash"]) == (stage != "moved_old")
        # bitwise: the same data order, optimizer, schedule, RNG and compression state as the uninterrupted run
        assert run["losses"] == straight[expected_start:], (stage, run["losses"], straight)
        assert run["after_resume"] == ["last.ckpt"]  # the next save removed what the crash left


@pytest.mark.parametrize("name, message", [
    ("flipped_shard", r"damaged: __1_0\.distcp does not match its manifest\.json \(size \d+, expected \d+; checksum differs\)"),
    ("shard_of_other_step", r"damaged: __0_0\.distcp does not match its manifest\.json .*than step 4"),
    ("meta_of_other_step", r"damaged: lightning_meta\.pt does not match its manifest\.json"),
    ("missing_rank_state", r"damaged: files \['rank_state/rank1\.pt'\] listed in its manifest\.json are missing"),
    ("missing_shard", r"damaged: files \['__1_0\.distcp'\] listed in its manifest\.json are missing"),
    ("truncated_metadata", r"damaged: \.metadata does not match its manifest\.json \(size 100, expected"),
    ("no_manifest", r"has no manifest\.json .* write_manifest"),
    ("planted_meta", r"lightning_meta\.pt holds an object lightning_3d does not load \(the global \S*open, a function"),
    ("planted_rank_state", r"rank_state/rank1\.pt holds an object lightning_3d does not load \(the global \S*open, a function"),
    ("planted_metadata", r"its \.metadata is not a DCP metadata file \(\S*open is not a class DCP writes"),
])
def test_a_damaged_checkpoint_is_the_same_error_on_every_rank(scenario: dict, name: str, message: str) -> None:
    import re

    outcomes = scenario["damaged"][name]
    assert all(o is not None for o in outcomes), (name, outcomes)  # no rank resumed
    assert outcomes[0] == outcomes[1], outcomes  # the same error on both ranks (so neither waits in a collective)
    assert re.search(message, outcomes[0][1]), outcomes[0][1]


def test_planted_pickles_never_ran_and_the_good_checkpoint_still_resumes(scenario: dict) -> None:
    assert scenario["damaged"]["markers"] == []
    assert scenario["damaged"]["good_resumed_from"] == 4


# ----- in this process ------------------------------------------------------------------------------------------
def test_plain_values_paths_namespaces_and_numpy_load_under_the_allow_list(tmp_path: Path) -> None:
    value = {"opts": {"sc": True, "link_gbps": 1.5, "name": "x", "nested": {"a": [1, 2.0, None, (3, "y")]}},
             "path": Path("/data/x"), "ns": argparse.Namespace(a=1, b="c"),
             "rng": ("MT19937", np.arange(5, dtype=np.uint32), 3, 0, 0.0), "t": torch.arange(3.0)}
    torch.save(value, tmp_path / "f.pt")
    loaded = ckpt.safe_load(tmp_path / "f.pt")
    assert loaded["opts"] == value["opts"] and loaded["path"] == value["path"] and loaded["ns"] == value["ns"]
    assert torch.equal(loaded["t"], value["t"])
    assert loaded["rng"][0] == "MT19937" and np.array_equal(loaded["rng"][1], value["rng"][1])


class _System:
    """A planted payload as an attacker writes it: a call of ``os.system`` (never run: the reader refuses it)."""

    def __reduce__(self):
        import os

        return (os.system, ("exit 3",))


def test_a_refused_file_names_the_object_and_never_advises_weights_only_false(tmp_path: Path) -> None:
    """The refusal names what was refused and why; torch's advice to retry with ``weights_only=False`` (run the
    file's code) is never passed on, whichever of torch's messages the payload provokes."""
    import os

    torch.save({"x": _System()}, tmp_path / "system.pt")  # a module torch blocks outright
    torch.save({"x": Payload(tmp_path / "marker")}, tmp_path / "open.pt")  # a global outside the allow-list
    (tmp_path / "inst.pt").write_bytes(b"(S'exit 3'\nios\nsystem\n.")  # protocol-0 instructions
    torch.save({"x": np.array([object()], dtype=object)}, tmp_path / "object.pt")  # a type outside the allow-list
    expected = {"system.pt": rf"the global {os.system.__module__}\.system, a function or class whose call could run",
                "open.pt": r"the global \S*open, a function or class",
                "inst.pt": r"the pickle instruction STRING, which the code-free reader does not accept",
                "object.pt": r"an object of <class 'numpy\.dtypes\.ObjectDType'>, a type outside the allow-list"}
    for name, found in expected.items():
        with pytest.raises(ValueError) as err:
            ckpt.safe_load(tmp_path / name)
        message = str(err.value)
        assert re.search(rf"{name} holds an object lightning_3d does not load \({found}", message), message
        assert "weights_only" not in message and "Re-running" not in message, message
        assert "do not load it by other means (unpickling it could run its code)" in message, message
    assert not (tmp_path / "marker").exists()


def _checkpoint(path: Path, hparams: dict) -> Path:
    dcp.save({"model": {"x": torch.zeros(2)}}, checkpoint_id=str(path), no_dist=True)
    torch.save({"hyper_parameters": hparams, "global_step": 7}, path / ckpt.META_FILE)
    return ckpt.write_manifest(path)


def _rehash(path: Path) -> None:
    ckpt._write_manifest(path, {f: ckpt._digest(path / f) for f in ckpt._listing(path)}, 7)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_never_runs_a_planted_pickle_or_imports_a_class_path(tmp_path: Path, monkeypatch) -> None:
    marker = tmp_path / "marker"
    meta = _checkpoint(tmp_path / "meta", {"preset_name": "tiny"})
    torch.save(Payload(marker), meta / ckpt.META_FILE)
    _rehash(meta)  # the manifest vouches for the planted file: only the refusal to unpickle it stops the payload
    with pytest.raises(ValueError, match=r"lightning_meta\.pt holds an object lightning_3d does not load"):
        export_checkpoint(meta, tmp_path / "out")
    metadata = _checkpoint(tmp_path / "metadata", {"preset_name": "tiny"})
    (metadata / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _rehash(metadata)
    with pytest.raises(ValueError, match=r"\.metadata is not a DCP metadata file"):
        export_checkpoint(metadata, tmp_path / "out")
    # A class path names a module whose import would run code: it is matched against the known classes, not imported.
    (tmp_path / "l3d_planted.py").write_text(f"open({str(marker)!r}, 'w')\nclass Model:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    planted = _checkpoint(tmp_path / "class", {"preset_name": "tiny", "_class_path": "l3d_planted.Model"})
    with pytest.raises(ValueError, match=r"class l3d_planted\.Model.*known classes: \[.*'lightning_3d\.recipes\.gpt\.module\.GPT'"
                                         r".*never imported"):
        export_checkpoint(planted, tmp_path / "out")
    assert not marker.exists() and "l3d_planted" not in sys.modules and not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_without_manifest_is_refused_until_write_manifest(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "legacy", {"preset_name": "tiny"})
    (path / ckpt.MANIFEST_FILE).unlink()
    with pytest.raises(ckpt.DamagedCheckpointError, match=r"has no manifest\.json.*write_manifest\('.*legacy'\)"):
        ckpt.verify(path)
    ckpt.write_manifest(path)
    manifest = ckpt.verify(path)
    assert manifest["step"] == 7 and sorted(manifest["files"]) == [".metadata", "__0_0.distcp", ckpt.META_FILE]
    with pytest.raises(FileNotFoundError, match="is not a lightning_3d checkpoint"):
        ckpt.verify(tmp_path / "nothing")


def test_the_recipe_class_table_names_real_subclasses_of_each_recipe() -> None:
    """Export looks a checkpoint's class path up in RECIPE_CLASS_PATHS instead of importing it; each entry must
    name a class of the recipe it claims (here, in the test, importing is fine: these are our own modules)."""
    import importlib

    from lightning_3d.recipes import GPT, T5
    from lightning_3d.recipes.hf import RECIPE_CLASS_PATHS

    base = {"gpt": GPT, "t5": T5}
    for path, recipe in RECIPE_CLASS_PATHS.items():
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        assert isinstance(cls, type) and issubclass(cls, base[recipe]), (path, recipe)
