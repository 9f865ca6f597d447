"""Text for calibration and evaluation that exists on every machine offline: the Python standard library's
English docstrings (read with `ast` from the source files, nothing imported or downloaded).

Modules are split by a hash of their top-level package name, so calibration and held-out text never come from
the same package: `corpus("calib")` (about 90%) and `corpus("heldout")` (the rest), both deterministic for one
Python installation. `read_text_file` turns the user's own file (`--calib FILE`) into paragraphs.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import re
import sysconfig
from pathlib import Path

from moecompile.errors import MoECompileError

HELDOUT_BUCKETS = 10  # one package in HELDOUT_BUCKETS goes to held-out text
# test suites and demo code hold few prose docstrings and many fixtures; idlelib/turtledemo are GUI code
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "lib2to3", "turtledemo", "__pycache__"}
_WORD = re.compile(r"[A-Za-z][a-z]+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def split_of(package: str) -> str:
    """'heldout' or 'calib' for a top-level package name: a stable hash, not Python's salted hash()."""
    digest = hashlib.sha256(package.encode()).digest()
    return "heldout" if digest[0] % HELDOUT_BUCKETS == 0 else "calib"


def _is_prose(text: str) -> bool:
    """English prose, not code, tables or doctests: mostly words, a few of them at least."""
    if ">>>" in text or "::" in text or text.count("|") > 1 or text.count("=") > 2:
        return False
    words = _WORD.findall(text)
    if len(words) < 6:
        return False
    letters = sum(ch.isalpha() or ch.isspace() for ch in text)
    return letters / len(text) > 0.85


def _paragraphs(doc: str) -> list[str]:
    out = []
    for block in re.split(r"\n\s*\n", doc):
        text = " ".join(line.strip() for line in block.strip().splitlines())
        if _is_prose(text):
            out.append(text)
    return out


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                docs.append(doc)
    return docs


@functools.lru_cache(maxsize=2)
def _stdlib_paragraphs(root: str) -> dict[str, tuple[str, ...]]:
    """{split: paragraphs} over the stdlib below root, in sorted file order, duplicates removed."""
    seen: set[str] = set()
    out: dict[str, list[str]] = {"calib": [], "heldout": []}
    base = Path(root)
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or rel.parts[0].startswith(("site-packages", "config-")):
            continue
        package = rel.parts[0].removesuffix(".py")
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for doc in _docstrings(source):
            for text in _paragraphs(doc):
                if text not in seen:
                    seen.add(text)
                    out[split_of(package)].append(text)
    return {k: tuple(v) for k, v in out.items()}


def corpus(split: str = "calib") -> list[str]:
    """The standard library's docstring paragraphs of one split ('calib' or 'heldout')."""
    if split not in ("calib", "heldout"):
        raise MoECompileError(f"unknown corpus split {split!r}; expected 'calib' or 'heldout'")
    paragraphs = _stdlib_paragraphs(sysconfig.get_paths()["stdlib"])
    if not paragraphs["calib"] or not paragraphs["heldout"]:
        raise MoECompileError("no docstrings found in the Python standard library sources; pass --calib FILE")
    return list(paragraphs[split])


def sentences(paragraphs: list[str], min_words: int = 6, max_words: int = 40) -> list[str]:
    """Single sentences of min_words..max_words words (held-out evaluation units)."""
    out = []
    for p in paragraphs:
        for s in _SENTENCE_END.split(p):
            if min_words <= len(s.split()) <= max_words and _is_prose(s):
                out.append(s)
    return out


def read_text_file(path: str | Path) -> list[str]:
    """The user's calibration text: paragraphs separated by blank lines (a line each if there are none)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MoECompileError(f"calibration file {path} does not exist") from None
    except (UnicodeDecodeError, OSError) as e:
        raise MoECompileError(f"cannot read calibration file {path} as UTF-8 text: {e}") from None
    blocks = [" ".join(b.split()) for b in re.split(r"\n\s*\n", text)]
    blocks = [b for b in blocks if b]
    if len(blocks) == 1:
        blocks = [line.strip() for line in text.splitlines() if line.strip()]
    if not blocks:
        raise MoECompileError(f"calibration file {path} holds no text")
    return blocks
