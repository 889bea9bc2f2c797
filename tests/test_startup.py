"""Start-up: the command line imports no torch or transformers until a command runs, and the choices it offers
without importing the readers name exactly what the readers and split targets are."""

from __future__ import annotations

import subprocess
import sys

from ckpttool.cli import choices
from ckpttool.readers import READERS
from ckpttool.commands.split import TARGETS

HEAVY = ("torch", "transformers", "numpy", "safetensors")


def _imported_after(code: str) -> list[str]:
    """The heavy packages a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport sys\nprint('imported:', *(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return done.stdout.splitlines()[-1].split()[1:]


def test_the_command_line_imports_no_torch() -> None:
    assert _imported_after("import ckpttool.cli") == []


def test_help_imports_no_torch() -> None:
    code = (
        "import sys\nfrom ckpttool.cli import main\n"
        "for argv in (['--help'], ['merge', '--help'], ['audit', '--help'], ['diff', '--help'], ['split', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, (argv, e.code)"
    )
    assert _imported_after(code) == []


def test_the_package_loads_its_api_on_first_use() -> None:
    assert _imported_after("import ckpttool") == []
    # ckpttool.merge no longer imports torch with its module (a dry run needs none: tests/test_torch_free.py), so
    # the module's arrival is the sign the API loaded on first use
    loads = "import ckpttool, sys\nassert 'ckpttool.commands.merge' not in sys.modules\nckpttool.merge\nprint('ckpttool.commands.merge' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", loads], capture_output=True, text=True, check=True).stdout == "True\n"


def test_format_choices_are_the_readers() -> None:
    assert choices.FORMAT_NAMES == tuple(READERS)


def test_split_choices_are_the_split_targets() -> None:
    assert choices.SPLIT_TARGETS == TARGETS


def test_api_names_stay_the_functions_after_their_modules_load() -> None:
    import ckpttool.audit.report_html  # binds nothing over the function ckpttool.audit
    import ckpttool.commands.diff

    assert callable(ckpttool.merge) and callable(ckpttool.audit) and callable(ckpttool.diff)
    assert callable(ckpttool.split)
    assert set(ckpttool.__all__) <= set(dir(ckpttool))
