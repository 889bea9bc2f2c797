"""Device meshes for ``split``: which box of every in-memory tensor each rank holds, as FSDP2, DTensor tensor
parallel and expert parallel place them. Plain data; no torch, no files.

A :class:`Mesh` is what a user states: ``fsdp`` (FSDP2 ``fully_shard``, ``Shard(0)``), ``tp`` (DTensor tensor
parallel) and ``ep`` (stacked experts over ranks). Ranks are laid out as transformers' ``DistributedConfig``
and ``init_device_mesh`` lay them out: dense tensors over the mesh ``(fsdp, tp)``, rank ``f * tp + t``;
stacked experts over ``(efsdp, ep)`` with ``efsdp = fsdp * tp / ep``, rank ``e_f * ep + e``: each group of
``ep`` consecutive ranks holds every expert once, ``Shard(0)`` of the expert dim, and the ``efsdp`` ranks
holding the same experts shard them again with FSDP2.

``dp`` adds data-parallel replicas in front, as FSDP2's HSDP does (``fully_shard`` on a 2-D mesh
``(replicate, shard)``, 3-D with tensor parallel): every tensor gets ``Replicate()`` on an outer ``dp`` dim,
rank ``d * fsdp * tp + f * tp + t``, and each replica holds the whole ``fsdp x tp`` layout above. DCP saves a
replicated chunk once (``dedup_save_plans``; :func:`ckpttool.writers.dcp.share_items`).

Tensor-parallel placements are the family adapter's (:meth:`ckpttool.families.adapter.FamilyAdapter.tp_placement`,
by default torch's and transformers' Llama/Mixtral plans: ``ColwiseParallel`` q/k/v/gate/up ``Shard(0)``,
``RowwiseParallel`` o/down ``Shard(1)``, embeddings and ``lm_head`` ``Shard(0)``, norms, routers and experts
replicated; stacked experts cut where transformers' own plan cuts them, :mod:`ckpttool.families.expert_tp`; ``ep``
shards experts), given to :func:`shard_tensors` by the command. FSDP2 over TP shards dim 0 of each TP shard: ``_StridedShard(0, tp)`` on ``fsdp`` when
TP shards dim 0, else ``Shard(0)``. The arithmetic is :mod:`ckpttool.layout.placements` (``torch.chunk`` splits, uneven
sizes included), the same that reads such checkpoints.

:class:`MegatronMesh` is the ``split --to megatron`` counterpart (tp x pp x ep, the vocab rule, the iteration);
:func:`mesh_for` checks a split's options and builds either. Every size is bounded (:data:`MAX_RANKS`,
:data:`MAX_DIVISIBLE_BY`, :data:`MAX_ITERATION`) before any work grows with it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ckpttool.layout.layout import Box, Shape
from ckpttool.errors import ArgumentError, ConfigError
from ckpttool.layout.placements import Placement, local_ranges, local_shape

SHARD0, SHARD1, REPLICATE = Placement("shard", 0), Placement("shard", 1), Placement("replicate")

#: the most ranks of any mesh dim, and of a whole mesh (the product of its dims): every rank is a file to plan
MAX_RANKS = 65536
#: the largest ``make_vocab_size_divisible_by``: the vocab is padded to a multiple of it times tp
MAX_DIVISIBLE_BY = 2**20
#: the largest iteration: Megatron-LM names its directory ``iter_%07d``
MAX_ITERATION = 10**7 - 1


def _check_whole(name: str, value: object, least: int, most: int, what: str) -> None:
    """``value`` is an int in ``least..most``, or an :class:`ArgumentError` naming ``name`` and the bounds."""
    if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= most:
        raise ArgumentError(f"{name}={value!r}: {what} is a whole number from {least} to {most}")


@dataclass(frozen=True, slots=True)
class Mesh:
    """A device mesh as the user states it: ``dp`` replicas (HSDP) of ``fsdp`` x ``tp`` ranks, experts over ``ep``
    of those.

    Raises:
        ArgumentError: a size below 1 or above :data:`MAX_RANKS`, more than :data:`MAX_RANKS` ranks in all, or
            ``ep`` that does not divide ``fsdp * tp``.

    Example:
        >>> Mesh(fsdp=2, tp=2).describe()
        'fsdp=2 tp=2 (4 ranks)'
        >>> Mesh(fsdp=2, dp=2).describe()
        'dp=2 fsdp=2 (4 ranks; HSDP: Replicate() over dp, each chunk saved once)'
    """

    fsdp: int = 1
    tp: int = 1
    ep: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("fsdp", "tp", "ep", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArgumentError(f"{name}={value!r}: a mesh dim is a whole number of ranks, 1 or more")
            _check_whole(name, value, 1, MAX_RANKS, "a mesh dim")
        if self.world > MAX_RANKS:
            raise ArgumentError(f"dp x fsdp x tp = {self.world} ranks: a mesh has at most {MAX_RANKS} ranks")
        if self.replica % self.ep:
            raise ArgumentError(
                f"ep={self.ep} does not divide the {self.replica} rank{'s' if self.replica != 1 else ''} of fsdp={self.fsdp} "
                f"x tp={self.tp}: experts are split over groups of ep ranks within those (as transformers' "
                f"DistributedConfig lays them out); choose an ep that divides fsdp x tp, or more ranks "
                f"(fsdp={self.ep * self.fsdp // math.gcd(self.ep, self.replica)} or tp={self.ep * self.tp // math.gcd(self.ep, self.replica)})"
            )

    @property
    def replica(self) -> int:
        """Ranks of one data-parallel replica: ``fsdp * tp``."""
        return self.fsdp * self.tp

    @property
    def world(self) -> int:
        return self.dp * self.replica

    @property
    def efsdp(self) -> int:
        """Ranks of a replica holding the same experts, which FSDP2 shards them over."""
        return self.replica // self.ep

    def describe(self) -> str:
        dims = [f"{k}={v}" for k, v in (("dp", self.dp), ("fsdp", self.fsdp), ("tp", self.tp), ("ep", self.ep)) if v > 1]
        hsdp = "; HSDP: Replicate() over dp, each chunk saved once" if self.dp > 1 else ""
        return f"{' '.join(dims) or 'one rank'} ({self.world} rank{'s' if self.world != 1 else ''}{hsdp})"

    def to_json(self) -> dict[str, int]:
        return {"dp": self.dp, "fsdp": self.fsdp, "tp": self.tp, "ep": self.ep, "world": self.world}


@dataclass(frozen=True, slots=True)
class MegatronMesh:
    """Megatron's parallel sizes as the user states them, the vocab rule and the iteration written
    (``split --to megatron``; :mod:`ckpttool.commands.split_megatron`).

    ``etp`` is the expert tensor-parallel size (``--expert-tensor-parallel-size``): 1 (experts whole on every TP
    rank) or ``tp`` (cut like the dense layers); 0 leaves it to the model (``tp``, but 1 for gpt-oss, as
    Megatron-Bridge trains it). It adds no rank: the expert TP ranks are the TP ranks.

    Raises:
        ArgumentError: a size below 1 or above :data:`MAX_RANKS` (or more ranks in all), a
            ``make_vocab_size_divisible_by`` above :data:`MAX_DIVISIBLE_BY`, an iteration below 0 or above
            :data:`MAX_ITERATION`, an ``etp`` other than 0, 1 or ``tp``.

    Example:
        >>> MegatronMesh(tp=2, pp=2).describe()
        'tp=2 pp=2 (4 ranks)'
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    divisible_by: int = 128
    iteration: int = 0
    #: layers of the first and of the last pipeline stage (Megatron-LM's ``--decoder-first-pipeline-num-layers``,
    #: ``--decoder-last-pipeline-num-layers``); 0: as many as every other stage
    pp_first: int = 0
    pp_last: int = 0
    #: virtual pipeline stages (model chunks) per stage (``--virtual-pipeline-model-parallel-size``)
    vpp: int = 1
    #: expert tensor parallelism (``--expert-tensor-parallel-size``): 1 (experts whole on every rank) or tp; 0: the
    #: model's default (:meth:`expert_tp`)
    etp: int = 0

    def __post_init__(self) -> None:
        for name in ("pp_first", "pp_last"):
            _check_whole(name, getattr(self, name), 0, MAX_RANKS * MAX_RANKS, "a stage's layer count")
        _check_whole("vpp", self.vpp, 1, MAX_RANKS, "the virtual pipeline size")
        if self.pp == 1 and (self.pp_first or self.pp_last or self.vpp > 1):
            raise ArgumentError(f"pp_first={self.pp_first}, pp_last={self.pp_last}, vpp={self.vpp}: uneven and "
                                "virtual pipeline stages need pp above 1")
        if not isinstance(self.etp, int) or isinstance(self.etp, bool) or self.etp not in (0, 1, self.tp):
            raise ArgumentError(f"etp={self.etp!r}: the expert tensor-parallel size is 1 (experts whole on every TP rank) "
                                f"or tp={self.tp} (cut like the dense layers); ckpttool writes no other")
        if self.vpp > 1 and (self.pp_first or self.pp_last):
            raise ArgumentError(f"vpp={self.vpp} with pp_first/pp_last: virtual pipeline stages over uneven stages "
                                "are not written yet; give one or the other")
        for name in ("tp", "pp", "ep", "divisible_by", "iteration"):
            value, least = getattr(self, name), 0 if name == "iteration" else 1
            what = "make_vocab_size_divisible_by" if name == "divisible_by" else name
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ArgumentError(f"{what}={value!r}: a whole number, {least} or more")
            most = {"divisible_by": MAX_DIVISIBLE_BY, "iteration": MAX_ITERATION}.get(name, MAX_RANKS)
            _check_whole(what, value, least, most, "the iteration (Megatron names it iter_%07d)"
                         if name == "iteration" else "the vocab rule" if name == "divisible_by" else "a mesh dim")
        if self.world > MAX_RANKS:
            raise ArgumentError(f"tp x pp x ep = {self.world} ranks: a mesh has at most {MAX_RANKS} ranks")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.ep

    def describe(self) -> str:
        dims = [f"{k}={v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("ep", self.ep)) if v > 1]
        stages = [f"{k}={v}" for k, v in (("pp_first", self.pp_first), ("pp_last", self.pp_last)) if v]
        stages += [f"vpp={self.vpp}"] if self.vpp > 1 else []
        stages += [f"etp={self.etp}"] if self.etp and self.tp > 1 else []
        return (f"{' '.join(dims) or 'one rank'}{' ' if stages else ''}{' '.join(stages)} "
                f"({self.world} rank{'s' if self.world != 1 else ''})")

    def expert_tp(self, model_type: str) -> int:
        """The expert tensor-parallel size written for a ``model_type`` model: ``etp``, or when 0 the model's
        default (1 for gpt-oss, whose experts Megatron-Bridge trains whole; else ``tp``, megatron-core's)."""
        return self.etp or (1 if model_type == "gpt_oss" else self.tp)

    def to_json(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "world": self.world,
                "make_vocab_size_divisible_by": self.divisible_by, "iteration": self.iteration,
                **({"pp_first": self.pp_first} if self.pp_first else {}),
                **({"pp_last": self.pp_last} if self.pp_last else {}), **({"vpp": self.vpp} if self.vpp > 1 else {}),
                **({"etp": self.etp} if self.etp else {})}


def check_target_options(to: str, *, fsdp: int = 1, dp: int = 1, pp: int = 1, divisible_by: int = 128,
                         iteration: int = 0, pp_first: int = 0, pp_last: int = 0, vpp: int = 1, etp: int = 0) -> None:
    """Refuse the options of the other split target (the command line's usage errors).

    Raises:
        ArgumentError: ``fsdp`` or ``dp`` for ``megatron``; ``pp``, ``divisible_by``, ``iteration``, ``pp_first``,
            ``pp_last``, ``vpp`` or ``etp`` for ``dcp``.
    """
    if to == "dcp" and (pp_first, pp_last, vpp) != (0, 0, 1):
        raise ArgumentError("pp_first, pp_last and vpp are for to='megatron' (its pipeline stages)")
    if to == "megatron" and fsdp != 1:
        raise ArgumentError(f"fsdp={fsdp!r}: Megatron-Core torch_dist has no FSDP dim; give tp, pp and ep")
    if to == "megatron" and dp != 1:
        raise ArgumentError(
            f"dp={dp!r}: a Megatron-Core torch_dist checkpoint does not depend on the data-parallel size: its chunks "
            "are those of tp x pp x ep, saved once whatever dp (only which rank's file holds a chunk differs), and a "
            "Megatron load at any dp reads it; split without dp")
    if to == "dcp" and etp:
        raise ArgumentError(f"etp={etp!r} is for to='megatron' (Megatron's expert tensor parallelism); a DCP split "
                            "places experts with ep and tp")
    if to == "dcp" and (pp, divisible_by, iteration) != (1, 128, 0):
        raise ArgumentError("pp, make_vocab_size_divisible_by and iteration are for to='megatron'")


def mesh_for(to: str, *, fsdp: int = 1, tp: int = 1, ep: int = 1, pp: int = 1, dp: int = 1, divisible_by: int = 128,
             iteration: int = 0, pp_first: int = 0, pp_last: int = 0, vpp: int = 1, etp: int = 0) -> Mesh | MegatronMesh:
    """The mesh a split writes for: :class:`MegatronMesh` for ``to="megatron"``, else :class:`Mesh`.

    Raises:
        ArgumentError: :func:`check_target_options`, or a size the mesh refuses.
    """
    check_target_options(to, fsdp=fsdp, dp=dp, pp=pp, divisible_by=divisible_by, iteration=iteration,
                         pp_first=pp_first, pp_last=pp_last, vpp=vpp, etp=etp)
    if to == "megatron":
        return MegatronMesh(tp, pp, ep, divisible_by, iteration, pp_first, pp_last, vpp, etp)
    return Mesh(fsdp, tp, ep, dp)


@dataclass(frozen=True, slots=True)
class Sharding:
    """One in-memory tensor over the mesh: the mesh dims it is laid over (``(name, size)``, every rank on them
    in row-major order) and one placement per dim."""

    name: str
    shape: Shape
    dims: tuple[tuple[str, int], ...]
    placements: tuple[Placement, ...]
    #: ``(start, stop)``: only these ranks hold it (a Megatron layer saved under its own number: its pipeline
    #: stage's ranks); None: every rank of the mesh, as the placements say
    ranks: tuple[int, int] | None = None

    def holds(self, rank: int) -> bool:
        """Whether ``rank`` holds any of it by :attr:`ranks` (then its placements say which box)."""
        return self.ranks is None or self.ranks[0] <= rank < self.ranks[1]

    def coordinate(self, rank: int) -> tuple[int, ...]:
        sizes = [n for _, n in self.dims]
        return tuple((rank // math.prod(sizes[d + 1:])) % n for d, n in enumerate(sizes))

    def ranges(self, rank: int) -> list[list[tuple[int, int]]]:
        return local_ranges(self.shape, [n for _, n in self.dims], self.coordinate(rank), self.placements)

    def boxes(self, rank: int) -> list[Box]:
        """The regions of the global tensor ``rank`` holds (one, unless a strided split gives it several
        ranges of a dim); none when its shard is empty."""
        ranges = self.ranges(rank)
        if not self.holds(rank) or math.prod(local_shape(ranges)) == 0:
            return []
        return [Box(tuple(a for a, _ in combo), tuple(b - a for a, b in combo)) for combo in itertools.product(*ranges)]

    def empty_box(self, rank: int) -> Box | None:
        """Where torch's DTensor places ``rank``'s shard when it is empty, for ``Shard``/``Replicate`` placements
        (``compute_local_shape_and_global_offset``: a sharded dim left with no element is placed at its global
        length); None when the shard is not empty, or is strided (DCP then names the tensor by another rank's
        chunk)."""
        if self.boxes(rank) or any(p.kind == "strided" for p in self.placements):
            return None
        offsets, sizes = [0] * len(self.shape), list(self.shape)
        for (_, n), c, p in zip(self.dims, self.coordinate(rank), self.placements):
            if p.kind == "shard":
                per = -(-sizes[p.dim] // n) if sizes[p.dim] else 0
                start = min(c * per, sizes[p.dim])
                offsets[p.dim] += start
                sizes[p.dim] = min(start + per, sizes[p.dim]) - start
        for d in {p.dim for p in self.placements if p.kind == "shard"}:
            if not sizes[d]:
                offsets[d] = self.shape[d]
        return Box(tuple(offsets), tuple(sizes))

    def local_shape(self, rank: int) -> Shape:
        """The shape of ``rank``'s local tensor (``DTensor.to_local()``); all zeros on a rank :attr:`ranks` leaves out."""
        return local_shape(self.ranges(rank)) if self.holds(rank) else tuple(0 for _ in self.shape)

    def local_shapes(self) -> list[Shape]:
        """:meth:`local_shape` of every rank, in rank order. A rank's shape depends on its coordinates along the
        mesh dims that cut the tensor only, so each is computed once and repeated over the dims that replicate it
        (8192 ranks x ~1,000 tensors for DeepSeek-V3 at TP8 x PP16 x EP64)."""
        sizes = [n for _, n in self.dims]

        def grid(dim: int, coordinate: tuple[int, ...]) -> list[Shape]:
            if dim == len(sizes):
                return [local_shape(local_ranges(self.shape, sizes, coordinate, self.placements))]
            if self.placements[dim].kind == "replicate":  # the same shapes whatever the coordinate on this dim
                return grid(dim + 1, (*coordinate, 0)) * sizes[dim]
            return [shape for c in range(sizes[dim]) for shape in grid(dim + 1, (*coordinate, c))]

        shapes = grid(0, ())
        if self.ranks is not None:
            start, stop = self.ranks
            zeros = tuple(0 for _ in self.shape)
            shapes = [zeros] * start + shapes[start:stop] + [zeros] * (len(shapes) - max(stop, start))
        return shapes

    def describe(self) -> str:
        """Placements on the mesh dims of more than one rank, e.g. ``(_StridedShard(0, sf=2), Shard(0))``."""
        shown = [(f"{name}={n}", str(p)) for (name, n), p in zip(self.dims, self.placements) if n > 1]
        only = f" on ranks {self.ranks[0]}..{self.ranks[1] - 1}" if self.ranks is not None else ""
        if not shown:
            return f"whole on the one rank{only}"
        return f"({', '.join(p for _, p in shown)}) over {' x '.join(d for d, _ in shown)}{only}"


def shard_tensors(tensors: Iterable[tuple[str, Shape, bool]], mesh: Mesh,
                  tp_placement: Callable[[str], Placement | None]) -> list[Sharding]:
    """Place every ``(name, shape, stacked experts)`` tensor on ``mesh``; ``tp_placement`` gives a tensor's
    placement on the ``tp`` dim by its in-memory name (the family adapter's), None when it knows none.

    Raises:
        ConfigError: every tensor the mesh cannot place, listed: no tensor-parallel rule for it (with ``tp``
            above 1), a TP dim it does not have, experts that ``ep`` does not divide evenly, or ``ep`` above 1
            for a model without stacked experts.
    """
    shardings, problems, stacked_seen = [], [], False
    for name, shape, stacked in tensors:
        stacked_seen = stacked_seen or stacked
        if stacked and mesh.ep > 1:
            if not shape or shape[0] % mesh.ep:
                experts = shape[0] if shape else 0
                problems.append(f"'{name}': its {experts} experts (dim 0) cannot be split evenly over ep={mesh.ep} "
                                f"ranks; choose an ep that divides {experts}")
                continue
            strided = Placement("strided", 0, mesh.ep) if mesh.efsdp > 1 else REPLICATE
            shardings.append(_replicated(Sharding(name, shape, (("efsdp", mesh.efsdp), ("ep", mesh.ep)), (strided, SHARD0)), mesh))
            continue
        tp = tp_placement(name) if mesh.tp > 1 else REPLICATE
        if tp is None:
            problems.append(f"'{name}': no tensor-parallel placement is known for it (tp={mesh.tp})")
            continue
        if tp.kind == "shard" and tp.dim >= len(shape):
            problems.append(f"'{name}': tensor parallel places it {tp}, but it has {len(shape)} dims")
            continue
        shardings.append(_replicated(Sharding(name, shape, (("fsdp", mesh.fsdp), ("tp", mesh.tp)), _dense(shape, tp, mesh)), mesh))
    if mesh.ep > 1 and not stacked_seen:
        problems.append(f"ep={mesh.ep}: the model has no stacked expert tensors to place over ep ranks")
    if problems:
        raise ConfigError(
            f"the mesh {mesh.describe()} does not fit the model ({len(problems)} problem{'s' if len(problems) != 1 else ''}):\n"
            + "\n".join(f"  - {p}" for p in problems[:20])
            + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
            + ("\nckpttool places tensors as torch's and transformers' Llama/Mixtral tensor-parallel plans do "
               "(q/k/v/gate/up Shard(0), o/down Shard(1), embeddings and lm_head Shard(0), norms replicated); "
               "split with tp=1 for a model it does not know." if any("no tensor-parallel" in p for p in problems) else "")
        )
    return shardings


def _replicated(sharding: Sharding, mesh: Mesh) -> Sharding:
    """HSDP: ``Replicate()`` on an outer ``dp`` dim, in front of the replica's dims (none when ``dp`` is 1)."""
    if mesh.dp == 1:
        return sharding
    return Sharding(sharding.name, sharding.shape, (("dp", mesh.dp), *sharding.dims), (REPLICATE, *sharding.placements))


def _dense(shape: Sequence[int], tp: Placement, mesh: Mesh) -> tuple[Placement, Placement]:
    """FSDP2's placement on ``fsdp`` (``Shard(0)`` of each TP shard) beside the TP one; a scalar is replicated."""
    if not shape:
        return REPLICATE, REPLICATE
    if mesh.fsdp == 1:
        return REPLICATE, tp
    if tp == SHARD0 and mesh.tp > 1:
        return Placement("strided", 0, mesh.tp), tp
    return SHARD0, tp
