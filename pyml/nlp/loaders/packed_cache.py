"""The packed-weights cache: a model's load-time copies (core/derived.py) kept in one file, mapped.

A model file's weights are mapped, not read; but loading also derives arrays from them - the
x8 re-layout of the legacy quant types (quant/interleaved.py), the Q/K/V and gate/up
concatenations, GPT-2's transposed Conv1D matrices - and those were process memory, made
again on every load (SmolLM2 Q4_1: 0.25 s of CPU and ~95 MB of RSS no other process could share).
Here they are written once into `<cache>/packed/` (`<cache>` = PYML_CACHE or ~/.cache/pyml,
beside the models and Numba's kernels; PYML_PACKED_CACHE names another folder) and memory-mapped
read-only on every later load: no copy, and two processes on one model share the pages.

One cache file per model (the name: the model file's name and a hash of its resolved path and
the load options that change what is derived, e.g. --lm-head-quant). Layout:

    header  magic "PYMLPAK1" (8), index offset (u64), index length (u64), CRC-32 of the index (u32)
    arrays  each at a multiple of the mapping granularity (4096), in the order the build made them
    index   JSON: {"identity": {...}, "arrays": {key: [offset, dtype, shape, CRC-32 of its bytes]}}

`identity` is what the arrays were derived from: every model file's resolved path, size and
mtime (nanoseconds), the format and the packer's version (interleaved.LAYOUT_VERSION). A file
whose identity differs is re-packed; one whose header, index or sizes do not hold together
(truncated, corrupt, an array past the index or of another shape than the model asks for) is
named in one warning line and rebuilt, never read. The index is checked before any array is
looked at, and no size in it allocates anything: arrays are views of the mapping.

Nothing is mapped that this cache did not write: each array's CRC-32 is checked when a load first
asks for it (an array whose bytes changed since - a disk error, a stray write - is named in one
warning line and the file rebuilt; zlib.crc32 is the fastest checksum the standard library has,
about 1 GB/s; docs/reliability.md has the load-time cost). The index and the arrays are read
through one file descriptor, so a file swapped in between is never mapped under another's index.
A cache folder owned by another user or writable by others is not used at all (one warning line,
packing in memory): anyone who can write there could hand a load arrays of their choosing.

The first load writes the arrays straight into the new file (each filled through a shared
mapping of its own range, a slab at a time by the packer), which is renamed into place only once
the model is built: a crash or a concurrent load leaves no half-written cache behind. A
cache folder that cannot be written falls back to process memory, with one warning line.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
import struct
import zlib
from pathlib import Path

import numpy as np

from pyml.core import perf
from pyml.core.derived import InMemory
from pyml.nlp.loaders import hub
from pyml.nlp.loaders.gguf import SHARD_NAME
from pyml.quant import interleaved

_perf = perf.get("pyml.nlp.load")
MAGIC = b"PYMLPAK1"
HEADER = struct.Struct("<8sQQI")
ALIGN = mmap.ALLOCATIONGRANULARITY
FORMAT = 2  # 2: a CRC-32 per array
SUFFIX = ".pyml-packed"
MAX_INDEX_BYTES = 16 << 20  # a model's index is a few hundred entries: anything near this is corrupt
DTYPES = {"uint8", "uint16", "float16", "float32"}  # what a derived weight can be
_warned: set = set()  # each read-only folder is said once per process


class CacheError(Exception):
    """A cache file that cannot be used: the reason, in words (never shown as a traceback)."""


class Stale(CacheError):
    """A cache file made from another model file, packer or set of arrays: re-pack quietly."""


def folder() -> Path:
    """Where the packed-weights cache lives."""
    override = os.environ.get("PYML_PACKED_CACHE")
    return Path(override).expanduser() if override else hub.cache_dir() / "packed"


def identity(model_files: list[Path]) -> dict:
    """What the derived arrays depend on: the model files as they are now, and the packer."""
    files = []
    for path in model_files:
        st = os.stat(path)
        files.append([str(Path(path).resolve()), st.st_size, st.st_mtime_ns])
    return {"format": FORMAT, "packer": interleaved.LAYOUT_VERSION, "files": files}


def cache_path(model_files: list[Path], options: str = "") -> Path:
    """The cache file of a model (its first file names it) loaded with `options`."""
    first = Path(model_files[0]).resolve()
    # the format in the name too: pyml versions of two formats sharing a folder keep a file each
    digest = hashlib.sha256(f"{first}\0{options}\0{FORMAT}".encode()).hexdigest()[:16]
    return folder() / f"{first.name}.{digest}{SUFFIX}"


def read_index(path: Path) -> tuple[dict, int]:
    """(index, file size) of a cache file whose header and index hold together; CacheError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CacheError(f"unreadable ({e.strerror or e})") from None
    try:
        return read_index_from(fd)
    finally:
        os.close(fd)


def read_index_from(fd: int) -> tuple[dict, int]:
    """read_index of an open file: the one descriptor its arrays are then mapped from."""
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, HEADER.size, 0)
        if len(head) < HEADER.size:
            raise CacheError(f"truncated ({size} bytes, the header alone is {HEADER.size})")
        magic, offset, length, crc = HEADER.unpack(head)
        if magic != MAGIC:
            raise CacheError(f"not a packed-weights cache file (magic {magic!r})")
        if not (HEADER.size <= offset and length <= MAX_INDEX_BYTES and offset + length == size):
            raise CacheError(f"truncated or corrupt: the header puts a {length}-byte index at {offset} "
                             f"in a {size}-byte file")
        raw = os.pread(fd, length, offset)
    except OSError as e:
        raise CacheError(f"unreadable ({e.strerror or e})") from None
    if zlib.crc32(raw) != crc:
        raise CacheError("corrupt: the index does not match its checksum")
    try:
        index = json.loads(raw)
        if index["identity"]["format"] != FORMAT:
            raise Stale(f"written in cache format {index['identity']['format']}, this pyml writes {FORMAT}")
        for key, entry in index["arrays"].items():
            _check_entry(key, *entry, offset)
    except CacheError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CacheError(f"corrupt index ({type(e).__name__}: {e})") from None
    return index, size


def _check_entry(key, at, dtype, shape, crc, data_end: int) -> None:
    if not (isinstance(key, str) and isinstance(at, int) and dtype in DTYPES and isinstance(shape, list)
            and all(isinstance(n, int) and 0 <= n < 1 << 40 for n in shape) and isinstance(crc, int)):
        raise CacheError(f"corrupt index entry {key!r}")
    nbytes = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
    if at % ALIGN or at < HEADER.size or at + nbytes > data_end:
        raise CacheError(f"corrupt index: array {key!r} ({nbytes} bytes at {at}) lies outside the data")


def folder_refused(where: Path) -> str | None:
    """Why the cache folder must not be used (None if it may): a folder another user owns, or one
    others can write to, could hold arrays this user's loads did not write."""
    try:
        st = os.stat(where)
    except FileNotFoundError:
        return None
    except OSError as e:
        return e.strerror or str(e)
    if st.st_uid != os.getuid():
        return f"owned by another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by others (mode {stat.S_IMODE(st.st_mode):04o}; chmod go-w makes it usable)"
    return None


def _file_refused(fd: int) -> str | None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "owned by another user or writable by others"
    return None


def _damaged(index: dict, fd: int) -> str | None:
    """The first array whose bytes differ from its checksum (the reason, in words), else None."""
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
        for key, (at, dtype, shape, crc) in index["arrays"].items():
            if _crc(mapped, at, dtype, shape) != crc:
                return f"array {key!r} does not match its checksum (changed since it was written)"
    return None


def _crc(mapped, at: int, dtype: str, shape) -> int:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return zlib.crc32(memoryview(mapped)[at:at + nbytes]) if nbytes else 0


class Reader:
    """A valid cache file, mapped read-only: every derived array is a view of it, its checksum
    checked the first time a load asks for it."""

    def __init__(self, path: Path, index: dict, fd: int):
        self.path, self.arrays = path, index["arrays"]
        self.uncached = set(index.get("uncached") or ())  # names that were not unique: made in memory
        self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # the descriptor the index was read from
        self._verified: set = set()

    def array(self, key, shape, dtype, fill):
        if not key or key in self.uncached:
            return InMemory().array(key, shape, dtype, fill)
        found = self.lookup(key, shape, dtype)
        if found is None:  # the model asks for what the file does not hold: it was made otherwise
            raise Stale(f"it holds no {key!r} of shape {list(shape)} {dtype}")
        return found

    def lookup(self, key, shape, dtype):
        entry = self.arrays.get(key)
        if entry is None or entry[1] != dtype.name or tuple(entry[2]) != shape:
            return None
        if key not in self._verified:
            with _perf.debug("packed_cache::verify", "{} bytes", int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
                             op="load"):
                if _crc(self._map, *entry[:3]) != entry[3]:
                    raise Stale(f"array {key!r} does not match its checksum (changed since it was written)")
            self._verified.add(key)
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:
            view = np.empty(shape, dtype)
            view.flags.writeable = False
            return view
        return np.frombuffer(self._map, dtype, count, entry[0]).reshape(shape)


class Writer:
    """A new cache file being filled: each array gets a range of it, mapped shared and writable
    while `fill` writes it (the cache's pages are the array's: no second copy); `commit` adds the
    index and renames the file into place."""

    def __init__(self, path: Path, ident: dict):
        self.path, self.identity, self.arrays = path, ident, {}
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # 0700: a umask of 002 would make it group-writable
        self._tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        self._file = open(self._tmp, "w+b")
        os.fchmod(self._file.fileno(), 0o600)  # not group-writable whatever the umask: loads refuse such files
        self._file.write(b"\0" * HEADER.size)
        self._end = ALIGN
        self._memory = InMemory()
        self.failed: OSError | None = None
        self.uncached: set = set()

    def array(self, key, shape, dtype, fill):
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if key in self.arrays or key in self.uncached:  # two arrays asked for under one name: keep neither,
            self.arrays.pop(key, None)                 # a later load would hand the first out for both
            self.uncached.add(key)
            return self._memory.array(None, shape, dtype, fill)
        if not key or self.failed or not nbytes:
            out = self._memory.array(key, shape, dtype, fill)
            if key and not self.failed:
                self.arrays[key] = [self._end, dtype.name, list(shape), 0]
            return out
        at = self._end
        try:  # reserved for real, so a full disk is an OSError here and not a SIGBUS in fill
            os.posix_fallocate(self._file.fileno(), at, nbytes)
            region = mmap.mmap(self._file.fileno(), nbytes, offset=at)
        except OSError as e:  # the model still loads, from memory; commit() says why once
            self.failed = e
            return self._memory.array(key, shape, dtype, fill)
        out = np.frombuffer(region, dtype).reshape(shape)
        fill(out)
        out.flags.writeable = False
        self.arrays[key] = [at, dtype.name, list(shape), zlib.crc32(region)]
        self._end = -(-(at + nbytes) // ALIGN) * ALIGN
        return out

    def lookup(self, key, shape, dtype):
        return None

    def commit(self) -> None:
        """Index, header, rename: the file is whole before anyone can open it. A failure (a full
        disk) leaves no file and one warning line; the loaded model does not depend on it."""
        try:
            if self.failed:
                raise self.failed
            index = json.dumps({"identity": self.identity, "arrays": self.arrays,
                                "uncached": sorted(self.uncached)}).encode()
            f = self._file
            f.truncate(self._end)
            f.seek(self._end)
            f.write(index)
            f.seek(0)
            f.write(HEADER.pack(MAGIC, self._end, len(index), zlib.crc32(index)))
            f.close()
            os.replace(self._tmp, self.path)
        except OSError as e:
            _perf.logger.warning("packed-weights cache %s not kept (%s): this load packed in memory",
                                 self.path, e.strerror or e)
            self.abort()

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


def model_files(source: Path) -> list[Path]:
    """The files a model is read from: a GGUF and the other shards of a split one, or a Hugging
    Face directory's config.json and safetensors files."""
    source = Path(source)
    if source.is_dir():
        return sorted(p for p in source.iterdir() if p.suffix == ".safetensors" or p.name == "config.json")
    shard = SHARD_NAME.match(source.name)
    if not shard:
        return [source]
    count = int(shard["count"])
    names = [source.with_name(f"{shard['prefix']}-{no:05d}-of-{count:05d}.gguf") for no in range(1, count + 1)]
    return [source] + [p for p in names if p != source and p.exists()]


def open_for(model_files: list[Path], options: str = "", reuse: bool = True):
    """The provider for one load: a Reader of a valid cache file (unless not `reuse`), else a Writer
    of a new one, else (a folder that cannot be written, or must not be used) process memory, said
    in one warning line."""
    path = cache_path(model_files, options)
    refused = folder_refused(path.parent)
    if refused:
        return _in_memory(path.parent, refused, "not used")
    ident = identity(model_files)
    if reuse and path.exists():
        try:
            return _reader(path, ident)
        except Stale as e:
            _perf.logger.debug("packed-weights cache %s: %s; re-packing", path, e)
        except CacheError as e:
            _perf.logger.warning("packed-weights cache %s: %s; rebuilding it", path, e)
    try:
        writer = Writer(path, ident)
    except OSError as e:
        return _in_memory(path.parent, e.strerror or str(e), "cannot be written")
    refused = folder_refused(path.parent)  # the folder as Writer made it (or found it, just now)
    if refused:
        writer.abort()
        return _in_memory(path.parent, refused, "not used")
    return writer


def _reader(path: Path, ident: dict) -> Reader:
    """A Reader of the cache file at `path`, its index and arrays read through one descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise CacheError(f"unreadable ({e.strerror or e})") from None
    try:
        refused = _file_refused(fd)
        if refused:
            raise CacheError(refused)
        index, _ = read_index_from(fd)
        if index["identity"] != ident:
            raise Stale("made from another model file or packer version")
        return Reader(path, index, fd)
    finally:
        os.close(fd)  # the mapping holds the file open on its own


def _in_memory(where: Path, why: str, what: str) -> InMemory:
    if str(where) not in _warned:
        _warned.add(str(where))
        _perf.logger.warning("packed-weights cache %s %s (%s): packing in memory", where, what, why)
    return InMemory()


def entries() -> list[dict]:
    """Every file in the cache folder: path, bytes, the model it was made from, and whether it is
    current (its model file unchanged, this packer, every array as written: each is checksummed,
    so this reads the whole cache) or why not."""
    out = []
    refused = folder_refused(folder())
    for path in sorted(folder().glob(f"*{SUFFIX}")) if folder().is_dir() else []:
        entry = {"path": path, "bytes": path.stat().st_size, "model": None, "state": "current"}
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                index, _ = read_index_from(fd)
                files = [Path(f[0]) for f in index["identity"]["files"]]
                entry["model"] = str(files[0])
                if refused or (refused := _file_refused(fd)):
                    entry["state"] = f"not used ({refused})"
                elif not all(f.exists() for f in files):
                    entry["state"] = "model file gone"
                elif index["identity"] != identity(files):
                    entry["state"] = "stale (model file or packer changed)"
                elif damaged := _damaged(index, fd):
                    entry["state"] = f"damaged ({damaged}): the next load rebuilds it"
            finally:
                os.close(fd)
        except Stale as e:
            entry["state"] = f"stale ({e})"
        except (CacheError, KeyError, TypeError, IndexError, OSError) as e:
            entry["state"] = f"unusable ({e})"
        out.append(entry)
    return out


def clear() -> tuple[int, int]:
    """Delete every cache file (and any left-over temporary); (files, bytes) freed. A process that
    has one mapped keeps reading it: the pages go when it exits."""
    files = freed = 0
    if folder().is_dir():
        for path in list(folder().glob(f"*{SUFFIX}")) + list(folder().glob(f"*{SUFFIX}.*.tmp")):
            freed += path.stat().st_size
            path.unlink()
            files += 1
    return files, freed
