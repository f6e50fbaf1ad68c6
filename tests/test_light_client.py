"""The client an application team installs: `pip install ./container` brings boto3, httpx and their pure-Python
dependencies, nothing that compiles; the client and the SageMaker transport import nothing of the adapter's
serving stack; and `serve` on a client install names the extra it needs instead of failing on an import.

The install is checked offline: the base requirements of `container/pyproject.toml` are walked through the
metadata of the distributions installed in this interpreter (requirements, markers and extras as pip reads
them), and each distribution reached must have been installed from a pure-Python wheel (`WHEEL`:
`Root-Is-Purelib: true`, tags `*-none-any`), which no platform has to build.
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "container" / "pyproject.toml"

# What serving needs and a client must not: by distribution (in the install) and by import name (at run time).
SERVING_DISTRIBUTIONS = {"llama-cpp-python", "starlette", "uvicorn", "numpy", "gguf"}
SERVING_MODULES = ("llama_cpp", "starlette", "uvicorn", "numpy", "gguf", "pydantic", "jinja2")


def project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def requirement_closure(requirements: list[str]) -> dict[str, importlib.metadata.Distribution]:
    """{canonical name: installed distribution} of everything ``requirements`` pull in on this interpreter."""
    environment = default_environment()
    found: dict[str, importlib.metadata.Distribution] = {}
    walked: set[tuple[str, str]] = set()
    pending = [(Requirement(r), "") for r in requirements]
    while pending:
        requirement, extra = pending.pop()
        if requirement.marker and not requirement.marker.evaluate({**environment, "extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        distribution = importlib.metadata.distribution(name)
        assert requirement.specifier.contains(distribution.version, prereleases=True), (
            f"{name} {distribution.version} is installed but {requirement} is asked: the walk would not be "
            "the install pip makes")
        found[name] = distribution
        for wanted in ("", *sorted(requirement.extras)):
            if (name, wanted) not in walked:
                walked.add((name, wanted))
                pending += [(Requirement(r), wanted) for r in distribution.requires or []]
    return found


def wheel_tags(distribution: importlib.metadata.Distribution) -> tuple[bool, list[str]] | None:
    """(Root-Is-Purelib, tags) from the distribution's `WHEEL` file; None when it was not installed from a wheel."""
    text = distribution.read_text("WHEEL")
    if text is None:
        return None
    wheel = email.parser.Parser().parsestr(text)
    return wheel.get("Root-Is-Purelib", "").strip().lower() == "true", wheel.get_all("Tag") or []


def not_pure_wheels(closure: dict[str, importlib.metadata.Distribution]) -> dict[str, str]:
    problems = {}
    for name, distribution in closure.items():
        tags = wheel_tags(distribution)
        if tags is None:
            problems[name] = "no WHEEL file: not installed from a wheel"
        elif not tags[0] or not all(tag.endswith("-none-any") for tag in tags[1]):
            problems[name] = f"a platform wheel (Root-Is-Purelib {tags[0]}, tags {tags[1]})"
    return problems


def test_the_base_install_pulls_only_pure_python_wheels_and_nothing_of_serving():
    closure = requirement_closure(project()["dependencies"])

    assert {"boto3", "botocore", "httpx"} <= closure.keys(), sorted(closure)
    assert not SERVING_DISTRIBUTIONS & closure.keys(), sorted(SERVING_DISTRIBUTIONS & closure.keys())
    assert not not_pure_wheels(closure), not_pure_wheels(closure)


def test_the_serve_extra_is_what_compiles_so_the_check_can_tell():
    """The same walk over the `serve` extra reaches llama-cpp-python and platform wheels: the check above is not
    blind to them."""
    closure = requirement_closure(project()["optional-dependencies"]["serve"])

    assert {"llama-cpp-python", "starlette", "uvicorn", "numpy"} <= closure.keys()
    assert {"llama-cpp-python", "numpy"} <= not_pure_wheels(closure).keys()


def blocking(modules) -> str:
    """Python source that makes ``modules`` (top-level import names) unimportable, as on a client install."""
    return f"""
import importlib.abc, sys

class BlockExtras(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {tuple(modules)!r}:
            raise ImportError(f"{{name}} is not part of the client install")

sys.meta_path.insert(0, BlockExtras())
"""


BLOCK_SERVING = blocking(SERVING_MODULES)
# The `tools` extra's import names too: what a client install (`pip install ./container`) lacks.
TOOLS_MODULES = ("pydantic", "numpy", "jinja2", "gguf", "rich", "matplotlib")
BLOCK_EXTRAS = blocking(sorted({*SERVING_MODULES, *TOOLS_MODULES}))

CLIENT_CALL = BLOCK_SERVING + """
import io, json

import boto3
from botocore.response import StreamingBody
from botocore.stub import ANY, Stubber

from semif.tools.client import SemIfClient
from semif.tools.sagemaker_transport import RetryPolicy

answer = json.dumps({"id": "route", "option_ids": ["hardware", "network"], "probabilities": [0.2, 0.8],
                     "choice": "network", "margin": 0.6}).encode()
runtime = boto3.client("sagemaker-runtime", region_name="us-east-1", aws_access_key_id="testing",
                       aws_secret_access_key="testing")
with Stubber(runtime) as stubber:
    stubber.add_response("invoke_endpoint",
                         {"Body": StreamingBody(io.BytesIO(answer), len(answer)), "ContentType": "application/json"},
                         {"EndpointName": "semif-dev-decision", "Body": ANY, "ContentType": "application/json",
                          "Accept": "application/json"})
    with SemIfClient.for_endpoint("semif-dev-decision", sagemaker_client=runtime,
                                  retry=RetryPolicy(max_attempts=1)) as client:
        result = client.decide("The VPN drops every ten minutes.", "Which team?", ["hardware", "network"], id="route")
    stubber.assert_no_pending_responses()
print(json.dumps({"choice": result["choice"], "attempts": result.attempts,
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in {"semif", "llama_cpp", "starlette"})}))
"""


def test_the_client_calls_an_endpoint_with_the_serving_stack_unimportable():
    result = subprocess.run([sys.executable, "-c", CLIENT_CALL], capture_output=True, text=True, timeout=120, cwd=REPO)

    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout)
    assert outcome["choice"] == "network" and outcome["attempts"] == 1, outcome
    assert not [m for m in outcome["loaded"] if m.startswith("semif.serving")], outcome["loaded"]


def run_entry_point(command: str, *arguments: str, block: str = BLOCK_SERVING) -> subprocess.CompletedProcess:
    """A console script's target as container/pyproject.toml names it, called as the script calls it, with the
    modules ``block`` names unimportable."""
    module, function = project()["scripts"][command].split(":")
    script = block + f"import {module} as entry\nraise SystemExit(entry.{function}({list(arguments)!r}))\n"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)


def run_serve_entry_point(*arguments: str) -> subprocess.CompletedProcess:
    return run_entry_point("serve", *arguments)


def test_serve_on_a_client_install_names_the_extra_to_install_instead_of_a_traceback():
    result = run_serve_entry_point("serve")

    assert result.returncode == 7, (result.returncode, result.stderr[-2000:])
    assert "pip install 'semif[serve]'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_python_dash_m_semif_gives_the_same_message():
    script = BLOCK_SERVING + "import runpy\nrunpy.run_module('semif', run_name='__main__')\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)

    assert result.returncode == 7 and "pip install 'semif[serve]'" in result.stderr, result.stderr[-2000:]


def test_the_serve_check_covers_every_distribution_of_the_serve_extra():
    """A distribution added to the extra without its import name in the check would bring the traceback back."""
    from semif.__main__ import EXTRA_MODULES
    CHECKED = EXTRA_MODULES["serve"]

    provided_by = importlib.metadata.packages_distributions()
    covered = {canonicalize_name(d) for module in CHECKED for d in provided_by.get(module, [])}
    serve_extra = {canonicalize_name(Requirement(r).name) for r in project()["optional-dependencies"]["serve"]}
    assert serve_extra <= covered, sorted(serve_extra - covered)


TOOL_SCRIPTS = sorted(name for name in project()["scripts"] if name != "serve")


def test_the_package_installs_the_operator_tools_console_scripts():
    assert {"semif-eval", "semif-gate", "semif-loadcheck", "semif-batch"} <= set(TOOL_SCRIPTS), TOOL_SCRIPTS


@pytest.mark.parametrize("command", TOOL_SCRIPTS)
def test_each_tool_on_a_client_install_names_the_tools_extra_instead_of_a_traceback(command):
    result = run_entry_point(command, "--help", block=BLOCK_EXTRAS)

    assert result.returncode == 7, (command, result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()  # one line
    extras = re.search(r"pip install 'semif\[([a-z,]+)\]'", line)
    assert extras and "tools" in extras.group(1).split(","), line
    assert line.startswith(f"{command}: "), line


def test_with_the_extras_installed_each_tool_script_runs_its_tool():
    """The check passes the command line through: each script's --help is its tool's own (argparse exits 0)."""
    names = {command: project()["scripts"][command] for command in TOOL_SCRIPTS}
    script = f"""
import contextlib, importlib, io, json
outcomes = {{}}
for command, target in {names!r}.items():
    module, function = target.split(":")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = getattr(importlib.import_module(module), function)(["--help"])
        except SystemExit as exit:
            code = exit.code
    outcomes[command] = [code, out.getvalue()[:200]]
print(json.dumps(outcomes))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)

    assert result.returncode == 0, result.stderr[-3000:]
    for command, (code, usage) in json.loads(result.stdout.splitlines()[-1]).items():
        assert code == 0 and usage.startswith("usage:"), (command, code, usage)


def test_the_tools_check_covers_every_distribution_of_the_tools_extra():
    from semif.__main__ import EXTRA_MODULES
    CHECKED = EXTRA_MODULES["tools"]

    assert set(CHECKED) == set(TOOLS_MODULES)  # what the tests above block is what the check looks for
    provided_by = importlib.metadata.packages_distributions()
    covered = {canonicalize_name(d) for module in CHECKED for d in provided_by.get(module, [])}
    tools_extra = {canonicalize_name(Requirement(r).name) for r in project()["optional-dependencies"]["tools"]}
    assert tools_extra <= covered, sorted(tools_extra - covered)


def test_the_calling_guide_installs_this_client_first_from_a_clone_and_from_git():
    import re
    import shlex

    guide = (REPO / "docs" / "how-to" / "call-an-endpoint.md").read_text()
    installs = [shlex.split(line, comments=True)[2:] for line in guide.splitlines()
                if re.match(r"\s*pip install ", line)]
    assert installs[0] == ["./container"], installs[:2]  # the first install on the page is the client, from a clone
    assert (REPO / installs[0][0] / "pyproject.toml").read_text() == PYPROJECT.read_text()
    from_git = Requirement(installs[1][0])
    assert from_git.name == project()["name"] and not from_git.extras, from_git
    assert from_git.url.startswith("git+https://github.com/") and from_git.url.endswith("#subdirectory=container")


def test_the_deploy_environment_holds_every_requirement_of_the_tools_extra():
    """`make deploy-setup` installs the package with --no-deps and the pins of requirements-deploy.txt; the model
    upload (semif-package-model) checks every module of the tools extra before it runs, so each must be pinned."""
    deploy = {canonicalize_name(Requirement(line).name): str(Requirement(line).specifier)
              for line in (REPO / "requirements-deploy.txt").read_text().splitlines()
              if line.strip() and not line.startswith(("#", "-r"))}
    for raw in project()["optional-dependencies"]["tools"]:
        requirement = Requirement(raw)
        name = canonicalize_name(requirement.name)
        assert name in deploy, f"requirements-deploy.txt lacks {requirement.name} (the tools extra)"
        assert deploy[name] == str(requirement.specifier), f"{requirement.name}: {deploy[name]} here, {requirement.specifier} in the extra"
