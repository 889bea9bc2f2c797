"""Megatron-LM's own checkpoint format (``--ckpt-format torch``): one ``torch.save`` file per model-parallel rank.

On disk, as Megatron-LM's ``checkpointing.py`` writes it::

    latest_checkpointed_iteration.txt          "10" (or "release")
    iter_0000010/                              (or release/)
        mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt

``TT`` is the tensor-parallel rank; ``_PPP`` the pipeline stage, present only when pipeline parallel > 1;
``_EEE`` the expert-parallel rank, present only when expert parallel > 1 (so ``mp_rank_00_001`` is stage 1 or EP
rank 1: the ``args`` decide). Only data-parallel rank 0 of each coordinate writes. Each file holds ``args``
(the training ``argparse.Namespace``), ``checkpoint_version``, ``iteration``, ``model`` (``model0``,
``model1``, ... with virtual pipeline stages) as the local module's ``state_dict``, and optimizer / RNG state,
which are not read. The pickles are walked with :func:`ckpttool.io.torch_save.scan` (an allow-list; nothing is
imported or run) and tensors are read in place.

Each local tensor becomes pieces of Megatron-Core's *global* tensor, the one ``torch_dist`` would save:

- which dim a local tensor is split on across TP ranks (or whether it is whole on every rank) is the source
  convention's table, which the reader is told (:class:`~.common.ConventionTables`: the Megatron-Core
  convention's :mod:`ckpttool.families.conventions.megatron_tp`); the global shape is the local one times the
  TP size on that dim, and rank ``r``'s piece starts at ``r`` times the local size;
- a tensor the table calls *paired* (a SwiGLU ``[gate_r; up_r]`` on each TP rank) is placed as halves
  ``gate[r]`` and ``up[r]`` of the global ``[gate; up]`` (a plain concatenation would interleave them);
- layers are renumbered across pipeline stages (global = stage offset + local index; uneven first/last stages
  and virtual stages from the args); experts are renumbered across EP ranks (global = ep_rank x local count +
  local index) and named ``decoder.layers.L.mlp.experts.E.*`` (``mtp.layers.K.transformer_layer.mlp.experts.E.*``);
- vocab rows padded to a multiple of ``make_vocab_size_divisible_by x tp`` are recorded as padding.

A missing rank file is named in coverage errors with the regions it should hold (its pieces are mirrored from
a sibling rank of the same stage).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.model.description import ModelInfo
from ckpttool.io.dtypes import itemsize
from ckpttool.layout.layout import RAW, Box, Layout, Piece
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.errors import SourceError, SourceNotFoundError
from ckpttool.io.paths import contained, open_inside
from ckpttool.io.safe_pickle import Record
from ckpttool.io.torch_save import StoredTensor
from ckpttool.readers.validate import expect, integer
from ckpttool.readers.megatron import common as megatron
from ckpttool.readers.megatron.common import ConventionTables
from ckpttool.readers.megatron import fp8 as megatron_fp8
from ckpttool.readers.base import FormatReader

NAME = "megatron-legacy"
LOOKS_FOR = "iter_N/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt (Megatron-LM --ckpt-format torch)"
FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^(mtp\.layers\.(\d+)\.transformer_layer\.)(.+)$")


def matches(root: Path) -> bool:
    directory = megatron.matched_iteration(root)
    if directory is None:
        return False
    return any(_RANK_DIR.match(p.name) and (p / FILE).is_file() for p in _subdirs(directory))


def _subdirs(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.iterdir() if p.is_dir())
    except OSError:
        return []


@dataclass(frozen=True, slots=True)
class _Rank:
    tp: int
    pp: int
    ep: int


def read(root: Path, model: ModelInfo | None, *, tables: ConventionTables | None = None) -> Layout:
    """The checkpoint in ``root`` as Megatron-Core's global tensors (see the module docstring); ``tables`` is what
    the source convention tells the reader (which dim each local tensor is split on, the args checks).

    Raises:
        SourceError: no ``tables`` (without them no global shape can be known), or the checkpoint is malformed.
        ConfigError: the args contradict ``model``'s config (before any vocab padding is checked).
    """
    if tables is None:
        raise SourceError(
            f"'{root}': the {NAME} format records no global shapes, and its reader was not told how Megatron-Core "
            "splits each tensor over TP ranks; read it with ckpttool.read_layout, which tells it"
        )
    directory = megatron.iteration_dir(root)
    prefix = "" if directory == root else f"{directory.relative_to(root)}/"
    dirs = [p.name for p in _subdirs(directory) if _RANK_DIR.match(p.name)]
    if not dirs:
        raise SourceNotFoundError(f"'{directory}': no mp_rank_* directories")
    states: dict[str, dict[str, Any]] = {}
    for name in dirs:
        rel = f"{prefix}{name}/{FILE}"
        if contained(root, rel).is_file():  # a link out of the source (the rank folder or the file) is refused
            with open_inside(root, rel) as f:
                state = megatron.scan_checkpoint(f, label=f"{prefix}{name}/{FILE}")
            if not isinstance(state, dict):
                raise SourceError(f"'{prefix}{name}/{FILE}': not a Megatron checkpoint (no state dict)")
            states[name] = state
    if not states:
        raise SourceNotFoundError(f"'{directory}': no mp_rank_*/{FILE} file")
    first = next(iter(states))
    args = states[first].get("args")
    if args is None:
        raise SourceError(f"'{prefix}{first}/{FILE}': no 'args'; ckpttool needs them for the parallel layout")
    for name, state in states.items():
        if state.get("args") is not None:
            expect(state["args"], (Record, dict), "args (the training arguments)", f"{prefix}{name}/{FILE}")
    parallel = megatron.parallel_of(args, f"{prefix}{first}/{FILE}")
    said = {**parallel, "num_layers": megatron.arg(args, "num_layers")}
    for name, state in states.items():
        other = {**megatron.parallel_of(state.get("args"), f"{prefix}{name}/{FILE}"),
                 "num_layers": megatron.arg(state.get("args"), "num_layers")}
        if other != said:
            raise SourceError(
                f"'{prefix}{name}/{FILE}': its args say {other}, but '{prefix}{first}/{FILE}' says {said}. "
                "Are two checkpoints mixed in one directory?"
            )
    if model is not None:
        tables.check_args(megatron.args_view(args), model, f"{prefix}{first}/{FILE}")
    tp, pp, ep = parallel["tp"], parallel["pp"], parallel["ep"]
    if tp > 99 or pp > 999 or ep > 999 or tp * pp * ep > 64 * len(dirs):
        raise SourceError(
            f"'{prefix}{first}/{FILE}': its args say tp={tp} pp={pp} ep={ep}, that is {tp * pp * ep} rank directories "
            f"(mp_rank_TT[_PPP][_EEE], at most 99 x 999 x 999), but {len(dirs)} are there; are these the args of "
            "this checkpoint?"
        )
    ranks = (_Rank(t, p, e) for p in range(pp) for t in range(tp) for e in range(ep))
    expected = {_dir_name(r, pp, ep): r for r in ranks}
    strangers = sorted(set(dirs) - set(expected))
    if strangers:
        raise SourceError(
            f"'{prefix}{strangers[0]}': does not fit the args' layout tp={tp} pp={pp} ep={ep} "
            f"(expected {', '.join(sorted(expected)[:4])}{', ...' if len(expected) > 4 else ''})"
        )
    builder = LayoutBuilder(str(root), NAME)
    builder.set_parallel(**parallel)
    reader = _Placer(builder, args, model, prefix, f"{prefix}{first}/{FILE}", tables)
    lost = []
    for name, rank in expected.items():
        if name in states:
            reader.place(f"{prefix}{name}/{FILE}", states[name], rank, present=True)
            continue
        donor = _donor(rank, expected, states)
        if donor is None:
            lost.append(_lost_stage(f"{prefix}{name}/{FILE}", rank, args, parallel))
        else:
            reader.place(f"{prefix}{name}/{FILE}", states[donor], rank, present=False)
    if lost:
        raise SourceError(
            "pipeline stages are missing, and no other file of those stages remains to tell their tensors:\n"
            + "\n".join(f"  - {line}" for line in lost) + "\nRestore them."
        )
    notes = [f"skipped {reader.skipped} non-weight entries (_extra_state)"] if reader.skipped else []
    if model is None:
        notes.append("no config: tensor names are Megatron-Core's global names (pass --config for HuggingFace names)")
    return megatron_fp8.with_notes(builder.build(notes), megatron.fp8_flags(args))


def _lost_stage(file: str, rank: _Rank, args: Any, parallel: dict[str, int]) -> str:
    """What a missing file with no sibling of its stage held: its layers, and the embedding or output layer."""
    layers = megatron.int_arg(args, "num_layers", file)
    pp, vpp = parallel["pp"], parallel.get("vpp", 1)
    lo = _layer_offset(args, layers, rank.pp, 0, pp, vpp, file)
    hi = _layer_offset(args, layers, rank.pp + 1, 0, pp, vpp, file) if rank.pp + 1 < pp else layers
    parts = [f"layers {lo}..{hi - 1}" if vpp == 1 else f"layers from {lo} (virtual stages)"]
    if rank.pp == 0:
        parts.insert(0, "embedding.word_embeddings.weight")
    if rank.pp == pp - 1:
        mtp = megatron.int_arg(args, "mtp_num_layers", file)  # MTP layers sit on the last stage
        parts.append("decoder.final_layernorm.weight and output_layer.weight"
                     + (f", mtp.layers.0..{mtp - 1}" if mtp else ""))
    return f"'{file}' (pipeline stage {rank.pp}, tp rank {rank.tp}, ep rank {rank.ep}): {', '.join(parts)}"


def _dir_name(rank: _Rank, pp: int, ep: int) -> str:
    """Megatron-LM's ``get_checkpoint_name``: ``mp_rank_TT``, ``_PPP`` when pp > 1, ``_EEE`` when ep > 1."""
    return f"mp_rank_{rank.tp:02d}" + (f"_{rank.pp:03d}" if pp > 1 else "") + (f"_{rank.ep:03d}" if ep > 1 else "")


def _donor(rank: _Rank, expected: dict[str, _Rank], states: dict[str, Any]) -> str | None:
    """A present file of the same pipeline stage, to tell which regions a missing file held."""
    same_stage = [(n, r) for n, r in expected.items() if n in states and r.pp == rank.pp]
    same_stage.sort(key=lambda nr: (nr[1].ep != rank.ep, nr[1].tp != rank.tp))
    return same_stage[0][0] if same_stage else None


class _Placer:
    """Turns one rank's local state dict into pieces of the global tensors."""

    def __init__(self, builder: LayoutBuilder, args: Any, model: ModelInfo | None, prefix: str, args_file: str,
                 tables: ConventionTables) -> None:
        self.builder = builder
        self.tables = tables
        self.args = args
        self.model = model
        self.prefix = prefix
        self.skipped = 0
        self.parallel = builder.parallel
        arg = megatron.arg
        self.layers = megatron.int_arg(args, "num_layers", args_file)
        self.experts = megatron.int_arg(args, "num_experts", args_file)
        self.mtp_layers = megatron.int_arg(args, "mtp_num_layers", args_file)
        self.full_rows = {  # the rows of a tensor split on rows or whole, from the args the table names
            suffix: (sum(megatron.int_arg(args, name, args_file) for name in names), " + ".join(names))
            for suffix, names in tables.either
        }
        self.paired = any(bool(arg(args, name, default)) for name, default in tables.paired_when)
        etp = arg(args, "expert_tensor_parallel_size")
        self.expert_tp = int(etp) if isinstance(etp, int) and etp > 0 else self.parallel["tp"]
        if self.expert_tp not in (1, self.parallel["tp"]):
            raise SourceError(
                f"expert_tensor_parallel_size {self.expert_tp} with tp {self.parallel['tp']}: ckpttool reads expert "
                "tensor parallelism equal to tp or 1"
            )
        self.padding: dict[str, tuple] = {}

    def place(self, file: str, state: dict[str, Any], rank: _Rank, *, present: bool) -> None:
        chunks = sorted(k for k in state if re.fullmatch(r"model\d*", str(k)))
        if not chunks:
            raise SourceError(f"'{file}': no 'model' entry")
        vpp = self.parallel.get("vpp", 1)
        for key in chunks:
            chunk = int(key[5:]) if key != "model" else 0
            weights = state[key]
            if not isinstance(weights, dict):
                raise SourceError(f"'{file}': '{key}' is not a state dict")
            offset = _layer_offset(self.args, self.layers, rank.pp, chunk, self.parallel["pp"], vpp, file)
            for local_name, tensor in weights.items():
                if str(local_name).endswith("_extra_state") or not isinstance(tensor, StoredTensor):
                    self.skipped += present
                    continue
                self._place_one(file, f"{key}.{local_name}" if len(chunks) > 1 else str(local_name),
                                str(local_name), tensor, rank, offset, present)

    def _place_one(self, file: str, key: str, name: str, t: StoredTensor, rank: _Rank, offset: int,
                   present: bool) -> None:
        fqn, expert = self._global_name(name, rank, offset, file)
        split = self.expert_tp if expert else self.parallel["tp"]
        tp_rank = rank.tp if split > 1 else 0
        dim = 0 if name.endswith(self.tables.column) else 1 if name.endswith(self.tables.row) else None
        dim = self._down_dim(file, key, name, t.shape, split) if dim is None else dim
        if split == 1:
            dim = None
        if dim is not None and len(t.shape) <= dim:
            raise SourceError(f"'{file}': '{key}' has shape {list(t.shape)}, not a tensor split on dim {dim}")
        shape = list(t.shape)
        if dim is not None:
            shape[dim] *= split
        where = f"'{file}'"
        if present:
            t.required_offset(file, key)
        if fqn in megatron.VOCAB_TENSORS and fqn not in self.padding and shape:
            self.padding[fqn] = megatron.vocab_padding(fqn, shape[0], self.args, self.model, file)
        if not self.builder.declare(fqn, shape, t.dtype, where=where, padding=self.padding.get(fqn, ())):
            return
        base = t.byte_offset() or 0
        tags = (("tp_rank", rank.tp), ("pp_stage", rank.pp)) + ((("ep_rank", rank.ep),) if expert else ())
        if name.endswith(self.tables.paired) and self.paired and split > 1:
            # [gate_r; up_r] on this rank -> gate rows r*f.. and up rows F + r*f.. of the global [gate; up]
            if t.shape[0] % 2 or not t.shape[0]:
                raise SourceError(f"'{file}': '{key}' has {t.shape[0]} rows, not a SwiGLU [gate; up] pair")
            half = t.shape[0] // 2
            row_bytes = (t.numel // t.shape[0]) * itemsize(t.dtype)
            for part, start in ((0, tp_rank * half), (1, shape[0] // 2 + tp_rank * half)):
                box = Box((start, *(0 for _ in t.shape[1:])), (half, *t.shape[1:]))
                piece = Piece(file, key, box, t.dtype, RAW, base + part * half * row_bytes, half * row_bytes, tags)
                self.builder.add(fqn, piece, present=present)
            return
        offsets = [0] * len(t.shape)
        if dim is not None:
            offsets[dim] = tp_rank * t.shape[dim]
        piece = Piece(file, key, Box(tuple(offsets), t.shape), t.dtype, RAW, base, t.numel * itemsize(t.dtype), tags)
        self.builder.add(fqn, piece, present=present)

    def _down_dim(self, file: str, key: str, name: str, shape: tuple[int, ...], split: int) -> int | None:
        """A tensor the table splits on rows or keeps whole (MLA's down projections): split on rows when a rank holds
        ``1/tp`` of the rows the args give, whole on every rank when it holds them all."""
        suffix = next((s for s in self.full_rows if name.endswith(s)), None)
        if suffix is None or split == 1:
            return None
        (full, what), rows = self.full_rows[suffix], shape[0] if shape else 0
        if full and rows in (full, full / split):
            return None if rows == full else 0
        why = (f"neither the {full} rows of the args' {what} nor a 1/{split} tensor-parallel share of them" if full
               else f"the args record no {what} to tell whether tensor-parallel ranks split it")
        raise SourceError(f"'{file}': '{key}' has {rows} rows: {why}")

    def _global_name(self, name: str, rank: _Rank, offset: int, file: str) -> tuple[str, bool]:
        """``decoder.layers.<global>.`` and ``mlp.experts.<global expert>.``; whether it is an expert tensor."""
        mtp = _MTP_LAYER.match(name)
        match = _LAYER.match(name)
        if mtp is not None:
            if self.mtp_layers and int(mtp.group(2)) >= self.mtp_layers:
                raise SourceError(f"'{file}': '{name}' is MTP layer {mtp.group(2)}, but the args say mtp_num_layers "
                                  f"{self.mtp_layers}")
            prefix, rest = mtp.group(1), mtp.group(3)
        elif match is not None:
            layer = offset + int(match.group(1))
            if self.layers and layer >= self.layers:
                raise SourceError(
                    f"'{file}': '{name}' is layer {layer} globally (stage offset {offset}), but the args say "
                    f"num_layers {self.layers}"
                )
            prefix, rest = f"decoder.layers.{layer}.", match.group(2)
        else:
            return name, False
        expert = _LOCAL_EXPERT.match(rest)
        if expert is None:
            return prefix + rest, False
        local = self.experts // self.parallel["ep"] if self.experts else 0
        number = rank.ep * local + int(expert.group(1))
        if local and int(expert.group(1)) >= local:
            raise SourceError(
                f"'{file}': '{name}' is local expert {expert.group(1)}, but num_experts {self.experts} over "
                f"ep {self.parallel['ep']} gives {local} per rank"
            )
        return f"{prefix}mlp.experts.{number}.{expert.group(2)}", True


def _layer_offset(args: Any, layers: int, stage: int, chunk: int, pp: int, vpp: int, file: str) -> int:
    """The global index of a stage's (virtual chunk's) first layer, as Megatron-Core's
    ``get_transformer_layer_offset`` computes it from the args."""
    arg = megatron.arg
    first = arg(args, "decoder_first_pipeline_num_layers")
    last = arg(args, "decoder_last_pipeline_num_layers")
    first = None if first is None else integer(first, "args.decoder_first_pipeline_num_layers", file)
    last = None if last is None else integer(last, "args.decoder_last_pipeline_num_layers", file)
    if pp == 1 and vpp == 1:
        return 0
    if first is None and last is None:
        if layers % (pp * vpp):
            raise SourceError(f"'{file}': num_layers {layers} does not divide over pp {pp} x vpp {vpp}")
        per_chunk = layers // (pp * vpp)
        return chunk * (layers // vpp) + stage * per_chunk
    if vpp > 1:
        raise SourceError(f"'{file}': uneven pipeline stages with virtual stages are not supported yet")
    middle = pp - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    if middle and rest % middle:
        raise SourceError(f"'{file}': {rest} middle layers do not divide over {middle} middle stages")
    per_middle = rest // middle if middle else 0
    sizes = [per_middle] * pp
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    return sum(sizes[:stage])


READER = FormatReader(NAME, LOOKS_FOR, matches, read)
