"""ARCHITECTURE.md and docs/internals/*.md name only code that exists.

Every backticked span of a page (and every token of its fenced diagrams) that names this repository's code is
looked up: a path (`kava_ray/core/distiller.py`, `recipes/distill.py`, `core/kv/{batch,rope}.py`, `tune_spaces/*.yaml`)
must exist; a dotted name (`core.distiller.Distiller.forward`, `runtime/console.status(line)`,
`DistillRecipe.build_model`, `plans.layer_plan`) must resolve to a module and then to what that module defines or
imports, a class's methods and attributes included; a bare private name (`_vocab_terms`) must be defined somewhere
in the code. Names are resolved by parsing the sources with `ast`, not by importing them: no torch, no Ray, a
fraction of a second, and a module that fails to import still gets its names checked.

What counts as a reference (strict where it is ours, silent where it is not):
    a dotted name counts when its first part is one of this repository's modules or packages (any dotted suffix of
    one: `kava_ray.core.plans`, `core.plans`, `plans`) or one of its classes; `ray.train.report`, `torch...`,
    `Dataset.map` are someone else's and skipped. A name that is also a config key (`fusion.kind`, `train.loggers`,
    `align.projector.kind`: resolved through `JobConfig`'s fields) passes as that.
    a path counts when its first part is a top-level entry of the repository or of `kava_ray/` (`RUN_DIR/logs/`,
    `final/` are a run's files, not the repository's; `data/{split}.jsonl` is a template of a user's path); a bare
    `name.py` (the layer diagram's `distill.py`) must be a file of the code.
"""

from __future__ import annotations

import ast
import glob
import re
from functools import cache
from pathlib import Path

import pytest

from kava_ray.common.config import JobConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
# docs/internals/references.md is left out: it quotes other projects' code (TRL's `_jsd_divergence`, Liger's
# `_input_chunk`, Megatron-Bridge's `docs/training/distillation.md`) and names none of ours
PAGES = ["ARCHITECTURE.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "internals").glob("*.md")
                                    if p.name != "references.md")]
CODE_DIRS = ("kava_ray", "actors", "tests")
IDENT = r"[A-Za-z_]\w*"
DOTTED = re.compile(rf"{IDENT}(?:\.{IDENT})+")


@cache
def _modules() -> dict[str, list[Path]]:
    """{every dotted suffix of a module's name: its files}: `kava_ray.core.align.tokens`, `core.align.tokens`,
    `align.tokens` and `tokens` all name kava_ray/core/align/tokens.py (a package by its __init__.py)."""
    out: dict[str, list[Path]] = {}
    for d in CODE_DIRS:
        for f in (ROOT / d).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            for i in range(len(parts)):
                out.setdefault(".".join(parts[i:]), []).append(f)
    return out


def _class_members(node: ast.ClassDef) -> set[str]:
    """A class's methods, class attributes and fields, and the attributes its methods set on `self`."""
    names = set()
    for n in node.body:  # its own body: a method's local variables are no members
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, ast.Assign):
            names.update(t.id for t in n.targets if isinstance(t, ast.Name))
    for n in ast.walk(node):
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                for e in ast.walk(t):
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                        names.add(e.attr)
    return names


@cache
def _parsed(path: Path) -> tuple[set[str], dict[str, set[str]]]:
    """(the names a module defines or imports at its top level, {its classes: their members})."""
    tree = ast.parse(path.read_text())
    top, classes = set(), {}
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top.add(n.name)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            top.add(n.target.id)
        elif isinstance(n, ast.Assign):
            top.update(e.id for t in n.targets for e in ast.walk(t) if isinstance(e, ast.Name))
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            top.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.If):  # `if TYPE_CHECKING:` imports, version branches
            top.update(_parsed_block(n))
    for n in ast.walk(tree):
        if isinstance(n, ast.ClassDef):
            classes.setdefault(n.name, set()).update(_class_members(n))
    return top, classes


def _parsed_block(node: ast.If) -> set[str]:
    names = set()
    for n in node.body + node.orelse:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in n.names)
    return names


@cache
def _classes() -> dict[str, set[str]]:
    """{every class of the code: its members (the union where two classes share a name)}."""
    out: dict[str, set[str]] = {}
    for files in _modules().values():
        for f in files:
            for name, members in _parsed(f)[1].items():
                out.setdefault(name, set()).update(members)
    return out


@cache
def _defined() -> set[str]:
    """Every function, class, method and attribute name the code defines anywhere."""
    names = set()
    for f in {f for files in _modules().values() for f in files}:
        top, classes = _parsed(f)
        names |= top | set(classes) | set().union(*classes.values())
    return names


def _in_module(path: Path, rest: list[str]) -> bool:
    """Does `a.b...` resolve in module `path`: a name it defines or imports, then a member of that class."""
    if not rest:
        return True
    top, classes = _parsed(path)
    if rest[0] not in top:
        return False
    if len(rest) == 1:
        return True
    members = classes.get(rest[0]) or _classes().get(rest[0])
    return members is not None and len(rest) == 2 and rest[1] in members


def _is_config_key(parts: list[str]) -> bool:
    model = JobConfig
    for p in parts:
        fields = getattr(model, "model_fields", None)
        if fields is None or p not in fields:
            return False
        ann = fields[p].annotation
        model = next((a for a in (ann, *getattr(ann, "__args__", ())) if hasattr(a, "model_fields")), None)
    return True


def _dotted_problem(name: str) -> str | None:
    """Why a dotted name is stale, or None (fine, or not this repository's)."""
    parts = name.split(".")
    if _is_config_key(parts):
        return None
    mods = _modules()
    for i in range(len(parts), 0, -1):  # the longest prefix that names a module
        files = mods.get(".".join(parts[:i]))
        if files:
            if any(_in_module(f, parts[i:]) for f in files):
                return None
            return f"{'.'.join(parts[i:])} is not in {', '.join(str(f.relative_to(ROOT)) for f in files)}"
    if parts[0] in _classes():
        if len(parts) == 2 and parts[1] in _classes()[parts[0]]:
            return None
        return f"class {parts[0]} has no {'.'.join(parts[1:])}"
    return None  # not ours: ray.train.report, torch.distributed, Dataset.map


def _expand(path: str) -> list[str]:
    """`core/kv/{batch,rope}.py` -> its paths."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand(path[:m.start()] + alt + path[m.end():])]


def _path_problem(path: str, page_dir: Path) -> str | None:
    """Why a repository path is stale, or None; `path/module.name` (a module, then a name in it) too."""
    path = path.rstrip("/")
    first = path.split("/")[0]
    if first not in {p.name for p in ROOT.iterdir()} | {p.name for p in (ROOT / "kava_ray").iterdir()}:
        return None  # RUN_DIR/logs, final/, train/cos_raw.qwen: a run's files and keys
    if re.search(r"\{\w*\}", path):
        return None  # data/{split}.jsonl: a template of a user's path
    m = re.fullmatch(r"(.*/\w+)\.(" + IDENT + r"(?:\." + IDENT + r")*)", path)
    if m and m.group(2) not in ("py", "md", "yaml", "yml", "toml", "sh", "txt", "json", "png", "cfg", "ini"):
        return _dotted_problem(m.group(1).replace("/", ".") + "." + m.group(2))  # runtime/console.status
    for p in _expand(path):
        bases = (ROOT, ROOT / "kava_ray", page_dir)
        if not any(glob.glob(str(b / p)) for b in bases):
            return f"no file {p}"
    return None


def _spans(text: str) -> list[tuple[int, str]]:
    """(line number, candidate) for every backticked span, and every dotted or private name of a fenced block."""
    out, fenced = [], False
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            out += [(no, t) for t in re.findall(rf"(?<![\w./-])(?:{IDENT}/)*{IDENT}(?:\.{IDENT})+"
                                                rf"|(?<![\w.])_[A-Za-z]\w*", line)]
        else:
            out += [(no, s) for s in re.findall(r"`([^`\n]+)`", line)]
    return out


def _problem(span: str, page_dir: Path) -> str | None:
    """Why one span names stale code, or None."""
    span = span.strip()
    m = re.match(rf"((?:{IDENT}/)*{IDENT}(?:\.[\w*]+)*/?)(?:\(.*)?$", span)  # drop a call's arguments
    if not m:
        m = re.fullmatch(r"([\w*./{},-]+/[\w*.{},-]*)", span)  # paths with globs or braces
        return _path_problem(m.group(1), page_dir) if m else None
    ref = m.group(1)
    if "/" in ref:
        return _path_problem(ref, page_dir)
    if ref.endswith(".py"):  # a bare module file (`distill.py`): somewhere in the code (`best.yaml` is a run's)
        return None if any(list((ROOT / d).glob(f"**/{ref}")) for d in CODE_DIRS) else f"no file {ref}"
    if DOTTED.fullmatch(ref):
        return _dotted_problem(ref)
    if re.fullmatch(r"_[A-Za-z]\w*", ref) and ref not in _defined():
        return f"{ref} is defined nowhere in {', '.join(CODE_DIRS)}"
    return None


def stale_references(page: str) -> list[str]:
    """'page:line: `span`: why' for every reference of `page` to code that does not exist."""
    path = ROOT / page
    return [f"{page}:{no}: `{span}`: {why}" for no, span in _spans(path.read_text())
            if (why := _problem(span, path.parent))]


@pytest.mark.parametrize("page", PAGES)
def test_every_code_reference_exists(page):
    stale = stale_references(page)
    assert not stale, f"{len(stale)} stale reference(s):\n" + "\n".join(stale)


@pytest.mark.parametrize("span", ["core.distiller.Distiller._made_up", "kava_ray/core/made_up.py",
                                  "runtime/console.made_up(line)", "DistillRecipe.made_up", "Distiller.total",
                                  "_made_up_term", "plans.made_up", "core/kv/{batch,made_up}.py"])
def test_a_made_up_name_is_stale(span):
    assert _problem(span, ROOT)


@pytest.mark.parametrize("span", ["ray.train.report", "torch.distributed", "Dataset.map", "fusion.kind",
                                  "align.projector.kind", "RUN_DIR/logs/", "core.terms.ce_logits.CELogitsTerm._routed",
                                  "runtime/console.status(line)", "core/kv/{batch,rope}.py", "kava_ray.data.Batch"])
def test_a_real_or_foreign_name_passes(span):
    assert _problem(span, ROOT) is None



# ---------------------------------------------------------------------------------- the public surface

PRODUCT = ("kava_ray", "actors")


def private_imports(source: str, where: str = "") -> list[str]:
    """`from kava_ray... import _name` / `from actors... import _name` in `source`: a module reaching into another's
    private name (a leading underscore; dunders aside). What one module shares with another is public."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PRODUCT:
            out += [f"{where}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_module_of_the_product_imports_another_s_private_name():
    found = [hit for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))
             for hit in private_imports(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "\n".join(found)


def test_a_private_import_is_found_in_one_and_in_several_lines():
    assert private_imports("from kava_ray.core.losses import _tail_of\n", "x.py") == [
        "x.py:1: kava_ray.core.losses._tail_of"]
    several = "from actors.pool import (\n    start_pool,\n    _actor_options,\n)\n"
    assert [h.split(": ")[1] for h in private_imports(several)] == ["actors.pool._actor_options"]
    assert private_imports("from ray._private import worker\nfrom kava_ray.cli import __version__\n") == []
