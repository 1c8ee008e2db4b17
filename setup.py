"""Package discovery for the three source roots, and the data files shipped inside them.

``plugins/`` and ``kernels/`` are imported as ``dspark_plugins`` and
``dspark_kernels`` (bare ``plugins``/``kernels`` would collide with other
projects), so every sub-package is found by walking the tree here.

Data shipped with the package: the default drafts (``dspark_core/drafts/<name>/``,
speculators checkpoints in plain directories) and the demo calibration files
(``dspark_core/configs/*.json``). Each draft directory is declared as a
namespace package of its own so setuptools copies it without warning;
tests/test_packaging.py checks that a built wheel holds all of them.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {"dspark_core": "dspark_core", "dspark_plugins": "plugins", "dspark_kernels": "kernels"}
DRAFT_FILES = ["config.json", "model.safetensors"]


def find_packages_under(import_name: str, directory: str) -> list[str]:
    found = []
    for init in sorted(Path(directory).rglob("__init__.py")):
        relative = init.parent.relative_to(directory).parts
        found.append(".".join((import_name, *relative)))
    return found


def draft_packages() -> dict[str, list[str]]:
    drafts = Path("dspark_core/drafts")
    found = {"dspark_core.drafts": []}
    for directory in sorted(p for p in drafts.iterdir() if p.is_dir() and (p / "config.json").is_file()):
        found[f"dspark_core.drafts.{directory.name}"] = DRAFT_FILES
    return found


DRAFTS = draft_packages()
setup(
    package_dir=ROOTS,
    packages=[pkg for name, directory in ROOTS.items() for pkg in find_packages_under(name, directory)] + list(DRAFTS),
    package_data={**DRAFTS, "dspark_core.configs": ["*.json"]},
)
