"""The docs run as written: every shell command of the getting-started and deploy guides names a program that
exists and parses; the getting-started guide's local part runs end to end on the embedded model; every relative
link in the README and docs/ resolves to a file (and a heading, where it names one)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from serving import ServeProcess, embedded_model, free_port

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
GETTING_STARTED = DOCS / "getting-started.md"
DEPLOY_GUIDE = DOCS / "how-to" / "deploy-first-environment.md"
GUIDES = [GETTING_STARTED, DEPLOY_GUIDE]

# Programs the guides name as prerequisites instead of installing them; each must be named in the guide's text.
PREREQUISITES = {"aws": "AWS CLI", "curl": "curl", "git": "git"}
# Getting-started sections whose blocks run against a live adapter; the others are checked, not run.
LOCAL_SECTIONS = ("## 1. Start the adapter", "## 2. Ask for a decision", "## 3. Several questions on one state",
                  "## 5. Evaluate on your own labeled decisions")
NOT_RUN = ("make run",)  # the test starts `serve` itself, on a free port, as `make run` would


def shell_blocks(markdown: str) -> list[str]:
    return [m.group(2) for m in re.finditer(r"(?ms)^```(bash|sh|console)[^\n]*\n(.*?)^```", markdown)]


def section(markdown: str, heading: str) -> str:
    start = markdown.index(heading + "\n")
    following = re.search(r"(?m)^## ", markdown[start + len(heading):])
    return markdown[start: start + len(heading) + following.start()] if following else markdown[start:]


def logical_lines(block: str) -> list[str]:
    """Lines with continuations joined; heredoc bodies and comments dropped."""
    lines, pending, heredoc_end = [], "", None
    for raw in block.splitlines():
        if heredoc_end is not None:
            if raw.strip() == heredoc_end:
                heredoc_end = None
            continue
        line = pending + raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        if not _quotes_close(line):  # a quoted argument spans lines (curl -d '{ ... }')
            pending = line + "\n"
            continue
        pending = ""
        marker = re.search(r"<<-?\s*'?\"?(\w+)'?\"?", line)
        if marker:
            heredoc_end = marker.group(1)
        if line.strip() and not line.lstrip().startswith("#"):
            lines.append(line)
    return lines


def _quotes_close(line: str) -> bool:
    try:
        shlex.split(line.replace("$(", " ( "), comments=True)
        return True
    except ValueError:
        return False


def heredoc_bodies(block: str) -> list[tuple[str, str]]:
    """(the line that opens the heredoc, its body)."""
    return [(m.group(1), m.group(3)) for m in
            re.finditer(r"(?ms)^([^\n]*<<-?\s*'?(\w+)'?[^\n]*)\n(.*?)^\2$", block)]


_SEPARATORS = {"|", "||", "&&", ";", "&", "(", ")", "$(", "`", "{", "}", "do", "then", "else"}
_KEYWORDS = {"for", "do", "done", "if", "then", "fi", "else", "while", "in", "case", "esac", "function"}


def command_words(line: str) -> list[str]:
    """The program of every simple command on a line, command substitutions included."""
    text = line.replace("$(", " ( ")
    lexer = shlex.shlex(text, posix=True, punctuation_chars="|&;()")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError as error:  # an unbalanced quote: bash -n reports it with more context
        raise AssertionError(f"cannot split {line!r}: {error}") from None
    words, expect_command, after_for = [], True, False
    for token in tokens:
        if token in _SEPARATORS or set(token) <= set("|&;()"):
            expect_command, after_for = True, False
            continue
        if after_for:  # `for p in a b c; do`: the loop variable and its words are not commands
            continue
        if not expect_command:
            continue
        if token == "for":
            after_for = True
            continue
        if token in _KEYWORDS or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", token):
            continue  # a keyword, or `VAR=value cmd`: the command comes next
        words.append(token)
        expect_command = False
    return words


def makefile_targets() -> set[str]:
    return set(re.findall(r"(?m)^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text()))


def program_exists(word: str, line: str, guide_text: str) -> str | None:
    """None when `word` names something that exists; otherwise why not."""
    venv_bin = REPO / ".venv" / "bin"
    if word == "make":
        target = next((t for t in shlex.split(line.split("make", 1)[1]) if "=" not in t and not t.startswith("-")),
                      None)
        return None if target is None or target in makefile_targets() else f"no Makefile target {target!r}"
    if word == "npx":
        tool = shlex.split(line.split("npx", 1)[1])[0]
        dev = json.loads((REPO / "package.json").read_text()).get("devDependencies", {})
        return None if tool == "cdk" and "aws-cdk" in dev else f"npx {tool}: not a pinned devDependency"
    if "/" in word:
        path = REPO / word if not word.startswith("/") else Path(word)
        return None if path.exists() else f"{word} does not exist in the repository"
    if word.startswith("$"):
        return None  # a variable the block sets (checked by bash -n only)
    kind = subprocess.run(["bash", "-c", f"type -t {shlex.quote(word)}"], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}"}).stdout.strip()
    if kind:
        return None
    if word in PREREQUISITES and PREREQUISITES[word] in guide_text:
        return None
    return f"{word!r} is neither installed nor a prerequisite the guide names"


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.name)
def test_every_shell_command_of_the_guides_names_a_real_program_and_parses(guide):
    text = guide.read_text()
    blocks = shell_blocks(text)
    assert len(blocks) >= 5, f"{guide.name}: found only {len(blocks)} shell blocks"
    problems = []
    for block in blocks:
        result = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        if result.returncode != 0:
            problems.append(f"bash -n: {result.stderr.strip()}\n{block}")
        for line in logical_lines(block):
            for word in command_words(line):
                why = program_exists(word, line, text)
                if why:
                    problems.append(f"{why}: {line.strip()}")
        for opener, body in heredoc_bodies(block):
            if "python" in opener:
                try:
                    compile(body, f"{guide.name} heredoc", "exec")
                except SyntaxError as error:
                    problems.append(f"heredoc Python does not compile: {error}")
    assert not problems, "\n".join(problems)


def test_the_getting_started_guide_runs_end_to_end_on_the_embedded_model(tmp_path):
    text = GETTING_STARTED.read_text()
    local = [block for heading in LOCAL_SECTIONS for block in shell_blocks(section(text, heading))]
    runnable = [block for block in local if block.strip() not in NOT_RUN]
    assert len(runnable) >= 4, runnable
    port = free_port()
    env = {**os.environ, "SEMIF_HOST": "127.0.0.1", "SEMIF_PORT": str(port), "SEMIF_N_THREADS": "2",
           "SEMIF_MODEL_PATH": str(embedded_model())}
    server = ServeProcess(env, port, tmp_path / "serve.log").wait_ready()
    try:
        answers = []
        for block in runnable:
            script = block.replace("127.0.0.1:8080", f"127.0.0.1:{port}").replace("/tmp/", f"{tmp_path}/")
            script = script.replace("curl -s ", "curl -s -w '\\n%{http_code}\\n' ")
            result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, capture_output=True,
                                    text=True, timeout=300)
            assert result.returncode == 0, (block, result.stdout[-2000:], result.stderr[-2000:])
            answers.append((block, result.stdout))
    finally:
        server.stop()

    decisions = [(block, out) for block, out in answers if "/invocations" in block]
    assert len(decisions) == 2, [b for b, _ in decisions]
    for block, out in decisions:
        body, status = out.rstrip("\n").rsplit("\n", 1)
        assert status == "200", (block, out)
        answer = json.loads(body)
        results = answer["results"] if "results" in answer else [answer]
        for result in results:
            probabilities = result["probabilities"]
            assert len(probabilities) == len(result["option_ids"]) >= 2
            assert abs(sum(probabilities) - 1) < 1e-6 and result["choice"] in result["option_ids"]
    ping = next(out for block, out in answers if "/ping" in block)
    assert ping.rstrip("\n").endswith("200") and json.loads(ping.rsplit("\n", 2)[0])["status"] == "ok"
    report = json.loads((tmp_path / "my-first-eval" / "report.json").read_text())
    label = report["runs"]["label"]
    assert label["cases"] == 4 and label["valid"] == 4 and 0 <= label["accuracy"] <= 1, label


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for heading in re.findall(r"(?m)^#{1,6} (.+)$", re.sub(r"(?ms)^```.*?^```", "", markdown)):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def test_every_relative_link_in_the_readme_and_docs_resolves():
    pages = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"(?ms)^```.*?^```", "", page.read_text())
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert len(pages) >= 20
    assert not broken, "\n".join(broken)


def test_the_readme_puts_the_two_commands_first_and_stays_short():
    readme = (REPO / "README.md").read_text()
    head = "\n".join(readme.splitlines()[:40])
    assert "make run" in head and "make test" in head
    assert len(readme.split()) <= 500, len(readme.split())  # two minutes at about 250 words a minute
