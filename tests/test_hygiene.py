"""Repository hygiene: stripped notebooks, no large files, imports that point one way."""

import ast
import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_BYTES = 5 * 1024 * 1024
# workbench -> engine -> kernels: a package may not import what sits above it.
FORBIDDEN_IMPORTS = {
    "engine": {"panel", "bokeh", "workbench"},
    "kernels": {"engine", "workbench"},
}


def unstripped_cells(notebook: Path) -> list[int]:
    """Indices of code cells that carry outputs or an execution count."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return [
        i
        for i, cell in enumerate(cells)
        if cell["cell_type"] == "code"
        and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]


def forbidden_imports(package_dir: Path, forbidden: set[str]) -> list[str]:
    """'file:line module' for every absolute import under package_dir of a forbidden top-level package."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            where = f"{path.relative_to(package_dir.parent)}:{node.lineno}"
            found += [f"{where} {name}" for name in names if name.split(".")[0] in forbidden]
    return found


def repository_files() -> list[Path]:
    """Files git tracks or would add (untracked, not ignored); skips the test outside a git checkout."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    result = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True,
    )
    if result.returncode != 0:
        pytest.skip(f"not a git checkout: {result.stderr.strip()}")
    return [ROOT / name for name in result.stdout.split("\0") if name]


def test_notebooks_are_committed_stripped():
    notebooks = sorted(ROOT.glob("notebooks/*.ipynb"))
    dirty = {nb.name: cells for nb in notebooks if (cells := unstripped_cells(nb))}
    assert not dirty, f"notebooks with outputs (cell indices); run `make strip`: {dirty}"


def test_no_large_files():
    # is_file: a deleted file is still listed until the deletion is staged.
    sizes = {str(p.relative_to(ROOT)): p.stat().st_size for p in repository_files() if p.is_file()}
    large = {name: size for name, size in sizes.items() if size > MAX_FILE_BYTES}
    assert not large, f"over {MAX_FILE_BYTES} bytes (weights, notebook outputs stay out of git): {large}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN_IMPORTS))
def test_imports_point_one_way(package):
    assert not forbidden_imports(ROOT / package, FORBIDDEN_IMPORTS[package])


def test_checks_catch_violations(tmp_path):
    """The scanners above find what they look for (a check that cannot fail proves nothing)."""
    pkg = tmp_path / "engine" / "core"
    pkg.mkdir(parents=True)
    source = "import os\nimport bokeh.models\nfrom panel.widgets import Button\nfrom . import b\n"
    (pkg / "a.py").write_text(source)
    assert forbidden_imports(tmp_path / "engine", {"panel", "bokeh"}) == [
        "engine/core/a.py:2 bokeh.models",
        "engine/core/a.py:3 panel.widgets",
    ]
    nb = tmp_path / "n.ipynb"
    code = {"cell_type": "code", "source": "1", "metadata": {}}
    printed = [{"output_type": "stream", "name": "stdout", "text": "1"}]
    cells = [
        {**code, "outputs": [], "execution_count": None},
        {**code, "outputs": [], "execution_count": 3},
        {**code, "outputs": printed, "execution_count": None},
        {"cell_type": "markdown", "source": "text", "metadata": {}},
    ]
    nb.write_text(json.dumps({"cells": cells}))
    assert unstripped_cells(nb) == [1, 2]
