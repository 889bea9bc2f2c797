"""One target's LoRA delta as data (:class:`LoraDelta`), and the fuse of a chunk of rows, with PEFT 0.21's arithmetic.

PEFT's ``lora.Linear.merge`` (``safe_merge=False``) does ``base_layer.weight.data += get_delta_weight(adapter)``, and
``get_delta_weight`` computes ``transpose(B @ A, fan_in_fan_out) * scaling`` in the dtype the adapter's weights have
in memory. ``PeftModel.from_pretrained`` and ``get_peft_model`` hold them in float32 whatever the file stores
(``autocast_adapter_dtype=True``, their default, upcasts bf16 / fp16 adapters: an exact cast), so the delta is a
float32 product, and the in-place add promotes: a bf16 base plus a float32 delta is computed in float32 and rounded to
bf16 once. (An adapter loaded with ``autocast_adapter_dtype=False`` keeps bf16 weights; PEFT then rounds the delta
to bf16 before the add, one rounding ckpttool does not make: up to half a bf16 ulp of the delta apart.)
:func:`fuse_rows` does exactly that for rows ``start..stop`` of the weight: ``B[start:stop] @ A`` (or, with
``fan_in_fan_out``, ``(B @ A[:, start:stop]).T``).

Where the bytes can differ from PEFT's: each element of a matrix product is a dot product over ``r``, but a CPU
kernel (torch's oneDNN / MKL sgemm) computes a full block of rows with one micro-kernel and the rows left over
with another, whose float32 sums may round differently in the last bit. So a chunk of 3 rows is not bit for bit the
same 3 rows of the whole product (measured: blocks of 1, 2, 3 or 7 rows differ, blocks of 16 or more rows starting
at multiples of 16 agree). The executor cuts a fused target into chunks of :data:`ROW_ALIGN` rows (256, a multiple
of every row block of those kernels), so each chunk's blocks are the whole product's: bit-exact with
``merge_and_unload`` on the fixtures (every target of fewer than 256 rows is one chunk) and with the whole product on
a 1000-row target. On a kernel whose row block does not divide 256 a chunk's rows can differ from PEFT's by the last
bit of a float32 sum, at most one rounding of the weight's dtype: tests/test_lora.py bounds it for chunks of 7 rows
and a rank of 512.
Several adapters on one weight are added one after another, each rounded to the weight's dtype, as PEFT's merges of
adapters loaded one after another are.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

from ckpttool.errors import SourceError
from ckpttool.fast.deferred import torch
from ckpttool.io.dtypes import dtype_name, itemsize, torch_dtype
from ckpttool.io.paths import source_os_error

#: the executor's per-thread buffers: ``scratch(name, shape, dtype)`` (:meth:`ckpttool.execute.reads.Reader.scratch`)
Scratch = Callable[[str, tuple[int, ...], str], "torch.Tensor"]

#: a fused target's chunks are whole blocks of this many rows (see the module docstring)
ROW_ALIGN = 256
#: adapter dtypes PEFT holds in float32 in memory (``autocast_adapter_dtype``)
CAST_UP = ("BF16", "F16")


@dataclass(frozen=True, slots=True)
class AdapterTensor:
    """A tensor of an adapter's weights file, not loaded: its raw C-order elements lie at ``byte_offset`` of ``file``
    (a safetensors file, or the data entry of a ``torch.save`` archive, stored uncompressed)."""

    file: str
    key: str
    shape: tuple[int, ...]
    dtype: str
    byte_offset: int

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start..stop`` of the tensor, read with one ``pread`` (a fresh tensor: the adapter's rows are few).

        Raises:
            SourceError: the file cannot be read or is shorter than its header says.
        """
        row = math.prod(self.shape[1:]) * itemsize(self.dtype)
        nbytes, at = (stop - start) * row, self.byte_offset + start * row
        try:
            fd = os.open(self.file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                data = os.pread(fd, nbytes, at) if nbytes else b""
            finally:
                os.close(fd)
        except OSError as e:
            raise source_os_error(self.file, e) from None
        if len(data) != nbytes:
            raise SourceError(f"'{self.file}': '{self.key}' needs {nbytes} bytes at offset {at} but only {len(data)} "
                              "are there; the file is truncated")
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        return flat.view(torch_dtype(self.dtype)).reshape(stop - start, *self.shape[1:])


@dataclass(frozen=True, slots=True)
class LoraDelta:
    """``scaling * B @ A`` to add to a target (PEFT's delta of one adapter's module).

    Attributes:
        adapter: the adapter folder, for messages.
        module: the module's name in the base (``model.layers.0.self_attn.q_proj``).
        a, b: ``lora_A.weight`` ``(r, in)`` and ``lora_B.weight`` ``(out, r)``.
        scaling: ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), per module with rank and alpha patterns.
        fan_in_fan_out: the base weight is stored ``(in, out)`` (GPT-2's ``Conv1D``); the delta is transposed.
        rounded: the delta is rounded to the weight's dtype before the add (LoRA on a parameter, PEFT's
            ``ParamWrapper``, which casts its delta to the parameter's dtype).
        experts: LoRA on a stacked expert parameter ``(E, out, in)`` (``ParamWrapper``): A is ``(r*E, in)``, one
            block of ``r`` rows per expert, and B ``(out, r*E)``, its columns interleaved by expert, so
            expert ``e``'s delta is ``B[:, e::E] @ A[e*r:(e+1)*r] * scaling`` (PEFT's
            ``einsum("o r e, e r i -> e o i")``, bit for bit: tests/test_lora_experts.py). 1 for a matrix.
        expert: which expert's delta this target takes.
        row_offset: the target's rows are the expert's delta rows from here (``w3`` is the second half of
            ``gate_up_proj``).
        parameters: before it is attached, the stacked parameters (in-memory names, ``...mlp.experts.down_proj``)
            the delta may be on; PEFT's keys do not say which, the shapes do (:func:`ckpttool.lora.attach`).
        stacked: LoRA on a stacked expert parameter that stays stacked on disk (gpt-oss's ``mlp.experts.gate_up_proj``
            ``(E, H, 2I)``): the target's rows are experts, and ``stacked`` is the output of PEFT's einsum, ``"e i o"``
            for a parameter stored ``(E, in, out)`` (transformers' ``is_transposed`` experts, gpt-oss's) or
            ``"e o i"`` for ``(E, out, in)``; rows ``start..stop`` are ``einsum("o r e, e r i -> " + stacked)`` of
            those experts' blocks of A and columns of B, as ``ParamWrapper.get_delta_weight`` computes the whole.
        upcast: a bf16 / fp16 adapter is computed in float32 (PEFT's ``autocast_adapter_dtype``); False: in its own
            dtype, the product rounded to it and scaled in it before the add, as Megatron-Bridge's ``LoRAMerge``
            computes ``base + alpha / dim * (linear_out @ linear_in)`` on a bf16 model.
    """

    adapter: str
    module: str
    a: AdapterTensor
    b: AdapterTensor
    scaling: float
    fan_in_fan_out: bool = False
    rounded: bool = False
    experts: int = 1
    expert: int = 0
    row_offset: int = 0
    parameters: tuple[str, ...] = ()
    stacked: str = ""
    upcast: bool = True

    @property
    def rank(self) -> int:
        return self.a.shape[0] // self.experts

    def rows(self, start: int, stop: int, scratch: Scratch | None = None) -> torch.Tensor:
        """Rows ``start..stop`` of the delta as PEFT's ``get_delta_weight`` computes them (float32, or float64 for a
        float64 adapter): the product into ``scratch("lora", shape, dtype)`` when given (the executor's per-thread
        buffer, reused chunk after chunk), scaled in place: the same operations, so the same bits."""
        if self.stacked:
            return self._stacked_rows(start, stop)
        if self.experts > 1:  # this expert's block of A and its interleaved columns of B
            a = self.a.read_rows(self.expert * self.rank, (self.expert + 1) * self.rank)
            b = self.b.read_rows(self.row_offset + start, self.row_offset + stop)[:, self.expert::self.experts]
        elif self.fan_in_fan_out:
            a = self.a.read_rows(0, self.a.shape[0])[:, start:stop]
            b = self.b.read_rows(0, self.b.shape[0])
        else:
            a = self.a.read_rows(0, self.a.shape[0])
            b = self.b.read_rows(self.row_offset + start, self.row_offset + stop)
        if self.upcast and self.b.dtype in CAST_UP:
            a, b = a.float(), b.float()
        if scratch is None:
            product = b @ a
        else:
            dtype = dtype_name(b.dtype)
            product = torch.matmul(b, a, out=scratch("lora", (b.shape[0], a.shape[1]), dtype))
        return (product.T if self.fan_in_fan_out else product).mul_(self.scaling)

    def _stacked_rows(self, start: int, stop: int) -> torch.Tensor:
        """Experts ``start..stop`` of a stacked parameter's delta: PEFT's einsum on their blocks of A ``(n, r, in)``
        and their columns of B ``(out, r, n)`` (a fresh tensor: einsum writes no buffer of ours), then scaled."""
        r, n = self.rank, stop - start
        a = self.a.read_rows(start * r, stop * r).reshape(n, r, self.a.shape[1])
        b = self.b.read_rows(0, self.b.shape[0]).reshape(self.b.shape[0], r, self.experts)[:, :, start:stop]
        if self.b.dtype in CAST_UP:
            a, b = a.float(), b.float()
        return torch.einsum(f"o r e, e r i -> {self.stacked}", b, a).mul_(self.scaling)

    def temporary_bytes(self, rows: int) -> int:
        """What :meth:`rows` reads and converts besides its product, for ``rows`` rows of a weight: A and the rows
        of B (B whole with ``fan_in_fan_out``; every expert's columns of them for a stacked parameter), and their
        float32 copies. For a parameter stacked on disk (``rows`` experts): their blocks of A, B whole, their
        float32 copies, and the product rounded to the weight's dtype before the add (counted at 4 bytes)."""
        if self.stacked:
            product = rows * self.a.shape[1] * self.b.shape[0]
            return (rows * self.rank * self.a.shape[1] + self.b.shape[0] * self.b.shape[1]) * (
                itemsize(self.a.dtype) + 4) + product * 4
        b_rows = self.b.shape[0] if self.fan_in_fan_out else rows
        return (self.rank * self.a.shape[1] + b_rows * self.b.shape[1]) * (itemsize(self.a.dtype) + 4)

    def product_bytes(self, rows: int, cols: int) -> int:
        """The product buffer (``scratch("lora")``) for ``rows`` rows of a weight of ``cols`` columns; the same for
        :func:`fuse_rows`'s ``lora-add`` buffer (the weight widened to the product's dtype, or the delta rounded to
        the weight's, never wider)."""
        return rows * cols * (8 if self.b.dtype == "F64" else 4)


def fuse_rows(weight: torch.Tensor, deltas: tuple[LoraDelta, ...], start: int, stop: int,
              scratch: Scratch | None = None) -> torch.Tensor:
    """Rows ``start..stop`` of the fused weight, in ``weight``'s dtype: each delta added in turn as PEFT's
    ``merge`` adds it (``weight += delta``: computed in the promoted dtype, rounded to the weight's once). With
    ``scratch`` (the executor's per-thread buffers), ``weight`` is a buffer of the thread's own, added to in place,
    and the product goes to the ``lora`` buffer; without, ``weight`` is left as it is and a new tensor returned."""
    out = weight if scratch is not None else weight.clone()
    for delta in deltas:
        rows = delta.rows(start, stop, scratch)
        if rows.dtype == out.dtype:
            out += rows
        elif delta.rounded:  # the delta rounded to W's dtype first (copy_ rounds as .to does), in a buffer of ours
            out += _like(scratch, rows, out.dtype).copy_(rows)
        else:  # PEFT's promoted add, float(W) + delta rounded once: W widened exactly in a buffer of ours (torch's
            # promoting add would widen it in a fresh tensor per chunk, which lets each thread's heap grow)
            out.copy_(rows.add_(_like(scratch, out, rows.dtype).copy_(out)))  # (x + y == y + x in IEEE arithmetic)
    return out


def _like(scratch: Scratch | None, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``tensor``'s shape in ``dtype``: the thread's ``lora-add`` buffer, or a fresh one without scratch."""
    if scratch is None:
        return torch.empty(tensor.shape, dtype=dtype)
    return scratch("lora-add", tuple(tensor.shape), dtype_name(dtype))

