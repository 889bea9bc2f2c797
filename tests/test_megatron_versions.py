"""Megatron checkpoints written by several megatron-core releases (``fixtures/make_megatron_versions.py``).

Each fixture ``megatron_v<major>_<minor>_<case>`` holds one small model saved by that release both ways
(``legacy/``, ``torch_dist/``), the full weights as Megatron itself gathered them (reference/) and Megatron's own
forward logits. For every (release, case, layout): the merge equals the reference bit for bit, transformers loads it
strictly and gives Megatron's logits, the audit of the source passes, and the two layouts of one run are equal.
The allow-list of pickled classes (:mod:`ckpttool.readers.megatron.allow`) is checked against what the releases write.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttool.readers import detect_format
from ckpttool.readers.megatron import allow as megatron_allow
from conftest import FIXTURES, assert_failed_cleanly, load_output, tree_digest

VERSIONED = sorted(p.name for p in FIXTURES.glob("megatron_v*_*") if (p / "producer.json").is_file())
FORMATS = {"legacy": "megatron-legacy", "torch_dist": "megatron-dist"}
SOURCES = [(name, fmt) for name in VERSIONED for fmt in sorted(FORMATS) if (FIXTURES / name / fmt).is_dir()]


def release(path: Path) -> str:
    """The megatron-core release that wrote a fixture (its ``producer.json``)."""
    producer = json.loads((path / "producer.json").read_text())["producer"]
    return re.match(r"megatron-core (\d+\.\d+\.\d+)", producer).group(1)


def test_the_matrix_is_there():
    """At least four releases from 0.9 to 0.16, each with a dense TP x PP and an MoE EP case, both layouts."""
    releases = {release(FIXTURES / n) for n in VERSIONED}
    assert {"0.9.0", "0.16.1"} <= releases and len(releases) >= 4, releases
    for name in VERSIONED:
        assert {"legacy", "torch_dist"} <= {p.name for p in (FIXTURES / name).iterdir()}, name
    assert set(megatron_allow.RELEASES) == releases | {"0.16.1"}


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """Each (fixture, layout) merged once through the CLI, shared by the tests that read the output."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    done: dict[tuple[str, str], Path] = {}

    def get(name: str, fmt: str) -> Path:
        if (name, fmt) not in done:
            out = tmp_path_factory.mktemp(f"{name}-{fmt}") / "out"
            src = FIXTURES / name / fmt
            before = tree_digest(src)
            result = CliRunner().invoke(main, ["merge", str(src), str(out), "--config", str(FIXTURES / name / "config.json"),
                                               "-q"])
            assert result.exit_code == 0, result.output
            assert tree_digest(src) == before
            done[(name, fmt)] = out
        return done[(name, fmt)]

    return get


@pytest.mark.parametrize(("name", "fmt"), SOURCES)
def test_detected_as_megatron(name, fmt):
    assert detect_format(FIXTURES / name / fmt) == FORMATS[fmt]


@pytest.mark.parametrize(("name", "fmt"), SOURCES)
def test_merge_equals_megatrons_own_full_weights(merged, name, fmt):
    got = load_output(merged(name, fmt))
    want = load_file(FIXTURES / name / "reference" / "model.safetensors")
    assert sorted(got) == sorted(want)
    differ = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert differ == []


@pytest.mark.parametrize(("name", "fmt"), SOURCES)
def test_transformers_loads_strictly_and_gives_megatrons_logits(merged, name, fmt):
    from transformers import AutoModelForCausalLM

    saved = load_file(FIXTURES / name / "logits.safetensors")
    model, info = AutoModelForCausalLM.from_pretrained(merged(name, fmt), dtype=torch.float32,
                                                       attn_implementation="eager", output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # nothing missing, unexpected or mismatched
    with torch.no_grad():
        logits = model(saved["tokens"]).logits
    vocab = json.loads((FIXTURES / name / "producer.json").read_text())["vocab"]
    assert logits.shape[-1] == vocab
    torch.testing.assert_close(logits, saved["logits"][..., :vocab], rtol=0, atol=1e-5)


@pytest.mark.parametrize(("name", "fmt"), SOURCES)
def test_audit_of_the_source_passes(cli, name, fmt):
    result = cli("audit", FIXTURES / name / fmt, "--config", FIXTURES / name / "config.json", "-q")
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output


@pytest.mark.parametrize("name", [n for n in VERSIONED if (FIXTURES / n / "legacy").is_dir()])
def test_the_two_layouts_of_one_run_are_equal(cli, name):
    config = FIXTURES / name / "config.json"
    result = cli("diff", FIXTURES / name / "legacy", FIXTURES / name / "torch_dist", "--config", config, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["equal"] and doc["differences"] == []


# ------------------------------------------------------------------------------------------------
# the allow-list names its releases
# ------------------------------------------------------------------------------------------------


def _pickled_classes(path: Path) -> set[tuple[str, str]]:
    """The (module, name) of every global a ``torch.save`` file's pickle names (read with pickletools, nothing run)."""
    import pickletools

    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
        elif op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
    return found


def _pickles(fixture: Path) -> list[Path]:
    return sorted(fixture.glob("legacy/iter_*/mp_rank_*/model_optim_rng.pt")) + sorted(fixture.glob("torch_dist/iter_*/common.pt"))


def _written() -> dict[tuple[str, str], set[str]]:
    """Every class of the table some Megatron fixture pickles -> the releases whose fixtures pickle it."""
    written: dict[tuple[str, str], set[str]] = {}
    table = {(a.module, a.name) for a in megatron_allow.TABLE}
    for fixture in sorted(FIXTURES.glob("megatron_*")):
        if not (fixture / "producer.json").is_file():
            continue
        for path in _pickles(fixture):
            for key in _pickled_classes(path) & table:
                written.setdefault(key, set()).add(release(fixture))
    return written


def test_every_class_the_releases_pickle_is_listed_with_them():
    """The table's ``written_by`` is what the fixtures show: each listed release writes the class, and no
    fixture's release writes a class the table does not list it for."""
    written = _written()
    assert written, "no Megatron fixture pickles a class of the table"
    for entry in megatron_allow.TABLE:
        key = (entry.module, entry.name)
        assert set(entry.written_by) == written.get(key, set()), (key, entry.written_by, written.get(key))


def test_no_fixture_pickles_a_class_outside_the_table():
    from ckpttool.io import torch_save

    for fixture in sorted(FIXTURES.glob("megatron_*")):
        for path in _pickles(fixture):
            with open(path, "rb") as f:
                torch_save.scan(f, label=path.name, allow=megatron_allow.ArgsAllow(path.name))  # refuses any other


def _rewrite_pickle(path: Path, old: bytes, new: bytes) -> None:
    """``path`` (a torch.save zip) with ``old`` replaced by ``new`` (same length) in its pickle."""
    with zipfile.ZipFile(path) as z:
        entries = [(info, z.read(info)) for info in z.infolist()]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as z:
        for info, data in entries:
            if info.filename.endswith("data.pkl"):
                assert data.count(old) == 1 and len(old) == len(new)
                data = data.replace(old, new)
            z.writestr(info, data)
    path.write_bytes(buffer.getvalue())


@pytest.mark.parametrize(("fmt", "file", "label"), [
    ("torch_dist", "iter_0000010/common.pt", "common.pt"),
    ("legacy", "iter_0000010/mp_rank_00/model_optim_rng.pt", "iter_0000010/mp_rank_00/model_optim_rng.pt"),
])
def test_an_unknown_megatron_class_is_refused_naming_it_and_the_releases(cli, tmp_path, fmt, file, label):
    name = next(n for n in VERSIONED if n.endswith("_tp2_pp2"))
    src = tmp_path / fmt
    shutil.copytree(FIXTURES / name / fmt, src)
    target = src / file.replace("mp_rank_00", "mp_rank_00_000")
    _rewrite_pickle(target, b"ModelType", b"ModelTypo")  # a class some other release might pickle
    before = tree_digest(src)
    out = tmp_path / "out"
    result = cli("merge", src, out, "--config", FIXTURES / name / "config.json", "-q")
    assert_failed_cleanly(
        result, out,
        f"'{label.replace('mp_rank_00', 'mp_rank_00_000')}': refused to unpickle: it asks for "
        "'megatron.core.enums.ModelTypo', a class of Megatron's that ckpttool does not know (nothing was executed); "
        "the checkpoint records no megatron-core version (megatron-core writes none). ckpttool reads the classes "
        f"that megatron-core {', '.join(megatron_allow.RELEASES)} write",
    )
    assert tree_digest(src) == before


def test_a_recorded_release_is_named_in_the_refusal():
    message = megatron_allow.refusal("common.pt", "megatron.core.enums.NewEnum", "0.19.2")
    assert message.startswith("'common.pt': refused to unpickle: it asks for 'megatron.core.enums.NewEnum'")
    assert "the checkpoint records megatron-core 0.19.2." in message


def test_the_releases_that_pickle_their_own_save_plan_in_the_dcp_metadata():
    """megatron-core 0.12 and 0.14 keep every rank's plan in ``.metadata`` as their ``MCoreSavePlan`` (an inert
    stand-in in ckpttool's metadata allow-list); 0.9 and 0.16 as torch's ``SavePlan``."""
    writes = {release(FIXTURES / n) for n in VERSIONED
              if b"MCoreSavePlan" in next((FIXTURES / n / "torch_dist").glob("iter_*/.metadata")).read_bytes()}
    assert writes == {"0.12.3", "0.14.0"} & {release(FIXTURES / n) for n in VERSIONED}
