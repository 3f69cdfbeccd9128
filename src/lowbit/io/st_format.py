"""The safetensors file format, read and written one tensor at a time.

The `safetensors` library writes a whole state dict at once and reads through a memory
map; both hold far more than one tensor in memory for a large shard. Checkpoint streaming
(lowbit.pipelines.tensorwise) needs memory bounded by the largest tensor, so this module speaks the
format directly. The format (https://github.com/huggingface/safetensors):
``u64 little-endian N | N bytes of JSON header | raw little-endian tensor bytes``;
the header maps each name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the end of the header) plus an optional ``"__metadata__"`` of
str -> str. Files written here are read back by the real library in the tests.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from typing import BinaryIO, Iterator

import torch

# safetensors dtype tag <-> torch dtype (the library's own table, written out so that
# reading a header needs no import of safetensors).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "U16": torch.uint16, "U32": torch.uint32,
    "U64": torch.uint64,
}
TAGS: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000  # the library's own limit; a larger value means a corrupt file
_COPY_CHUNK = 1 << 20

if sys.byteorder != "little":  # pragma: no cover - every supported machine is little-endian
    raise ImportError("lowbit.io.st_format writes raw tensor bytes and needs a little-endian host")


class CheckpointError(ValueError):
    """A checkpoint file or directory is missing, truncated or inconsistent."""


def _nbytes(dtype: torch.dtype, shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


def read_header(path: str | os.PathLike) -> tuple[dict, dict, int]:
    """Parse and validate a safetensors header.

    Returns ``(entries, metadata, data_start)``: entries maps tensor name to
    ``(dtype, shape, begin, end)`` with absolute byte offsets into the file. Raises
    CheckpointError naming the file when the header is malformed or the file is
    shorter than the header says (a truncated download or an interrupted write).
    """
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isfile(path):
        raise CheckpointError(f"{path} is not a regular file (a directory, device or pipe); give a .safetensors file")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short to be a safetensors file "
                                      "(truncated?); re-create or re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path}: header length {n} does not fit in the file's {size} bytes "
                                      "(truncated or not a safetensors file); re-create or re-download it")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    try:
        header = loads_strict(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e}); the file is corrupt") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is a JSON {type(header).__name__}, not an object; the file is corrupt")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings; the file is corrupt")
    data_start = 8 + n
    entries, spans = {}, []
    for name, info in header.items():
        dtype, shape, begin, end = _entry(path, name, info)
        entries[name] = (dtype, shape, data_start + begin, data_start + end)
        spans.append((begin, end, name))
    # the library's rule: the tensors tile the data section, no overlap and no gap
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            what = "overlaps the previous tensor" if begin < at else f"leaves a gap of {begin - at} bytes"
            raise CheckpointError(f"{path}: tensor {name!r} at data_offsets [{begin}, {end}] {what}; "
                                  "the header lies about the file's layout")
        at = end
    if data_start + at != size:
        how = "is truncated" if data_start + at > size else "has bytes after the last tensor"
        raise CheckpointError(f"{path}: header describes {at} data bytes but the file holds "
                              f"{size - data_start}; the file {how}, re-create or re-download it")
    return entries, metadata, data_start


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str | bytes):
    """json.loads that refuses NaN / Infinity (Python's json accepts them; JSON and every other
    reader of these files do not: a NaN scale or size must not slip in). Raises ValueError
    (or RecursionError for absurd nesting)."""
    return json.loads(text, parse_constant=_no_constant)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry(path: str, name: str, info) -> tuple[torch.dtype, list[int], int, int]:
    """One header entry, checked: (dtype, shape, begin, end) with offsets relative to the data."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise CheckpointError(f"{path}: header entry {name!r} must be an object with dtype, shape and "
                              f"data_offsets, got {str(info)[:120]}")
    tag, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(tag, str) or tag not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {str(tag)[:40]!r}, not one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{path}: tensor {name!r} has shape {str(shape)[:120]}; a shape is a list of "
                              "non-negative integers")
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs) and 0 <= offs[0] <= offs[1]):
        raise CheckpointError(f"{path}: tensor {name!r} has data_offsets {str(offs)[:120]}; they must be "
                              "[begin, end] with 0 <= begin <= end")
    dtype = DTYPES[tag]
    if offs[1] - offs[0] != _nbytes(dtype, shape):
        raise CheckpointError(f"{path}: tensor {name!r} has {offs[1] - offs[0]} bytes but dtype "
                              f"{tag} and shape {shape} need {_nbytes(dtype, shape)}")
    return dtype, list(shape), offs[0], offs[1]


class TensorReader:
    """Read tensors from one safetensors file one at a time, each into fresh memory.

    Nothing is memory-mapped, so after a tensor is dropped its memory is returned; peak
    memory is the tensor being read. Use as a context manager.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.entries, self.metadata, _ = read_header(self.path)
        self._f: BinaryIO | None = open(self.path, "rb")

    def keys(self) -> list[str]:
        return list(self.entries)

    def info(self, name: str) -> tuple[torch.dtype, list[int]]:
        dtype, shape, _, _ = self.entries[name]
        return dtype, list(shape)

    def span(self, name: str) -> tuple[int, int]:
        """[begin, end): absolute byte offsets of the tensor's data in the file (for ranged reads)."""
        if name not in self.entries:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        return self.entries[name][2], self.entries[name][3]

    def get(self, name: str) -> torch.Tensor:
        if name not in self.entries:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        dtype, shape, begin, end = self.entries[name]
        buf = torch.empty(end - begin, dtype=torch.uint8)
        self._f.seek(begin)
        got = self._f.readinto(memoryview(buf.numpy())) if end > begin else 0
        if got != end - begin:
            raise CheckpointError(f"{self.path}: short read of {name!r} ({got} of {end - begin} bytes)")
        return buf.view(dtype).reshape(shape) if buf.numel() else torch.empty(shape, dtype=dtype)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.entries:
            yield name, self.get(name)

    def close(self):
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a CPU tensor without a Python bytes copy."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return memoryview(t.view(torch.uint8).numpy())


class ShardedWriter:
    """Write tensors into safetensors shards of bounded size, each tensor's bytes going to
    disk as soon as it is added (the header is prepended when a shard closes).

    ``add(name, tensor)`` appends; when the open shard would exceed ``max_shard_bytes``
    it is closed first. ``finish()`` names the shards ``model.safetensors`` (one) or
    ``model-0000i-of-0000n.safetensors`` and writes ``model.safetensors.index.json``
    (Hugging Face's layout); it returns the list of file names. Memory use is one
    tensor plus a copy buffer of 1 MiB.
    """

    def __init__(self, directory: str | os.PathLike, max_shard_bytes: int = 5 << 30,
                 metadata: dict[str, str] | None = None, header_reserve: int = 0, tag: str = ""):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        if header_reserve < 0 or header_reserve % 8:
            raise ValueError(f"header_reserve={header_reserve}: give a non-negative multiple of 8 bytes")
        # header_reserve > 0: each shard file starts with that many bytes kept for its header, so
        # that finish() writes the header in place (padded with spaces, which the format allows)
        # instead of copying every byte of the shard behind a header; a header that does not
        # fit falls back to the copy. 0: the compact files of before (no padding).
        self.header_reserve = int(header_reserve)
        # tag: in the names of the shard files while they are written, so that several writers
        # can fill one directory at once (e.g. from two threads) and finish(*others) as one checkpoint
        if not tag.isalnum() and tag:
            raise ValueError(f"tag={tag!r}: letters and digits only")
        self.tag = tag
        self.dir = os.fspath(directory)
        self.max_shard_bytes = int(max_shard_bytes)
        self.metadata = {"format": "pt", **(metadata or {})}
        self._shards: list[tuple[str, dict]] = []  # (data file, header)
        self._names: set[str] = set()
        self._data = None
        self._header: dict = {}
        self._offset = 0
        self.total_bytes = 0

    def _open(self):
        path = os.path.join(self.dir, f".shard{self.tag}{len(self._shards):05d}.data")
        self._data = open(path, "wb")
        if self.header_reserve:
            self._data.write(b"\0" * (8 + self.header_reserve))
        self._header, self._offset = {}, 0
        self._shards.append((path, self._header))

    def add(self, name: str, tensor: torch.Tensor):
        if name in self._names:
            raise ValueError(f"tensor name {name!r} written twice")
        if tensor.dtype not in TAGS:
            raise TypeError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors encoding")
        nbytes = _nbytes(tensor.dtype, tensor.shape)
        if self._data is None or (self._offset and self._offset + nbytes > self.max_shard_bytes):
            self._close_data()
            self._open()
        if nbytes:
            self._data.write(_tensor_bytes(tensor))
        self._record(name, tensor.dtype, tensor.shape, nbytes)

    def add_from_file(self, name: str, dtype: torch.dtype, shape, src: str | os.PathLike, begin: int):
        """Append a tensor whose raw bytes are those of file `src` from offset `begin` (e.g. an
        input checkpoint's tensor, TensorReader.span), copied by the kernel (os.copy_file_range
        where available): the bytes never pass through Python memory."""
        if name in self._names:
            raise ValueError(f"tensor name {name!r} written twice")
        if dtype not in TAGS:
            raise TypeError(f"tensor {name!r}: dtype {dtype} has no safetensors encoding")
        nbytes = _nbytes(dtype, shape)
        if self._data is None or (self._offset and self._offset + nbytes > self.max_shard_bytes):
            self._close_data()
            self._open()
        self._data.flush()
        with open(src, "rb") as f:
            left, at = nbytes, begin
            fast = hasattr(os, "copy_file_range")
            while left:
                n = 0
                if fast:
                    try:
                        n = os.copy_file_range(f.fileno(), self._data.fileno(), min(left, 1 << 30), at)
                    except OSError:
                        fast = False       # e.g. across filesystems on old kernels: plain copy
                if not fast:
                    f.seek(at)
                    chunk = f.read(min(left, _COPY_CHUNK))
                    self._data.write(chunk)
                    self._data.flush()
                    n = len(chunk)
                if n <= 0:
                    raise CheckpointError(f"{src}: short read copying {name!r} ({nbytes - left} of {nbytes} bytes)")
                left, at = left - n, at + n
        self._data.seek(0, os.SEEK_END)   # the buffered file object's position after the kernel's writes
        self._record(name, dtype, shape, nbytes)

    def _record(self, name, dtype, shape, nbytes):
        self._header[name] = {"dtype": TAGS[dtype], "shape": list(shape),
                              "data_offsets": [self._offset, self._offset + nbytes]}
        self._offset += nbytes
        self.total_bytes += nbytes
        self._names.add(name)

    def _close_data(self):
        if self._data is not None:
            self._data.close()
            self._data = None

    def finish(self, *others: "ShardedWriter") -> list[str]:
        """Close the shards and name them (this writer's, then each of `others`', whose tensors
        were written into the same directory under other tags): one checkpoint, one index."""
        writers = (self, *others)
        for w in writers:
            w._close_data()
            if w.dir != self.dir or w.metadata != self.metadata:
                raise ValueError("finish(*others): the writers must share the directory and the metadata")
        shards = [(sh, w) for w in writers for sh in w._shards]
        if len({n for w in writers for n in w._names}) != sum(len(w._names) for w in writers):
            raise ValueError("finish(*others): a tensor name was written by two writers")
        if not shards:
            raise ValueError("no tensors were written; a checkpoint needs at least one")
        n = len(shards)
        names = (["model.safetensors"] if n == 1 else
                 [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        weight_map = {}
        for ((data_path, header), w), fname in zip(shards, names):
            blob = json.dumps({"__metadata__": self.metadata, **header}, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)  # the spec allows space padding; aligns the data
            if w.header_reserve and len(blob) <= w.header_reserve:
                # the header in the space kept for it: the data bytes are not copied
                blob += b" " * (w.header_reserve - len(blob))
                with open(data_path, "r+b") as out:
                    out.write(struct.pack("<Q", len(blob)))
                    out.write(blob)
                os.replace(data_path, os.path.join(self.dir, fname))
            else:
                with open(os.path.join(self.dir, fname), "wb") as out, open(data_path, "rb") as src:
                    out.write(struct.pack("<Q", len(blob)))
                    out.write(blob)
                    if w.header_reserve:      # it did not fit: skip the kept space
                        src.seek(8 + w.header_reserve)
                    shutil.copyfileobj(src, out, _COPY_CHUNK)
                os.remove(data_path)
            weight_map.update({k: fname for k in header})
        if n > 1:
            index = {"metadata": {"total_size": sum(w.total_bytes for w in writers)}, "weight_map": weight_map}
            with open(os.path.join(self.dir, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        return names


def checkpoint_files(directory: str | os.PathLike) -> dict[str, str]:
    """Map every tensor name in a checkpoint directory to its safetensors file.

    Reads ``model.safetensors.index.json`` when present (and checks that every file it
    names exists and holds exactly the tensors it lists), else the single
    ``*.safetensors`` file. Raises CheckpointError with the fix when anything is off.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory!r} does not exist")
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = loads_strict(f.read())["weight_map"]
        except (OSError, UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path} is unreadable or has no 'weight_map': {e}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: weight_map must map tensor names to file names")
        by_file: dict[str, set] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(fname, set()).add(name)
        for fname, names in by_file.items():
            path = _inside(directory, fname, index_path)
            if not os.path.exists(path):
                raise CheckpointError(f"{index_path} lists {fname} but the file is missing from {directory}")
            have = set(read_header(path)[0])
            if have != names:
                missing, extra = sorted(names - have)[:3], sorted(have - names)[:3]
                raise CheckpointError(f"{path} does not match {index_path}: missing {missing}, "
                                      f"unlisted {extra}; the index and the shards are out of step")
        return {name: _inside(directory, fname, index_path) for name, fname in weight_map.items()}
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{directory} holds no *.safetensors file (pickled .bin checkpoints "
                              "are not read: convert them with safetensors first)")
    if len(files) > 1:
        raise CheckpointError(f"{directory} holds {len(files)} safetensors files but no "
                              "model.safetensors.index.json saying which tensor lives where")
    path = _inside(directory, files[0], directory)
    return {name: path for name in read_header(path)[0]}


def _inside(directory: str, fname: str, where: str) -> str:
    """The path of shard `fname` of a checkpoint, refused unless it is a plain file name whose
    real path (symlinks resolved) lies in the directory: an index must not make lowbit read
    files elsewhere (``../``, absolute paths, links out)."""
    if not fname or fname != os.path.basename(fname) or fname in (".", "..") or "\\" in fname:
        raise CheckpointError(f"{where} names shard {fname!r}, which is not a file name inside the checkpoint "
                              "directory; an index may only name files next to it")
    path = os.path.join(directory, fname)
    real_dir = os.path.realpath(directory)
    if os.path.commonpath([os.path.realpath(path), real_dir]) != real_dir:
        raise CheckpointError(f"{path} is a link to {os.path.realpath(path)}, outside the checkpoint directory; "
                              "copy the file in instead of linking it")
    return path
