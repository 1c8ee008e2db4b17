"""Package discovery for the three source roots.

``plugins/`` and ``kernels/`` are imported as ``dspark_plugins`` and
``dspark_kernels`` (bare ``plugins``/``kernels`` would collide with other
projects), so every sub-package is found by walking the tree here.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {"dspark_core": "dspark_core", "dspark_plugins": "plugins", "dspark_kernels": "kernels"}


def find_packages_under(import_name: str, directory: str) -> list[str]:
    found = []
    for init in sorted(Path(directory).rglob("__init__.py")):
        relative = init.parent.relative_to(directory).parts
        found.append(".".join((import_name, *relative)))
    return found


setup(
    package_dir=ROOTS,
    packages=[pkg for name, directory in ROOTS.items() for pkg in find_packages_under(name, directory)],
    # the shipped default drafts are data files, not packages
    package_data={"dspark_core": ["drafts/*/config.json", "drafts/*/model.safetensors"]},
)
