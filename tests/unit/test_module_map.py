"""docs/architecture.md is the one map of zero_recipes/: every module named there by its path, and no path named
there that is gone. A module added, moved or removed without the map fails here, so the map stays true."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAP = REPO / "docs" / "architecture.md"


def modules() -> set[str]:
    return {p.relative_to(REPO).as_posix() for p in (REPO / "zero_recipes").rglob("*.py") if p.name != "__init__.py"}


def named() -> set[str]:
    return set(re.findall(r"zero_recipes/[\w/]+\.py", MAP.read_text()))


def test_every_module_is_on_the_map():
    missing = sorted(modules() - named())
    assert not missing, f"docs/architecture.md does not name {missing}: add a line for each, in its room"


def test_the_map_names_only_modules_that_exist():
    gone = sorted(p for p in named() - modules() if not p.endswith("__init__.py"))
    assert not gone, f"docs/architecture.md names {gone}, which do not exist: move or remove those lines"


def test_the_map_is_read_from_the_tree():
    # the two checks above compare sets; this one keeps them from passing on an empty tree or an empty page
    assert len(modules()) > 50 and "zero_recipes/config/train_config.py" in named()
