"""The research notebooks in notebooks/ run: every code cell, in order, in one namespace, from the repository
root (as `jupyter nbconvert --execute` would, without needing Jupyter). The notebooks assert their own claims
(parity, identical logits across modes, dispatch counts), so a passing run also checks those.

Also checks that the committed files are valid nbformat-4 notebooks with a python3 kernel and no stored outputs.
"""

from __future__ import annotations

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _load(path: pathlib.Path) -> dict:
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4, f"{path.name}: nbformat {nb['nbformat']}"
    assert nb["metadata"]["kernelspec"]["name"] == "python3", f"{path.name}: kernel is not python3"
    for i, cell in enumerate(nb["cells"]):
        assert cell["cell_type"] in ("code", "markdown", "raw"), f"{path.name} cell {i}: {cell['cell_type']}"
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, (
                f"{path.name} cell {i}: stored outputs (clear them before committing)")
    return nb


def test_notebooks_present() -> None:
    names = [p.name for p in NOTEBOOKS]
    assert "01_sparse_attention.ipynb" in names and "02_execution_boundary.ipynb" in names, names


@pytest.mark.slow  # documentation notebooks run end to end; the code they call has its own tests
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nb = _load(path)
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    try:  # headless figures if matplotlib is installed (the notebooks guard its absence themselves)
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        pass
    ns: dict = {"__name__": "__main__"}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        assert not any(line.lstrip().startswith(("%", "!")) for line in src.splitlines()), (
            f"{path.name} cell {i}: IPython magics / shell escapes do not run outside Jupyter")
        try:
            exec(compile(src, f"{path.name}[cell {i}]", "exec"), ns)
        except Exception as e:  # name the cell in the failure
            raise AssertionError(f"{path.name} cell {i} failed: {type(e).__name__}: {e}") from e
    if "plt" in ns and ns["plt"] is not None:
        ns["plt"].close("all")
