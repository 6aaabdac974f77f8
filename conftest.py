"""Root pytest configuration: the course's grading plugin (see lessons/harness/grading.py)."""

from pathlib import Path

import pytest

# A lesson's test files share helpers in its common.py, imported as ``lessonNN.common`` (see
# lessons/harness/__init__.py): their asserts explain themselves as a test file's do.
pytest.register_assert_rewrite(*(f"lesson{folder.name[:2]}" for folder
                                in Path(__file__).parent.glob("lessons/[0-9][0-9]_*/")))

pytest_plugins = ["harness.grading"]
