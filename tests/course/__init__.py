"""The maintainers' tooling, beside the integrity suite that uses it (not lesson material).

- ``course.manifest``: the course manifest: lessons, their tasks and scripts.
- ``course.chain``: the chain of scripts, each step's diff and its size
  (``python tests/course/chain.py``).
- ``course.selfcheck``: run the course's own tests from outside, in scratch copies (for
  ``tests/``: solutions pass, stubs and known wrong answers are caught).
- ``course.forkserver``: those runs, forked from a process that has imported torch once.
- ``course.ci_grading``: CI's shortcut, a pytest plugin only ``.ci/run`` loads.

What the lessons' own tests share is ``lessons/harness``.
"""
