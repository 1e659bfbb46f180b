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
