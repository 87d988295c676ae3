"""The one launcher's handling of a rank lost to a signal (paddle_cp/tools/launcher.py, through tests/launcher.py's
`run_tool`): scripts that count their runs stand for a launch, no ranks started."""
import sys
import warnings

import pytest
from launcher import run_tool

# each run appends a line to `runs`; what the run then does is given per test
SCRIPT = """
import os, sys
runs = sys.argv[1]
with open(runs, "a") as f:
    f.write("run\\n")
tries = open(runs).read().count("run")
{body}
"""
PADDLE_LAUNCH_ABORT = ('print("Container rank 1 status failed cmd [...] code -6 log log/workerlog.1\\n"'
                       '"[SignalInfo: *** SIGABRT (@0x5ea) received by PID 1514 ***]"); sys.exit(250)')
# a rank lost to SIGSEGV in its teardown: its log ends with its work's output, nothing of the signal
PADDLE_LAUNCH_SEGFAULT = 'print("Container rank 2 status failed cmd [...] code -11 log log/workerlog.2"); sys.exit(245)'


def _run(tmp_path, body, **kwargs):
    runs = tmp_path / "runs"
    proc = run_tool([sys.executable, "-c", SCRIPT.format(body=body), runs], timeout=60, **kwargs)
    return proc, runs.read_text().count("run")


@pytest.mark.parametrize("abort, signal", [(PADDLE_LAUNCH_ABORT, "SIGABRT"), ("os.abort()", "SIGABRT"),
                                           (PADDLE_LAUNCH_SEGFAULT, "SIGSEGV")],
                         ids=["a rank", "the process itself", "a rank's teardown"])
def test_a_run_that_lost_a_rank_to_a_signal_runs_once_more_in_fresh_folders(tmp_path, abort, signal):
    fresh = tmp_path / "output"
    fresh.mkdir()
    (fresh / "partial").write_text("left by the lost run")
    with pytest.warns(UserWarning, match=rf"was lost to {signal}; launched once more") as caught:
        proc, tries = _run(tmp_path, f"if tries == 1: {abort}\nprint('done')", fresh=[fresh])
    assert proc.returncode == 0 and proc.stdout.strip() == "done" and tries == 2, proc
    if abort == PADDLE_LAUNCH_ABORT:  # the warning quotes what the aborted rank printed
        assert str(caught[0].message).endswith(":\nSIGABRT (@0x5ea) received by PID 1514 ***]\n"), caught[0].message
    assert fresh.is_dir() and not any(fresh.iterdir())


@pytest.mark.parametrize("body, code", [("sys.exit(1)", 1), ("raise ValueError('bad config')", 1),
                                        ('print("Container rank 1 status failed code -15"); sys.exit(241)', 241),
                                        ('print("Container rank 1 status failed code -110"); sys.exit(241)', 241)])
def test_a_failure_of_any_other_kind_is_reported_at_once(tmp_path, body, code):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "launched once more"
        proc, tries = _run(tmp_path, body)
    assert proc.returncode == code and tries == 1, proc


def test_a_run_that_aborts_again_fails_with_the_second_abort(tmp_path):
    with pytest.warns(UserWarning, match="launched once more"):
        proc, tries = _run(tmp_path, "os.abort()")
    assert proc.returncode == -6 and tries == 2
