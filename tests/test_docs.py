"""Docs tests: every snippet of README.md and the reference pages under examples/ runs, or says why it cannot here.

A fenced block is one of:

- `python`: run in a fresh interpreter (with `import lightning as L` and `import torch` before it);
- `bash`: each command run the cheapest real way: `accel-train ...` composed and checked as accel-train does
  before launch (nothing trains), `accel-bench`/`accel-tune ...` with `--dry-run` (every stage composed and
  checked), `accel-doctor` and `python -m lightning_accel.gpu_check` for real, `python examples/...` for real (under
  `-m slow`, as are the python blocks and the GPU check's commands, each a process that loads torch); commands of your
  own config tree (`model=my_model`) run against a small one made for the test;
- `yaml`: parsed; `diff`: the template's patch, applied by tests/test_template_app.py; `text`: output, not code.

A block that cannot run on a CPU machine without a cluster is marked on the line above it:
`<!-- docs: gpu -->`, `<!-- docs: cluster -->`, `<!-- docs: setup ... -->` (installing, the suite itself: `.ci/run`
runs them), `<!-- docs: template ... -->` (a lightning-hydra-template command: tests/test_template_app.py runs it).
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "examples").glob("*.md"))]
MARKERS = ("gpu", "cluster", "setup", "template")
LANGUAGES = ("python", "bash", "yaml", "diff", "text")
PRELUDE = "import lightning as L\nimport torch\n"


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int
    language: str
    body: str
    marker: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def snippets() -> list[Snippet]:
    found = []
    for path in DOCS:
        lines = path.read_text().split("\n")
        index = 0
        while index < len(lines):
            line = lines[index]
            if line.startswith("```"):
                start = index
                end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
                above = next((lines[i] for i in range(start - 1, -1, -1) if lines[i].strip()), "")
                marker = re.match(r"<!-- docs: (\w+)", above)
                found.append(
                    Snippet(
                        path,
                        start + 1,
                        line[3:].strip(),
                        "\n".join(lines[start + 1 : end]),
                        marker.group(1) if marker else "",
                    )
                )
                index = end
            index += 1
    return found


SNIPPETS = snippets()


def commands(snippet: Snippet) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments and blank lines left out."""
    joined = snippet.body.replace("\\\n", " ")
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def _run_python(code: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_every_block_has_a_language_and_a_known_marker() -> None:
    assert len(SNIPPETS) > 40  # the parser found the docs' blocks
    for snippet in SNIPPETS:
        assert snippet.language in LANGUAGES, f"{snippet.id}: ```{snippet.language}: use one of {LANGUAGES}"
        assert not snippet.marker or snippet.marker in MARKERS, f"{snippet.id}: unknown marker {snippet.marker}"


def test_the_readme_is_short_and_links_every_reference_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 400
    for page in sorted((ROOT / "examples").glob("*.md")):
        assert f"examples/{page.name}" in readme, f"README does not link {page.name}"


def test_every_link_to_a_file_of_the_repo_resolves() -> None:
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#]+)\)", path.read_text()):
            if "://" not in target:
                assert (path.parent / target).exists(), f"{path.name} links {target}, which does not exist"


PYTHON = [s for s in SNIPPETS if s.language == "python" and not s.marker]


@pytest.mark.slow  # each starts an interpreter that loads torch and Lightning and fits: seconds each on 2 CPUs
@pytest.mark.parametrize("snippet", PYTHON, ids=[s.id for s in PYTHON])
def test_python_snippet_runs(snippet: Snippet, tmp_path: Path) -> None:
    done = _run_python(PRELUDE + snippet.body, tmp_path)
    assert done.returncode == 0, f"{snippet.id}:\n{snippet.body}\n{done.stderr[-3000:]}"


YAML = [s for s in SNIPPETS if s.language == "yaml" and not s.marker]


@pytest.mark.parametrize("snippet", YAML, ids=[s.id for s in YAML])
def test_yaml_snippet_parses(snippet: Snippet) -> None:
    assert isinstance(yaml.safe_load(snippet.body), dict), snippet.id


@pytest.fixture
def user_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with a config tree of the user's own, as the docs' `model=my_model` commands assume."""
    conf = tmp_path / "conf"
    for rel, text in {
        "model/my_model.yaml": "# @package _global_\ndefaults:\n  - gpt\nmodel:\n  n_layer: 1\n",
        "data/my_data.yaml": "defaults:\n  - stdlib_text\nmax_chars: 200000\n",
        "preset/tuned_my_model.yaml": "# @package _global_\ndefaults:\n  - override /precision: fp32\n",
    }.items():
        (conf / rel).parent.mkdir(parents=True, exist_ok=True)
        (conf / rel).write_text(text)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _sweep(overrides: list[str]) -> list[list[str]]:
    """`-m key=a,b`: one list of overrides per value (the first sweep key's)."""
    for index, override in enumerate(overrides):
        key, _, value = override.partition("=")
        if "," in value and not value.startswith(("[", "'[", '"[')):
            return [[*overrides[:index], f"{key}={v}", *overrides[index + 1 :]] for v in value.split(",")]
    return [overrides]


def check_accel_train(args: list[str], run_dir: Path) -> None:
    """What `accel-train ARGS` checks before anything is built or spawned, here, without training."""
    from lightning_accel.benchmark.stage_config import compose_config
    from lightning_accel.checks import check_config
    from lightning_accel.compose import split_data_config

    multirun = "-m" in args or "--multirun" in args
    overrides = [
        a
        for a in args
        if a not in ("-m", "--multirun", "--resolve") and not a.startswith("--cfg") and a not in ("job", "hydra", "all")
    ]
    for case in _sweep(overrides) if multirun else [overrides]:
        cfg = compose_config(case, str(run_dir))
        check_config(cfg)
        from omegaconf import OmegaConf

        split_data_config(OmegaConf.to_container(cfg.data, resolve=True))


def run_command(command: str, cwd: Path) -> None:
    """Run one documented command the cheapest real way (see the module docstring)."""
    words = shlex.split(command)
    redirect = words.index(">") if ">" in words else None
    if redirect is not None:
        words = words[:redirect]
    program, args = words[0], words[1:]
    if program == "accel-train":
        check_accel_train(args, cwd / "run")
    elif program in ("accel-bench", "accel-tune"):
        from lightning_accel import bench, tune

        main = bench.main if program == "accel-bench" else tune.main
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main([*args, "--dry-run"])
        assert code == 0, f"`{command} --dry-run` exited {code}:\n{out.getvalue()[-3000:]}"
    elif program == "accel-doctor":
        from lightning_accel import doctor

        with contextlib.redirect_stdout(io.StringIO()):
            assert doctor.main(args) in (0, 1)  # 1: a check FAILs on this machine, as documented
    elif program == "python" and args[:2] == ["-m", "lightning_accel.gpu_check"]:
        done = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600)
        assert done.returncode in (0, 1), done.stderr[-3000:]
    else:
        raise AssertionError(f"`{command}`: no docs runner for `{program}`; mark its block or add one")


BASH = [(s, c) for s in SNIPPETS if s.language == "bash" and not s.marker for c in commands(s)]
SCRIPTS = [(s, c) for s, c in BASH if c.startswith("python examples/")]
CHEAP = [(s, c) for s, c in BASH if (s, c) not in SCRIPTS]


def _bash_params(pairs: list[tuple[Snippet, str]]) -> list[Any]:
    """The commands, the GPU check's (a process of its own that loads torch, seconds each) carrying `slow`."""
    return [
        pytest.param(s, c, marks=pytest.mark.slow) if "lightning_accel.gpu_check" in c else (s, c) for s, c in pairs
    ]


@pytest.mark.parametrize(("snippet", "command"), _bash_params(CHEAP), ids=[f"{s.id}:{c[:60]}" for s, c in CHEAP])
def test_bash_command_runs(snippet: Snippet, command: str, user_tree: Path) -> None:
    run_command(command, user_tree)


@pytest.mark.slow
@pytest.mark.parametrize(("snippet", "command"), SCRIPTS, ids=[f"{s.id}:{c[:60]}" for s, c in SCRIPTS])
def test_example_script_runs(snippet: Snippet, command: str) -> None:
    done = subprocess.run(
        [sys.executable, *shlex.split(command)[1:]], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_template_commands_are_the_ones_the_template_tests_run() -> None:
    """The `<!-- docs: template -->` commands: each one's overrides are a case of tests/test_template_app.py."""
    source = (ROOT / "tests" / "test_template_app.py").read_text()
    lines = [c for s in SNIPPETS if s.marker == "template" for c in commands(s)]
    assert lines
    for line in lines:
        for override in shlex.split(line)[2:]:
            assert f'"{override}"' in source, f"`{line}`: `{override}` is in no template test"


def test_every_logged_key_is_in_the_callbacks_docstring_and_the_table() -> None:
    """Each key a callback logs (`pl_module.log("key", ...)`, the `dataloader_tuner/...` and `gpu_monitor/...`
    families) is listed in its docstring's "Logs" section and in examples/callbacks.md, whose table names every
    exported callback."""
    import inspect

    import lightning_accel.callbacks as callbacks

    table = (ROOT / "examples" / "callbacks.md").read_text()
    for name in callbacks.__all__:
        cls = getattr(callbacks, name)
        doc = inspect.getdoc(cls) or ""
        assert "Logs" in doc or "logs nothing" in doc, f"{name}'s docstring has no Logs section"
        assert f"`{name}`" in table, f"examples/callbacks.md has no row for {name}"
        source = inspect.getsource(inspect.getmodule(cls))  # type: ignore[arg-type]
        for key in re.findall(r'pl_module\.log\("([^"]+)"', source):
            assert f"`{key}`" in doc and f"`{key}`" in table, f"{name} logs `{key}`, undocumented"


CONTRACT = ("Keeps identical", "Changes on purpose", "Cannot serve")
CONTRACT_SECTION = "## What each callback keeps, changes and cannot serve"


def callback_contract(doc: str) -> dict[str, str]:
    """{"Keeps identical": text, ...} from a callback docstring's three contract paragraphs (whitespace folded): each
    `Head: text` on its line, or a `Head:` section with its text indented under it, up to a blank line."""
    found = {}
    for head in CONTRACT:
        ends = "|".join(CONTRACT)  # a blank line, the next of the three, or the end
        match = re.search(rf"^{head}:\s*(.*?)(?=\n\s*\n|\n(?:{ends}):|\Z)", doc, re.S | re.M)
        if match:
            found[head] = " ".join(match.group(1).split())
    return found


def test_every_callback_says_what_it_keeps_changes_and_cannot_serve_in_its_docstring_and_the_page() -> None:
    """Each exported callback's docstring has the three paragraphs, and examples/callbacks.md's section repeats them
    word for word under the callback's own heading."""
    import inspect

    import lightning_accel.callbacks as callbacks

    page = (ROOT / "examples" / "callbacks.md").read_text()
    section = page[page.index(CONTRACT_SECTION) :]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    folded = " ".join(section.split())
    for name in callbacks.__all__:
        contract = callback_contract(inspect.getdoc(getattr(callbacks, name)) or "")
        assert set(contract) == set(CONTRACT), f"{name}'s docstring lacks {set(CONTRACT) - set(contract)}"
        assert f"### {name}" in section, f"examples/callbacks.md has no `### {name}` under {CONTRACT_SECTION!r}"
        own = folded[folded.index(f"### {name}") :]
        own = own[: own.find("### ", 4) if "### " in own[4:] else len(own)]
        for head, text in contract.items():
            assert f"**{head}:** {text}" in own, f"examples/callbacks.md's {name}: {head!r} differs from the docstring"


NEWCOMER_FEATURES = (
    "accel-tune's search",
    "the checks before launch",
    "the run plan",
    "the GPU check",
    "the DataLoaderTuner's cache",
)


def test_the_contributor_table_names_one_file_per_feature_and_that_file_holds_it() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## For contributors: where each feature lives", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (.+?) \| `([^`]+)` \| `([^`]+)` \|$", section, re.M)
    assert len(rows) >= len(NEWCOMER_FEATURES)
    for feature in NEWCOMER_FEATURES:
        named = [row for row in rows if row[0].startswith(feature)]
        assert len(named) == 1, f"the contributor table should name one file for {feature}: {named}"
    for feature, file, symbol in rows:
        path = ROOT / file
        assert path.is_file(), f"{feature}: {file} does not exist"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
            t.id
            for n in ast.walk(tree)
            if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Name)
        }
        assert symbol in defined, f"{feature}: {file} does not define {symbol}"


def test_the_changelog_keeps_a_changelog_with_the_packages_version() -> None:
    import tomllib

    text = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## \[(.+?)\](.*)$", text, re.M)
    assert versions[0] == ("Unreleased", "")
    for version, date in versions[1:]:
        assert re.fullmatch(r"\d+\.\d+\.\d+", version) and re.fullmatch(r" - \d{4}-\d{2}-\d{2}", date), version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] in [v for v, _ in versions]
    kinds = set(re.findall(r"^### (.+)$", text, re.M))
    assert kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security", "Known issues"}, kinds
