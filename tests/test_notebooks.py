"""Execute the notebooks in ``notebooks/`` top to bottom (nbclient, python3 kernel).

Each runs in its own temporary working directory with ``JBATCH_NB_OUT`` pointing there, so the
repository is never modified. Skipped when the demo model is absent (it ships with the package).
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from jbatch.demo import demo_model_path  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CELL_TIMEOUT_S = 300


def _require_demo_model() -> None:
    try:
        demo_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"demo model not available: {e}")


def _execute(name: str, workdir: Path, monkeypatch) -> nbformat.NotebookNode:
    monkeypatch.setenv("JBATCH_NB_OUT", str(workdir))  # the kernel inherits the environment
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},  # the kernel's working directory
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    return nb


def _text_output(nb) -> str:
    return "\n".join(
        out.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )


@pytest.mark.parametrize(
    "name", ["quickstart.ipynb", "continuous_vs_static.ipynb", "jit_library.ipynb"]
)
def test_notebook_is_committed_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{name}: clear outputs"


@pytest.mark.slow
def test_quickstart(tmp_path, monkeypatch):
    _require_demo_model()
    nb = _execute("quickstart.ipynb", tmp_path, monkeypatch)
    text = _text_output(nb)
    # Off Colab, the install and hub cells do nothing (no network access) and say so.
    assert "pip install skipped (not on Colab)" in text
    assert "skipped (not on Colab): this section downloads" in text


@pytest.mark.slow
def test_continuous_vs_static(tmp_path, monkeypatch):
    _require_demo_model()
    _execute("continuous_vs_static.ipynb", tmp_path, monkeypatch)
    png = tmp_path / "slot_utilization.png"
    assert png.is_file(), "the notebook must save its plot under $JBATCH_NB_OUT"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000

    import matplotlib.image

    pixels = matplotlib.image.imread(png)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0, "the plot is blank"


@pytest.mark.slow
def test_jit_library(tmp_path, monkeypatch):
    _require_demo_model()
    nb = _execute("jit_library.ipynb", tmp_path, monkeypatch)
    assert "identical" in _text_output(nb)  # jit + scan tokens == LLM.generate greedy
