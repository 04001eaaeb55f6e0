"""Running a suite: the runner, its child processes (`child`: workers, ranks, calibration) and the messages
between them, torchrun sessions, and the console's progress and summary."""
