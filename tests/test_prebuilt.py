"""The session's background jobs (tests/support/prebuilt.py): a result comes back, a failed job
fails the waiting test with its log, a job past its timeout is killed and fails it: no hang."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support import prebuilt


def _writes(out: Path, text: str) -> None:
    (out / "result.txt").write_text(text)


def _fails(out: Path) -> None:
    print("the job's own words before it failed", flush=True)
    raise RuntimeError("boom")


def _hangs(out: Path) -> None:
    time.sleep(600)


def test_a_job_started_by_its_first_wait_returns_its_directory():
    job = prebuilt.job("selftest-writes", _writes, args=("hello",), fixture="-")
    assert (job.wait() / "result.txt").read_text() == "hello"
    assert job.wait() == job.out                       # done: a second wait returns at once


def test_a_failed_job_fails_the_test_with_the_end_of_its_log():
    job = prebuilt.job("selftest-fails", _fails, fixture="-")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)'selftest-fails'.*exited with status 1.*"
                                                    r"own words before it failed.*RuntimeError: boom"):
        job.wait()


def test_a_job_past_its_timeout_is_killed_and_fails_the_test():
    job = prebuilt.job("selftest-hangs", _hangs, fixture="-", timeout=3)
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="ran past its timeout of 3 s and was killed"):
        job.wait()
    assert time.monotonic() - t0 < 60 and job.proc.poll() is not None
