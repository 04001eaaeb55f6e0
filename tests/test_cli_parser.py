"""The command line's parser is built from one function per command, with the device choices written once."""

from __future__ import annotations

from bench import cli
from bench.spec.case import DEVICES


def test_the_device_choices_are_the_cases_devices():
    assert cli.DEVICES == DEVICES
    parser = cli.build_parser()
    for argv in (["run", "s.yaml"], ["ab", "a", "b", "s.yaml"], ["calibrate"], ["profile", "s.yaml", "--impl", "x"],
                 ["inputs", "s.yaml"]):
        for device in DEVICES:
            assert parser.parse_args([*argv, "--device", device]).device == device, argv


def test_every_command_is_registered():
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(commands) == {"run", "list", "compare", "ab", "history", "export", "dashboard", "env", "calibrate",
                             "model", "profile", "inputs", "capture", "submit", "import"}
