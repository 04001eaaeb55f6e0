"""The two exceptions other parts rely on: `Unavailable` (an implementation cannot run) and `BadInput`."""

from __future__ import annotations


class Unavailable(Exception):
    """An implementation cannot run here (no GPU, no triton, ...) or cannot run this case.

    `reason` is the one-line explanation that ends up in a `skipped` record.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BadInput(Exception):
    """Bad user input: a suite file, a results file, a flag. The CLI prints it and exits with code 2.

    The message names the file, the field path (e.g. `sweep.seq_len[2]`), the value given and what is
    allowed, in the form `FILE: FIELD: got VALUE; ALLOWED`.
    """

    def __init__(self, message: str, *, file: str | None = None, field: str | None = None) -> None:
        self.file = file
        self.field = field
        self.detail = message
        prefix = "".join(f"{part}: " for part in (file, field) if part)
        super().__init__(prefix + message)
