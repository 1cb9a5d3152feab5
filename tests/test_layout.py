"""The layout's limits (docs/layout.md): each subsystem in its folder, no folder over 12 modules, no file of the
library or the scripts over 450 lines, no class over 170, chat_rl at nanochat's size, the README for users, and
no circle of imports (tests/layout_census.py counts them from the code's own files)."""

import pytest
from helpers import REPO
from layout_census import census, circles


@pytest.fixture(scope="module")
def layout():
    return census()


def test_each_folder_holds_at_most_12_modules(layout):
    crowded = {folder: len(modules) for folder, modules in layout["folders"].items() if len(modules) > 12}
    assert not crowded


def test_no_file_of_the_library_or_scripts_is_over_450_lines(layout):
    long_files = {path: n for path, n in layout["files"].items() if n > 450 and path.startswith(("nanochat/", "scripts/"))}
    assert not long_files


def test_no_class_is_over_170_lines(layout):
    assert not {name: n for name, n in layout["classes"].items() if n > 170}


def test_chat_rl_reads_at_nanochats_size_and_the_readme_is_for_users(layout):
    assert layout["files"]["scripts/chat_rl.py"] <= 350
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
