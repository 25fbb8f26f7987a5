"""A Ctrl-C that lands while the engine starts its worker threads (between the first thread's start and the
monitor) stops the threads already started and reports the run interrupted, as one during the run does;
before, the KeyboardInterrupt left run() with a worker waiting on the router for good (CPU, the toy program)."""

from __future__ import annotations

import threading

from dflash.engine.engine import Engine
from dflash.engine.toy import ToySpec, toy_program
from tests.test_engine import cfg


def test_ctrl_c_while_the_workers_start_stops_the_started_ones_and_reports_interrupted(monkeypatch):
    engine = Engine(toy_program(ToySpec(compile_backend="eager")),
                    cfg(drafter_devices=("cpu", "cpu"), prewarm=False, steps=3))
    real = engine._spawn
    spawned: list[threading.Thread] = []

    def spawn(live, fn, *args):
        if spawned:  # the second worker's start: SIGINT arrives here
            raise KeyboardInterrupt
        real(live, fn, *args)
        spawned.append(live.thread)

    monkeypatch.setattr(engine, "_spawn", spawn)
    report = engine.run()
    assert report.outcome == "interrupted"
    assert report.steps_done == 0
    assert len(spawned) == 1 and not spawned[0].is_alive()  # the started worker was stopped and joined
