"""Per-device saves of sharded states (`maybe_save(..., shardings=...)`): what such a
save is, shared by the stages that handle it.

- `Layout` (built by `layout_of` when the save is planned, `_save/_route.py`, from the
  shardings `chosen` for it): the mesh, how each leaf is split over it, and which block
  of a leaf each device holds.
- Traced side (`_save/_traced.py`): inside the save's `lax.cond`, a `shard_map` over the
  shardings' mesh runs the crossing on every device with only that device's block of
  each leaf, plus the device's coordinates in the mesh (`lax.axis_index` per mesh axis).
  No leaf is gathered, so the compiled program needs no temporary copy of the state.
- Host side (`_save/_assembly.py`): every device's call copies the blocks it owns into
  staging memory and adds them to the step's `Assembly`; the device that completes it
  queues one save whose leaves are `ShardedArray`s.
- Writer side: each `ShardedArray`'s blocks are written as they are, one zarr chunk per
  block (`_write/_store.py` takes the same type, its blocks made storable), by the
  lowest-numbered process holding a replica of the block (`ShardedArray.written_here`);
  the writer never touches the devices, which the running program may hold while one
  of them waits for this writer (a full queue). Plain Orbax reads the leaf with any
  sharding, and `restore(like)` reads on each device only the slices it holds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import cast

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

from .._base._errors import InvalidStateError, where

AxisNames = tuple[str, ...]  # the mesh axes one array dimension is split over
BlockKey = tuple[tuple[int, int], ...]  # a block's global index: (start, stop) per dimension


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the crossing leaves are split over the mesh (fixed at trace time)."""

    axis_names: tuple[str, ...]  # the mesh's axes, in order
    axis_sizes: tuple[int, ...]
    dims: tuple[tuple[AxisNames, ...], ...]  # per crossing leaf, per dimension
    # The mesh's device ids in mesh order (None inside pmap/shard_map: this process's
    # devices in order), and how many of them belong to this process.
    device_ids: tuple[int, ...] | None = None
    local: int | None = None

    @property
    def devices(self) -> int:
        return int(np.prod(self.axis_sizes, dtype=np.int64))

    @property
    def spans_processes(self) -> bool:
        """Some of the mesh's devices belong to other processes (jax.distributed)."""
        return self.local is not None and self.local < self.devices

    @property
    def reporting(self) -> int:
        """The devices whose reports complete a step in this process."""
        return self.devices if self.local is None else self.local

    def index(
        self, leaf: int, coords: Sequence[int], block: tuple[int, ...], replicas: bool = False
    ) -> tuple[slice, ...] | None:
        """The global index of the block a device holds, or None when another device
        holds the replica that is written (coordinates 0 along unused mesh axes), unless
        `replicas` (several processes: every process keeps its own devices' replicas,
        and Orbax writes the one whose replica id is 0)."""
        dims = self.dims[leaf]
        used = {name for names in dims for name in names}
        position = dict(zip(self.axis_names, coords, strict=True))
        size = dict(zip(self.axis_names, self.axis_sizes, strict=True))
        if not replicas and any(position[name] for name in self.axis_names if name not in used):
            return None
        index = []
        for d, length in enumerate(block):
            names = dims[d] if d < len(dims) else ()
            tile = 0
            for name in names:  # row-major over the axes splitting this dimension
                tile = tile * size[name] + position[name]
            index.append(slice(tile * length, (tile + 1) * length))
        return tuple(index)

    @property
    def partition_specs(self) -> tuple[PartitionSpec, ...]:
        """Each crossing leaf's PartitionSpec (the shard_map's `in_specs`)."""
        return tuple(PartitionSpec(*(names or None for names in dims)) for dims in self.dims)

    def global_shape(self, leaf: int, block: tuple[int, ...]) -> tuple[int, ...]:
        size = dict(zip(self.axis_names, self.axis_sizes, strict=True))
        dims = self.dims[leaf]
        return tuple(
            length * int(np.prod([size[n] for n in (dims[d] if d < len(dims) else ())]))
            for d, length in enumerate(block)
        )


def chosen(
    given: Sequence[Sharding] | None,
    leaves: Sequence[object],
    crossing: Sequence[int],
    state_leaves: int,
) -> Sequence[Sharding] | None:
    """The shardings a traced save's crossing leaves (`crossing`, indices into `leaves`)
    go by: `given` (`shardings=`, one per leaf of the state), else the ones the trace
    knows (`_explicit_shardings`). The metrics (scalars, after the state's
    `state_leaves`) go along, replicated on the same mesh. None: the save is gathered."""
    of_state = [i for i in crossing if i < state_leaves]
    if given is not None:
        shardings: Sequence[Sharding] | None = [given[i] for i in of_state]
    else:
        shardings = _explicit_shardings([leaves[i] for i in of_state])
    if not shardings:
        return None
    extra = len(crossing) - len(of_state)
    if extra:
        mesh = getattr(shardings[0], "mesh", None)
        if mesh is None:
            return None
        shardings = [*shardings, *[NamedSharding(mesh, PartitionSpec())] * extra]
    return shardings


def _explicit_shardings(leaves: Sequence[object]) -> list[NamedSharding] | None:
    """The leaves' shardings when the trace knows them (a mesh with explicit axes, as
    `jax.make_mesh` makes by default) and at least one leaf is split; else None."""
    if jax.sharding.get_abstract_mesh().manual_axes:
        return None  # inside shard_map: the gather path (axis_name=)
    found: list[NamedSharding | None] = []
    split = False
    for leaf in leaves:
        sharding = None
        if isinstance(leaf, (Tracer, jax.Array)):
            try:
                sharding = jax.typeof(leaf).sharding
            except (AttributeError, TypeError):
                sharding = None
        if not isinstance(sharding, NamedSharding):
            found.append(None)
            continue
        explicit = jax.sharding.AxisType.Explicit in tuple(sharding.mesh.axis_types)
        if not explicit:
            found.append(None)
            continue
        split = split or any(entry is not None for entry in sharding.spec)
        found.append(sharding)
    if not split:
        return None
    meshes = {(s.mesh.axis_names, s.mesh.axis_sizes) for s in found if s is not None}
    if len(meshes) != 1 or any(s is None for s in found):
        return None  # mixed: save gathered
    return cast(list[NamedSharding], found)  # (no None in it: checked above)


def layout_of(
    shardings: Sequence[Sharding],
    payload: Sequence[jax.Array],
    names: Sequence[str],
) -> tuple[Layout, Mesh | AbstractMesh]:
    """The Layout of the crossing leaves, from one NamedSharding per leaf (another kind
    is refused, naming the leaf); the mesh.

    Checks what the shard_map will need, naming the leaf: one mesh for all leaves, a
    spec no longer than the leaf's rank, dimensions divisible by their axes' sizes.
    """
    mesh = None
    dims = []
    for sharding, leaf, name in zip(shardings, payload, names, strict=True):
        if not isinstance(sharding, NamedSharding):
            raise InvalidStateError(
                f"{where()}(shardings=...): leaf {name} has {type(sharding).__name__} "
                f"({sharding!r}); each leaf needs a jax.sharding.NamedSharding (or pass "
                "no shardings= to save the gathered state)."
            )
        if mesh is None:
            mesh = sharding.mesh
        elif tuple(sharding.mesh.axis_names) != tuple(mesh.axis_names) or tuple(
            sharding.mesh.axis_sizes
        ) != tuple(mesh.axis_sizes):
            raise InvalidStateError(
                f"{where()}(shardings=...): leaf {name} is on mesh "
                f"{dict(sharding.mesh.shape)}, another leaf on {dict(mesh.shape)}; one save "
                "crosses over one mesh. Fix: use one mesh for the state's shardings."
            )
        dims.append(_split_dims(sharding, np.shape(leaf), name))
    assert mesh is not None
    ids = local = None
    if isinstance(mesh, Mesh):  # an AbstractMesh names no devices (its .devices raises)
        ids = tuple(int(d.id) for d in mesh.devices.flat)
        local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    layout = Layout(
        tuple(mesh.axis_names), tuple(int(s) for s in mesh.axis_sizes), tuple(dims), ids, local
    )
    return layout, mesh


def _split_dims(
    sharding: NamedSharding, shape: tuple[int, ...], name: str
) -> tuple[AxisNames, ...]:
    """The mesh axes each dimension of a leaf is split over, its spec checked (naming
    the leaf): no longer than the leaf's rank, each dimension divisible."""
    spec = tuple(sharding.spec)
    if len(spec) > len(shape):
        raise InvalidStateError(
            f"{where()}(shardings=...): leaf {name} has shape {tuple(shape)} but "
            f"its sharding's spec {sharding.spec} has {len(spec)} entries. Fix: give "
            "this leaf a PartitionSpec with at most one entry per dimension."
        )
    entry = []
    for d, axes in enumerate(spec):
        if axes is not None and not isinstance(axes, (str, tuple, list)):
            raise InvalidStateError(
                f"{where()}(shardings=...): leaf {name}: dimension {d} of the spec "
                f"{sharding.spec} is {axes!r}; a save needs each dimension's mesh axes "
                "(a name, a tuple of names, or None). Fix: pass the leaf's actual "
                "sharding, e.g. jax.typeof(x).sharding or x.sharding."
            )
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        parts = int(np.prod([sharding.mesh.shape[a] for a in axes]))
        if shape[d] % parts:
            raise InvalidStateError(
                f"{where()}(shardings=...): leaf {name} has {shape[d]} elements along "
                f"dimension {d}, which its spec {sharding.spec} splits into {parts} "
                "equal blocks. Fix: pad the dimension or change the spec."
            )
        entry.append(axes)
    return tuple(entry)


@dataclasses.dataclass(eq=False)
class ShardedArray:
    """One leaf of a save as its host blocks: {global index: array}. The one type of a
    leaf written block by block: the host side makes it, the writer hands `_store` a
    copy whose blocks are this process's, as stored (`dataclasses.replace`)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    layout: Layout
    leaf: int
    blocks: dict[BlockKey, np.ndarray]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def written_here(self) -> dict[BlockKey, np.ndarray]:
        """The blocks this process writes: each block once, by the lowest-numbered
        process holding a replica of it (several processes each keep their own)."""
        if not self.layout.spans_processes:
            return self.blocks
        writer = _writers(self.layout, self.leaf, self.shape)
        me = jax.process_index()
        return {key: block for key, block in self.blocks.items() if writer[key] == me}


@functools.lru_cache(maxsize=1024)
def _writers(layout: Layout, leaf: int, shape: tuple[int, ...]) -> dict[BlockKey, int]:
    """{block key: the lowest process index among the devices holding that block}."""
    assert layout.device_ids is not None
    process = {d.id: int(d.process_index) for d in jax.devices()}
    sizes = dict(zip(layout.axis_names, layout.axis_sizes, strict=True))
    dims = layout.dims[leaf]
    block = tuple(
        n // int(np.prod([sizes[a] for a in (dims[d] if d < len(dims) else ())]))
        for d, n in enumerate(shape)
    )
    out: dict[BlockKey, int] = {}
    for k, device in enumerate(layout.device_ids):
        coords = np.unravel_index(k, layout.axis_sizes)
        index = layout.index(leaf, [int(c) for c in coords], block, replicas=True)
        assert index is not None  # (replicas=True: every device's block)
        key = block_key(index, shape)
        out[key] = min(out.get(key, process[device]), process[device])
    return out


def block_key(index: Sequence[slice], shape: Sequence[int]) -> BlockKey:
    """A block's global index as hashable (start, stop) pairs, one per dimension."""
    return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape, strict=True))
