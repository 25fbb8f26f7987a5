"""Interpreter-start files for `compilewatch run` (this directory goes on the child's PYTHONPATH)."""
