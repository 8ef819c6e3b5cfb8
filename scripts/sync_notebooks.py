"""Write the shared install cell into every notebook and the Colab badges into the README.

Both come from ``[project.urls] Repository`` (``jbatch.project.repository_url``): after changing
it, run ``PYTHONPATH=. python scripts/sync_notebooks.py``. ``tests/test_notebooks.py`` checks
that every notebook's first code cell and the README's badge block equal what this writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

from jbatch.project import PLACEHOLDER_OWNER, colab_url, repository_url

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
README = ROOT / "README.md"
MARKER = "# jbatch setup"  # first line of the install cell
BADGES_BEGIN, BADGES_END = "<!-- colab badges: scripts/sync_notebooks.py -->", "<!-- end badges -->"
BADGE = "https://colab.research.google.com/assets/colab-badge.svg"

_CELL = '''\
@MARKER@: the same cell in every notebook (scripts/sync_notebooks.py writes it).
# On Colab it installs jbatch from its repository, or from JBATCH_SOURCE (the form field or the
# environment variable): a git URL (a fork; @branch picks a branch), a wheel or a folder.
# Anywhere else jbatch is expected to be installed already (`pip install -e .` from a clone).
import importlib
import os
import subprocess
import sys

REPOSITORY = "@URL@"  # [project.urls] Repository in pyproject.toml
JBATCH_SOURCE = ""  # @param {type:"string"}


def pip_target(source: str) -> str:
    """What pip installs for ``source``: a wheel, a folder or git+ URL as is; else a git URL."""
    if source.endswith(".whl") or source.startswith("git+") or os.path.isdir(source):
        return source
    return "git+" + source


if "google.colab" in sys.modules:
    source = JBATCH_SOURCE or os.environ.get("JBATCH_SOURCE") or REPOSITORY
    if "/@OWNER@/" in source:
        raise RuntimeError(
            f"{source} is a placeholder: set JBATCH_SOURCE (above) to the repository's git URL"
        )
    print(f"pip install {pip_target(source)}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", pip_target(source)], check=True)
    importlib.invalidate_caches()
else:
    print("pip install skipped (not on Colab): using the jbatch installed in this environment")

import jax  # noqa: E402 (after the install, which may upgrade it)

import jbatch  # noqa: E402

BACKEND = jax.default_backend()  # "cpu", "gpu" or "tpu"
DTYPE = "float32" if BACKEND == "cpu" else "bfloat16"  # accelerators run in bfloat16
print(f"jbatch {jbatch.__version__} from {os.path.dirname(jbatch.__file__)}")
print(f"jax {jax.__version__}, backend {BACKEND} ({jax.devices()[0].device_kind}): {DTYPE}")'''

_INTRO = """\
## Setup

On Colab the next cell installs jbatch (from its repository, or from `JBATCH_SOURCE`); anywhere
else it only checks that jbatch imports. It prints what the notebook runs on: on a GPU or TPU
runtime the models run in bfloat16 on the accelerator, on a CPU in float32."""


def install_cell(url: str | None = None) -> str:
    """The source of every notebook's first code cell."""
    cell = _CELL.replace("@MARKER@", MARKER).replace("@URL@", url or repository_url())
    return cell.replace("@OWNER@", PLACEHOLDER_OWNER)


def badges(url: str | None = None) -> str:
    """The README's block of "Open in Colab" badges, one per notebook."""
    lines = [BADGES_BEGIN]
    for nb in sorted(NOTEBOOKS.glob("*.ipynb")):
        lines.append(f"- [![Open In Colab]({BADGE})]({colab_url(nb.name, url)}) `{nb.name}`")
    return "\n".join([*lines, BADGES_END])


def sync_notebook(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    cells = nb.cells
    first = next(i for i, c in enumerate(cells) if c.cell_type == "code")
    if cells[first].source.startswith(MARKER):
        cells[first].source = install_cell()
    else:  # insert the setup section before the first code cell
        cells[first:first] = [
            nbformat.v4.new_markdown_cell(_INTRO, id="jbatch-setup-intro"),
            nbformat.v4.new_code_cell(install_cell(), id="jbatch-setup"),
        ]
    nbformat.write(nb, path)


def sync_readme() -> None:
    text = README.read_text()
    start, end = text.index(BADGES_BEGIN), text.index(BADGES_END) + len(BADGES_END)
    README.write_text(text[:start] + badges() + text[end:])


def main() -> int:
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        sync_notebook(path)
        print(path)
    sync_readme()
    print(README)
    return 0


if __name__ == "__main__":
    sys.exit(main())
