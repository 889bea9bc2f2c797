"""What a split did (or, with a dry run, would do): :class:`SplitResult`, its summary lines and its JSON."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ckpttool.commands.meshes import MegatronMesh, Mesh, Sharding
from ckpttool.console.terminal import escaped, shown, size_text
from ckpttool.plan.plan import Plan
from ckpttool.writers import dcp, megatron_dist
from ckpttool.writers.hf import predict_peak_bytes

__all__ = ["LOCAL_SHAPES_MOST", "SplitResult"]

#: the most ranks whose local shapes ``--json`` lists one by one (``local_shapes``); above, as runs of ranks
LOCAL_SHAPES_MOST = 1024


@dataclass(frozen=True, slots=True)
class SplitResult:
    """What :func:`~ckpttool.commands.split.split` did (or, with ``dry_run``, would do)."""

    source: str
    output: str | None
    format: str
    to: str
    mesh: Mesh | MegatronMesh
    #: one target per chunk written (a rank's box of a tensor), in file order
    plan: Plan
    files: tuple[dcp.DcpFile, ...]
    tensors: tuple[Sharding, ...]
    config: str | None
    adapter: str
    dry_run: bool
    extras: tuple[str, ...] = ()
    workers: int = 1
    restored: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def transforms(self) -> dict[str, str]:
        """The tensors written through a transform (:mod:`ckpttool.plan.transforms`), with its name."""
        return {i.fqn: i.target.transform.name for f in self.files for i in f.items if i.target.transform is not None}

    def to_json(self) -> dict[str, object]:
        dtypes = {i.fqn: i.target.dtype for f in self.files for i in f.items}
        transforms = self.transforms()
        return {
            "status": "ok", "dry_run": self.dry_run, "source": self.source, "output": self.output,
            "format": self.format, "to": self.to, "mesh": self.mesh.to_json(), "config": self.config,
            "adapter": self.adapter, "coverage": "every chunk of every tensor is covered exactly once",
            "tensors": [{"name": s.name, "shape": list(s.shape), "dtype": dtypes.get(s.name),
                         "placements": s.describe(), **self._local_shapes(s),
                         **({"transform": transforms[s.name]} if s.name in transforms else {})}
                        for s in self.tensors],
            "files": [{"name": f.name, "rank": f.rank, "bytes": f.nbytes, "items": len(f.items)} for f in self.files],
            "total_bytes": self.nbytes, "workers": self.workers,
            "predicted_peak_bytes": predict_peak_bytes(self.plan, self.workers),
            "extras": list(self.extras), "notes": list(self.notes), "restored": self.restored,
        }

    def _local_shapes(self, sharding: Sharding) -> dict[str, object]:
        """Each rank's local shape (``local_shapes``, one per rank), or above :data:`LOCAL_SHAPES_MOST` ranks, the
        runs of consecutive ranks of one shape (``local_shape_runs``: ``[shape, ranks]`` in rank order): DeepSeek-V3
        at TP8 x PP16 x EP64 would list 8192 shapes for each of ~1,000 tensors, ~400 MB of JSON, in ~3 runs each."""
        shapes = sharding.local_shapes()
        if self.mesh.world <= LOCAL_SHAPES_MOST:
            return {"local_shapes": [list(shape) for shape in shapes]}
        return {"local_shape_runs": [[list(shape), len(list(run))] for shape, run in itertools.groupby(shapes)]}

    def _files_written(self) -> str:
        files = f"{len(self.files)} rank files + {dcp.METADATA}"
        if isinstance(self.mesh, MegatronMesh):
            return (f"{megatron_dist.iteration_name(self.mesh.iteration)}/: {files}, {megatron_dist.COMMON}, "
                    f"{megatron_dist.METADATA_JSON}; {megatron_dist.TRACKER}")
        return files

    def lines(self, verbose: bool = False) -> list[str]:
        """The summary the command line prints; with ``verbose`` (always for a dry run) every tensor's placements
        and each rank's local shape (runs of equal shapes as ``250x32 x3``)."""
        verb = "would write" if self.dry_run else "wrote"
        out = shown(self.output) if self.output is not None else "(none given)"
        lines = [
            f"source:   {shown(self.source)} ({self.format})", f"config:   {self.config}", f"family:   {self.adapter}",
            f"mesh:     {self.mesh.describe()}",
            f"coverage: ok, every chunk of {len(self.tensors)} tensors covered exactly once ({len(self.plan.targets)} chunks)",
            f"output:   {out} ({verb} {size_text(self.nbytes)} in {self._files_written()})",
            *(f"  {f.name}  {len(f.items)} chunks  {size_text(f.nbytes)}" for f in self.files),
        ]
        if self.extras:
            lines.append(f"  + {', '.join(self.extras)}")
        if self.dry_run:
            lines.append(f"peak memory: at most {size_text(predict_peak_bytes(self.plan, self.workers))} with "
                         f"{self.workers} worker{'s' if self.workers != 1 else ''}")
        lines.extend(f"note: {escaped(note)}" for note in self.notes)
        transforms = self.transforms() if verbose or self.dry_run else {}
        for s in self.tensors if verbose or self.dry_run else ():
            runs = [(shape, len(list(group))) for shape, group in
                    itertools.groupby(s.local_shapes())]
            local = ", ".join(("x".join(map(str, shape)) or "scalar") + (f" x{n}" if n > 1 else "") for shape, n in runs)
            through = f"  ({escaped(transforms[s.name])})" if s.name in transforms else ""
            lines.append(f"  {shown(s.name)}  [{'x'.join(map(str, s.shape))}]  {s.describe()}  local {local}{through}")
        return lines
