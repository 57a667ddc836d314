"""What a fresh install gets: the test extras' pins work together, and CI installs as the README says.

A new venv installs the newest versions the pins allow, so a pin that lets in a release the other
test tools cannot run with turns a user's first test run red (pytest 9.2 removed the
`request.node._nodeid` that schemathesis 4.32.x reads). CI runs on a fresh venv to see it first.
"""
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _test_extra() -> dict[str, Requirement]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = [Requirement(r) for r in meta["project"]["optional-dependencies"]["test"]]
    return {r.name.lower(): r for r in reqs}


def test_pytest_pin_excludes_releases_schemathesis_cannot_run_with():
    extra = _test_extra()
    st, pt = extra["schemathesis"], extra["pytest"]
    # While any schemathesis 4.32.x is allowed, pytest 9.2+ must not be.
    if st.specifier.contains("4.32.5"):
        assert not pt.specifier.contains("9.2.0"), f"pytest pin {pt} lets in 9.2, which {st} breaks"
    assert pt.specifier.contains("9.1.1"), "the pin must still allow the tested pytest"


def test_ci_installs_as_the_readme_says_in_a_fresh_venv():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv" in readme and "pip install -e ." in readme
    assert "bash scripts/test.sh" in readme
    body = [ln for ln in ci.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    code = "\n".join(body)
    # a new venv each run (not a reused one), activated, then the README's install and test commands
    assert re.search(r"python3 -m venv \"?\$", code), "CI must make a new venv in a fresh folder"
    assert re.search(r"^\. .*bin/activate", code, re.M)
    assert re.search(r"^pip install -q -e \.$", code, re.M)
    assert code.rstrip().endswith("bash scripts/test.sh")
