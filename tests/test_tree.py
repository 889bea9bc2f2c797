"""The tree keeps its promises: no module imports another module's private names.

What another module needs is that module's public API (a name without a leading underscore, with a docstring). A
public name imported under a private alias (``from x import size_text as _size``) is fine: the name imported is public.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ckpttool"

#: private names still imported across modules, each to be made public by the developer who owns the module named:
#: (importing module, imported module, name). Empty it as those renames are merged (an entry no longer imported
#: excuses nothing, so a stale one does not fail the test).
ALLOWED: set[tuple[str, str, str]] = set()  # none: every name shared across modules is public


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_module(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute name of the module ``node`` imports from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_imports() -> list[tuple[str, str, str, int]]:
    """Every ``from ckpttool... import _x`` of a private name of another module: (module, source, name, line)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _imported_module(node, module, path.name == "__init__.py")
            if source.split(".")[0] != "ckpttool" or source == module:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append((module, source, alias.name, node.lineno))
    return found


def test_the_check_sees_the_package():
    assert len(list(PACKAGE.rglob("*.py"))) > 100


def test_no_module_imports_another_modules_private_names():
    found = private_imports()
    bad = [f"{m} (line {line}) imports {name!r} from {src}" for m, src, name, line in found
           if (m, src, name) not in ALLOWED]
    assert not bad, "private names imported across modules (make them public where they are used):\n" + "\n".join(bad)


def test_the_code_map_names_every_folder():
    """docs/code.md's map has a line for every folder of the package, and names no folder that is gone."""
    text = (PACKAGE.parent / "docs" / "code.md").read_text(encoding="utf-8")
    folders = {p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*")
               if p.is_dir() and p.name != "__pycache__"}
    missing = sorted(f for f in folders if f"| `{f}/` |" not in text)
    assert not missing, f"docs/code.md has no line for {missing}"
    named = set(re.findall(r"^\| `(ckpttool/[^`]*)/` \|", text, flags=re.M))
    assert not named - folders, f"docs/code.md names folders that are gone: {sorted(named - folders)}"
