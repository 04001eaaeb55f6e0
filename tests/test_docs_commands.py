"""Every `bench` command line that README.md, CONTRIBUTING.md and docs/ show in a bash block parses with today's
options, and every `bench run` of a committed suite passes the real run's checks under --dry-run; every option of
every command has help text; the files README links exist."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from bench.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"<[^>]*>|\[|\.\.\.|\b(?:ROOT|RUN_DIR|SUITE\.yaml|IMPL|NAME)\b")


def bash_commands() -> list[tuple[str, str]]:
    """(file, command line) for each `bench ...` line of a ```bash block (a `&&` chain gives each part)."""
    found = []
    for doc in DOCS:
        in_bash = False
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                in_bash = line.strip() == "```bash" and not in_bash
                continue
            if not in_bash:
                continue
            for part in line.split("&&"):
                command = part.split(" #")[0].strip()
                for prefix in (".venv/bin/bench ", "bench "):
                    if command.startswith(prefix):
                        found.append((doc.name, command[len(prefix):]))
    return found


COMMANDS = bash_commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) > 30 and any(c.startswith("run suites/smoke.yaml") for _, c in COMMANDS)


@pytest.mark.parametrize(("doc", "command"), COMMANDS, ids=[f"{d}: {c}"[:90] for d, c in COMMANDS])
def test_a_documented_command_parses_and_a_run_passes_its_preflight(doc, command, capsys):
    # a redirection is the shell's; a <placeholder> one word
    argv = shlex.split(re.sub(r"<[^>]*>", "PLACEHOLDER", command.split(" > ")[0]))
    build_parser().parse_args(argv)  # an unknown option or a missing argument exits 2 here
    concrete = not PLACEHOLDER.search(command) and "/shared/" not in command and "--executor slurm" not in command
    if argv[0] == "run" and concrete and "--resume" not in argv and "--shard" not in argv:
        assert main([*argv, "--dry-run"]) == 0, capsys.readouterr().err


def every_action(parser: argparse.ArgumentParser, path: str = "bench"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from every_action(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_option_and_positional_has_help_text():
    missing = [f"{path} {a.option_strings or a.dest}" for path, a in every_action(build_parser())
               if not (a.help and a.help.strip())]
    assert not missing, f"options without help text: {missing}"


def test_the_files_readme_names_exist():
    text = (ROOT / "README.md").read_text()
    named = set(re.findall(r"\b((?:docs|suites|scripts|results)/[\w./-]+\.(?:md|yaml|py|sh))\b", text))
    assert named and not [n for n in named if not (ROOT / n).exists()]
