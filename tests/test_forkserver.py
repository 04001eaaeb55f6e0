"""The fork server behind CPU memory measurement: every request runs in a process of its own, forked from a
server that has run nothing, and whatever happens there comes back as an answer or an error, never a hang."""

from __future__ import annotations

import os

import pytest

from bench.run.forkserver import ForkReply, ForkServer

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

STATE: list[int] = []  # what a job leaves behind in its process


def remember(request: dict) -> dict:
    STATE.append(request["value"])
    return {"pid": os.getpid(), "parent": os.getppid(), "seen": list(STATE)}


def fail(request: dict) -> dict:
    if request.get("exit") is not None:
        os._exit(request["exit"])
    raise ValueError(f"bad value {request['value']}")


def test_each_request_runs_in_a_fresh_process_that_sees_nothing_of_the_earlier_ones():
    STATE[:] = [1]  # before the fork: every fresh process starts from this
    server = ForkServer(remember)
    try:
        STATE.append(99)  # after the fork: no fresh process sees it
        first, second = server.run({"value": 2}).answer, server.run({"value": 3}).answer
    finally:
        server.close()
    assert first["seen"] == [1, 2] and second["seen"] == [1, 3]
    assert len({first["pid"], second["pid"], os.getpid(), server.pid}) == 4
    assert first["parent"] == second["parent"] == server.pid


def test_a_job_that_raises_or_dies_is_an_error_and_the_server_goes_on():
    server = ForkServer(fail)
    try:
        raised = server.run({"value": 5})
        died = server.run({"value": 0, "exit": 3})
        again = server.run({"value": 6})
    finally:
        server.close()
    assert raised.error == "ValueError: bad value 5" and "Traceback" in str(raised.details)
    assert died == ForkReply(error="the fresh process ended without an answer (exit code 3)")
    assert again.error == "ValueError: bad value 6"


def test_a_closed_or_killed_server_answers_with_why():
    server = ForkServer(remember)
    os.kill(server.pid, 9)
    os.waitpid(server.pid, 0)
    answer = server.run({"value": 1})
    assert answer.error in ("the fork server died", "the fork server is gone (Broken pipe)")
    assert server.run({"value": 1}) == answer  # broken from then on, without trying again
    server.close()


def test_the_server_holds_none_of_the_descriptors_it_was_told_to_close():
    read_fd, write_fd = os.pipe()
    server = ForkServer(remember, close_fds=(write_fd,))
    try:
        os.close(write_fd)
        # The server closed its copy: with ours closed too, the pipe reads its end at once.
        assert os.read(read_fd, 1) == b""
    finally:
        os.close(read_fd)
        server.close()
