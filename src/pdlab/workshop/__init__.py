"""The workshop kit, above the course: the pre-flight check a room runs on every seat (`pdlab preflight`)."""
