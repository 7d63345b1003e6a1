"""The index of an OCDBT database, read without TensorStore.

A step's arrays sit in an OCDBT database (`_store.py`): a manifest (`manifest.ocdbt`)
that points at the root of a B+tree, whose leaves hold each key's value inline or as
a byte range of a data file (`d/<hex>`). The format is TensorStore's, documented in
its `kvstore/ocdbt/index.rst`. TensorStore reads it, but importing TensorStore takes
~0.5 s (its import of ml_dtypes), which was all of `jax-cb-ckpt verify`'s start, and
it reads a bucket's index node by node. This module reads the index of the databases
the writer writes (manifest and nodes uncompressed, `_store._OCDBT_CONFIG`) with the
standard library alone, from a local folder (`Folder`) or from a bucket step's bytes
read at once (`Held`, `_bucket.BucketChunks.index`).

What it does not read it says (`Unsupported`: a database whose nodes are compressed, as
Orbax's are and this package's were before 2026-12-04, a numbered manifest, a node
reached twice, an index too large to hold), and the caller reads it with TensorStore,
which looks keys up one by one. What is not what the format says (a cut or flipped
file, a node that points outside its file or out of its parent's key range, keys out of
order or too long, more nodes or keys than the manifest counts, a file that is not a
regular file) is `Damaged`, found before anything is allocated on its claim: every
length is checked against the file's size, every node's CRC-32C against its footer,
every count against the bytes that hold it, and the walk reads each node once and at
most the bytes of B-tree the manifest counts. A data file table (the manifest's, each
node's) whose paths would expand past what any writer's do (`Inflated`: paths sharing
long prefixes, 5 bytes each on disk, up to 64 KiB each in memory) is damage too, found
from its lengths before a path is built, and never left to TensorStore, whose reader
would expand it as well.

Blocks the calling thread while it reads; nothing runs in the background.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import struct
from typing import Protocol

MANIFEST = "manifest.ocdbt"

_MANIFEST_MAGIC = 0x0CDB3A2A
_BTREE_MAGIC = 0x0CDB20DE
# A node or manifest larger than this is read by TensorStore (ours are a few KiB: the
# index of 10,000 leaves is ~1 MiB).
_MAX_NODE_BYTES = 64 << 20
_MAX_HEIGHT = 32  # B+tree heights are ~log_1024(keys): 3 covers a billion keys
_MAX_KEY_BYTES = 65535  # the format's own limit on keys and data file paths
# A larger index is read by TensorStore, which looks keys up one by one (ours: ~1 MiB
# and ~100 bytes of keys per 10,000 leaves).
_MAX_TREE_BYTES = 64 << 20
# What a walk may build, checked before anything of it is built: the bytes of every key
# it expands (a node's prefix-compressed keys included), and the entries of every node
# (each a few Python objects, ~250 bytes with its value: 2**17 entries are ~32 MiB,
# the keys of ~60,000 leaves). A larger index is TensorStore's to read.
_MAX_KEY_TOTAL = 16 << 20
_MAX_ENTRIES = 1 << 17
# What the data file tables of a read (the manifest's and every node's) may build, found
# from their lengths before a path is built: each file's path with the base path it
# inherits, its own base path, and ~100 bytes of Python objects. TensorStore names a data
# file `d/` and 32 hex digits (a multi-process step's under `ocdbt.process_<i>/`): 100-130
# bytes a file in all, and a table lists only the files its entries point at, so 16 MiB
# holds more files than a walk holds entries. Paths sharing long prefixes are 5 bytes
# each on disk and up to 64 KiB each in memory, in TensorStore's reader too: a table
# past this is no index a writer writes, refused (`Inflated`), never TensorStore's.
_MAX_TABLE_BYTES = 16 << 20
_FILE_BYTES = 100
_MAX_PREAD = 1 << 30


class Unsupported(Exception):
    """A database this reader does not read: compressed nodes, a numbered manifest, a
    field or format version it does not know (a newer TensorStore's), an index larger
    than it builds, or one that breaks a rule TensorStore holds it to. Read it with
    TensorStore, the authority, which says what (if anything) is wrong with it."""


class Damaged(ValueError):
    """A database's index is provably not what was written: a CRC-32C that does not
    match, a file cut, missing or not a regular file, a length or count its bytes
    cannot hold, a path outside the database's folder, keys out of order."""


class Inflated(Damaged):
    """An index whose data file tables would build more than `_MAX_TABLE_BYTES`: paths
    that share long prefixes, a few bytes each on disk and up to 64 KiB each once
    expanded. No writer writes one, and TensorStore's reader would expand it too: it is
    damage, found before a path is built, and a step that holds one is never handed
    to TensorStore (a bucket's reader passes every other `Damaged` on to it)."""


@dataclasses.dataclass(frozen=True)
class Indirect:
    """A value stored out of line: `length` bytes at `offset` of the data file `path`
    (relative to the database's folder)."""

    path: str
    offset: int
    length: int


Value = bytes | Indirect


class Database:
    """The keys of the latest version of the OCDBT database in folder `root` (or in
    `files`: the objects of a step in a bucket, read into memory), and where each value
    is. Reads the whole index when made (every B+tree node); values are read by
    `read`."""

    def __init__(self, root: str, files: Files | None = None) -> None:
        self.root = root
        self.files = Folder(root) if files is None else files
        named = f"the manifest '{self._path(MANIFEST)}'"
        # The latest version is the last one inline (older ones, which may sit in
        # version tree nodes after these, are never read).
        latest = _latest(self._read_exact(MANIFEST, 0, None), named)
        self.values: dict[bytes, Value] = {}
        self._seen: dict[tuple[str, int, int], int] = {}  # node -> its height
        self._version_files = set(latest.version_files)
        if latest.keys == 0:
            return
        if latest.root is None:
            raise Damaged(f"{named} points at no data file for its root")
        if latest.height > _MAX_HEIGHT:
            raise Damaged(f"{named} gives its B-tree a height of {latest.height}")
        if latest.tree_bytes > _MAX_TREE_BYTES:
            raise Unsupported(f"a B-tree of {latest.tree_bytes} bytes")
        # The walk reads each node once, at most the node bytes the manifest counts, and
        # keeps at most the keys it counts: a node reached twice, or a tree larger than
        # its manifest says, ends it (a crafted index cannot make it loop or explode).
        self._tree_left, self._keys_left = latest.tree_bytes, latest.keys
        self._key_bytes_left = _MAX_KEY_TOTAL
        self._entries_left = _MAX_ENTRIES
        self._table_bytes_left = _MAX_TABLE_BYTES - latest.table_bytes
        path, base = latest.root
        self._node(path, base, latest.offset, latest.length, latest.height, b"", b"", None)
        if len(self.values) != latest.keys:  # (statistics TensorStore does not check)
            raise Unsupported(
                f"{named} counts {latest.keys} keys where its B-tree holds {len(self.values)}"
            )

    # -- reading ----------------------------------------------------------------------

    def locate(self, key: str) -> Value | None:
        """Where `key`'s value is (bytes when inline), or None when there is no `key`."""
        return self.values.get(key.encode())

    def read(self, key: str) -> bytes | None:
        """The value of `key`, or None when the database has no such key."""
        where = self.locate(key)
        if where is None or isinstance(where, bytes):
            return where
        return self.read_range(where)

    def data_files(self) -> set[str]:
        """The data files the latest version needs (its B-tree's nodes, its values
        stored out of line, and the version tree nodes a writer of the next version
        reads), relative to the database's folder; `Damaged` when a file of its own
        (`d/`) is too short for the values the index places in it (one size asked per
        file; a file of another database the root merged, `ocdbt.process_<i>/d/`, is
        that process's to check)."""
        nodes = {path for path, _, _ in self._seen}
        ends: dict[str, int] = {}
        for v in self.values.values():
            if isinstance(v, Indirect):
                ends[v.path] = max(ends.get(v.path, 0), v.offset + v.length)
        for path, end in ends.items():
            if "/" in path.removeprefix("d/"):
                continue  # another database's file (a process's, the root merged it)
            size = self.files.size(self._relative(path))
            if end > size:
                raise Damaged(
                    f"the step's index gives bytes up to {end} of '{self._path(path)}', "
                    f"which holds {size}"
                )
        return nodes | set(ends) | self._version_files

    def read_range(self, where: Indirect) -> bytes:
        """The bytes of an out-of-line value, checked to lie within its file before
        anything is allocated for them."""
        return self._read_exact(where.path, where.offset, where.length)

    # -- the index ----------------------------------------------------------------------

    def _node(
        self,
        path: str,
        base: str,
        offset: int,
        length: int,
        height: int,
        prefix: bytes,
        lower: bytes,
        upper: bytes | None,
    ) -> None:
        """Read the B+tree node at (`path`, `offset`, `length`) of `height`, whose keys
        all begin with `prefix` and lie in [`lower`, `upper`), and every node below it."""
        where = f"the B-tree node at bytes {offset}..{offset + length} of '{self._path(path)}'"
        self._visit((path, offset, length), height, where)
        encoded = self._read_exact(path, offset, length)
        reader = _Reader(_unwrap(encoded, _BTREE_MAGIC, where), where)
        if reader.byte() != height:
            raise Damaged(f"{where} is not of the height its parent gives")
        files, built = _file_table(reader, base, self._table_bytes_left)
        self._table_bytes_left -= built
        count = reader.count(1, "entries")
        if count == 0:
            raise Damaged(f"{where} is empty")
        self._entries_left -= count  # (before the lists of its fields are made)
        if self._entries_left < 0:
            raise Unsupported(f"an index of more than {_MAX_ENTRIES} entries")
        prefix_lengths = [0] + [reader.varint() for _ in range(count - 1)]
        suffix_lengths = [reader.varint() for _ in range(count)]
        common = [reader.varint() for _ in range(count)] if height > 0 else []
        keys = self._keys(reader, prefix_lengths, suffix_lengths, prefix, where)
        if prefix + keys[0] < lower:
            raise Damaged(f"{where} begins below the key its parent gives")
        if upper is not None and prefix + keys[-1] >= upper:
            raise Damaged(f"{where} ends above the key its parent gives")
        if height == 0:
            self._leaf(reader, keys, files, prefix, where)
        else:
            self._children(reader, keys, common, files, height, prefix, upper, where)

    def _visit(self, at: tuple[str, int, int], height: int, where: str) -> None:
        """Count the node at `at` (path, offset, length) against the walk's bounds: a node
        reached twice, a tree larger than its manifest says or a node too large is left
        to TensorStore (`Unsupported`); one below itself is `Damaged`."""
        seen = self._seen.get(at)
        if seen is not None:  # shared by two parents (legal), or its own descendant
            if seen != height:
                raise Damaged(f"{where} is reached again below itself")
            raise Unsupported(f"{where}, reached twice")
        self._seen[at] = height
        self._tree_left -= at[2]
        if self._tree_left < 0:  # the walk's bound: past it, TensorStore decides
            raise Unsupported(f"{where} makes the B-tree larger than its manifest says")
        if at[2] > _MAX_NODE_BYTES:
            raise Unsupported(f"{where}, larger than {_MAX_NODE_BYTES >> 20} MiB")

    def _keys(
        self,
        reader: _Reader,
        prefix_lengths: list[int],
        suffix_lengths: list[int],
        prefix: bytes,
        where: str,
    ) -> list[bytes]:
        """A node's keys (after `prefix`), in order."""
        keys: list[bytes] = []
        for i, (shared, suffix) in enumerate(zip(prefix_lengths, suffix_lengths, strict=True)):
            # Each key's length, and the walk's running total, checked before it is built
            # (a key shares up to all of the one before it: 4,500 keys of a 65,000-byte
            # prefix in a 216 KiB node would expand to ~280 MiB).
            if i and shared > len(keys[-1]):
                raise Damaged(f"{where} has a key prefix longer than the key before it")
            size = shared + suffix
            if len(prefix) + size > _MAX_KEY_BYTES:
                raise Damaged(f"{where} has a key longer than {_MAX_KEY_BYTES} bytes")
            self._key_bytes_left -= len(prefix) + size
            if self._key_bytes_left < 0:
                raise Unsupported(f"keys of more than {_MAX_KEY_TOTAL >> 20} MiB in all")
            key = (keys[-1][:shared] if i else b"") + reader.take(suffix)
            if keys and key <= keys[-1]:
                raise Damaged(f"{where} has keys out of order")
            keys.append(key)
        return keys

    def _children(
        self,
        reader: _Reader,
        keys: list[bytes],
        common: list[int],
        files: list[tuple[str, str]],
        height: int,
        prefix: bytes,
        upper: bytes | None,
        where: str,
    ) -> None:
        """The rest of an interior node (its children's places), and each child."""
        count = len(keys)
        ids = [reader.varint() for _ in range(count)]
        offsets = [reader.varint() for _ in range(count)]
        lengths = [reader.varint() for _ in range(count)]
        for _ in range(3 * count):  # num_keys, num_tree_bytes, num_indirect_value_bytes
            reader.varint()
        reader.end()
        for i, key in enumerate(keys):
            if common[i] > len(key) or ids[i] >= len(files):
                raise Damaged(f"{where} has an entry that points nowhere")
            child, child_base = files[ids[i]]
            self._node(
                child,
                child_base,
                offsets[i],
                lengths[i],
                height - 1,
                prefix + key[: common[i]],
                prefix + key,
                prefix + keys[i + 1] if i + 1 < count else upper,
            )

    def _leaf(
        self,
        reader: _Reader,
        keys: list[bytes],
        files: list[tuple[str, str]],
        prefix: bytes,
        where: str,
    ) -> None:
        count = len(keys)
        lengths = [reader.varint() for _ in range(count)]
        kinds = [reader.byte() for _ in range(count)]
        if any(k > 1 for k in kinds):
            raise Unsupported(f"{where} has a value of a kind this reader does not know")
        indirect = [i for i in range(count) if kinds[i] == 1]
        ids = [reader.varint() for _ in indirect]
        offsets = [reader.varint() for _ in indirect]
        for j, i in enumerate(indirect):
            if ids[j] >= len(files):
                raise Damaged(f"{where} has a value that points at no data file")
            path = files[ids[j]][0]
            self._add(prefix + keys[i], Indirect(path, offsets[j], lengths[i]), where)
        for i in range(count):
            if kinds[i] == 0:
                self._add(prefix + keys[i], reader.take(lengths[i]), where)
        reader.end()

    def _add(self, key: bytes, value: Value, where: str) -> None:
        if key in self.values:
            raise Damaged(f"{where} repeats key {key!r}")
        self._keys_left -= 1  # (the key's bytes were counted as its node's key was built)
        if self._keys_left < 0:  # the walk's bound: past it, TensorStore decides
            raise Unsupported(f"{where} holds more keys than its manifest counts")
        self.values[key] = value

    # -- files --------------------------------------------------------------------------

    def _relative(self, relative: str) -> str:
        """The file `relative` of the database, checked never to be outside it."""
        parts = relative.split("/")
        if not relative or relative.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise Damaged(f"the step's index names a data file {relative!r} outside its folder")
        return relative

    def _path(self, relative: str) -> str:
        """The file `relative`, named in full for a message."""
        return f"{self.root.rstrip('/')}/{self._relative(relative)}"

    def _read_exact(self, path: str, offset: int, length: int | None) -> bytes:
        """`length` bytes at `offset` of the file `path` (None: all of a manifest),
        checked to lie within the file before anything is allocated for them, and to be
        all there once read."""
        size = self.files.size(self._relative(path))
        if length is None:
            if size > _MAX_NODE_BYTES:
                raise Unsupported(f"a manifest of {size} bytes")
            length = size
        if offset + length > size:
            raise Damaged(
                f"the step's index gives bytes {offset}..{offset + length} of "
                f"'{self._path(path)}', which holds {size}"
            )
        data = self.files.read(path, offset, length)
        if len(data) != length:
            raise Damaged(f"'{self._path(path)}' was cut while it was read")
        return data


def indexed_bytes(manifest: bytes, where: str) -> tuple[int, str, int]:
    """(the bytes of the latest version's B-tree and out-of-line values, the data file
    that holds its root, where the root ends in it), as the manifest `manifest` says
    (claims, to decide how to read the database: a database written at once is those
    bytes, its root last in its file)."""
    latest = _latest(manifest, where)
    indexed = latest.tree_bytes + latest.value_bytes
    if latest.keys == 0 or latest.root is None:
        return indexed, "", 0
    return indexed, latest.root[0], latest.offset + latest.length


def _latest(manifest: bytes, named: str, table_bytes: int = _MAX_TABLE_BYTES) -> _Version:
    """The latest version of an encoded manifest, whose data file table may build at
    most `table_bytes` (`Inflated`)."""
    reader = _Reader(_unwrap(manifest, _MANIFEST_MAGIC, named), named)
    arity_log2 = _manifest_config(reader, named, table_bytes)
    files, built = _file_table(reader, "", table_bytes)
    inline = _Inline.read(reader)
    if not inline.generations:
        raise Damaged(f"{named} lists no version")
    inline.check(arity_log2, len(files), named)
    last = inline.generations[-1]
    nodes = _version_tree_nodes(reader, arity_log2, len(files), last, named)
    reader.end()
    root = None if inline.offsets[-1] == inline.lengths[-1] == _MISSING else files[inline.ids[-1]]
    return _Version(
        root,
        inline.heights[-1],
        inline.offsets[-1],
        inline.lengths[-1],
        inline.keys[-1],
        inline.tree_bytes[-1],
        inline.value_bytes[-1],
        built,
        tuple(files[i][0] for i in nodes),
    )


def _manifest_config(reader: _Reader, named: str, table_bytes: int) -> int:
    """A manifest's configuration, read up to its data file table: the version tree's
    arity (log2). `Unsupported` for what this reader does not read (numbered manifests,
    zstd nodes), after the data file table of a zstd one is bounded all the same."""
    reader.take(16)  # the database's uuid
    if reader.byte() != 0:
        raise Unsupported("a numbered manifest (manifest_kind 'numbered')")
    reader.varint()  # max_inline_value_bytes
    reader.varint()  # max_decoded_node_bytes
    arity_log2 = reader.byte()
    if reader.varint() != 0:
        # (zstd, its level in 4 bytes; another method TensorStore refuses.) Its data file
        # table is read all the same, bounded: TensorStore, which reads this database,
        # would expand it; whether the table decodes, TensorStore judges.
        try:
            reader.take(4)
            _file_table(reader, "", table_bytes)
        except Inflated:
            raise
        except Damaged:
            pass
        raise Unsupported("compressed B-tree nodes (zstd)")
    if not 1 <= arity_log2 <= 16:
        raise Damaged(f"{named} gives a version tree arity of 2**{arity_log2}")
    return arity_log2


@dataclasses.dataclass(frozen=True)
class _Inline:
    """The versions a manifest lists inline, field by field (one list per field)."""

    generations: list[int]
    heights: list[int]
    ids: list[int]
    offsets: list[int]
    lengths: list[int]
    keys: list[int]
    tree_bytes: list[int]
    value_bytes: list[int]
    times: list[int]

    @classmethod
    def read(cls, reader: _Reader) -> _Inline:
        count = reader.count(16, "versions")

        def varints() -> list[int]:
            return [reader.varint() for _ in range(count)]

        generations = varints()
        heights = [reader.byte() for _ in range(count)]
        ids, offsets, lengths, keys, tree_bytes, value_bytes = (varints() for _ in range(6))
        times = [int.from_bytes(reader.take(8), "little") for _ in range(count)]
        return cls(
            generations, heights, ids, offsets, lengths, keys, tree_bytes, value_bytes, times
        )

    def check(self, arity_log2: int, files: int, named: str) -> None:
        """What TensorStore checks of the versions (its ValidateVersionTreeLeafNode-
        Entries). A manifest whose CRC-32C holds but that breaks one of them is not one
        this reader understands: TensorStore, the authority, decides (`Unsupported`), so
        verify and restore accept and refuse the same steps."""
        count, generations, times = len(self.generations), self.generations, self.times
        _check(
            count <= 1 << arity_log2,
            f"{named} lists {count} versions inline, more than 2**{arity_log2}",
        )
        _check(all(generations), f"{named} has a version numbered 0")
        _check(
            all(a < b for a, b in zip(generations, generations[1:], strict=False)),
            f"{named} has its versions out of order",
        )
        _check(
            all(a < b for a, b in zip(times, times[1:], strict=False)),
            f"{named} has its versions' commit times out of order",
        )
        last = generations[-1]
        _check(
            generations[0] >= last - (last - 1) % (1 << arity_log2),
            f"{named} lists versions of more than one version tree leaf",
        )
        for i in range(count):
            _check(self.ids[i] < files, f"{named} names a data file it does not list")
            if self.offsets[i] == self.lengths[i] == _MISSING:  # no B-tree (an empty version)
                _check(
                    self.heights[i] == 0
                    and self.keys[i] == self.tree_bytes[i] == self.value_bytes[i] == 0,
                    f"{named} gives an empty version a height or statistics",
                )
            else:
                _check(
                    self.offsets[i] + self.lengths[i] < 1 << 64,
                    f"{named}: an offset/length overflows",
                )


_MISSING = (1 << 64) - 1  # offset and length of an empty version's (absent) root


def _check(holds: bool, what: str) -> None:
    """A rule TensorStore holds a manifest to: when it does not hold, TensorStore reads
    the step and says what is wrong with it (`Unsupported` here)."""
    if not holds:
        raise Unsupported(what)


def _version_tree_nodes(
    reader: _Reader, arity_log2: int, files: int, last: int, named: str
) -> list[int]:
    """The references to version tree nodes after a manifest's inline versions (older
    versions: never read), checked as TensorStore checks them: the data files (ids in
    the manifest's table) that hold them."""
    most = 63 // arity_log2 - 1
    count = reader.count(12, "version tree nodes")  # (>= 12 bytes each: 8 of them a time)
    _check(count <= most, f"{named} references {count} version tree nodes, more than {most}")
    generations = [reader.varint() for _ in range(count)]
    ids = [reader.varint() for _ in range(count)]
    for _ in range(2 * count):  # offsets, lengths
        reader.varint()
    for _ in range(count):  # generations each holds
        reader.varint()
    reader.take(8 * count)  # commit times
    heights = [reader.byte() for _ in range(count)]
    _check(all(i < files for i in ids), f"{named} names a data file it does not list")
    _check(all(generations) and all(1 <= h <= most for h in heights), f"{named}: version nodes")
    for i in range(1, count):
        _check(
            generations[i] > generations[i - 1] and heights[i] < heights[i - 1],
            f"{named} has its version tree nodes out of order",
        )
    # Each height the manifest may reference holds generations of one range.
    expected: list[tuple[int, int, int]] = []
    generation, height = (last - 1) >> arity_log2 << arity_log2, 1
    while generation:
        shift = (height + 1) * arity_log2
        below = (generation - 1) >> shift << shift
        expected.append((below + 1, generation, height))
        height, generation = height + 1, below
    index = count
    for low, high, at in expected:
        if index == 0 or heights[index - 1] != at:
            continue
        index -= 1
        _check(low <= generations[index] <= high, f"{named}: a version tree node out of range")
    _check(index == 0, f"{named} references a version tree node it cannot hold")
    return ids


@dataclasses.dataclass(frozen=True)
class _Version:
    """The latest version a manifest lists (older ones are never read)."""

    root: tuple[str, str] | None  # its root node's data file (path, base); None: none
    height: int  # the B-tree's
    offset: int  # of the root node in its data file
    length: int  # of the root node
    keys: int  # in the B-tree
    tree_bytes: int  # of the B-tree's nodes
    value_bytes: int  # of the values stored out of line
    table_bytes: int  # what the manifest's data file table built (`_file_table`)
    version_files: tuple[str, ...] = ()  # the data files of its version tree nodes


class Files(Protocol):
    """Where a database's files are: `size` of one, `read` of a byte range of one."""

    def size(self, relative: str) -> int: ...

    def read(self, relative: str, offset: int, length: int) -> bytes: ...


def _no_nul(path: str) -> str:
    """`path`, or `FileNotFoundError` for one no file can have (a NUL in a name the
    index gives: such a file is missing, as it is for TensorStore)."""
    if "\0" in path:
        raise FileNotFoundError(f"no file can be named {path!r}")
    return path


class Folder:
    """A database's files in a local folder."""

    def __init__(self, root: str) -> None:
        self.root = root

    def size(self, relative: str) -> int:
        path = os.path.join(self.root, relative)
        info = os.lstat(_no_nul(path))
        if not stat.S_ISREG(info.st_mode):  # a FIFO's size is 0, and opening it blocks
            raise Damaged(f"'{path}' is not a regular file")
        return info.st_size

    def read(self, relative: str, offset: int, length: int) -> bytes:
        path = os.path.join(self.root, relative)
        fd = os.open(_no_nul(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise Damaged(f"'{path}' is not a regular file")
            parts, done = [], 0
            while done < length:  # one pread returns at most ~2 GiB on Linux
                part = os.pread(fd, min(length - done, _MAX_PREAD), offset + done)
                if not part:
                    break
                parts.append(part)
                done += len(part)
            return parts[0] if len(parts) == 1 else b"".join(parts)
        finally:
            os.close(fd)


class Held:
    """A database's files, or the parts of them read, held in memory: {relative path:
    {offset: bytes}}; a read of bytes not held is of a missing file
    (`FileNotFoundError`)."""

    def __init__(self, parts: dict[str, dict[int, bytes]], where: str) -> None:
        self.parts, self.where = parts, where

    def size(self, relative: str) -> int:
        held = self.parts.get(relative)
        if not held:
            raise FileNotFoundError(f"{self.where}/{relative} does not exist")
        return max(offset + len(data) for offset, data in held.items())

    def read(self, relative: str, offset: int, length: int) -> bytes:
        for start, data in self.parts.get(relative, {}).items():
            if start <= offset and offset + length <= start + len(data):
                return data[offset - start : offset - start + length]
        raise FileNotFoundError(f"{self.where}/{relative} does not exist")

    def missing(self, database: Database) -> list[Indirect]:
        """The out-of-line values of `database` that lie outside the bytes held."""
        return [
            v
            for v in database.values.values()
            if isinstance(v, Indirect)
            and not any(
                s <= v.offset and v.offset + v.length <= s + len(d)
                for s, d in self.parts.get(v.path, {}).items()
            )
        ]

    def add(self, value: Indirect, data: bytes) -> None:
        self.parts.setdefault(value.path, {})[value.offset] = data


# -- encoding -----------------------------------------------------------------------------


def _unwrap(encoded: bytes, magic: int, where: str) -> bytes:
    """The body of an encoded manifest or node: its header, length and CRC-32C checked."""
    if len(encoded) < 16:
        raise Damaged(f"{where} is {len(encoded)} bytes long, too short to be one")
    found, length = struct.unpack_from(">I", encoded)[0], struct.unpack_from("<Q", encoded, 4)[0]
    if found != magic:
        raise Damaged(f"{where} does not begin with its magic number")
    if length != len(encoded):
        raise Damaged(f"{where} says it is {length} bytes long, where {len(encoded)} were read")
    (crc,) = struct.unpack_from("<I", encoded, len(encoded) - 4)
    if crc32c(memoryview(encoded)[:-4]) != crc:
        raise Damaged(f"{where} does not match its CRC-32C")
    reader = _Reader(encoded[12:-4], where)
    if reader.varint() != 0:
        raise Unsupported(f"{where} is of a format version this reader does not know")
    compression = reader.varint()
    if compression == 1:
        raise Unsupported(f"{where} is compressed (zstd)")
    if compression != 0:
        raise Unsupported(f"{where} has a compression format this reader does not know")
    return reader.rest()


def _file_table(reader: _Reader, transitive: str, left: int) -> tuple[list[tuple[str, str]], int]:
    """A data file table: (full path, the base path its children inherit) per file,
    under the base path `transitive` its node inherits; and the bytes that built
    (`_MAX_TABLE_BYTES`), found from the table's lengths before a path is built:
    `Inflated` when that is more than `left`."""
    count = reader.count(1, "data files")
    built = count * _FILE_BYTES  # (before the lists of its lengths are made)
    if built > left:
        raise Inflated(_inflated(reader.where, count, built, left))
    prefixes = [0] + [reader.varint() for _ in range(count - 1)]
    suffixes = [reader.varint() for _ in range(count)]
    bases = [reader.varint() for _ in range(count)]
    # Each path's length follows from the lengths alone (a path keeps a prefix of the
    # one before it): the paths and base paths the table will build are counted first.
    # A path longer than the format allows once its node's base path is put before it
    # is damage, as TensorStore finds it.
    length = 0
    for i in range(count):
        if prefixes[i] > length:
            raise Damaged(f"{reader.where} has a data file table that does not decode")
        length = prefixes[i] + suffixes[i]
        if len(transitive) + length > _MAX_KEY_BYTES or bases[i] > length:
            raise Damaged(f"{reader.where} has a data file table that does not decode")
        built += 2 * len(transitive) + length + bases[i]
    if built > left:
        raise Inflated(_inflated(reader.where, count, built, left))
    files: list[tuple[str, str]] = []
    previous = b""
    for i in range(count):
        path = previous[: prefixes[i]] + reader.take(suffixes[i])
        # Bytes that are not UTF-8 name no file the writer makes, but only a file that is
        # read matters (TensorStore reads a database whose older versions name such
        # files): kept as the OS would take them, and found missing if read.
        text = path.decode(errors="surrogateescape")
        base = path[: bases[i]].decode(errors="surrogateescape")
        files.append((transitive + text, transitive + base))
        previous = path
    return files, built


def _inflated(where: str, count: int, built: int, left: int) -> str:
    """What an `Inflated` data file table says."""
    of = "" if left == _MAX_TABLE_BYTES else f"the {left} bytes left of "
    return (
        f"{where} has a data file table of {count} files that would build {built} bytes "
        f"of paths, more than {of}the {_MAX_TABLE_BYTES >> 20} MiB the data file tables of "
        "one index may build (a writer names its data files 'd/' and 32 hex digits): "
        "paths sharing long prefixes, refused before they are built"
    )


class _Reader:
    """The fields of an encoded body, each checked to be there."""

    def __init__(self, data: bytes, where: str) -> None:
        self.data, self.pos, self.where = data, 0, where

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise Damaged(f"{self.where} ends before its fields do")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def byte(self) -> int:
        return self.take(1)[0]

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if b < 0x80:
                return value
            shift += 7
            if shift > 63:
                raise Damaged(f"{self.where} has a number longer than 64 bits")

    def count(self, least_bytes: int, what: str) -> int:
        """A count of items that take at least `least_bytes` each: no more than the
        bytes left could hold, so that nothing is allocated on a false claim."""
        n = self.varint()
        if n * least_bytes > len(self.data) - self.pos:
            raise Damaged(f"{self.where} claims {n} {what}, more than it holds")
        return n

    def rest(self) -> bytes:
        return self.data[self.pos :]

    def end(self) -> None:
        if self.pos != len(self.data):
            # A field a newer TensorStore writes after the ones read here (its CRC holds):
            # not damage, and TensorStore's to read.
            raise Unsupported(
                f"{self.where} has {len(self.data) - self.pos} bytes after its fields"
            )


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()

try:
    from google_crc32c import value as _fast  # pyright: ignore[reportMissingImports]
except ImportError:  # pragma: no cover - depends on what else is installed
    _fast = None


def crc32c(data: bytes | memoryview) -> int:
    """CRC-32C (Castagnoli), as OCDBT's footers hold it: google-crc32c's where it is
    installed (it comes with the Google Cloud clients), else this module's own, ~13
    MB/s (an index of 100 leaves is ~40 KB: 3 ms)."""
    if _fast is not None:
        return _fast(bytes(data))
    return crc32c_python(data)


def crc32c_python(data: bytes | memoryview) -> int:
    crc = 0xFFFFFFFF
    table = _TABLE
    for b in bytes(data):
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF
