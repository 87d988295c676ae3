"""The collective timeout: its settings, and a guarded operation that outlives it (in a child
process, which the watchdog ends)."""
import re
import subprocess
import sys
import textwrap

import pytest
from launcher import ROOT

import paddle_cp as pcp
from paddle_cp import runtime
from paddle_cp.comm import watchdog


@pytest.mark.parametrize("value", ["0", "-3", "inf", "never"])
def test_timeout_environment_variable_is_checked(monkeypatch, value):
    monkeypatch.setenv("PCP_TIMEOUT", value)
    with pytest.raises(ValueError, match="PCP_TIMEOUT must be a positive number"):
        pcp.get_timeout()


def test_timeout_from_environment_or_set_timeout(monkeypatch):
    from paddle_cp.comm import watchdog

    monkeypatch.setattr(runtime.installed, "collective_timeout", None)
    monkeypatch.delenv("PCP_TIMEOUT", raising=False)
    assert pcp.get_timeout() == watchdog.DEFAULT_TIMEOUT
    monkeypatch.setenv("PCP_TIMEOUT", "12.5")
    assert pcp.get_timeout() == 12.5
    pcp.set_timeout(3)
    assert pcp.get_timeout() == 3.0


def test_guard_leaves_nothing_in_flight():
    with watchdog.guard("unit_op", (0, 1)):
        assert len(runtime.state.collectives_in_flight) == 1
    assert not runtime.state.collectives_in_flight


def test_an_operation_past_the_timeout_ends_the_process_naming_it():
    script = textwrap.dedent("""
        import sys, time
        sys.path.insert(0, %r)
        import paddle_cp as pcp
        from paddle_cp.comm.watchdog import guard
        pcp.set_timeout(0.5)
        with guard("stuck_all_reduce", (0, 1, 2)):
            time.sleep(60)
        print("not reached")
    """ % str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 17, done.stderr[-2000:]
    assert "not reached" not in done.stdout
    assert "in collective 'stuck_all_reduce' over group [0, 1, 2] waiting for ranks [1, 2]" in done.stderr


def test_a_collective_the_backend_fails_is_named_and_the_error_kept(capsys):
    """Gloo gives up after its fixed 30 s (before a longer paddle_cp timeout): the rank says which
    collective and which peers, beside gloo's terse TIMEOUT, and the backend's error propagates."""
    with pytest.raises(RuntimeError, match="unbound_buffer.cc:80] TIMEOUT"):
        with watchdog.guard("pp_recv", (0, 2)):
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:80] TIMEOUT self_rank = none")
    err = capsys.readouterr().err
    assert re.search(r"paddle_cp: rank 0 failed after \d+\.\d s in collective 'pp_recv' over group \[0, 2\] "
                     r"waiting for ranks \[2\]", err), err
    assert not runtime.state.collectives_in_flight
