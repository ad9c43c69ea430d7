"""The trainer's checkpoints: a folder distca owns, holding tensors in a form that cannot run code.

    DIR/distca_train.json   the header: the format name and version, what run it continues (checked
                            on --resume: steps done, backends, ranks, context, model, and the data:
                            the --data file's content fingerprint, or the synthetic workload and
                            seed) and a table of the tensors (name, dtype, shape, byte offset) with
                            state.bin's size and SHA-256
    DIR/state.bin           the tensors' bytes, end to end (little-endian, C order)

Versions: 3 names --data by its content (distca.torch.train.data.Documents.fingerprint, agreed by every
rank after reading); 2 named it by its path, so a resume on a rewritten file went unnoticed; 1 was
torch.distributed.checkpoint. A reader refuses every version but its own, saying why.

Why not torch.distributed.checkpoint or torch.save: both unpickle on load (DCP's `.metadata`, a
pickle; torch.load's restricted unpickler is still an unpickler), so a crafted checkpoint could run
code on --resume. This format is JSON plus raw bytes: loading parses numbers and copies bytes, and
nothing in it is ever executed. The model is replicated under DDP, so rank 0 writes the one copy.

Ownership (the CLI's rules, src/core/file.cc, for a folder): --checkpoint DIR replaces DIR only
when DIR is absent, an empty folder, or a checkpoint of this trainer holding nothing but the two
files above; never a folder with anything else in it, the working folder or one above it, a folder
holding the --data file, or one inside or around the --resume checkpoint (the resumed folder itself
may be the output: it is read whole before the first step and replaced only by a complete newer
checkpoint, as `distca train --resume F --checkpoint F` does). A save writes a new, uniquely named
folder beside DIR, renames the old checkpoint aside under another unique name, renames the new one
into place, then deletes the old one's two files and its folder: no folder of the user's is ever
renamed or deleted, whatever its name.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import uuid
from pathlib import Path
from typing import Optional

import numpy as np
import torch

META = "distca_train.json"
DATA = "state.bin"
FORMAT = "distca-torch-train-checkpoint"
VERSION = 3
# Why a reader of VERSION refuses the versions before it.
_OLD_VERSIONS = {
    1: "version 1 was torch.distributed.checkpoint, whose pickled metadata could run code on load",
    2: "version 2 named the --data file by its path, so a resume on a rewritten file went unnoticed; version 3 "
       "names it by its content",
}
OWN_FILES = frozenset({META, DATA})
MAX_META_BYTES = 64 << 20          # the header: names and shapes, far below this for any model here

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32}
_NAMES = {v: k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written here: one line naming the path."""


# ---------------------------------------------------------------------------------------------
# Ownership


def _entries(path: Path) -> list:
    try:
        return sorted(os.listdir(path))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot list the folder ({e.strerror})") from None


def is_own_checkpoint(path: Path) -> bool:
    """A folder holding only this trainer's two files, with a header of this format (any version)."""
    names = _entries(path)
    if not names or not set(names) <= OWN_FILES or META not in names:
        return False
    try:
        with open(path / META, "rb") as f:
            head = json.loads(f.read(MAX_META_BYTES))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(head, dict) and head.get("format") == FORMAT


def _inside(inner: Path, outer: Path) -> bool:
    return inner != outer and outer in inner.parents


def probe_folder(flag: str, path: str, folder: Path, error: type) -> None:
    """`error` unless a file can be made in `folder` (made and removed at once, under a unique
    name): permissions alone do not tell, for root on a read-only or virtual file system."""
    probe = folder / f".distca-probe-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise error(f"{flag} {path}: cannot write in the folder {folder} ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)


def check_output_folder(flag: str, path: str, inputs: dict) -> None:
    """CheckpointError unless `path` may become a checkpoint folder (see the module docstring).
    inputs: {flag: path} of the run's inputs (--data, --resume), None where not given."""
    if not path:
        raise CheckpointError(f"{flag} needs a folder name")
    target = Path(os.path.abspath(path))
    resolved = target.resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or _inside(cwd, resolved):
        raise CheckpointError(f"{flag} {path}: is the working folder or one above it; give a folder of its own")
    if os.path.lexists(target) and not target.is_dir():
        raise CheckpointError(f"{flag} {path}: a file is there; a checkpoint is a folder")
    parent = resolved.parent
    if not parent.is_dir():
        raise CheckpointError(f"{flag} {path}: the folder {parent} does not exist (create it first)")
    probe_folder(flag, path, parent, CheckpointError)
    for in_flag, source in inputs.items():
        if not source:
            continue
        src = Path(os.path.abspath(source)).resolve()
        if in_flag == "--resume" and src == resolved:
            continue                      # continuing in place: read whole first, replaced when complete
        if src == resolved or _inside(src, resolved):
            raise CheckpointError(f"{flag} {path}: holds the {in_flag} input {source}, which a save would delete; "
                                  f"write the checkpoint elsewhere")
        if _inside(resolved, src):
            raise CheckpointError(f"{flag} {path}: lies inside the {in_flag} folder {source}; write it elsewhere")
    if target.is_dir():
        names = _entries(resolved)
        if names and not is_own_checkpoint(resolved):
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise CheckpointError(f"{flag} {path}: a folder this trainer did not make is there (it holds {shown}); "
                                  f"give a new or empty folder, or a checkpoint of this trainer to replace")
        if not os.access(resolved, os.W_OK | os.X_OK):
            raise CheckpointError(f"{flag} {path}: the folder is not writable")


# ---------------------------------------------------------------------------------------------
# Tensors to and from the folder


def _as_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _remove_stale_scratch(parent: Path, name: str) -> None:
    """Scratch folders of an earlier save of this checkpoint that was interrupted (Ctrl-C, a kill):
    named as only a save names them and holding only this trainer's files, so they are ours."""
    pattern = re.compile(rf"\.{re.escape(name)}\.distca-(new|old)-[0-9a-f]{{12}}")
    for entry in os.scandir(parent):
        if not pattern.fullmatch(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        folder = Path(entry.path)
        names = set(_entries(folder))
        if names <= OWN_FILES:
            for own in names:
                os.unlink(folder / own)
            os.rmdir(folder)


def save(path: str, header: dict, tensors: dict) -> None:
    """Writes header + tensors as a checkpoint folder at `path` (checked with check_output_folder
    before the run; checked again here, since the folder may have changed during training)."""
    target = Path(os.path.abspath(path)).resolve() if os.path.lexists(path) else Path(os.path.abspath(path))
    parent = target.parent
    if target.is_dir() and _entries(target) and not is_own_checkpoint(target):
        raise CheckpointError(f"{path}: the folder no longer holds only a checkpoint of this trainer; nothing was "
                              f"replaced")
    _remove_stale_scratch(parent, target.name)
    new = parent / f".{target.name}.distca-new-{uuid.uuid4().hex[:12]}"
    os.mkdir(new)                          # fails if it exists: never a folder of the user's
    try:
        _write(new, header, tensors)
    except BaseException:
        # A full disk, a failed write, Ctrl-C: the scratch goes, the old checkpoint stays as it was.
        _remove_own_folder(new)
        raise
    old: Optional[Path] = None
    # Ctrl-C waits for both renames: between them no checkpoint is at `path`.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        if target.is_dir():
            old = parent / f".{target.name}.distca-old-{uuid.uuid4().hex[:12]}"
            os.rename(target, old)
        try:
            os.rename(new, target)
        except OSError:
            if old is not None:            # put the old checkpoint back where it was
                os.rename(old, target)
            _remove_own_folder(new)
            raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    if old is not None:                    # ours: only our two files (checked above), or empty
        _remove_own_folder(old)


def _write(folder: Path, header: dict, tensors: dict) -> None:
    """The tensors' bytes and the header into `folder` (a save's scratch), each synced to disk."""
    table, digest, offset = [], hashlib.sha256(), 0
    with open(folder / DATA, "wb") as f:
        for name, t in tensors.items():
            if t.dtype not in _NAMES:
                raise CheckpointError(f"{name}: dtype {t.dtype} is not one a checkpoint holds")
            data = _as_bytes(t)
            f.write(data)
            digest.update(data)
            table.append({"name": name, "dtype": _NAMES[t.dtype], "shape": list(t.shape), "offset": offset})
            offset += len(data)
        f.flush()
        os.fsync(f.fileno())
    doc = dict(header, format=FORMAT, version=VERSION,
               tensors={"file": DATA, "bytes": offset, "sha256": digest.hexdigest(), "entries": table})
    with open(folder / META, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _remove_own_folder(folder: Path) -> None:
    """A folder a save made: its files of ours, then the folder (left where anything else is in it)."""
    for name in OWN_FILES:
        if (folder / name).exists():
            os.unlink(folder / name)
    try:
        os.rmdir(folder)
    except OSError:
        pass


def read_header(path: str) -> dict:
    """The header of the checkpoint folder `path` (CheckpointError naming what is wrong)."""
    meta = Path(path) / META
    try:
        with open(meta, "rb") as f:
            raw = f.read(MAX_META_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"{meta}: cannot read the checkpoint header ({e.strerror})") from None
    if len(raw) > MAX_META_BYTES:
        raise CheckpointError(f"{meta}: over {MAX_META_BYTES >> 20} MiB; not a header of this trainer")
    try:
        head = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{meta}: not JSON ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise CheckpointError(f"{meta}: not a {FORMAT} header")
    version = head.get("version")
    if version != VERSION:
        why = _OLD_VERSIONS.get(version, "") if isinstance(version, int) and not isinstance(version, bool) else ""
        raise CheckpointError(f"{meta}: version {version!r}; this trainer reads version {VERSION}"
                              f"{f' ({why})' if why else ''}: retrain, or resume with the distca that wrote it")
    return head


def _bad(meta: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{meta}: {what}")


def load(path: str, head: dict) -> dict:
    """The tensors of the checkpoint folder `path` whose header is `head` -> {name: tensor}.
    Every field is checked (types, bounds, the data's size and SHA-256) before a byte is used."""
    meta = Path(path) / META
    spec = head.get("tensors")
    if not isinstance(spec, dict) or spec.get("file") != DATA:
        raise _bad(meta, f'field "tensors" must name the file {DATA}')
    size, want_sha, entries = spec.get("bytes"), spec.get("sha256"), spec.get("entries")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not isinstance(want_sha, str) \
            or not isinstance(entries, list):
        raise _bad(meta, 'field "tensors" needs "bytes" (an integer), "sha256" and "entries" (a list)')
    data_path = Path(path) / DATA
    try:
        actual = os.stat(data_path).st_size
    except OSError as e:
        raise CheckpointError(f"{data_path}: cannot read ({e.strerror})") from None
    if actual != size:
        raise CheckpointError(f"{data_path}: {actual} bytes, the header says {size} (truncated or replaced?)")
    blob = np.fromfile(data_path, dtype=np.uint8) if size else np.zeros(0, np.uint8)
    if hashlib.sha256(blob.data).hexdigest() != want_sha:
        raise CheckpointError(f"{data_path}: its SHA-256 differs from the header's (corrupted or replaced)")
    out: dict = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) != {"name", "dtype", "shape", "offset"}:
            raise _bad(meta, f"tensor entry {i} must have exactly name, dtype, shape and offset")
        name, dtype, shape, offset = entry["name"], entry["dtype"], entry["shape"], entry["offset"]
        if not isinstance(name, str) or name in out:
            raise _bad(meta, f"tensor entry {i}: the name must be a string not used before")
        if dtype not in _DTYPES:
            raise _bad(meta, f"tensor {name}: dtype {str(dtype)[:40]!r} is not one of {', '.join(_DTYPES)}")
        if not isinstance(shape, list) or len(shape) > 8 or \
                any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < (1 << 40) for n in shape):
            raise _bad(meta, f"tensor {name}: the shape must be a list of at most 8 integers >= 0")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise _bad(meta, f"tensor {name}: the offset must be an integer >= 0")
        itemsize = torch.empty((), dtype=_DTYPES[dtype]).element_size()
        nbytes = int(np.prod(shape, dtype=np.float64)) * itemsize if shape else itemsize
        if offset + nbytes > size:
            raise _bad(meta, f"tensor {name}: bytes {offset}..{offset + nbytes} lie past the data's {size}")
        raw = torch.from_numpy(blob[offset:offset + nbytes].copy())
        out[name] = raw.view(_DTYPES[dtype]).reshape(shape)
    return out
