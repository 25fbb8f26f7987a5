"""Race programs a new user might write, each with the verdict compilewatch must give (asserted in
tests/test_race_programs.py). Every program is a standalone script (`compilewatch run -- python
tests/race_programs/X.py` works) whose `main()` returns what its threads really saw:
`{"errors": {thread name: [ "Type: message", ...]}}`. Threads meet through Events only: no sleeps,
the same interleaving on every run. Backends are "eager"/"aot_eager" (CPU-fast).
"""
