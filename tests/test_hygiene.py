"""Repository hygiene: notebooks committed stripped (through the git filter `make` sets up), no large files,
imports that point one way (between packages, around the scheduler, and in no cycle), set-up files that name only
files the repository has."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_BYTES = 5 * 1024 * 1024
DRAFT_HEADS, MAX_DRAFT_HEADS_BYTES = "engine/spec_decode/heads/", 16 * 1000 * 1000
# workbench -> engine -> kernels: a package may not import what sits above it. vLLM is a reference only, run in its
# own venv by tests/fidelity/vllm_driver.py: none of the three imports it.
FORBIDDEN_IMPORTS = {
    "engine": {"panel", "bokeh", "workbench", "vllm"},
    "kernels": {"engine", "workbench", "vllm"},
    "workbench": {"vllm"},
}
# The scheduler decides; its output is what the others read. Only the engine drives the scheduler itself.
SCHEDULER = "engine.core.sched.scheduler"
SCHEDULER_OUTPUT = "engine.core.sched.output"
SCHEDULER_USERS = {"engine.llm_engine"}
OUTPUT_ONLY = ("engine.model", "engine.kv_transfer")  # the model runner, the connectors
CYCLE_FREE = ("engine", "workbench", "kernels")


def unstripped_cells(notebook: Path | bytes) -> list[int]:
    """Indices of code cells that carry outputs or an execution count (a notebook file, or its bytes)."""
    text = notebook.read_bytes() if isinstance(notebook, Path) else notebook
    cells = json.loads(text.decode("utf-8"))["cells"]
    return [
        i
        for i, cell in enumerate(cells)
        if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
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


def module_name(path: Path, root: Path) -> str:
    """engine/core/sched/scheduler.py -> engine.core.sched.scheduler; a package's __init__.py -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, package: str, modules: set[str]) -> set[str]:
    """The modules of `modules` that any import statement in `tree` names, wherever it stands (in a function,
    under `if TYPE_CHECKING:`): `import X` -> X; `from X import Y` -> X.Y where that is a module, else X."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return found & modules


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """{module: the modules it imports} over every module of `packages` (folders under root)."""
    files = {module_name(path, root): path for package in packages for path in sorted((root / package).rglob("*.py"))}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = imported_modules(tree, package, set(files)) - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that import one another, directly or not (a strongly connected component of more
    than one module, by Tarjan's algorithm, iteratively), as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:  # the root of a component: pop it off the stack
                    component = stack[stack.index(module) :]
                    del stack[stack.index(module) :]
                    if len(component) > 1:
                        cycles.append(sorted(component))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                work.append((target, iter(sorted(graph[target]))))
            elif target in stack:
                low[module] = min(low[module], index[target])
    return sorted(cycles)


def _inside(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def scheduler_imports(graph: dict[str, set[str]]) -> list[str]:
    """'importer -> module' for each import of engine/ that breaks the scheduler's rules: only SCHEDULER_USERS
    import the scheduler module; the model runner and the connectors import of the scheduler's package only
    its output."""
    found = []
    for module, targets in sorted(graph.items()):
        if not _inside(module, ("engine",)):
            continue
        for target in sorted(targets):
            if target == SCHEDULER and module not in SCHEDULER_USERS:
                found.append(f"{module} -> {target}")
            elif (
                _inside(module, OUTPUT_ONLY) and _inside(target, ("engine.core.sched",)) and target != SCHEDULER_OUTPUT
            ):
                found.append(f"{module} -> {target}")
    return found


def repository_files() -> list[Path]:
    """Files git tracks or would add (untracked, not ignored); skips the test outside a git checkout."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    result = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        pytest.skip(f"not a git checkout: {result.stderr.strip()}")
    return [ROOT / name for name in result.stdout.split("\0") if name]


def git(*args: str, cwd: Path = ROOT, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["git", *args], cwd=cwd, capture_output=True, env=env)
    if check and result.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed ({result.returncode}): {result.stderr.decode().strip()}")
    return result


def is_checkout_top(folder: Path) -> bool:
    """Whether git is installed and `folder` is the top of a git work tree (where `make` sets up the filter)."""
    if shutil.which("git") is None:
        return False
    result = git("rev-parse", "--show-prefix", cwd=folder, check=False)
    return result.returncode == 0 and not result.stdout.strip()


def git_would_commit(file: Path, path: str, cwd: Path = ROOT) -> bytes:
    """The blob `git add` would store for the contents of `file` placed at `path` (relative to the top of cwd's
    checkout): .gitattributes' clean filter applied, when .git/config defines it. `git hash-object -w` writes the
    blob to a throwaway object folder, where `git cat-file` reads it back: the repository is left as it was."""
    with tempfile.TemporaryDirectory() as objects:
        env = {**os.environ, "GIT_OBJECT_DIRECTORY": objects}
        blob = git("hash-object", "-w", "--path", path, str(file), cwd=cwd, env=env).stdout.decode().strip()
        return git("cat-file", "blob", blob, cwd=cwd, env=env).stdout


def notebook_filter_missing(cwd: Path = ROOT) -> str | None:
    """Why git in cwd would not commit notebooks through nbstripout (None: it would)."""
    if not is_checkout_top(cwd):
        return "not the top of a git checkout (or git is not installed)"
    attribute = git("check-attr", "filter", "--", "notebooks/x.ipynb", cwd=cwd).stdout.decode().strip()
    if not attribute.endswith(": nbstripout"):
        return f".gitattributes gives notebooks no nbstripout filter ({attribute})"
    if not git("config", "--get", "filter.nbstripout.clean", cwd=cwd, check=False).stdout.strip():
        return "the nbstripout filter is not set up in .git/config (`make test` and `make lab` set it up)"
    return None


def committed_form(notebook: Path) -> bytes:
    """What would be committed of a notebook: through git (and its filter) in a checkout, else the file itself.
    A file without outputs stays so through a filter that strips them: only the others are passed through git."""
    if is_checkout_top(ROOT) and unstripped_cells(notebook):
        return git_would_commit(notebook, notebook.relative_to(ROOT).as_posix())
    return notebook.read_bytes()


# A code cell as JupyterLab saves it after a run: outputs, a count, cell metadata; and the notebook metadata it
# adds (the kernel's language_info); what nbstripout (as the Makefile configures it) keeps of them.
LAB_OUTPUTS = [
    {"output_type": "stream", "name": "stdout", "text": ["1\n"]},
    {
        "output_type": "display_data",
        "metadata": {},
        "data": {"text/plain": ["<Row>"], "application/javascript": ["/* 8 MB of Bokeh */"]},
    },
]
LAB_LANGUAGE_INFO = {
    "codemirror_mode": {"name": "ipython", "version": 3},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
    "version": "3.11.2",
}


def stripped_notebook() -> dict:
    code = {
        "cell_type": "code",
        "execution_count": None,
        "id": "c01",
        "metadata": {},
        "outputs": [],
        "source": ["print(1)"],
    }
    kernelspec = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    return {
        "cells": [{"cell_type": "markdown", "id": "c00", "metadata": {}, "source": ["# x"]}, code],
        "metadata": {"kernelspec": kernelspec, "language_info": {"name": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def as_lab_saves_it(notebook: dict) -> dict:
    notebook = json.loads(json.dumps(notebook))
    notebook["metadata"]["language_info"] = dict(LAB_LANGUAGE_INFO)
    for n, cell in enumerate(c for c in notebook["cells"] if c["cell_type"] == "code"):
        cell.update(outputs=LAB_OUTPUTS, execution_count=n + 1)
        cell["metadata"].update(scrolled=True, execution={"iopub.status.busy": "2026-11-30T17:00:00.000Z"})
    return notebook


def test_notebooks_are_committed_stripped():
    """Checks what git would commit of each notebook (through the nbstripout filter where `make` set it up), not
    the working file: JupyterLab's autosave writes outputs into the working files, which is fine."""
    notebooks = sorted(ROOT.glob("notebooks/*.ipynb"))
    dirty = {nb.name: cells for nb in notebooks if (cells := unstripped_cells(committed_form(nb)))}
    why = notebook_filter_missing() or "the filter is set up"
    assert not dirty, (
        f"notebooks git would commit with outputs (cell indices): {dirty} ({why}); `make test` or "
        f"`make lab` set up the git filter, `make strip` clears the working files"
    )


def test_git_filter_commits_a_notebook_saved_with_outputs_stripped(tmp_path):
    """A notebook as JupyterLab saves it after a run, committed at notebooks/: git stores it stripped."""
    if why := notebook_filter_missing():
        pytest.skip(f"no notebook filter here: {why}")
    saved = tmp_path / "saved.ipynb"  # outside the checkout; --path places it at notebooks/
    saved.write_text(json.dumps(as_lab_saves_it(stripped_notebook()), indent=1), encoding="utf-8")
    assert unstripped_cells(saved) == [1]
    committed = git_would_commit(saved, "notebooks/_hygiene_probe.ipynb")
    assert unstripped_cells(committed) == []
    assert json.loads(committed) == stripped_notebook()  # cell ids kept, language_info back to its name


def test_no_large_files():
    # is_file: a deleted file is still listed until the deletion is staged.
    sizes = {p.relative_to(ROOT).as_posix(): p.stat().st_size for p in repository_files() if p.is_file()}
    # the one exception: default draft heads made by `workbench train-draft` (issues #21, #38), under 16 MB in all
    heads = {name: size for name, size in sizes.items() if name.startswith(DRAFT_HEADS)}
    assert sum(heads.values()) < MAX_DRAFT_HEADS_BYTES, f"draft heads over {MAX_DRAFT_HEADS_BYTES} bytes: {heads}"
    large = {name: size for name, size in sizes.items() if size > MAX_FILE_BYTES}  # heads too: they are sharded
    if is_checkout_top(ROOT):  # the size git would store: a notebook saved with outputs goes through the filter
        large = {name: size for name in large if (size := len(git_would_commit(ROOT / name, name))) > MAX_FILE_BYTES}
    assert not large, f"over {MAX_FILE_BYTES} bytes (weights, notebook outputs stay out of git): {large}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN_IMPORTS))
def test_imports_point_one_way(package):
    assert not forbidden_imports(ROOT / package, FORBIDDEN_IMPORTS[package])


def test_only_the_engine_drives_the_scheduler_and_the_others_read_its_output():
    assert not scheduler_imports(import_graph(ROOT, ("engine",)))


def test_no_import_cycles():
    """Counting imports inside functions and under TYPE_CHECKING: a cycle there is a cycle of the design."""
    graph = import_graph(ROOT, CYCLE_FREE)
    cycles = import_cycles(graph)
    edges = [f"{m} -> {t}" for cycle in cycles for m in cycle for t in sorted(graph[m]) if t in cycle]
    assert not cycles, f"modules that import one another: {cycles} (imports: {edges})"


def test_import_checks_catch_violations(tmp_path):
    """A fake engine: a runner that imports the scheduler (in a function, relatively) and the request queue,
    a connector that reads only the output, cycles through a TYPE_CHECKING import and through a package's
    __init__."""
    files = {
        "engine/__init__.py": "from engine.llm_engine import LLMEngine\n",
        "engine/llm_engine.py": "from engine.core.sched.scheduler import Scheduler\n",
        "engine/core/__init__.py": "",
        "engine/core/sched/__init__.py": "",
        "engine/core/sched/scheduler.py": "from engine.core.sched.output import SchedulerOutput\n",
        "engine/core/sched/request_queue.py": "",
        "engine/core/sched/output.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.model import runner\n"
        ),
        "engine/model/__init__.py": "",
        "engine/model/runner.py": (
            "import engine.core.sched.request_queue\ndef f():\n    from ..core.sched import scheduler\n"
        ),
        "engine/kv_transfer/__init__.py": "from .base import Connector\n",
        "engine/kv_transfer/base.py": (
            "def f():\n    import engine.kv_transfer\n    from engine.core.sched import output\n"
        ),
    }
    for name, source in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    graph = import_graph(tmp_path, ("engine",))
    assert graph["engine.model.runner"] == {"engine.core.sched.request_queue", SCHEDULER}
    assert scheduler_imports(graph) == [
        "engine.model.runner -> engine.core.sched.request_queue",
        "engine.model.runner -> engine.core.sched.scheduler",
    ]
    assert import_cycles(graph) == [
        ["engine.core.sched.output", "engine.core.sched.scheduler", "engine.model.runner"],
        ["engine.kv_transfer", "engine.kv_transfer.base"],
    ]


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


def _make_filter_step(folder: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The Makefile's git-filter step in `folder` (a copy of the Makefile there), the venv's install taken as done."""
    return subprocess.run(
        [shutil.which("make"), "-C", str(folder), "-o", ".venv/.installed", ".venv/.git-filter"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def _fake_project(folder: Path) -> Path:
    """The Makefile and .gitattributes, and a .venv whose python is this test's interpreter."""
    bin_dir = folder / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("Makefile", ".gitattributes"):
        shutil.copy(ROOT / name, folder / name)
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # not resolved: the venv's own python
    python.chmod(0o755)
    return folder


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None, reason="needs make and git")
def test_make_sets_up_the_notebook_filter_once_and_only_in_a_checkout(tmp_path):
    repo = _fake_project(tmp_path / "repo")
    git("init", "-q", ".", cwd=repo)
    step = _make_filter_step(repo)
    assert step.returncode == 0, step.stdout + step.stderr
    python = os.path.realpath(repo / ".venv" / "bin" / "python")  # by absolute path: git runs it from anywhere

    def config(key: str) -> str:
        return git("config", "--get", key, cwd=repo, check=False).stdout.decode().strip()

    assert config("filter.nbstripout.clean").startswith(f'"{python}" -m nbstripout ')
    assert (config("filter.nbstripout.smudge"), config("filter.nbstripout.required")) == ("cat", "true")
    assert config("diff.ipynb.textconv").startswith(f'"{python}" -m nbstripout ')
    assert notebook_filter_missing(repo) is None

    # JupyterLab saves over a committed notebook: nothing to diff, nothing to commit
    nb = repo / "notebooks" / "x.ipynb"
    nb.parent.mkdir()
    nb.write_text(json.dumps(stripped_notebook(), indent=1) + "\n", encoding="utf-8")
    git("add", "notebooks/x.ipynb", cwd=repo)
    git("-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "x", cwd=repo)
    nb.write_text(json.dumps(as_lab_saves_it(stripped_notebook()), indent=1) + "\n", encoding="utf-8")
    assert unstripped_cells(nb) == [1]
    assert json.loads(git_would_commit(nb, "notebooks/x.ipynb", cwd=repo)) == stripped_notebook()
    assert git("diff", "--quiet", cwd=repo, check=False).returncode == 0
    # git status still names it while the index holds the old size (git's stat check, before any filter); adding it
    # stages nothing and quiets that
    git("add", "notebooks/x.ipynb", cwd=repo)
    assert git("diff", "--cached", "--quiet", cwd=repo, check=False).returncode == 0
    assert git("status", "--porcelain", "--", "notebooks", cwd=repo).stdout.decode() == ""
    # and the project's committed notebooks pass through the filter byte for byte (else they would show modified):
    # the clean command as configured, run once over copies of them (it rewrites the files it is given)
    if is_checkout_top(ROOT):
        staged = {
            path: git("cat-file", "blob", f":{path}").stdout
            for path in git("ls-files", "--", "notebooks/*.ipynb").stdout.decode().split()
        }
        copies = tmp_path / "staged"
        copies.mkdir()
        for path, blob in staged.items():
            (copies / Path(path).name).write_bytes(blob)
        names = " ".join(f"'{Path(path).name}'" for path in staged)
        run = subprocess.run(
            ["sh", "-c", f"{config('filter.nbstripout.clean')} {names}"], cwd=copies, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        rewritten = [p for p, blob in staged.items() if (copies / Path(p).name).read_bytes() != blob]
        assert not rewritten, f"the filter would rewrite these committed notebooks: {rewritten}"

    # once: a second make leaves the configuration alone (here, removed by hand)
    git("config", "--unset", "filter.nbstripout.clean", cwd=repo)
    assert _make_filter_step(repo).returncode == 0 and not config("filter.nbstripout.clean")

    # not a checkout, or no git at all: nothing set up, nothing fails
    plain = _fake_project(tmp_path / "plain")
    if not git("rev-parse", "--git-dir", cwd=plain, check=False).returncode:
        pytest.skip("the temporary folder lies inside a git checkout")
    step = _make_filter_step(plain)
    assert step.returncode == 0 and "not a git checkout" in step.stdout, step.stdout + step.stderr
    assert not (plain / ".git").exists()
    no_git = tmp_path / "bin"
    no_git.mkdir()
    (no_git / "touch").symlink_to(shutil.which("touch"))
    (plain / ".venv" / ".git-filter").unlink()
    git("init", "-q", ".", cwd=plain)
    step = _make_filter_step(plain, env={"PATH": str(no_git), "HOME": str(tmp_path)})
    assert step.returncode == 0 and "not a git checkout" in step.stdout, step.stdout + step.stderr
    assert not git("config", "--get", "filter.nbstripout.clean", cwd=plain, check=False).stdout.strip()


# The files that set up and describe the repository: a document they name must be in it.
SETUP_FILES = ["README.md", "Makefile", "requirements.txt", "pyproject.toml", ".gitattributes", "binder/*", ".ci/*"]


def test_setup_files_name_only_documents_the_repository_has():
    have = set()
    for _folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if d not in {".git", ".venv", "node_modules"}]
        have |= {name for name in files if name.endswith(".md")}
    missing = {}
    for pattern in SETUP_FILES:
        for path in sorted(ROOT.glob(pattern)):
            if path.is_file():
                named = set(re.findall(r"[\w.-]+\.md\b", path.read_text(encoding="utf-8", errors="replace")))
                if lacking := sorted(name for name in named if Path(name).name not in have):
                    missing[str(path.relative_to(ROOT))] = lacking
    assert not missing, f"documents named but not in the repository: {missing}"


# ---- the code map --------------------------------------------------------------------------------------------------
STRUCTURE = ROOT / "docs" / "STRUCTURE.md"
MAPPED_PATH = re.compile(r"`((?:engine|kernels|workbench|tests|notebooks)/[\w/]+\.(?:py|ipynb))`")


def test_the_code_map_names_only_files_that_exist_and_every_module():
    """docs/STRUCTURE.md: every path it names exists, and every module of the three packages has its line."""
    text = STRUCTURE.read_text(encoding="utf-8")
    named = set(MAPPED_PATH.findall(text))
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"docs/STRUCTURE.md names files that do not exist: {missing}"
    modules = {
        p.relative_to(ROOT).as_posix()
        for package in ("engine", "kernels", "workbench")
        for p in (ROOT / package).rglob("*.py")
        if p.name != "__init__.py"
    }
    unmapped = sorted(modules - named)
    assert not unmapped, f"modules without a line in docs/STRUCTURE.md: {unmapped}"


def test_the_code_map_has_a_row_per_mechanism_of_the_seeds():
    text = STRUCTURE.read_text(encoding="utf-8")
    rows = text[text.index("## The seeds' mechanisms") :]
    for mechanism in (
        "paged KV cache",
        "scheduling",
        "chunked prefill",
        "prefix caching",
        "guided decoding",
        "speculative decoding",
        "KV transfer",
    ):
        row = next((line for line in rows.splitlines() if line.startswith(f"| {mechanism}")), None)
        assert row is not None, f"no row for {mechanism}"
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6 and all(cells), f"{mechanism}: engine, events, view, tests and notebook all named"
