"""The layout's limits (docs/layout.md): each subsystem in its folder (rooms cut by meaning: no cap on a folder's
modules, which had put modules in the wrong rooms to fit), nanochat's re-exported import paths holding re-exports
only, no file of the library or the scripts over 450 lines, no class over 150 and no
function over 60 in them (tasks/ is data and rewards: exempt), chat_rl at 220 lines with its loop on a screen, the
README for users, and no circle of imports (tests/support/layout_census.py counts them from the code's own files)."""

import ast

import pytest
from helpers import REPO
from layout_census import census, circles

# nanochat's import paths, kept so that scripts written against karpathy/nanochat run here (docs/layout.md,
# "nanochat's names"). They hold re-exports only (checked below), so a reader finds no code in them. A new one is
# added here, by name.
NANOCHAT_IMPORT_PATHS = {"nanochat/gpt.py", "nanochat/checkpoint_manager.py", "nanochat/muon.py", "nanochat/adamw.py"}


@pytest.fixture(scope="module")
def layout():
    return census()


@pytest.mark.parametrize("path", sorted(NANOCHAT_IMPORT_PATHS))
def test_nanochats_import_paths_only_re_export(path):
    """nanochat's import paths hold nothing but a docstring, imports from the library and `__all__`."""
    body = ast.parse((REPO / path).read_text()).body
    docstring = body[:1] if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else []
    code = [node for node in body[len(docstring):]
            if not (isinstance(node, ast.ImportFrom) and node.module.startswith("nanochat."))
            and not (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"])]
    assert docstring and not code, f"{path}: {[ast.unparse(node) for node in code]}"


def test_no_file_of_the_library_or_scripts_is_over_450_lines(layout):
    long_files = {path: n for path, n in layout["files"].items() if n > 450 and path.startswith(("nanochat/", "scripts/"))}
    assert not long_files


def test_no_class_of_the_library_or_scripts_is_over_150_lines(layout):
    assert not {name: n for name, n in layout["classes"].items() if n > 150 and name.startswith(("nanochat/", "scripts/"))}


def test_no_function_of_the_library_or_scripts_is_over_60_lines(layout):
    """Split by meaning, as nanoGPT's train.py and gpt-fast's generate.py are: a loop on one screen calling named
    helpers."""
    assert not {name: n for name, n in layout["functions"].items() if n > 60 and name.startswith(("nanochat/", "scripts/"))}


# calls that take their arguments by position whatever their count: each with why
POSITIONAL_CALLS = {
    "apply": "an autograd Function's apply takes its inputs by position only",
    "store_rows": "a torch.library operator (nanochat::store_rows): its schema's order, inside compiled code",
    "rotary_store": "a torch.library operator over a Triton kernel (nanochat::rotary_store): its schema's order",
    "sample_rows": "a torch.library operator over a Triton kernel (nanochat::sample_rows): its schema's order",
    "add_shared": "flag names, add_shared(parser, *names)",
    "run_flex_prompt_attention": "a compiled function's flat tensors, run_flex_prompt_attention(*args)",
}


def test_no_call_of_the_library_or_scripts_passes_more_than_five_arguments_by_position(layout):
    """Past five, a call names its arguments: a reader need not count them against the def. Triton's jit code in
    nanochat/kernels/ is exempt (a kernel's launch and the helpers it calls take the compiled signature's order), and
    POSITIONAL_CALLS."""
    def callee(call):  # "path:line module.name" -> name
        return call.split()[-1].rpartition(".")[2]
    wide = {call: n for call, n in layout["wide_calls"].items() if call.startswith(("nanochat/", "scripts/"))
            and not call.startswith("nanochat/kernels/") and callee(call) not in POSITIONAL_CALLS}
    assert not wide


def test_chat_rl_reads_at_nanochats_size_and_the_readme_is_for_users(layout):
    assert layout["files"]["scripts/chat_rl.py"] <= 220
    assert len((REPO / "README.md").read_text().splitlines()) <= 500


def test_no_module_imports_itself_through_others(layout):
    assert layout["circles"] == []


def test_the_packages_import_one_way(layout):
    """Among the subsystem folders, no two import each other (the top folder holds both the base modules, such as
    common, and the command-line layer over everything, so it is left out)."""
    arrows = {a: {b for b in bs if b != "nanochat"} for a, bs in layout["folder_arrows"].items() if a != "nanochat"}
    assert circles(arrows) == []


def test_the_census_finds_a_circle_and_a_long_class():
    """The census itself: a circle of three and a class's length, on a made-up graph and source."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_tests_are_in_folders_by_package_of_at_most_20_files():
    """tests/ holds no test file at its top; each folder at most 20 (docs/testing.md lists them, a table a folder)."""
    tests = REPO / "tests"
    assert sorted(p.name for p in tests.glob("test_*.py")) == []
    crowded = {d.name: n for d in tests.iterdir() if d.is_dir() and (n := len(list(d.glob("test_*.py")))) > 20}
    assert not crowded
    listed = (REPO / "docs" / "testing.md").read_text()
    assert sorted(p.name for p in tests.glob("*/test_*.py") if f"`{p.name}`" not in listed) == []


def test_the_distribution_lists_every_package():
    """pyproject.toml's packages are every folder of the library and scripts with an __init__.py (a package left
    out installs without it, and an installed run fails to import it)."""
    import re
    packages = re.search(r"(?ms)^packages = \[(.*?)\]", (REPO / "pyproject.toml").read_text()).group(1)
    listed = set(re.findall(r'"([\w.]+)"', packages))  # read as text: tomllib is Python 3.11's
    found = {str(p.parent.relative_to(REPO)).replace("/", ".") for top in ("nanochat", "tasks", "scripts")
             for p in (REPO / top).rglob("__init__.py")}
    assert found == listed


def test_the_files_scheduled_first_exist():
    """tests/conftest.py's FILES_FIRST (the longest files, given to the xdist workers first) names test files that
    exist: a renamed file would silently drop back to its place in file order, and the suite's tail would grow."""
    from conftest import FILES_FIRST, TESTS
    assert [name for name in FILES_FIRST if not (TESTS / name).is_file()] == []
    assert len(set(FILES_FIRST)) == len(FILES_FIRST)


def test_every_mutation_still_applies_to_the_code_it_names():
    """tests/support/mutations.py's rows (the bugs the suite is proved against) name code by its exact text: each
    original occurs exactly once in its file, and each test it names exists. A refactor that moves or rewrites the
    code leaves a row that the runner refuses, and the row's bug unguarded, unless the row moves with it. Each row's
    name is its own: the runner takes rows by name, so two of one name ran together and reported as one."""
    from mutations import MUTATIONS
    stale = [m.name for m in MUTATIONS if (REPO / m.file).read_text().count(m.original) != 1]
    missing = [(m.name, t) for m in MUTATIONS for t in m.tests if not (REPO / t.split("::")[0]).is_file()]
    names = [m.name for m in MUTATIONS]
    assert stale == [] and missing == []
    assert sorted({name for name in names if names.count(name) > 1}) == []
