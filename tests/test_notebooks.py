"""Execute the notebooks in ``notebooks/`` top to bottom (nbclient, python3 kernel).

Each runs in its own temporary working directory with ``JBATCH_NB_OUT`` pointing there, so the
repository is never modified. Skipped when the demo model is absent (it ships with the package).

The shared setup cell (``scripts/sync_notebooks.py``) is also run as on Colab: a fake
``google.colab`` module, ``JBATCH_SOURCE`` a ``git+file://`` copy of this checkout, in a fresh
virtual environment that sees the system's packages (pip installs only jbatch, offline).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

import jbatch  # noqa: E402
from jbatch.demo import demo_model_path  # noqa: E402
from jbatch.project import repository_url  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
NAMES = ["quickstart.ipynb", "continuous_vs_static.ipynb", "jit_library.ipynb"]
CELL_TIMEOUT_S = 300
# Colab's kernel has google.colab imported; jax then imports google.colab.output (its debugger).
FAKE_COLAB = """import sys, types
colab = sys.modules["google.colab"] = types.ModuleType("google.colab")
colab.output = sys.modules["google.colab.output"] = types.ModuleType("google.colab.output")
"""


def _sync_script():
    spec = importlib.util.spec_from_file_location(
        "sync_notebooks", ROOT / "scripts/sync_notebooks.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_code_cell(name: str) -> str:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    return next(c.source for c in nb.cells if c.cell_type == "code")


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


def test_every_notebook_is_listed():
    assert sorted(NAMES) == sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.parametrize("name", NAMES)
def test_first_code_cell_is_the_install_cell(name):
    sync = _sync_script()
    assert _first_code_cell(name) == sync.install_cell(), "run scripts/sync_notebooks.py"
    assert "pip install jbatch" not in (NOTEBOOKS / name).read_text()


def test_readme_has_a_colab_badge_per_notebook():
    sync = _sync_script()
    readme = (ROOT / "README.md").read_text()
    assert sync.badges() in readme, "run scripts/sync_notebooks.py"
    for name in NAMES:
        assert f"/blob/main/notebooks/{name})" in sync.badges()
    assert "pip install jbatch\n" not in readme and "pip install jbatch " not in readme


@pytest.fixture(scope="module")
def checkout_git_url(tmp_path_factory) -> str:
    """A ``git+file://`` URL of a one-commit copy of this checkout (uncommitted files too)."""
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    git = lambda *a, cwd: subprocess.run(["git", *a], cwd=cwd, check=True, capture_output=True)
    files = git("ls-files", "-co", "--exclude-standard", "-z", cwd=ROOT).stdout.split(b"\0")
    copy = tmp_path_factory.mktemp("checkout")
    for rel in filter(None, (f.decode() for f in files)):
        if (ROOT / rel).is_file():
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, copy / rel)
    git("init", "-q", cwd=copy)
    git("add", "-A", cwd=copy)
    git("-c", "user.name=ci", "-c", "user.email=ci@localhost", "commit", "-qm", "copy", cwd=copy)
    return f"git+file://{copy}"


@pytest.mark.parametrize("name", NAMES)
def test_colab_install_cell(name, checkout_git_url, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)  # pip: the system's
    python = env_dir / "bin" / "python"
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},  # no checkout on the path
        "JBATCH_SOURCE": checkout_git_url,
        "PIP_NO_INDEX": "1",  # everything but jbatch is already installed: nothing is downloaded
        "PIP_NO_BUILD_ISOLATION": "0",  # build with the system's setuptools (pip: 0 = off)
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    run = subprocess.run(
        [str(python), "-c", FAKE_COLAB + _first_code_cell(name)],
        cwd=tmp_path,  # not the checkout: `import jbatch` must find the installed copy
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"pip install {checkout_git_url}" in run.stdout
    site = Path(
        subprocess.check_output(
            [str(python), "-c", "import site; print(site.getsitepackages()[0])"], text=True
        ).strip()
    )
    assert f"from {site / 'jbatch'}\n" in run.stdout, run.stdout  # the venv's copy was imported
    assert "backend cpu" in run.stdout and ": float32" in run.stdout
    assert (site / "jbatch" / "demo_model" / "model.safetensors").is_file()  # package data
    meta = subprocess.check_output(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('jbatch-engine'))"],
        text=True,
    )
    assert meta.strip() == jbatch.__version__  # the distribution is named jbatch-engine
    if name == NAMES[0]:  # installed, jbatch.project reads the address from the metadata
        show = "from jbatch.project import repository_url; print(repository_url())"
        url = subprocess.check_output([str(python), "-c", show], cwd=tmp_path, env=env, text=True)
        assert url.strip() == repository_url()


@pytest.mark.parametrize("name", NAMES)
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
