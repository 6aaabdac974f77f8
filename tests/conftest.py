"""Integrity-suite reporting: the known-wrong-answers table (rows from test_wrong_answers.py)."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter):
    rows = [value for reports in terminalreporter.stats.values() for report in reports
            if getattr(report, "when", None) == "call"
            for key, value in getattr(report, "user_properties", []) if key == "wrong_answer"]
    if not rows:
        return
    terminalreporter.section("known wrong answers", sep="=")
    write = terminalreporter.write_line
    write(f"{'task':<8} {'wrong answer':<36} {'caught':<6} {'s':>5}  first line of the message")
    for task, name, caught, seconds, first_line in sorted(rows):
        write(f"{task:<8} {name[:36]:<36} {'yes' if caught else 'NO':<6} {seconds:>5.1f}  "
              f"{first_line[:110]}")
