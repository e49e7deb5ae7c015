"""The files of a checkpoint directory: reading them without running code, writing them atomically, and a
manifest that every load verifies. The DCP side (what goes into the shards) is ``checkpoint.state``.

Safety (files users give us never execute code, a crash never costs the last good checkpoint, damage is an error):
- Every file is read without running code: ``torch.load(weights_only=True)`` with an explicit allow-list
  (:data:`SAFE_GLOBALS`) for our ``.pt`` files, and DCP's ``.metadata`` pickle is first replayed by a restricted
  unpickler that admits only DCP's metadata classes (:func:`check_dcp_metadata`) before DCP itself unpickles it.
- A save writes into a fresh sibling ``<name>.tmp-<id>``; when every rank has written, the files are hashed (each
  rank a share), rank 0 writes ``manifest.json`` (size and BLAKE2b of every file, the step and a checkpoint id)
  last, then renames the directory into place (an existing one is first renamed to ``<name>.old-<id>`` and deleted
  after). A crash leaves the old or the new checkpoint complete, and :func:`resolve` finds it.
- A load verifies the manifest on every rank (each hashes a share of the files, the verdicts are gathered) before
  any collective of DCP, so a damaged checkpoint is the same clear error on all ranks instead of a hang or wrong state.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import hashlib
import json
import os
import pathlib
import pickle
import re
import shutil
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

META_FILE = "lightning_meta.pt"
RANK_STATE_DIR = "rank_state"
MANIFEST_FILE = "manifest.json"
_MANIFEST_FORMAT = "lightning_3d checkpoint manifest 1"


# ----- reading without running code ------------------------------------------------------------------------------
# What our files may hold beyond tensors and plain Python values (dict, list, tuple, str, int, float, bool, None,
# OrderedDict, torch dtypes and sizes, which weights_only admits anyway): hyper-parameters that are paths or argparse
# namespaces, and numeric numpy arrays (the NumPy RNG state of selective compression in the rank-state files;
# Lightning stores hyper-parameters as a plain dict). Each is a plain container or value type whose reconstruction
# runs no user code.
def _safe_globals() -> list:
    import numpy as np

    numeric = [type(np.dtype(t)) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                           np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
                                           np.complex128)]
    return [pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath, argparse.Namespace,
            np.ndarray, np.dtype, _numpy_reconstruct(), *numeric]


def _numpy_reconstruct() -> Any:
    """``numpy.ndarray``'s unpickling helper (NumPy 2 moved it from ``numpy.core`` to ``numpy._core``)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


def safe_load(file: Path, map_location: Any = None) -> Any:
    """``torch.load`` of one of our ``.pt`` files that cannot run code: tensors, plain values and
    :func:`_safe_globals` only; anything else is an error naming the file and the refused object."""
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        allowed = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in _safe_globals())
        raise ValueError(
            f"{file} holds an object lightning_3d does not load ({refused_object(str(err))}): checkpoint files are read"
            f" without running code, so only tensors, plain Python values and {allowed} are accepted. The file was not"
            " written by Compressed3DStrategy or was altered: do not load it by other means (unpickling it could run"
            " its code); use a checkpoint that was written by Compressed3DStrategy."
        ) from None


def refused_object(message: str) -> str:
    """What torch's restricted unpickler refused and why, read from its error. Only the refused object is taken from
    that text: torch's own advice (retry with the restriction off) is exactly what must not be done with a file that
    holds a foreign object, so it is never repeated."""
    import pickletools

    glob = re.search(r"GLOBAL ([\w.]+)", message)
    if glob:
        return f"the global {glob.group(1)}, a function or class whose call could run code"
    operand = re.search(r"Unsupported operand (\d+)", message)
    if operand:
        code = int(operand.group(1))
        name = next((op.name for op in pickletools.opcodes if op.code == chr(code)), None)
        return f"the pickle instruction {name or code}, which the code-free reader does not accept"
    built = re.search(r"but got (<class '[\w.]+'>)", message)
    if built:
        return f"an object of {built.group(1)}, a type outside the allow-list"
    return "an object outside the allow-list"


# DCP's .metadata is a pickle that DCP reads with pickle.load. Replaying it first with an unpickler that admits only
# the classes DCP writes there (its metadata dataclasses and enums, torch.Size, dtypes, layouts, paths) means a
# planted payload is refused before DCP unpickles the file.
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _DCP_METADATA_MODULE:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:  # its dataclasses and enums, nothing imported there
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not a class DCP writes into .metadata")


def check_dcp_metadata(path: Path) -> None:
    """An error unless ``path/.metadata`` unpickles using DCP's metadata classes only (see ``_MetadataUnpickler``)."""
    try:
        with open(path / ".metadata", "rb") as f:
            _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as err:
        raise ValueError(f"Checkpoint {path} is damaged: its .metadata is not a DCP metadata file ({err}); it is not"
                         " loaded (unpickling it could run code). Use another checkpoint.") from None


# ----- atomic saves, manifests and their verification -----------------------------------------------------------
def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every rank (a collective when there are several)."""
    world = _rank_world()[1]
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    if _rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _reached(stage: str) -> None:
    """Called after each step of a save ("written", "manifest", then "exchanged" or "moved_old", "moved_new"): a
    seam where the tests inject a crash to check that every interrupted save leaves a loadable checkpoint. Does
    nothing here."""


def _digest(file: Path) -> dict[str, Any]:
    h, size = hashlib.blake2b(digest_size=32), 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "blake2b": h.hexdigest()}


def _listing(path: Path) -> list[str]:
    """Every file of a checkpoint directory but its manifest, as sorted relative paths."""
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def staging_path(target: Path) -> Path:
    """A fresh sibling of ``target`` to write a checkpoint into (its name does not end in ``.ckpt``, so Lightning's
    search for ``last*.ckpt`` never picks it)."""
    return target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:16]}")


def _write_manifest(path: Path, files: dict[str, dict], step: Any) -> None:
    manifest = {"format": _MANIFEST_FORMAT, "checkpoint_id": uuid.uuid4().hex, "step": step, "files": files}
    part = path / (MANIFEST_FILE + ".part")
    with open(part, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path / MANIFEST_FILE)


def _fsync_dir(path: Path) -> None:
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing directory entries atomically (Linux ``renameat2(RENAME_EXCHANGE)``), so the target of a save
    is never missing, not even for an instant; False where the system or filesystem cannot (two renames then)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without renameat2 (glibc < 2.28)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):  # not supported here
        return False
    raise OSError(code, os.strerror(code), str(b))


def leftovers(target: Path) -> list[Path]:
    """Staging (``.tmp-``) and replaced (``.old-``) directories of ``target`` that earlier saves left behind."""
    if not target.parent.is_dir():
        return []
    prefixes = (f"{target.name}.tmp-", f"{target.name}.old-")
    return [p for p in target.parent.iterdir() if p.name.startswith(prefixes)]


def commit(staging: Path, target: Path, step: Any) -> None:
    """Called on every rank once it has written its files into ``staging``: hash them (each rank a share), write
    the manifest (rank 0, last) and move ``staging`` to ``target``. Steps and what a crash after each leaves:
    manifest written (old ``target`` intact); ``staging`` and an existing ``target`` exchanged atomically (new
    ``target``; the old one, now under the staging name, is deleted next). Where the filesystem cannot exchange:
    old target renamed to ``<name>.old-<id>`` (``target`` missing, :func:`resolve` finds the complete staging
    directory); new renamed in (done; ``.old-`` deleted next). A failure on any rank raises on every rank."""
    _reached("written")
    rank, world = _rank_world()
    gather_objects(None)  # every rank has written its files
    digests: dict[str, dict] = {}
    error = None
    try:
        files = _listing(staging)
        digests = {f: _digest(staging / f) for f in files[rank::world]}
    except OSError as err:
        error = f"{type(err).__name__}: {err}"
    gathered = gather_objects((digests, error))
    error = None
    if rank == 0:
        try:
            if errors := [e for _, e in gathered if e]:
                raise OSError(errors[0])
            merged = {f: d for part, _ in gathered for f, d in part.items()}
            if sorted(merged) != files:
                raise OSError(f"the ranks saw different files in {staging} (is it on a filesystem all ranks share?)")
            _write_manifest(staging, merged, step)
            _fsync_dir(staging)
            _reached("manifest")
            if (target.exists() or target.is_symlink()) and _exchange(staging, target):
                _fsync_dir(target.parent)
                _reached("exchanged")  # target holds the new checkpoint, staging the old one (removed below)
            else:
                if target.exists() or target.is_symlink():
                    os.rename(target, target.with_name(f"{target.name}.old-{uuid.uuid4().hex[:16]}"))
                    _reached("moved_old")
                os.rename(staging, target)
                _fsync_dir(target.parent)
                _reached("moved_new")
            for stale in leftovers(target):  # the replaced checkpoint and leftovers of interrupted saves
                remove(stale)
        except Exception as err:  # reported on every rank below; nothing is cleaned up, as after a crash
            error = f"{type(err).__name__}: {err}"
    error = _broadcast(error)
    if error:
        raise RuntimeError(f"Saving checkpoint {target} failed: {error}. A checkpoint that was at {target} before is"
                           f" still there or, if the failure came between the renames, loadable from that path.")


def resolve(path: Path) -> Path:
    """``path``, or, if it is missing because a save stopped between renaming the old checkpoint away and the new
    one in, the complete directory (with a manifest) that save left: its staging directory, else the old one."""
    if path.exists() or path.is_symlink():
        return path
    found = [p for p in leftovers(path) if (p / MANIFEST_FILE).is_file()]
    found.sort(key=lambda p: (p.name.startswith(f"{path.name}.tmp-"), (p / MANIFEST_FILE).stat().st_mtime_ns))
    if found:
        warnings.warn(f"{path} is missing: a save into it was interrupted; loading the complete checkpoint it left in"
                      f" {found[-1]} (the next save to {path} cleans up).", stacklevel=2)
        return found[-1]
    return path


def write_manifest(path: str | os.PathLike) -> Path:
    """Write the manifest of a checkpoint directory saved before checkpoints had one (single process), so that it
    loads. It vouches for the files as they are now: only call it on a checkpoint you trust and know to be complete."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a DCP checkpoint directory (it has no .metadata file).")
    meta = safe_load(path / META_FILE, map_location="cpu") if (path / META_FILE).is_file() else {}
    _write_manifest(path, {f: _digest(path / f) for f in _listing(path)}, meta.get("global_step"))
    return path


class DamagedCheckpointError(ValueError):
    """A checkpoint directory whose files do not match its manifest (or that has none)."""


def _check_files(path: Path, rank: int, world: int) -> dict[str, Any]:
    if not path.is_dir() or not ((path / ".metadata").is_file() or (path / MANIFEST_FILE).is_file()):
        raise FileNotFoundError(
            f"{path} is not a lightning_3d checkpoint: expected a directory written by Compressed3DStrategy"
            f" (with .metadata, {META_FILE} and {MANIFEST_FILE}). Pass the checkpoint directory that ModelCheckpoint"
            f" or trainer.save_checkpoint created."
        )
    damaged = f"Checkpoint {path} is damaged"
    if not (path / MANIFEST_FILE).is_file():
        raise DamagedCheckpointError(
            f"{damaged} or unverifiable: it has no {MANIFEST_FILE} (the list of its files with checksums, written last"
            f" by every save since lightning_3d verifies checkpoints; a save that did not finish has none either). If"
            f" it is a complete checkpoint of an older lightning_3d that you trust, run"
            f" `python -c \"from lightning_3d.checkpoint.files import write_manifest; write_manifest('{path}')\"`"
            f" once."
        )
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        listed = manifest["files"]
        if manifest.get("format") != _MANIFEST_FORMAT or not isinstance(listed, dict):
            raise ValueError(f"format {manifest.get('format')!r}")
        for f, entry in listed.items():
            if not (isinstance(f, str) and isinstance(entry, dict) and {"size", "blake2b"} <= set(entry)):
                raise ValueError(f"entry {f!r}")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as err:
        raise DamagedCheckpointError(f"{damaged}: its {MANIFEST_FILE} is not a lightning_3d manifest ({err}).") from None
    present = _listing(path)
    if missing := sorted(set(listed) - set(present)):
        raise DamagedCheckpointError(f"{damaged}: files {missing[:5]} listed in its {MANIFEST_FILE} are missing"
                                     f"{f' (and {len(missing) - 5} more)' if len(missing) > 5 else ''}.")
    if unlisted := sorted(set(present) - set(listed)):
        raise DamagedCheckpointError(f"{damaged}: files {unlisted[:5]} are not part of it (not in its {MANIFEST_FILE});"
                                     f" they come from another save. Remove them or use another checkpoint.")
    for f in sorted(listed)[rank::world]:
        if (got := _digest(path / f)) != {k: listed[f][k] for k in ("size", "blake2b")}:
            raise DamagedCheckpointError(
                f"{damaged}: {f} does not match its {MANIFEST_FILE} (size {got['size']}, expected {listed[f]['size']};"
                f" checksum {'differs' if got['blake2b'] != listed[f]['blake2b'] else 'matches'}): it was altered,"
                f" truncated or comes from another checkpoint than step {manifest.get('step')}. Use another checkpoint."
            )
    check_dcp_metadata(path)
    return manifest


def verify(path: Path, collective: bool = True) -> dict[str, Any]:
    """Check every file of a checkpoint against its manifest and ``.metadata`` for planted objects; returns the
    manifest. ``collective``: every rank of the process group calls this, each checks a share of the files and all
    raise the same error for any mismatch; else this process checks everything alone."""
    rank, world = _rank_world() if collective else (0, 1)
    manifest, problem = None, None
    try:
        manifest = _check_files(path, rank, world)
    except (OSError, ValueError) as err:
        problem = (isinstance(err, FileNotFoundError) and not isinstance(err, DamagedCheckpointError), str(err))
    if problems := [p for p in (gather_objects(problem) if collective else [problem]) if p]:
        not_found, message = problems[0]
        raise (FileNotFoundError if not_found else DamagedCheckpointError)(message)
    return manifest


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
