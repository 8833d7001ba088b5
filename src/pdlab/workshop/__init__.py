"""The workshop kit, above the course: the pre-flight check a room runs on every seat (`pdlab preflight`), and
the student copies of the notebooks with their answers kept apart (`pdlab workshop student-copies`, `make lab`),
and the course timed as a learner runs it (`pdlab workshop time`)."""
