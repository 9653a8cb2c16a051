"""The pipeline lease on a real filesystem, with real processes: one holder at a time,
tokens that only grow, a holder killed with kill -9 frees it at once, a holder on
another machine holds it until its heartbeat expires, and a stale token is fenced."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from volley_dagster.checkpoint.lease import MAX_RETAKES, Fence, PipelineLease, current_holder, newest_token
from volley_dagster.errors import FencedError, LeaseLapsedError, PipelineBusyError

HOLD = """
import sys, time
from volley_dagster.checkpoint.lease import PipelineLease
lease = PipelineLease(sys.argv[1], owner="dagster run 1234abcd", wait_s=5).acquire()
print(lease.fence.token, flush=True)
time.sleep(600)
"""
PAUSED = """
import sys
from volley_dagster.checkpoint.lease import PipelineLease
from volley_dagster.errors import LeaseLapsedError
lease = PipelineLease(sys.argv[1], owner="cli", ttl_s=float(sys.argv[2]), pipeline="payments",
                      notify=lambda message: print("told:", message, flush=True)).acquire()
print(lease.fence.token, flush=True)
sys.stdin.readline()  # the test freezes this process meanwhile
try:
    lease.check("epoch 2: committing sink 'balances'")
except LeaseLapsedError as exc:
    print("lapsed:", exc, flush=True)
    lease.retake(str(exc))
lease.check("epoch 2: committing sink 'balances'")
print("holds", lease.fence.token, flush=True)
sys.stdin.readline()
"""
ROOT = Path(__file__).resolve().parents[2]


def hold_in_subprocess(root: Path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    token = int(proc.stdout.readline())
    return proc, token


def test_one_holder_at_a_time_and_tokens_only_grow(tmp_path):
    first = PipelineLease(tmp_path, owner="dagster run aaa", wait_s=0.5, pipeline="payments").acquire()
    assert first.fence.token == 1 == newest_token(tmp_path)
    second = PipelineLease(tmp_path, owner="cli", wait_s=0.5, pipeline="payments")
    started = time.monotonic()
    with pytest.raises(PipelineBusyError) as busy:
        second.acquire()
    assert 0.5 <= time.monotonic() - started < 5
    message = str(busy.value)
    assert "pipeline 'payments' is busy" in message
    assert f"host {os.uname().nodename} pid {os.getpid()} (dagster run aaa), token 1" in message
    assert not second.held
    first.release()
    assert current_holder(tmp_path).released_at is not None
    with second:
        assert second.fence.token == 2
    with PipelineLease(tmp_path) as third:
        assert third.fence.token == 3
    assert newest_token(tmp_path) == 3


def test_a_waiting_runner_says_so_and_gets_the_lease_when_it_is_released(tmp_path):
    holder = PipelineLease(tmp_path, owner="dagster run first").acquire()
    said: list[str] = []
    waiter = PipelineLease(tmp_path, owner="dagster run second", wait_s=10, notify=said.append)
    threading.Timer(1.0, holder.release).start()
    with waiter:
        assert waiter.fence.token == 2 and waiter.waited_s >= 0.9
    assert said and "held by host" in said[0] and "(dagster run first)" in said[0]


def test_a_holder_killed_with_sigkill_frees_the_lease_at_once(tmp_path):
    proc, token = hold_in_subprocess(tmp_path)
    try:
        with pytest.raises(PipelineBusyError, match=rf"pid {proc.pid} \(dagster run 1234abcd\), token {token}"):
            PipelineLease(tmp_path, wait_s=0.3).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    started = time.monotonic()
    with PipelineLease(tmp_path, wait_s=10) as lease:
        assert time.monotonic() - started < 5.0  # no expiry (30 s) to wait out on this machine; slack for a slow disk
        assert lease.fence.token == token + 1
        with pytest.raises(FencedError, match=rf"moved on to token {token + 1} \(this runner holds {token}\)"):
            Fence(str(tmp_path), token).check("epoch 3: writing its manifest")
        lease.fence.check("epoch 3: writing its manifest")


def test_a_holder_on_another_machine_holds_until_its_heartbeat_expires(tmp_path):
    """A shared disk whose locks do not reach across machines: the newest token's
    record, renewed by its holder's heartbeat, is what fences the others."""
    with PipelineLease(tmp_path):
        pass  # token 1, released
    now = time.time()
    record = {"token": 2, "host": "worker-7.example", "boot": "another-boot", "pid": 4242, "pid_ticks": 1,
              "owner": "dagster run remote", "acquired_at": now, "renewed_at": now, "expires_at": now + 2.0,
              "released_at": None}
    (tmp_path / "lease" / "tokens" / "0000000002.json").write_text(json.dumps(record))
    with pytest.raises(PipelineBusyError, match=r"host worker-7\.example pid 4242 \(dagster run remote\), token 2"):
        PipelineLease(tmp_path, wait_s=0.5, ttl_s=2.0).acquire()
    with PipelineLease(tmp_path, wait_s=10, ttl_s=2.0) as lease:  # once its heartbeat is 2 s old
        assert time.time() >= now + 2.0
        assert lease.fence.token == 3


def test_the_heartbeat_renews_the_record(tmp_path):
    lease = PipelineLease(tmp_path, ttl_s=0.6).acquire()
    first = current_holder(tmp_path).expires_at
    time.sleep(0.5)
    assert current_holder(tmp_path).expires_at > first  # renewed every ttl/3
    lease.release()


def test_a_holder_paused_past_its_lease_is_stopped_then_takes_a_new_token(tmp_path):
    """SIGSTOP (a long GC pause, a suspended VM) past the ttl: the holder's next check
    refuses, naming what its heartbeat did; ``retake`` gives it the next token while
    it keeps the flock, so its old token is fenced and no one else gets in between."""
    ttl = 1.5
    proc = subprocess.Popen([sys.executable, "-c", PAUSED, str(tmp_path), str(ttl)], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert int(proc.stdout.readline()) == 1
        proc.send_signal(signal.SIGSTOP)
        time.sleep(ttl + 1.0)
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        lapsed, told, holds = (proc.stdout.readline() for _ in range(3))
        assert lapsed.startswith("lapsed: epoch 2: committing sink 'balances': stopped, this runner's lease of ")
        assert "(token 1) lapsed" in lapsed and "its heartbeat is due every 0.5s and" in lapsed and "was paused" in lapsed
        assert told.startswith("told: epoch 2: committing sink 'balances'")
        assert told.rstrip().endswith("took the lease of 'payments' again (fencing token 2, was 1) and runs again")
        assert holds.split() == ["holds", "2"]
        assert newest_token(tmp_path) == 2 and current_holder(tmp_path).pid == proc.pid
        with pytest.raises(FencedError, match=r"moved on to token 2 \(this runner holds 1\)"):
            Fence(str(tmp_path), 1).check("epoch 2: installing shard 1's snapshot")  # what the old attempt left running
        with pytest.raises(PipelineBusyError, match=rf"pid {proc.pid} \(cli\), token 2"):
            PipelineLease(tmp_path, wait_s=0.3).acquire()
    finally:
        proc.kill()
        proc.wait()


def test_retake_refuses_a_lease_never_taken(tmp_path):
    with pytest.raises(FencedError, match="epoch 4: .* is not held, so it cannot be taken again"):
        PipelineLease(tmp_path).retake("epoch 4: lapsed")


def test_retaking_on_lapse_runs_again_under_each_new_token_then_gives_up(tmp_path):
    told: list[str] = []
    with PipelineLease(tmp_path, pipeline="payments", notify=told.append) as lease:
        ran: list[int] = []

        def lapses_once() -> str:
            ran.append(lease.fence.token)
            if len(ran) == 1:
                raise LeaseLapsedError("epoch 3: writing its manifest: stopped, lapsed")
            return "committed"

        assert lease.retaking_on_lapse(lapses_once) == "committed" and ran == [1, 2]
        assert told == ["epoch 3: writing its manifest: stopped, lapsed; took the lease of 'payments' again "
                        "(fencing token 2, was 1) and runs again"]

        def always_lapses() -> None:
            ran.append(lease.fence.token)
            raise LeaseLapsedError(f"epoch 4: lapsed under token {lease.fence.token}")

        with pytest.raises(LeaseLapsedError, match=f"under token {2 + MAX_RETAKES}$"):
            lease.retaking_on_lapse(always_lapses)
        assert ran[2:] == list(range(2, 3 + MAX_RETAKES)) and newest_token(tmp_path) == 2 + MAX_RETAKES
