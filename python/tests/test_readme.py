"""The README is a guide a newcomer can follow: its first screen (40 lines) says what distca is in one
or two sentences, gives exactly the two quick-start commands (scripts/demo.sh, scripts/test.sh,
which CI runs) and maps the layout; the demo's main job runs as demo.sh runs it; the README stays
short, holds no run history and links every guide; and every relative link in the README, docs/,
reports/ and dev/ reaches a file (and, with an #anchor, a heading of that file)."""
from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
CLI = Path(os.environ.get("DISTCA_BIN") or REPO / "build" / "src" / "tools" / "distca")
MAX_LINES = 250
FIRST_SCREEN = 40


def _fenced_blocks(text: str) -> list[list[str]]:
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def quick_start_commands(text: str) -> list[str]:
    """The commands of the first fenced block after the 'Quick start' heading (comments dropped)."""
    start = re.search(r"^## Quick start.*$", text, re.M)
    assert start, "README.md has no '## Quick start' heading"
    blocks = _fenced_blocks(text[start.end():])
    assert blocks, "the quick start has no fenced block of commands"
    return [line.split("#", 1)[0].strip() for line in blocks[0] if line.split("#", 1)[0].strip()]


def test_the_quick_start_is_two_commands_that_exist_and_ci_runs_the_second():
    text = README.read_text()
    commands = quick_start_commands(text)
    assert commands == ["scripts/demo.sh", "scripts/test.sh"], commands
    for c in commands:
        path = REPO / c
        assert path.is_file() and os.access(path, os.X_OK), f"{c} is not an executable file"
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^exec scripts/test\.sh\s*$", ci, re.M), ".ci/run must run the README's test command"
    # The two commands are on the first screen.
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("## Quick start"))
    fence_end = [i for i, l in enumerate(lines) if l.startswith("```") and i > start][1]
    assert fence_end < FIRST_SCREEN, f"the quick start's commands end on line {fence_end + 1} (by {FIRST_SCREEN})"


def test_the_first_screen_is_what_distca_is_the_two_commands_and_the_layout():
    """The first 40 lines: a summary of one or two sentences, the quick start (checked above) and the
    layout, a table that names every top folder of the repository and every layer of src/."""
    lines = README.read_text().splitlines()
    assert lines[0] == "# distca", lines[0]
    summary = " ".join(itertools.takewhile(str.strip, lines[2:]))
    assert summary.startswith("distca ") and "core attention disaggregation" in summary, summary
    sentences = [x for x in re.split(r"(?<=[.!?])\s+(?=[A-Z])", summary) if x]
    assert len(sentences) <= 2, f"the summary is {len(sentences)} sentences (at most 2): {sentences}"
    start = lines.index("## Layout")
    rows = list(itertools.takewhile(lambda l: l.startswith("|"), lines[start + 2:]))
    assert rows and start + 2 + len(rows) <= FIRST_SCREEN, (
        f"the layout table ends on line {start + 2 + len(rows)} (by {FIRST_SCREEN})")
    named = {name.strip("/") for row in rows[2:] for name in re.findall(r"`([^`]+)`", row.split("|")[1])}
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout: " + tracked.stderr.strip())
    top = {f.split("/")[0] for f in tracked.stdout.splitlines() if "/" in f and not f.startswith(".")}
    layers = {f"src/{f.split('/')[1]}" for f in tracked.stdout.splitlines() if f.startswith("src/") and f.count("/") >= 2}
    missing = sorted((top - {"src"} | layers) - named)
    assert not missing, f"the README's layout does not name {missing}"


def test_the_readme_links_every_guide():
    text = README.read_text()
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md")) if f"(docs/{p.name}" not in text]
    assert not missing, f"README.md links no guide {missing}"


def test_the_readme_is_short_and_holds_no_run_history():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES})"
    # Run logs name the commits they ran on ("on 8efbc47"); history lives in git, not here.
    hashes = [(i + 1, m.group(0)) for i, line in enumerate(lines)
              for m in re.finditer(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", line)]
    assert not hashes, f"README.md names commits (run history belongs in reports/ and git): {hashes}"


def demo_command() -> list[str]:
    """The command scripts/demo.sh ends with (its `exec mpirun ...`), as words."""
    text = (REPO / "scripts" / "demo.sh").read_text().replace("\\\n", " ")
    line = next((l for l in text.splitlines() if l.strip().startswith("exec mpirun")), None)
    assert line, "scripts/demo.sh no longer ends in `exec mpirun ...`"
    words = shlex.split(line.strip())[1:]
    assert words[-1] == "$@", words
    return words[:-1]


def test_the_demo_runs_its_main_job_as_demo_sh_does(tmp_path):
    """demo.sh's last command, as it stands in the script, for 1 step: both backends train and the
    run ends with the speedup line the README shows (demo.sh's other commands are the install and
    build scripts that scripts/test.sh runs first)."""
    if not CLI.is_file():
        pytest.skip(f"{CLI} is not built")
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed")
    words = demo_command()
    assert words[0] == "mpirun" and "./build/src/tools/distca" in words, words
    words = [str(CLI) if w == "./build/src/tools/distca" else w for w in words]
    words = [str(tmp_path / "demo.json") if w == "build/train-demo.json" else w for w in words]
    p = subprocess.run(words + ["--steps", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert re.search(r"speedup of CAD over colocated \(same run, same data\): [0-9.]+x", p.stdout), p.stdout[-3000:]
    assert (tmp_path / "demo.json").is_file()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not fenced:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            anchors.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return anchors


def _markdown_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "reports").rglob("*.md")),
            *sorted((REPO / "dev").rglob("*.md"))]


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_its_file_and_heading(path):
    broken = []
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = path if not file else (path.parent / file).resolve()
            if not dest.exists():
                broken.append(f"{path.name}:{number}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{path.name}:{number}: {target} (no heading #{anchor} in {dest.name})")
    assert not broken, "\n".join(broken)


def test_source_comments_cite_the_design_in_the_repository():
    """Comments cite docs/design.md, not a DESIGN.md outside the repository."""
    outside = []
    for folder in ("src", "tests", "python", "bench", "scripts", "examples"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix not in (".h", ".cc", ".cu", ".cuh", ".py", ".pyi", ".sh", ".txt") or not path.is_file():
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if re.search(r"(?<!docs/)DESIGN\.md", line) and path.name != "test_readme.py":
                    outside.append(f"{path.relative_to(REPO)}:{number}")
    assert not outside, f"cite docs/design.md instead: {outside}"
