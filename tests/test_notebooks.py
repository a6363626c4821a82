"""Every notebook runs top to bottom, headless, in a kernel of this test's own Python."""

import json
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
KERNEL_NAME = "workbench-test"
CELL_TIMEOUT_S = 600
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
PROGRESS_BAR = re.compile(r"\d+%\|")  # tqdm's text bar: noise in a lesson's output
# Two test workers (up to 5 GB each) and a lesson's kernel share the machine's 24 GiB: 05b, whose eight engines each
# took the default 1 GiB cache, peaked at 17.8 GB and its kernel was killed for memory mid-run (9.8 GiB with their
# caches sized to its chats; the other lessons 0.5-4.5 GiB, 2026-12-05).
KERNEL_PEAK_BYTES = 12 << 30


@pytest.fixture(scope="module")
def kernel_spec_manager(tmp_path_factory) -> KernelSpecManager:
    """A kernelspec running sys.executable: a user-level `python3` kernel cannot stand in for the venv."""
    spec_dir = tmp_path_factory.mktemp("kernels") / KERNEL_NAME
    spec_dir.mkdir()
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec = {"argv": argv, "display_name": KERNEL_NAME, "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return KernelSpecManager(kernel_dirs=[str(spec_dir.parent)], ensure_native_kernel=False)


def run_notebook(path: Path, kernel_spec_manager: KernelSpecManager) -> str | None:
    """Execute an in-memory copy of the notebook (the file is never written), cwd = its folder.

    Returns the failing cell's source and traceback, or a cell that printed a progress bar, or None.
    """
    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=kernel_spec_manager)
    resources = {"metadata": {"path": str(path.parent)}}
    client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, resources=resources)
    try:
        # Panel must inline its JavaScript: there is no CDN offline.
        client.execute(env={**os.environ, "PANEL_INLINE": "true"})
        peak = kernel_peak_bytes(km)
    except CellExecutionError as err:
        # The kernel colours its traceback; escape codes make CI logs unreadable.
        return ANSI_ESCAPE.sub("", str(err))
    finally:
        # nbclient shuts down only kernels it started itself: each lesson's kernel (its model, its engine threads)
        # would otherwise live on beside the next lessons until the session ends
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    if peak > KERNEL_PEAK_BYTES:
        return f"its kernel peaked at {peak / 2**30:.1f} GiB of memory, more than {KERNEL_PEAK_BYTES / 2**30:.0f}"
    for index, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and PROGRESS_BAR.search(out.get("text", "")):
                return f"cell {index} printed a progress bar: {out['text'][-200:]!r}"
    return None


def kernel_peak_bytes(km: KernelManager) -> int:
    """The kernel process's peak resident memory (Linux's VmHWM), read while it still runs; 0 where /proc has none."""
    status = Path(f"/proc/{km.provisioner.pid}/status")
    found = re.search(r"VmHWM:\s+(\d+) kB", status.read_text()) if status.exists() else None
    return int(found.group(1)) * 1024 if found else 0


# Only defined when there are notebooks: an empty parametrization would still report a skipped test.
if NOTEBOOKS:

    @pytest.mark.slow
    @pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
    def test_notebook_runs(path: Path, kernel_spec_manager: KernelSpecManager):
        if error := run_notebook(path, kernel_spec_manager):
            pytest.fail(f"{path.name}: {error}", pytrace=False)
