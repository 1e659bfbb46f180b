"""environment.yml (conda) mirrors pyproject.toml: every requirement of the core and of every extra, same bounds."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_environment_yml_lists_every_requirement_of_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    wanted = {r.split(";")[0].strip() for r in wanted}  # environment markers aside
    listed = set(re.findall(r'^\s*- "([^"]+)"', (ROOT / "environment.yml").read_text(), flags=re.M))
    listed.discard("-e .")  # minispec itself
    assert wanted - listed == set(), f"in pyproject.toml, not in environment.yml: {sorted(wanted - listed)}"
    assert listed - wanted == set(), f"in environment.yml, not in pyproject.toml: {sorted(listed - wanted)}"


def test_pyproject_metadata_reads_without_a_deprecation_warning():
    """``pip install`` builds minispec with setuptools, which warns on every install about a deprecated
    ``project.license`` table: the license is an SPDX string, which the minimum setuptools of
    ``build-system.requires`` (77, PEP 639) reads."""
    import warnings

    from packaging.requirements import Requirement
    from packaging.version import Version
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    toml = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (setuptools,) = [Requirement(r) for r in toml["build-system"]["requires"] if Requirement(r).name == "setuptools"]
    assert not setuptools.specifier.contains("76.9") and setuptools.specifier.contains("77.0"), setuptools
    assert toml["project"]["license"] == "MIT"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # setuptools' deprecation warning fails the test
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert dist.metadata.license_expression == "MIT"
