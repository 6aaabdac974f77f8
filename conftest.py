"""Root pytest configuration: the course's grading plugin (see lessons/harness/grading.py)."""

pytest_plugins = ["harness.grading"]
