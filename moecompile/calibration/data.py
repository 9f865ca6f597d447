"""Text for calibration and evaluation that exists on every machine offline (nothing imported or downloaded).

Calibration reads the Python standard library, three kinds of English prose in it: `docstrings` (with `ast`),
`comments` (a regex lexer of comments and string literals) and `reference` (the language and library reference of
`pydoc_data.topics`). Each unit is assigned by a stable hash of its top-level package (or reference topic) to `calib`
(80%), `select` (10%: the text the end-to-end stage is judged on) or `heldout` (10%: the report's in-domain number).

Evaluation (`eval_sources`) uses text that shares nothing with calibration: the held-out standard-library
docstrings (in-domain), and out of domain the docstrings of moecompile's dependencies and the READMEs and licences
in their *.dist-info folders. Calibration never reads a dependency's text, so that text stays fit for evaluation.
`other_sentences` reads the calibration text of other projects packaged with moecompile (other_text.py builds it).
`read_text_file` turns the user's own file (`--calib FILE`) into paragraphs.
"""
from __future__ import annotations

import ast
import bisect
import functools
import gzip
import hashlib
import random
import re
import sysconfig
from collections import deque
from pathlib import Path

from moecompile.core.errors import MoECompileError

OTHER_TEXT = Path(__file__).with_name("other_text.txt.gz")  # one sentence a line; other_text.py writes it
SPLIT_BUCKETS = 10  # hash bucket 0 of a package: held-out text, bucket 1: selection text, the rest: calibration
SPLITS = ("calib", "select", "heldout")
STDLIB_KINDS = ("docstrings", "comments", "reference")
# out-of-domain evaluation: docstrings of these dependencies (the first of their files in a stable hash order)
DEPENDENCY_DOCSTRINGS = ("torch", "transformers", "numpy", "networkx")
EVAL_WORDS = (8, 40)  # evaluation sentences: 8-40 words
# test suites and demo code hold few prose docstrings and many fixtures; idlelib/turtledemo are GUI code
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "lib2to3", "turtledemo", "__pycache__",
             "testing"}
_WORD = re.compile(r"[A-Za-z][a-z]+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_MARKUP = re.compile(r"!?\[([^\]]*)\]\([^)]*\)|<[^>]+>|[*_`#>]+")  # markdown links and images, HTML tags, emphasis


def split_of(package: str) -> str:
    """'heldout', 'select' or 'calib' for a top-level package name: a stable hash, not Python's salted hash()."""
    bucket = hashlib.sha256(package.encode()).digest()[0] % SPLIT_BUCKETS
    return SPLITS[2] if bucket == 0 else SPLITS[1] if bucket == 1 else SPLITS[0]


def _is_prose(text: str) -> bool:
    """English prose, not code, tables or doctests: mostly words, a few of them at least."""
    if ">>>" in text or "::" in text or text.count("|") > 1 or text.count("=") > 2:
        return False
    words = _WORD.findall(text)
    if len(words) < 6:
        return False
    letters = sum(map(str.isalpha, text)) + sum(map(str.isspace, text))  # disjoint classes, counted at C speed
    return letters / len(text) > 0.85


def _paragraphs(doc: str) -> list[str]:
    out = []
    for block in re.split(r"\n\s*\n", doc):
        text = " ".join(line.strip() for line in block.strip().splitlines())
        if _is_prose(text):
            out.append(text)
    return out


_DEFINITIONS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
# the fields that hold statements (or except / case clauses holding them): definitions live only there, so the walk
# skips every expression, in ast.walk's breadth-first order
_STATEMENT_FIELDS = ("body", "orelse", "finalbody", "handlers", "cases")
# a comment, or a string literal (skipped: a "#" inside one starts no comment); tokenize's rules, at regex speed
_LEXEME = re.compile(r"""(?P<comment>\#[^\r\n]*)
    |(?:'''(?:[^'\\]|\\.|'(?!''))*'''|\"\"\"(?:[^"\\]|\\.|"(?!""))*\"\"\"
    |'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")""", re.VERBOSE | re.DOTALL)


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    docs, queue = [], deque([tree])
    while queue:
        node = queue.popleft()
        if isinstance(node, _DEFINITIONS):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                docs.append(doc)
        for name in _STATEMENT_FIELDS:
            queue.extend(getattr(node, name, ()))
    return docs


def _comments(source: str) -> list[str]:
    """Runs of comment lines on consecutive lines, each joined into one paragraph."""
    line_starts = [0] + [m.end() for m in re.finditer("\n", source)]
    runs, run, last = [], [], -2
    for lexeme in _LEXEME.finditer(source):
        if lexeme.lastgroup != "comment":
            continue
        line = bisect.bisect_right(line_starts, lexeme.start())
        text = lexeme.group().lstrip("#!").strip()
        if line != last + 1 and run:
            runs.append(" ".join(run))
            run = []
        if text:
            run.append(text)
        last = line
    if run:
        runs.append(" ".join(run))
    return [r for r in runs if _is_prose(r)]


def _source_files(base: Path):
    """(top-level package, path) of the .py files below base that hold prose, in sorted order."""
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or rel.parts[0].startswith(("site-packages", "config-")):
            continue
        yield rel.parts[0].removesuffix(".py"), path


@functools.lru_cache(maxsize=2)
def _stdlib_paragraphs(root: str) -> dict[tuple[str, str], tuple[str, ...]]:
    """{(kind, split): paragraphs} over the stdlib below root, in sorted file order, duplicates removed."""
    seen: set[str] = set()
    out: dict[tuple[str, str], list[str]] = {(k, s): [] for k in STDLIB_KINDS for s in SPLITS}

    def add(kind, split, texts):
        for text in texts:
            if text not in seen:
                seen.add(text)
                out[(kind, split)].append(text)

    base = Path(root)
    for package, path in _source_files(base):
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        add("docstrings", split_of(package), [t for doc in _docstrings(source) for t in _paragraphs(doc)])
        add("comments", split_of(package), _comments(source))
    topics = base / "pydoc_data" / "topics.py"
    if topics.exists():  # {topic: reference text}, a literal dict
        try:
            tree = ast.parse(topics.read_text(encoding="utf-8"))
            table = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign))
        except (SyntaxError, ValueError, StopIteration, OSError):
            table = {}
        for topic, text in sorted(table.items()):
            add("reference", split_of(topic), _paragraphs(text))
    return {k: tuple(v) for k, v in out.items()}


def corpus(split: str = "calib", kind: str = "docstrings") -> list[str]:
    """The standard library's paragraphs of one kind (STDLIB_KINDS) and split (SPLITS)."""
    if split not in SPLITS:
        raise MoECompileError(f"unknown corpus split {split!r}; expected one of {', '.join(SPLITS)}")
    if kind not in STDLIB_KINDS:
        raise MoECompileError(f"unknown corpus kind {kind!r}; expected one of {', '.join(STDLIB_KINDS)}")
    paragraphs = _stdlib_paragraphs(sysconfig.get_paths()["stdlib"])
    if not paragraphs[("docstrings", "calib")] or not paragraphs[("docstrings", "heldout")]:
        raise MoECompileError("no docstrings found in the Python standard library sources; pass --calib FILE")
    return list(paragraphs[(kind, split)])


def sentences(paragraphs: list[str], min_words: int = 6, max_words: int = 40) -> list[str]:
    """Single sentences of min_words..max_words words."""
    out = []
    for p in paragraphs:
        for s in _SENTENCE_END.split(p):
            if min_words <= len(s.split()) <= max_words and _is_prose(s):
                out.append(s)
    return out


def interleave(parts: list[list[str]], seed: int = 0) -> list[str]:
    """Each part shuffled, then one item of each in turn (a part that runs out drops out): any prefix of the result
    draws about equally on every part."""
    rng = random.Random(seed)
    parts = [rng.sample(p, len(p)) for p in parts if p]
    out = []
    for i in range(max((len(p) for p in parts), default=0)):
        out.extend(p[i] for p in parts if i < len(p))
    return out


def substituted(texts: list[str], words: list[str], rate: float, seed: int = 0) -> list[str]:
    """Each text with about `rate` of its words of 4+ letters replaced by random `words` (the model's vocabulary):
    the syntax of real text around words it does not hold."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) if len(w) >= 4 and w.isalpha() and rng.random() < rate else w
                     for w in t.split()) for t in texts]


def stdlib_mix(split: str = "calib", seed: int = 0, words: list[str] = (), rate: float = 0.0) -> list[str]:
    """Single sentences of every standard-library kind of one split, and with `words` and a `rate` (substituted)
    those sentences again with vocabulary words in, all interleaved (`interleave`)."""
    parts = [sentences(corpus(split, kind)) for kind in STDLIB_KINDS]
    if words and rate > 0:
        parts.append(substituted([s for p in parts for s in p], list(words), rate, seed))
    return interleave(parts, seed)


@functools.lru_cache(maxsize=1)
def other_sentences() -> tuple[str, ...]:
    """The packaged sentences of other projects' documentation (other_text.py), in their file's order."""
    try:
        with gzip.open(OTHER_TEXT, "rt", encoding="utf-8") as f:
            return tuple(line.rstrip("\n") for line in f if line.strip())
    except (OSError, EOFError) as e:
        raise MoECompileError(f"cannot read moecompile's packaged calibration text {OTHER_TEXT} ({e}); reinstall "
                              "moecompile or pass --calib stdlib") from None


def distribution_name(name: str) -> str:
    """A distribution's name as _dependencies lists it (lower case, "-" for "_"), to compare names by."""
    return name.lower().replace("_", "-")


def _dependencies() -> list[str]:
    """moecompile's required distributions and theirs (extras left out), by name, sorted."""
    from importlib import metadata

    todo, seen = ["moecompile"], set()
    while todo:
        name = todo.pop()
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for req in requires:
            if "extra ==" in req:
                continue
            dep = distribution_name(re.match(r"[A-Za-z0-9_.-]+", req).group(0))
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return sorted(seen)


def _package_sentences(name: str, want: int, skip: frozenset = frozenset()) -> list[str]:
    """Docstring sentences (EVAL_WORDS) of an installed package, its files (not those below a `skip` folder) read in a
    stable hash order until `want` sentences: the first files of a large package (torch) are a fair sample of all."""
    root = Path(sysconfig.get_paths()["purelib"]) / name
    files = sorted((p for _, p in _source_files(root) if not skip.intersection(p.relative_to(root).parts)),
                   key=lambda p: hashlib.sha256(str(p.relative_to(root)).encode()).digest())
    out, seen = [], set()
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for s in sentences([t for doc in _docstrings(source) for t in _paragraphs(doc)], *EVAL_WORDS):
            if s not in seen:
                seen.add(s)
                out.append(s)
        if len(out) >= want:
            break
    return out


def licence_files(dist) -> list[Path]:
    """The licence files in an installed distribution's *.dist-info folder."""
    return [Path(f.locate()) for f in dist.files or []
            if ".dist-info/" in str(f) and re.search(r"LICEN[CS]E|COPYING", f.name, re.I)]


def distribution_sentences(names: list[str], readmes: bool = True) -> list[str]:
    """Sentences (EVAL_WORDS) of the long descriptions (READMEs; not with readmes=False) and licence files of the named
    installed distributions (those not installed are left out)."""
    from importlib import metadata

    texts = []
    for name in names:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if readmes:
            texts.append(dist.metadata.get_payload() or dist.metadata.get("Description") or "")
        for path in licence_files(dist):
            try:
                texts.append(path.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                continue
    paragraphs = [_MARKUP.sub(r"\1", p) for t in texts for p in re.split(r"\n\s*\n", t)]
    return list(dict.fromkeys(sentences(_paragraphs("\n\n".join(paragraphs)), *EVAL_WORDS)))


def dependency_sentences(n: int) -> dict[str, list[str]]:
    """The out-of-domain evaluation pools: up to 4n docstring sentences of each of DEPENDENCY_DOCSTRINGS that is
    installed, and `readmes`, every sentence of the READMEs and licences of moecompile's dependencies."""
    pools = {name: _package_sentences(name, 4 * n) for name in DEPENDENCY_DOCSTRINGS}
    pools["readmes"] = distribution_sentences(_dependencies())
    return pools


def eval_sources(n: int, seed: int = 0) -> dict[str, list[str]]:
    """Evaluation sentences, up to n per source, none of them in the calibration text (the standard library's and
    the packaged text of other projects) or the selection text: `stdlib` (the held-out packages' docstrings:
    in-domain), then out of domain each of DEPENDENCY_DOCSTRINGS that is installed (its docstrings) and `readmes`
    (READMEs and licences of moecompile's dependencies)."""
    seen = {s for split in SPLITS[:2] for kind in STDLIB_KINDS for s in sentences(corpus(split, kind), 1, 10**9)}
    seen.update(other_sentences())
    pools = {"stdlib": sentences(corpus("heldout"), *EVAL_WORDS), **dependency_sentences(n)}
    out = {}
    for name, pool in pools.items():
        pool = [s for s in pool if s not in seen]
        if pool:
            out[name] = random.Random(seed).sample(pool, min(n, len(pool)))
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
