"""``harness/`` (shared with the benchmarks) under the name the tests import: configs from ``harness.configs``,
processes from ``harness.processes``, checks on a run's outputs from ``harness.checks``. New code imports those."""
from harness import REPO  # noqa: F401
from harness.checks import (assert_same_steps, comparable, complete_steps, export_matches_logged_val_loss,  # noqa: F401
                            metrics, tracebacks, train_steps)
from harness.configs import EPOCHS, SAVE_EVERY, STEPS_PER_EPOCH, noisy_config, tiny_config, write_yaml  # noqa: F401
from harness.processes import (TRAIN, command, continue_from, env, free_port, kill, kill_after_step,  # noqa: F401
                               kill_tree, killed_run_continues_bit_for_bit, output_of, run_forked, run_together,
                               run_train, start, train_args)
