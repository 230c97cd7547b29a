"""Where each record of a data file starts: the index a one-pass epoch over files reads by.

A TFRecord file is a sequence of records, each a 12-byte header (8-byte
little-endian length, 4-byte CRC), the data and a 4-byte CRC: the start of
record `i + 1` follows from record `i`'s header, so the index walks the
headers. A text file's records are its lines: each starts after a newline.
Both are read in blocks through `tf.io.gfile` (local paths, `gs://`, `ram://`;
1 MB blocks for TFRecord headers, 16 MB for text): a TFRecord record larger
than a block is skipped by seeking, so large records cost their headers only.

A compressed file (GZIP or ZLIB) cannot be entered at a record: its index is
its number of records only, counted by one whole, decompressing read through
TensorFlow's own reader (`TFRecordDataset`/`TextLineDataset` with the
pipeline's `compression_type`), so the count is what the workers' reader will
yield, quirks included (TensorFlow reads one ZLIB stream, gzip members on).

`index_files` indexes files in parallel and keeps each file's index in this
process, keyed by the path, size, modification time and compression: a file
that changed is indexed again. Given a cache folder (beside `kfit-ps run
--backup-dir`'s backups), it also keeps each index there, so a restarted
chief reads it instead of the files: a `.npz` file named by a hash of the key, holding the
key and the format's version, written under a temporary name and renamed
when complete.
"""

import concurrent.futures
import dataclasses
import functools
import hashlib
import io
import os
import struct
import threading
import time
import uuid

import numpy as np
import tensorflow as tf

TFRECORD, TEXT = "TFRecord", "text"
_BLOCK = 1 << 20
_HEADER = 12  # 8-byte length, 4-byte CRC of the length.
_FOOTER = 4  # CRC of the data.


_COUNTED_BATCH = 4096  # Records a compressed file's count adds up at once.
COMPRESSIONS = ("GZIP", "ZLIB")


@dataclasses.dataclass(frozen=True)
class FileIndex:
    """The records of one file: `offsets[i]` is where record `i` starts (bytes); a
    compressed file has `records` and no offsets (None): it is read from its start."""

    path: str
    size: int
    mtime_ns: int
    records: int
    offsets: np.ndarray = None  # int64, ascending; None for a compressed file
    compression: str = ""


_cache = {}
_cache_lock = threading.Lock()


def index_files(paths, kind, skip=0, threads=8, cache_dir=None, compression=""):
    """`(indexes, seconds)`: a `FileIndex` per path, in order, without each file's first
    `skip` records (a header line), and the time reading the files took (0 when every index
    was cached, here or in `cache_dir`). `compression`: the readers' `compression_type`
    ("", or one of `COMPRESSIONS`: each file's records are then counted, not found)."""
    start = time.monotonic()
    stats = [tf.io.gfile.stat(path) for path in paths]
    keys = [(kind, compression, path, stat.length, stat.mtime_nsec)
            for path, stat in zip(paths, stats)]
    with _cache_lock:
        missing = [key for key in dict.fromkeys(keys) if key not in _cache]
    stored = {key: _load(cache_dir, key) for key in missing} if cache_dir else {}
    with _cache_lock:
        _cache.update((key, offsets) for key, offsets in stored.items() if offsets is not None)
    missing = [key for key in missing if stored.get(key) is None]
    if missing:
        if compression:
            count = _record_counter(kind, compression)
            reader = lambda path, size: _count_records(count, path, kind, compression)  # noqa
        else:
            reader = _tfrecord_offsets if kind == TFRECORD else _line_offsets
        with concurrent.futures.ThreadPoolExecutor(min(threads, len(missing))) as pool:
            found = dict(zip(missing, pool.map(lambda key: reader(key[2], key[3]), missing)))
        with _cache_lock:
            _cache.update(found)
        for key, offsets in found.items():
            if cache_dir:
                _store(cache_dir, key, offsets)
    with _cache_lock:
        found = [_cache[key] for key in keys]
    indexes = [FileIndex(*key[2:], records=max(int(value) - skip, 0), compression=compression)
               if compression else FileIndex(*key[2:], records=len(value[skip:]),
                                             offsets=value[skip:])
               for key, value in zip(keys, found)]
    return indexes, (time.monotonic() - start if missing else 0.0)


@functools.lru_cache(maxsize=None)
def _record_counter(kind, compression):
    """A function of a file's path: its number of records, read whole (decompressed) by
    TensorFlow's own reader, in blocks of `_COUNTED_BATCH` records (one by one, tf.data
    spends 20x longer per record). Traced once per kind and compression."""
    read = tf.data.TFRecordDataset if kind == TFRECORD else tf.data.TextLineDataset

    @tf.function(input_signature=[tf.TensorSpec([], tf.string)])
    def count(path):
        records = read(path, compression_type=compression, buffer_size=_BLOCK)
        return records.batch(_COUNTED_BATCH).reduce(
            tf.constant(0, tf.int64), lambda total, block: total + tf.size(block, tf.int64))

    return count


def _count_records(count, path, kind, compression):
    """Records of the compressed file `path`, or a ValueError naming it."""
    try:
        return int(count(tf.constant(path)))
    except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as e:
        said = str(e).strip().splitlines()[0][:200]
        raise ValueError(
            f"{path} cannot be read as a {compression}-compressed {kind} file: TensorFlow says "
            f"{said!r}. Received: compression_type={compression!r}. Pass the compression "
            "its files were written with to the reader (`compression_type='GZIP'`, 'ZLIB' or "
            "'' for none), one per pipeline.") from None


def _tfrecord_offsets(path, size):
    """Record starts of the TFRecord file `path`, from its headers."""
    offsets = []
    with tf.io.gfile.GFile(path, "rb") as f:
        block, block_start, position = b"", 0, 0
        while position < size:
            if position + _HEADER > block_start + len(block):  # The header is not in `block`.
                f.seek(position)
                block, block_start = f.read(max(_BLOCK, _HEADER)), position
            if position + _HEADER > block_start + len(block):  # Fewer than 12 bytes left.
                break
            (length,) = struct.unpack_from("<Q", block, position - block_start)
            offsets.append(position)
            position += _HEADER + length + _FOOTER
        if position != size:
            raise ValueError(
                f"{path} is not a TFRecord file (or it is compressed, or truncated): its "
                f"record headers end at byte {position}, the file has {size} bytes. Received: "
                "compression_type='' (none). Pass the compression it was written with to the "
                "reader (`TFRecordDataset(files, compression_type='GZIP')`, or 'ZLIB').")
    return np.asarray(offsets, np.int64)


def _line_offsets(path, size):
    """Line starts of the text file `path`: 0 and each byte after a newline, before the end."""
    parts, position = [np.zeros(1 if size else 0, np.int64)], 0
    with tf.io.gfile.GFile(path, "rb") as f:
        while True:
            block = f.read(_BLOCK * 16)
            if not block:
                break
            newlines = np.flatnonzero(np.frombuffer(block, np.uint8) == ord("\n"))
            parts.append(newlines.astype(np.int64) + position + 1)
            position += len(block)
    starts = np.concatenate(parts)
    starts = starts[starts < size]
    if len(starts) and _only_carriage_returns(path, int(starts[-1])):
        starts = starts[:-1]  # TextLineDataset removes every "\r": that line is no record.
    return starts


def _only_carriage_returns(path, start):
    """Whether the bytes of `path` from `start` to its end are all "\r" (a last line
    without a newline that TextLineDataset skips)."""
    with tf.io.gfile.GFile(path, "rb") as f:
        f.seek(start)
        while True:
            chunk = f.read(4096)
            if not chunk:
                return True
            if chunk.strip(b"\r"):
                return False


_CACHE_VERSION = 3  # Bumped whenever indexing rules change: older files are not read.


def _cache_path(cache_dir, key):
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
    return os.path.join(cache_dir, f"{digest}.npz")


def _load(cache_dir, key):
    """The offsets (a compressed file's: its record count) stored for `key` in `cache_dir`,
    or None: the file stores the format's version and the whole key with them. Any failure
    to read is None (the cache only saves time: an unreadable file is indexed again)."""
    try:
        with tf.io.gfile.GFile(_cache_path(cache_dir, key), "rb") as f:
            stored = np.load(io.BytesIO(f.read()), allow_pickle=False)
            same = (int(stored["version"]) == _CACHE_VERSION
                    and str(stored["key"]) == repr(key))
            if not same:
                return None
            return int(stored["records"]) if "records" in stored.files else stored["offsets"]
    except Exception:  # noqa: BLE001 - missing, partial, empty, foreign: not a cached index
        return None


def _store(cache_dir, key, offsets):
    """Writes `offsets` (or a compressed file's record count) for `key` under a temporary
    name, then renames it: a reader finds a complete index or none. A failure (a full disk,
    no permission) is not the fit's: the index is then only in this process."""
    buffer = io.BytesIO()
    found = {"offsets": offsets} if isinstance(offsets, np.ndarray) else {
        "records": np.asarray(offsets, np.int64)}
    np.savez(buffer, version=np.asarray(_CACHE_VERSION), key=np.asarray(repr(key)), **found)
    path = _cache_path(cache_dir, key)
    partial = f"{path}.{uuid.uuid4().hex}.partial"
    try:
        tf.io.gfile.makedirs(cache_dir)
        with tf.io.gfile.GFile(partial, "wb") as f:
            f.write(buffer.getvalue())
        tf.io.gfile.rename(partial, path, overwrite=True)
    except (tf.errors.OpError, OSError):
        try:
            tf.io.gfile.remove(partial)
        except (tf.errors.OpError, OSError):
            pass
