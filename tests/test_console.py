"""Where a run's lines go: stdout when nothing is set up, the program's own logging setup otherwise, and only
the given handler inside ``relayed_to`` (a driver actor's stream, a study run's log file)."""

from __future__ import annotations

import logging
import logging.handlers
import subprocess
import sys

from rayspec.training.console import ROOT, relayed_to

LINE = "logging.getLogger('rayspec.training.loop').info('eval  %6d  val_loss %.4f', 3, 0.5)"


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)


def test_lines_reach_stdout_when_logging_is_not_set_up():
    res = python(f"import logging\nfrom rayspec.training.console import ensure_console\nensure_console()\n"
                 f"ensure_console()\n{LINE}")
    assert res.stdout == "eval       3  val_loss 0.5000\n" and res.stderr == ""


def test_a_program_that_set_up_logging_keeps_its_setup():
    res = python("import logging, sys\nlogging.basicConfig(level=logging.WARNING, stream=sys.stdout)\n"
                 f"from rayspec.training.console import ensure_console\nensure_console()\n{LINE}")
    assert res.stdout == ""  # its level drops INFO; no handler of rayspec's adds them


def test_relayed_lines_go_to_the_handler_alone_and_the_setup_comes_back(caplog):
    caplog.set_level(logging.WARNING, logger=ROOT)
    logger = logging.getLogger(ROOT)
    console = logging.handlers.BufferingHandler(100)  # where ensure_console's handler would be
    logger.addHandler(console)
    try:
        kept = logger.level, logger.propagate, list(logger.handlers)
        relay = logging.handlers.BufferingHandler(100)
        with relayed_to(relay):
            logging.getLogger("rayspec.training.progress").info("step %6d/%d", 3, 6)
        logging.getLogger("rayspec.training.progress").info("after")
        logging.getLogger("rayspec.training.progress").warning("back")
        assert (logger.level, logger.propagate, list(logger.handlers)) == kept
    finally:
        logger.removeHandler(console)
    assert [relay.format(r) for r in relay.buffer] == ["step      3/6"]
    assert [r.getMessage() for r in console.buffer] == ["back"]  # the logger's own handlers skip the relayed lines
    assert caplog.messages == ["back"]  # not propagated while relayed, and INFO is below the level after it
