"""The code-structure measures issue 65 names, for a source tree (a checkout, or `git archive REV | tar -x` of one):
the `Distiller` class's lines, the functions in core/ and data/ that take a `JobConfig` (annotated, or an
unannotated `cfg`), private names imported across the product's modules, the base names shared by 2+ product files,
non-blank lines over 100 and 120 characters (and "(" per line), the longest function, `recipes/distill.py`'s and
README.md's lines. Usage: python scripts/structure_measures.py [ROOT] (default: this checkout)."""

import ast
import collections
import pathlib
import sys


def measures(root: pathlib.Path) -> dict:
    prod = [p for d in ("kava_ray", "actors") for p in (root / d).rglob("*.py")]
    tree = ast.parse((root / "kava_ray/core/distiller.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Distiller")
    n_job, longest, private = 0, (0, ""), 0
    for p in prod:
        rel = str(p.relative_to(root))
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > longest[0]:
                    longest = (lines, f"{rel}:{node.name}")
                args = node.args.args + node.args.kwonlyargs
                if rel.startswith(("kava_ray/core/", "kava_ray/data/")) and any(
                        (a.annotation is not None and "JobConfig" in ast.unparse(a.annotation))
                        or (a.arg == "cfg" and a.annotation is None) for a in args):
                    n_job += 1
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("kava_ray", "actors"):
                private += sum(a.name.startswith("_") and not a.name.startswith("__") for a in node.names)
    names = collections.Counter(p.name for p in prod if p.name != "__init__.py")
    text = [line for p in prod for line in p.read_text().splitlines() if line.strip()]
    return {
        "Distiller class lines": cls.end_lineno - cls.lineno + 1,
        "functions in core/ and data/ taking a JobConfig": n_job,
        "private names imported across modules": private,
        "base names shared by 2+ product files (files)": (sum(v > 1 for v in names.values()),
                                                          sum(v for v in names.values() if v > 1)),
        "non-blank product lines, over 100, over 120": (len(text), sum(len(x) > 100 for x in text),
                                                        sum(len(x) > 120 for x in text)),
        "'(' per non-blank line": round(sum(x.count("(") for x in text) / len(text), 2),
        "longest function": longest,
        "recipes/distill.py lines": len((root / "kava_ray/recipes/distill.py").read_text().splitlines()),
        "README.md lines": len((root / "README.md").read_text().splitlines()),
    }


if __name__ == "__main__":
    for k, v in measures(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")).items():
        print(f"{k}: {v}")
