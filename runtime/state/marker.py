"""The completion marker: a checkpoint counts once it is there, and says what every file must hold.

DCP writes one file per rank and a ``.metadata`` (a pickle). ``Writer`` is DCP's file writer that
also takes each file's sha256 on the rank that wrote it, and on the coordinator, once every rank's
write has returned and ``.metadata`` is written, adds ``partita-complete.json`` last (atomically):
the step, the fingerprint (runtime/state/fingerprint.py), the user's ``extra`` and the digest of
every file. A save a kill interrupted has no marker and is never used.

Loading reads the marker (JSON) first and checks every digest (``verify``: the files shared out
over the ranks) before anything is unpickled; ``Reader`` then unpickles ``.metadata`` allowing
only the classes DCP's metadata is made of, and ``Planner`` refuses DCP's pickled byte items, so a
checkpoint from elsewhere cannot run code. Every failure is one ``CheckpointError`` naming the
checkpoint and the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from partita.core.errors import PartitaError
from partita.runtime.state import fingerprint

COMPLETE = "partita-complete.json"  # written last, by the coordinator, once every rank's write has returned
FORMAT = 1  # the marker's format
METADATA = ".metadata"  # DCP's
# Written first, by the coordinator, before any rank writes: the folder is a save of partita's, even
# one a kill interrupted before its marker (runtime/state/periodic.py prunes only what is partita's)
STARTED = "partita-save-started"
_DIGESTS = "partita.digests"  # a write result that carries a rank's file digests to the coordinator
_CHUNK = 1 << 22


class CheckpointError(PartitaError):
    """A checkpoint could not be written, or is not one this model may load; the message names it."""


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class Writer(FileSystemWriter):
    """DCP's file writer, digesting what each rank wrote; the coordinator writes the marker last.

    ``record`` is the marker's content (step, extra, optimizer, the model's name order), used on
    the coordinator; ``local`` wraps this rank's own writing (the watchdog does not count it as a
    wait); ``on_complete(path)`` runs on the coordinator once the marker is written."""

    def __init__(self, path: Path, record: dict[str, Any], *, local: Callable[[], Any] = contextlib.nullcontext,
                 on_complete: Callable[[Path], None] | None = None) -> None:
        super().__init__(path, sync_files=True)
        self.record, self.local, self.on_complete = record, local, on_complete

    def prepare_local_plan(self, plan: Any) -> Any:
        with warnings.catch_warnings():  # an interrupted save at this step is written over: no warning
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
            return super().prepare_local_plan(plan)

    def write_data(self, plan: Any, planner: Any) -> Future:
        """This rank's items into one file, each as DCP writes it (``torch.save``'s format at an
        offset, so DCP's reader and ``dcp_to_torch_save`` read it), digested as it is written."""
        from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo

        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results, digest, offset = [], hashlib.sha256(), 0
        try:
            with self.local(), open(Path(self.path, name), "wb") as f:
                for item in plan.items:
                    with _serialized(planner.resolve_data(item)) as blob:
                        f.write(blob)
                        digest.update(blob)
                        results.append(WriteResult(index=item.index, size_in_bytes=blob.nbytes,
                                                   storage_data=_StorageInfo(name, offset, blob.nbytes)))
                        offset += blob.nbytes
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # a full disk, say: name the file
            raise CheckpointError(f"cannot write checkpoint {self.path}: {Path(self.path, name)}: "
                                  f"{e.strerror or e}", hint="free space on that file system, or keep fewer "
                                  "checkpoints (keep_last=)") from None
        results.append(WriteResult(index=MetadataIndex(_DIGESTS), size_in_bytes=0,
                                   storage_data={name: digest.hexdigest()}))
        out: Future = Future()
        out.set_result(results)
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        digests: dict[str, str] = {}
        for wr_list in results:
            for wr in wr_list:
                if wr.index.fqn == _DIGESTS:
                    digests.update(wr.storage_data)
        super().finish(metadata, [[wr for wr in wl if wr.index.fqn != _DIGESTS] for wl in results])
        digests[METADATA] = file_digest(Path(self.path, METADATA))
        saved = {k.removeprefix("model."): [list(md.size), fingerprint.dtype_name(md.properties.dtype)]
                 for k, md in metadata.state_dict_metadata.items()
                 if k.startswith("model.") and hasattr(md, "size")}
        record = dict(self.record)
        order = record.pop("order", [])
        marker = {"format": FORMAT, **record, "model": fingerprint.merged([saved], order), "files": digests}
        _write_atomically(Path(self.path, COMPLETE), json.dumps(marker))
        if self.on_complete is not None:
            self.on_complete(Path(self.path))


@contextlib.contextmanager
def _serialized(data: Any) -> Any:
    """One item's bytes as DCP stores them: a tensor ``torch.save``d (only its own elements, not a
    larger storage it views), a byte item as it is."""
    buf = data if isinstance(data, io.BytesIO) else io.BytesIO()
    if isinstance(data, torch.Tensor):
        t = data.detach().cpu()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        torch.save(t, buf)
    view = buf.getbuffer()
    try:
        yield view
    finally:
        view.release()


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)  # a reader sees the marker whole or not at all


def begin_save(path: Path) -> None:
    """The coordinator's first act of a save, before any rank writes: the folder is marked as
    partita's (``STARTED``), and a save over an existing checkpoint stops counting (its marker
    removed) until the new marker is there."""
    with contextlib.suppress(FileNotFoundError):
        Path(path, COMPLETE).unlink()
    Path(path).mkdir(parents=True, exist_ok=True)
    Path(path, STARTED).touch()


def read_marker(path: Path) -> dict[str, Any]:
    """The marker of the checkpoint at ``path``, or one ``CheckpointError`` saying why there is none."""
    path = Path(path)
    hint = "pass a directory written by save_checkpoint or checkpoint_dir= (a save that was interrupted has no marker)"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist" if not path.exists() else
                              f"checkpoint {path} is not a directory", hint=hint)
    try:
        text = Path(path, COMPLETE).read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete checkpoint: it has no {COMPLETE} (its save did not "
                              "finish, or it was not written by partita)", hint=hint) from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path / COMPLETE}: {e.strerror or e}", hint=hint) from e
    try:
        marker = json.loads(text)
        if not isinstance(marker, dict) or marker.get("format") != FORMAT or not isinstance(marker.get("files"), dict):
            raise ValueError(f"not a partita completion marker of format {FORMAT}")
    except ValueError as e:
        raise CheckpointError(f"{path / COMPLETE} is damaged: {e}", hint=hint) from None
    return marker


def verify(path: Path, marker: dict[str, Any]) -> None:
    """Check every file's digest against the marker, the files shared out over the ranks (a
    collective when a process group is up); one ``CheckpointError`` naming the first bad file."""
    files = sorted(marker["files"])
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    bad = []
    for name in files[rank::world]:
        f = Path(path, name)
        if Path(name).name != name:
            bad.append((name, "is not a file of the checkpoint's own directory"))
        elif not f.is_file():
            bad.append((name, "is missing"))
        else:
            try:
                if file_digest(f) != marker["files"][name]:
                    bad.append((name, "does not match the digest its completion marker recorded (it was changed "
                                "or cut short after it was written)"))
            except OSError as e:
                bad.append((name, f"cannot be read: {e.strerror or e}"))
    if world > 1:
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, bad)
        bad = sorted(sum(parts, []))
    if bad:
        name, why = bad[0]
        more = f" ({len(bad) - 1} other file{'s' if len(bad) > 2 else ''} too)" if len(bad) > 1 else ""
        raise CheckpointError(f"checkpoint {path} is damaged: {name} {why}{more}",
                              hint="load an older checkpoint (with checkpoint_dir= the run falls back to the newest "
                              "intact one by itself)")


# What DCP's .metadata is made of: nothing else is unpickled.
_METADATA_CLASSES = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                     torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint's metadata never holds")


class Reader(FileSystemReader):
    """DCP's file reader, unpickling ``.metadata`` (once) with only the classes DCP's metadata is
    made of."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._checked: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._checked is None:
            self._checked = self._read()
        self._checked.storage_meta.load_id = self.load_id
        return self._checked

    def _read(self) -> Metadata:
        path = Path(self.path, METADATA)
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e.strerror or e}", hint="pass an intact checkpoint") from e
        except Exception as e:  # (a pickle may raise anything: each is one message)
            raise CheckpointError(f"refusing {path}: {e}", hint="load only checkpoints partita wrote") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"refusing {path}: it holds a {type(metadata).__name__}, not DCP's metadata",
                                  hint="load only checkpoints partita wrote")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        return metadata


class Planner(DefaultLoadPlanner):
    """DCP's load planner, which refuses the pickled byte items DCP can hold (partita saves none)."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CheckpointError(f"refusing {read_item.dest_index.fqn}: a pickled object, which partita never saves",
                              hint="load only checkpoints partita wrote")
