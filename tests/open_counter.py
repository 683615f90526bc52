"""Run a script with an audit hook that logs every file it opens under a folder: a measurement, no mocks.

    python tests/open_counter.py <log file> <folder> train.py --cfg-path x.yaml

Python raises the ``open`` audit event for every file opened, by any module, in the
process (forked DataLoader workers inherit the hook). The log has one path per line.
"""
import os
import runpy
import sys

log_path, folder, script = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3]
log = open(log_path, "a", buffering=1)  # opened before the hook: the log itself is not counted


def log_opens(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], (str, os.PathLike)):
        path = os.path.abspath(os.fspath(args[0]))
        if path.startswith(folder + os.sep):
            log.write(path + "\n")


sys.addaudithook(log_opens)
sys.argv = sys.argv[3:]
runpy.run_path(script, run_name="__main__")
