"""Execute every example notebook (with QUICK=1: small subsets) and fail on any cell error.

The kernel is this interpreter: a kernel spec written to a temporary JUPYTER_PATH (searched
before the user's and the system's) runs ``sys.executable -m ipykernel_launcher``, so the
notebooks import the dfmodel installed here, whatever other kernels the machine has.
Skipped when nbclient/nbformat/ipykernel are not installed (``pip install -e .[test]`` has them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CELL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (dfmodel tests)",
        "language": "python",
    }))
    return root


@pytest.fixture
def quick_kernel(kernel_env, monkeypatch, tmp_path):
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_env))
    monkeypatch.setenv("QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))  # no user profile or startup files


def run(nb, cwd: Path):
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return nb


def test_kernel_is_this_interpreter(quick_kernel, tmp_path):
    from nbformat.v4 import new_code_cell, new_notebook

    nb = run(new_notebook(cells=[new_code_cell("import sys, os, dfmodel; print(sys.executable); "
                                               "print(os.environ['QUICK']); print(dfmodel.__file__)")]), tmp_path)
    exe, quick, pkg = nb.cells[0].outputs[0]["text"].split()
    assert Path(exe).resolve() == Path(sys.executable).resolve()
    assert quick == "1"
    import dfmodel

    assert Path(pkg).resolve() == Path(dfmodel.__file__).resolve()


NAMES = ["quickstart.ipynb", "system_design_space.ipynb", "sram_dram.ipynb", "fidelity.ipynb", "storage_io.ipynb"]


def test_every_notebook_is_tested():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(quick_kernel, name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "notebooks are stored without outputs"
    run(nb, NOTEBOOKS)  # raises CellExecutionError on the first failing cell
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert images >= 1, "every notebook draws at least one figure"
