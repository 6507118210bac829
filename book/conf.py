"""Sphinx + MyST-NB configuration for the dcp-ref book (builds offline).

    .venv/bin/pip install -e .[book]
    .venv/bin/sphinx-build -c book -b html . book/_build/html     (from the repository root)

Notebooks are rendered with their committed outputs (nbval checks those outputs in CI), so
building the book never executes kernels.
"""

from __future__ import annotations

project = "dcp-ref"
author = "dcp-ref contributors"
copyright = "2026, dcp-ref contributors"

extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
# API page: Google-style docstrings ("Args:", "Returns:"); members in source order; the kernels'
# modules import triton / cutlass at import time, which the book extra's environment has.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
nb_execution_mode = "off"  # committed outputs are the tested ones
myst_enable_extensions = ["dollarmath", "colon_fence"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
# The source directory is the repository root (so the notebooks are read where they live);
# only the book's index and the chapters are sources.
root_doc = "book/index"
include_patterns = ["book/index.md", "book/api.md", "notebooks/[0-9][0-9]_*.ipynb"]
exclude_patterns = ["book/_build", "**.ipynb_checkpoints", ".venv"]
html_theme = "sphinx_book_theme"
html_title = "dcp-ref: decode context parallelism for DeepSeek sparse attention"
html_theme_options = {"show_toc_level": 2}
suppress_warnings = ["mystnb.unknown_mime_type", "misc.highlighting_failure"]
