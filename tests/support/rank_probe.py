"""torchrun entry point of the multi-node tests: ``rank_probe.py OUT_DIR <dspark-trt arguments>``.

Records what torchrun gave this process (its variables, pid, its agent's pid, and how
``parallel.topology.Launch`` reads them) in ``OUT_DIR/rank<RANK>.json``, then runs
``dspark_trt.cli`` with the remaining arguments. On Linux the process dies with its agent
(PR_SET_PDEATHSIG), so a test that kills the agents leaves no rank behind.
"""
import ctypes
import json
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _die_with_agent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))     # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass                                           # not Linux: the test kills the pids it recorded


def main() -> int:
    _die_with_agent()
    out, argv = sys.argv[1], sys.argv[2:]
    record = {k: os.environ.get(k) for k in KEYS}
    record.update(pid=os.getpid(), agent_pid=os.getppid())
    path = os.path.join(out, f"rank{record['RANK']}.json")
    with open(path + ".tmp", "w") as f:                # the pid first: the test can kill a hung rank
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    sys.path[0] = ROOT                 # not tests/support (its modules would shadow libraries')
    from dspark_trt.parallel.topology import Launch
    record["launch"] = Launch.from_env().describe()
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    from dspark_trt.cli import main as cli
    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
