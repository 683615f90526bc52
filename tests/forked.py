"""``harness.forked`` (the suite's fork server, shared with the benchmarks), under the name tests import for one
transition."""
from harness.forked import *  # noqa: F401,F403
from harness.forked import STILL_RUNNING, TRAIN, Job, start_server  # noqa: F401
