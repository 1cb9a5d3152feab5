"""
The project's layout in numbers, from the code's own files (ast only; nothing is imported or run): the folders
and their modules, the longest file, class and function, the import arrows between the project's modules, and
any circle among them. tests/project/test_layout.py holds the code to the limits; run this file to see the numbers:

    python tests/support/layout_census.py            # the tree as it is
    python tests/support/layout_census.py --rev REV  # as it was at a git revision (read with `git show`, not checked out)
"""

import argparse
import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("nanochat", "scripts", "tasks")
WIDE_CALL = 5  # more arguments than this by position, and a call reads better with their names


def read_tree(rev=None):
    """{path: source} of the project's Python files (PACKAGES), at `rev` or in the working tree."""
    if rev is None:
        return {str(p.relative_to(REPO)): p.read_text() for top in PACKAGES for p in sorted((REPO / top).rglob("*.py"))}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, *PACKAGES], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=REPO, check=True, capture_output=True,
                              text=True).stdout for n in names if n.endswith(".py")}


def module_name(path):
    parts = path[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(tree, name, known):
    """The project modules `name` imports (anywhere in the file), resolved to known module names."""
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def circles(arrows):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in arrows.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))
    for v in sorted(arrows):
        if v not in index:
            visit(v)
    return out


def census(rev=None):
    """The layout's numbers, as a dict (see the module docstring)."""
    sources = read_tree(rev)
    trees = {path: ast.parse(text) for path, text in sources.items()}
    names = {module_name(p): p for p in sources}
    folders = defaultdict(list)
    for path in sources:
        folders[str(Path(path).parent)].append(Path(path).name)
    files = {p: len(t.splitlines()) for p, t in sources.items()}
    classes, functions, wide_calls = {}, {}, {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            where = f"{path}:{getattr(node, 'name', '')}"
            if isinstance(node, ast.Call) and len(node.args) > WIDE_CALL:
                wide_calls[f"{path}:{node.lineno} {ast.unparse(node.func)}"] = len(node.args)
            if isinstance(node, ast.ClassDef):
                classes[where] = node.end_lineno - node.lineno + 1
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[where] = node.end_lineno - node.lineno + 1
    arrows = {name: imports_of(trees[path], name, names) for name, path in names.items()}
    # a package's __init__ re-exporting its own modules is not an arrow between rooms
    arrows = {a: {b for b in bs if not (names[a].endswith("__init__.py") and b.startswith(a + "."))}
              for a, bs in arrows.items()}
    folder_of = {name: str(Path(path).parent) for name, path in names.items()}
    folder_arrows = defaultdict(set)
    for a, bs in arrows.items():
        folder_arrows[folder_of[a]] |= {folder_of[b] for b in bs if folder_of[b] != folder_of[a]}
    return {"folders": dict(sorted(folders.items())), "files": files, "classes": classes, "functions": functions,
            "wide_calls": wide_calls, "arrows": arrows, "circles": circles(arrows),
            "folder_arrows": dict(folder_arrows),
            "folder_circles": circles(folder_arrows)}


def longest(sizes, n=1):
    return sorted(sizes.items(), key=lambda kv: -kv[1])[:n]


def report(c):
    lines = [f"folders: {len(c['folders'])}"]
    for folder, modules in c["folders"].items():
        lines.append(f"  {folder}/  {len(modules)} modules, {sum(c['files'][f'{folder}/{m}'] for m in modules)} lines")
    for what in ("files", "classes", "functions"):
        lines.append(f"longest {what[:-1] if what != 'classes' else 'class'}: "
                     + ", ".join(f"{k} {v}" for k, v in longest(c[what], 3)))
    lines.append(f"import arrows: {sum(len(v) for v in c['arrows'].values())}")
    lines.append(f"circles: {len(c['circles'])}" + "".join(f"\n  {' <-> '.join(x)}" for x in c["circles"]))
    lines.append("folder arrows: " + "; ".join(f"{a} -> {', '.join(sorted(bs))}"
                                             for a, bs in sorted(c["folder_arrows"].items()) if bs))
    lines.append(f"folder circles: {len(c['folder_circles'])}"
                 + "".join(f"\n  {' <-> '.join(x)}" for x in c["folder_circles"]))
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--rev", default=None, help="a git revision to read instead of the working tree")
    print(report(census(parser.parse_args().rev)))
    sys.exit(0)
