"""Shared test helpers: the committed fixtures, a CLI runner, and tensor comparison."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import fork_client
from fork_client import MEGATRON_PRELOAD, MEGATRON_VENV, MERGE_PRELOAD, fork_server

ROOT = Path(__file__).resolve().parent.parent
#: examples per property test and fuzz target; CKPTTOOL_HYPOTHESIS_EXAMPLES=2000 for a long run
HYPOTHESIS_EXAMPLES = int(os.environ.get("CKPTTOOL_HYPOTHESIS_EXAMPLES", "100"))
FIXTURES = ROOT / "fixtures"

#: every fixture fixtures/make_fixtures.py produces; a missing one fails the tests rather than skipping
FIXTURE_NAMES = (
    "llama_fsdp2_dcp",
    "llama_tp2_dcp",
    "llama_tp2_fsdp2_dcp",
    "llama_hf_tp2",
    "mixtral_fsdp2_dcp",
    "mixtral_fsdp8_dcp_zero_chunk",
    "mixtral_hf_tp2_ep2",
)


def fixture_dir(name: str) -> Path:
    path = FIXTURES / name
    assert (path / "checkpoint").is_dir(), f"fixture {name} missing: run fixtures/make_fixtures.py"
    return path


def load_output(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF output directory, single-file or sharded."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def apply_spec(spec, sources: dict[str, torch.Tensor]) -> torch.Tensor:
    """A target spec carried out on whole source tensors (NaN where no slice writes), to check a cut by value."""
    out = torch.full(spec.shape, float("nan"))
    for sl in spec.slices:
        src = sources[sl.source][tuple(slice(o, o + n) for o, n in zip(sl.src.offsets, sl.src.sizes))]
        out[tuple(slice(o, o + n) for o, n in zip(sl.dst.offsets, sl.dst.sizes))] = src.reshape(sl.dst.sizes)
    return out


#: the top-level entries of a torchtitan step that are not the model
TRAINING_STATE = ("optimizer", "lr_scheduler", "dataloader", "train_state")


def dcp_chunks(path: Path) -> dict[str, tuple]:
    """Every model tensor of a DCP (a torchtitan step's training state left out): its global size and its saved
    chunks (offsets, sizes), sorted."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: (tuple(v.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
            for k, v in meta.items() if k.split(".", 1)[0] not in TRAINING_STATE}


def dcp_model_tensors(path: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a DCP, whole, as torch's own ``dcp_to_torch_save`` reads them."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = scratch / f"{path.name}-whole.pt"
    dcp_to_torch_save(str(path), str(whole))
    state = torch.load(whole, weights_only=False)
    whole.unlink()
    return {k: v for k, v in state.items()
            if isinstance(v, torch.Tensor) and k.split(".", 1)[0] not in TRAINING_STATE}


def assert_same_dcp(got: Path, want: Path, scratch: Path, unequal: tuple[str, ...] = ()) -> None:
    """Two DCPs hold the same model tensors in the same chunks, each bit for bit with its dtype, but for the names
    ending with one of ``unequal`` (compared by name and chunks only)."""
    assert dcp_chunks(got) == dcp_chunks(want)
    have, expected = dcp_model_tensors(got, scratch), dcp_model_tensors(want, scratch)
    assert sorted(have) == sorted(expected)
    for key, tensor in expected.items():
        if unequal and key.endswith(unequal):
            continue
        assert have[key].dtype == tensor.dtype and torch.equal(have[key], tensor), key


def tree_digest(directory: Path) -> dict[str, str]:
    """sha256 of every file under a directory, to prove a source was not modified."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def assert_failed_cleanly(result, out: Path, *needles: str) -> None:
    """Exit code 1, no traceback, every needle in stderr, nothing at the destination and no staging left."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr}"
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.ckpttool-partial-*")), "staging directory left behind"


def assert_merge_refused_with_config(cli, tmp_path: Path, src: Path, config: dict, *needles: str) -> None:
    """``merge SRC OUT --config`` with ``config`` (written under tmp_path) fails cleanly with every needle in its
    message (:func:`assert_failed_cleanly`), and the source is left as it was."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(config))
    before = tree_digest(src)
    out = tmp_path / "out"
    result = cli("merge", src, out, "--config", tmp_path / "cfg" / "config.json")
    assert_failed_cleanly(result, out, *needles)
    assert tree_digest(src) == before


@pytest.fixture(autouse=True, scope="session")
def model_cache(tmp_path_factory):
    """The tests' own cache of model descriptions (never the user's ~/.cache), empty at the start."""
    path = tmp_path_factory.mktemp("ckpttool-cache")
    os.environ["CKPTTOOL_CACHE"] = str(path)
    return path


@pytest.fixture(scope="module")
def describe_inline():
    """For a test module that imports transformers anyway (``pytestmark = pytest.mark.usefixtures("describe_inline")``):
    its configs are described in this process, not one subprocess each."""
    from ckpttool.model.architecture import DESCRIBE_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DESCRIBE_ENV, "inline")
        yield


def build_in_row_chunks(plan, targets, rows: int):
    """Build ``targets`` of ``plan`` chunk by chunk, ``rows`` rows each, as the executor does: (each target's chunks
    in order, the buffer sizes ``buffer_sizes`` predicts, the size of each predicted buffer actually allocated)."""
    from ckpttool.execute.reads import Reader
    from ckpttool.execute.buffers import buffer_sizes, chunks, piece_uses
    from ckpttool.execute.assembly import build

    small = [c for t in targets for c in chunks(t, 0, rows=rows)]
    sizes = buffer_sizes(small)
    reader = Reader(plan.root, piece_uses(small), sizes)
    parts: dict = {t.name: [] for t in targets}
    try:
        for chunk in small:
            parts[chunk.target.name].append(build(chunk, reader).clone())
        allocated = {n: len(b) for n, b in reader._local.buffers.items() if n in sizes}
    finally:
        reader.close()
    return parts, sizes, allocated


@pytest.fixture
def copy_fixture(tmp_path: Path):
    """Copy a fixture (checkpoint + config next to it) into tmp_path, to damage it safely."""

    def make(name: str) -> Path:
        dest = tmp_path / name
        shutil.copytree(fixture_dir(name), dest, ignore=shutil.ignore_patterns("reference"))
        return dest / "checkpoint"

    return make


@pytest.fixture
def cli():
    from ckpttool.cli import main

    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(main, [str(a) for a in args], catch_exceptions=False)

    return invoke


# ---- jobs forked from a server that imported their heavy modules once (tests/fork_client.py) ------------------------

@pytest.fixture(autouse=True, scope="session")
def fork_servers(tmp_path_factory):
    """The session's fork servers (tests/fork_client.py) keep their jobs' files under the session's temporary
    directory, and stop at its end."""
    fork_client.start_session(tmp_path_factory.mktemp("forks"))
    yield
    fork_client.close_all()


@pytest.fixture(scope="session")
def megatron_torchrun():
    """``megatron_torchrun(SCRIPT, *ARGS, nproc=N)``: ``torchrun --standalone --nproc_per_node N SCRIPT ARGS`` in the
    Megatron venv, its ranks forked from one server that imported megatron-core once for the session (instead of
    once per rank); a ``subprocess.CompletedProcess`` whose stdout and stderr hold every rank's, rank by rank."""
    server = fork_server(MEGATRON_VENV / "bin" / "python", MEGATRON_PRELOAD)

    def run(script: Path, *args, nproc: int, timeout: float = 600) -> subprocess.CompletedProcess:
        command = [str(server.python), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   str(script), *map(str, args)]
        return server.run(command, {"script": str(script), "args": [str(a) for a in args], "nproc": nproc}, timeout)

    return run


@pytest.fixture(scope="session")
def forked_python():
    """``forked_python(SOURCE, *ARGS)``: ``python -c SOURCE ARGS`` in this venv, forked from one server that imported
    what a merge imports (MERGE_PRELOAD) once for the session; a ``subprocess.CompletedProcess`` (killed by a signal:
    ``-signal``)."""
    server = fork_server(Path(sys.executable), MERGE_PRELOAD)

    def run(code: str, *args, timeout: float = 600) -> subprocess.CompletedProcess:
        return server.run([sys.executable, "-c", code, *map(str, args)], {"code": code, "args": [str(a) for a in args]},
                          timeout)

    return run


def interrupt_after(nbytes: int):
    """A merge progress callback that raises KeyboardInterrupt once ``nbytes`` are written (a Ctrl-C mid-merge)."""
    done = 0

    def progress(written: int, total: int) -> None:
        nonlocal done
        done += written
        if done >= nbytes:
            raise KeyboardInterrupt

    return progress


# ---- two workers (scripts/test.sh runs `pytest -n 2 --dist loadfile`) -------------------------------------------------

#: test modules every test of which starts several processes at once (torchrun, gloo ranks, two torchrun "nodes")
MULTI_PROCESS_MODULES = (
    "test_distributed_merge.py", "test_live.py", "test_live_cuda.py", "test_live_fp8.py", "test_live_transforms.py",
    "test_multinode.py", "test_producers.py", "test_quantized_dcp.py", "test_split_hsdp.py", "test_split_torch.py",
)
#: the tests of other modules that do: megatron-core consumers (4 ranks) and torchrun splits
MULTI_PROCESS_TESTS = ("test_megatron_core_loads_", "test_negative_control_a_wrong_qkv_interleave", "_under_torchrun_")
#: the one work unit that holds them all
MULTI_PROCESS_UNIT = "multi-process tests"


def runs_several_processes(nodeid: str) -> bool:
    """Whether the test of ``nodeid`` starts several processes at once (see MULTI_PROCESS_MODULES and _TESTS)."""
    path, _, name = nodeid.partition("::")
    return path.rsplit("/", 1)[-1] in MULTI_PROCESS_MODULES or any(part in name for part in MULTI_PROCESS_TESTS)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With ``--dist loadfile``: each test module is a unit of work (its module fixtures built once), but the tests
    that start several processes at once are one unit of their own, handed out first. So one worker runs them one
    after another, the longest unit from the start, while the other runs the single-process modules: two multi-rank
    jobs never share the two cores (their timeouts and the live tests' timing stay as on one worker), and their free
    ports are taken one job at a time. Any other ``--dist`` keeps pytest-xdist's own scheduler."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class MultiProcessFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return MULTI_PROCESS_UNIT if runs_several_processes(nodeid) else super()._split_scope(nodeid)

        def schedule(self) -> None:
            if self.collection is None and self.collection_is_completed and any(
                    runs_several_processes(i) for i in next(iter(self.registered_collections.values()))):
                # the work queue keeps a key's first place when the base class fills it in: this unit goes first
                self.workqueue[MULTI_PROCESS_UNIT] = {}
            super().schedule()

    return MultiProcessFirst(config, log)
