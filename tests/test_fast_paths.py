"""The fast paths a plan of many tensors takes (issue 19) give what the general code gives: layouts built in one
call, the peak-memory prediction from one target per signature, one output file without huggingface_hub, target
sizes summed at C speed, quantization links checked once per signature."""

from __future__ import annotations

import pytest
from conftest import FIXTURE_NAMES, fixture_dir
from test_quantized import DEEPSEEK, GPT_OSS, checkpoint

import ckpttool
from ckpttool.execute.buffers import distinct_targets
from ckpttool.execute.buffers import predict_peak_bytes as stream_peak_bytes
from ckpttool.execute.buffers import chunks
from ckpttool.layout.layout import Box, Piece
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.plan.plan import target_sizes
from ckpttool.errors import SourceError
from ckpttool.quant.checks import check_tensors
from ckpttool.quant.formats import read_quantization
from ckpttool.writers.hf import assign_files, predict_peak_bytes


def _plans() -> list:
    plans = [ckpttool.prepare(fixture_dir(name) / "checkpoint").plan for name in FIXTURE_NAMES]
    plans += [ckpttool.prepare(fixture_dir(name) / "checkpoint", dtype="float16").plan for name in FIXTURE_NAMES[:3]]
    plans += [ckpttool.prepare(checkpoint(name), dtype="bfloat16").plan for name in (DEEPSEEK, GPT_OSS)]
    plans += [ckpttool.prepare(checkpoint(name)).plan for name in (DEEPSEEK, GPT_OSS)]
    return plans


def test_the_peak_predicted_from_distinct_targets_is_the_one_from_every_target():
    for plan in _plans():
        every = [c for t in plan.targets for c in chunks(t, 0)]
        for workers in (1, 3):
            assert predict_peak_bytes(plan, workers) == stream_peak_bytes(every, workers)
        assert len(distinct_targets(plan.targets)) <= len(plan.targets)


def test_targets_of_one_signature_count_once_and_others_each():
    box, other = Box((0, 0), (4, 8)), Box((0, 0), (4, 8))
    from ckpttool.plan.tiling import Copy
    from ckpttool.plan.plan import Target

    def whole(name: str, dtype: str = "F32", b: Box = box) -> Target:
        piece = Piece(f"{name}.safetensors", name, b, dtype)
        return Target(name, (4, 8), dtype, dtype, (Copy(piece, b, b),), (name,))

    a, b, c = whole("a"), whole("b"), whole("c", "F16")
    d = Target("d", (4, 8), "F32", "F32", (Copy(a.copies[0].piece, box, other),), ("a",))  # boxes equal, not one
    assert distinct_targets([a, b, c, d, whole("e", b=other)]) == [a, c, d]


def test_target_sizes_are_the_targets_nbytes():
    for plan in _plans():
        assert list(target_sizes(plan.targets)) == [t.nbytes for t in plan.targets]
        assert plan.nbytes == sum(t.nbytes for t in plan.targets)
        assert plan.largest_target_bytes() == max(t.nbytes for t in plan.targets)


@pytest.mark.parametrize("limit", [10**12, "5GB", 3000, 1])
def test_files_assigned_as_huggingface_hub_assigns_them(limit):
    from huggingface_hub import split_state_dict_into_shards_factory

    from ckpttool.writers.hf import _shard_size

    for plan in _plans():
        by_name = {t.name: t for t in plan.targets}
        split = split_state_dict_into_shards_factory(by_name, get_storage_size=lambda t: t.nbytes,
                                                     filename_pattern="model{suffix}.safetensors",
                                                     max_shard_size=_shard_size(limit))
        expected = [(name, tuple(by_name[n] for n in names)) for name, names in split.filename_to_tensors.items()]
        assert [(f.name, f.targets) for f in assign_files(plan, limit)] == expected


def _pieces(shapes: list[tuple[int, ...]], offsets: list[tuple[int, ...]] | None = None) -> list[Piece]:
    offsets = offsets or [(0,) * len(s) for s in shapes]
    return [Piece(f"f{i}", f"t{i}", Box(o, s), "F32", byte_length=4) for i, (s, o) in enumerate(zip(shapes, offsets))]


@pytest.mark.parametrize("names, shapes, offsets", [
    (["a", "b", "c"], [(2, 3), (4,), ()], None),  # the common case: at C speed
    (["a", "b", "a"], [(2, 3), (4,), (2, 3)], None),  # a name twice: one at a time, as add_whole has it
    (["a", "b"], [(2, 0), (4,)], None),  # an empty tensor: declared, no piece
    (["a", "b"], [(2, 3), (4,)], [(0, 0), (1,)]),  # a piece off its origin: outside the shape it declares
])
def test_adding_wholes_at_once_builds_what_adding_them_one_at_a_time_builds(names, shapes, offsets):
    one, bulk = LayoutBuilder("root", "hf"), LayoutBuilder("root", "hf")
    one.add_whole("first", _pieces([(1,)])[0], where="'x'")
    bulk.add_whole("first", _pieces([(1,)])[0], where="'x'")
    pieces = _pieces(shapes, offsets)
    for name, piece in zip(names, pieces):
        one.add_whole(name, piece, where=f"'{piece.file}'")
    bulk.add_wholes(names, pieces, [f"'{p.file}'" for p in pieces])
    try:
        expected = one.build()
    except SourceError as e:
        with pytest.raises(SourceError) as found:
            bulk.build()
        assert str(found.value) == str(e)
        return
    built = bulk.build()
    assert built == expected and list(built.tensors) == list(expected.tensors)


def test_a_link_with_a_problem_among_sound_ones_is_named_where_it_was():
    quant = read_quantization({"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}})
    tensors = {}
    for i in range(4):
        tensors[f"l{i}.weight"] = ("F8_E4M3", (32, 32))
        tensors[f"l{i}.weight_scale_inv"] = ("F32", (2, 2) if i != 2 else (3, 2))
    tensors["l5.weight"] = ("F8_E4M3", (32, 32))
    tensors["l5.weight_scale_inv"] = ("F16", (3, 2))
    found = check_tensors(tensors, quant, has_config=True)
    assert [(p.code, p.tensor) for p in found] == [
        ("quant-scale-shape", "l2.weight_scale_inv"), ("quant-scale-shape", "l5.weight_scale_inv")]
    assert "'l2.weight_scale_inv' has shape [3, 2], but 'l2.weight' [32, 32] in 16x16 blocks" in found[0].message


def _gc_after(argv: list[str], code: str, first: str = "") -> list[str]:
    """What a fresh interpreter whose argv is ``argv`` (the command's, when argv[0] is ``ckpttool``) prints."""
    import subprocess
    import sys

    probe = f"import sys\nsys.argv = {argv!r}\nimport gc\n{first}\nimport ckpttool\n{code}"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()


def test_a_planning_command_collects_no_garbage_until_its_plan_is_built():
    plan = f"print(gc.isenabled(), gc.get_freeze_count() > 0)\nckpttool.prepare({str(fixture_dir(FIXTURE_NAMES[0]) / 'checkpoint')!r})\n"
    shown = "print(gc.isenabled(), gc.get_freeze_count() > 0, gc.get_threshold()[0])"
    assert _gc_after(["ckpttool", "merge", "x", "--dry-run"], plan + shown) == ["False", "False", "True", "True", "100000"]
    assert _gc_after(["ckpttool", "-v", "audit", "x"], shown) == ["False", "False", "100000"]
    # a command that plans nothing, and a program that imports ckpttool: the collector as it was
    assert _gc_after(["ckpttool", "verify", "x"], shown) == ["True", "False", "100000"]
    torchrun = "import os\nos.environ['WORLD_SIZE'] = '2'"  # its process groups are collected as they always were
    assert _gc_after(["ckpttool", "split", "x"], plan + shown, torchrun) == ["True", "False", "True", "False", "100000"]
    assert _gc_after(["program.py", "merge"], plan + shown) == ["True", "False", "True", "False", "700"]


def test_a_family_rule_applies_where_it_matches_whatever_the_filter_before_it():
    from ckpttool.layout.layout import TensorLayout
    from ckpttool.plan.plan import tensor_specs
    from ckpttool.families import mixtral, qwen2_moe
    from ckpttool.families.rules import Rename, _any_rule, cut

    backref = (Rename(r"^(\w+)\.\1$", r"\1.twice"), Rename(r"^x(?i:Y)$", "xy"))
    names = ["m.layers.0.mlp.gate.weight", "m.layers.0.mlp.experts.gate_up_proj", "m.layers.0.mlp.experts.down_proj",
             "m.layers.0.mlp.experts.0.down_proj.weight", "a.a", "a.b", "xy", "xY", "m.mlp.experts.down_proj.x"]
    for rules in (mixtral.RULES, qwen2_moe.RULES, backref):
        for name in names:
            tensor = TensorLayout(name, (2, 4, 3), "F32", ())
            expected = tensor_specs(tensor, name)
            for rule in rules:  # the rules as cut applied them before any filter
                match = __import__("re").match(rule.pattern, name)
                if match is not None:
                    expected = (tensor_specs(tensor, match.expand(rule.replacement)) if isinstance(rule, Rename)
                                else cut(tensor, name, (rule,)))
                    break
            assert cut(tensor, name, rules) == expected
    assert _any_rule(backref).pattern == ""  # a backreference: no alternation, every rule tried


def test_links_of_shapes_given_as_lists_are_checked_one_by_one():
    quant = read_quantization({"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}})
    tensors = {"a.weight": ("F8_E4M3", [32, 32]), "a.weight_scale_inv": ("F32", [3, 2]),
               "b.weight": ("F8_E4M3", [32, 32]), "b.weight_scale_inv": ("F32", (2, 2))}
    assert [(p.code, p.tensor) for p in check_tensors(tensors, quant, has_config=True)] == [
        ("quant-scale-shape", "a.weight_scale_inv")]
