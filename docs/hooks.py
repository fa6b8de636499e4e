"""MkDocs hook: publish files that live outside docs/ without copying them into it.

The benchmark plots (benchmarks/results/*.png, written by ``make bench``) and the notebooks
(notebooks/*.ipynb) are committed where they are made. Pages link to them by their path in the
repository (``../benchmarks/results/kernels.png``), which GitHub's view of docs/ follows too;
here those links are pointed at copies the site serves (``results/``, ``notebooks/``), so
``mkdocs build --strict`` checks them like any other link. ``*_quick`` files (``make
bench-quick``, not committed) are left out.
"""

from __future__ import annotations

import pathlib

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parent.parent
PUBLISHED = {"../benchmarks/results/": ("benchmarks/results", "*.png", "results/"),
             "../notebooks/": ("notebooks", "*.ipynb", "notebooks/")}


def on_files(files, config):
    for folder, pattern, site_prefix in PUBLISHED.values():
        for path in sorted((ROOT / folder).glob(pattern)):
            if not path.stem.endswith("_quick"):
                files.append(File.generated(config, site_prefix + path.name, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    depth = page.file.src_uri.count("/")  # pages in subfolders of docs/ link one level further up
    for repo_prefix, (_, _, site_prefix) in PUBLISHED.items():
        markdown = markdown.replace("../" * depth + repo_prefix, "../" * depth + site_prefix)
    return markdown
