import pytest

from lavis_ds.datasets.samplers import EvalBatchSampler, StepBatchSampler


def _epoch(num, micro, accum, world, seed=0, epoch=0, start=0):
    """Per optimizer step: the set of samples all ranks consume."""
    per_rank = []
    for rank in range(world):
        s = StepBatchSampler(num, micro, accum, world, rank, seed)
        s.set_position(epoch, start)
        per_rank.append(list(s))
    steps = []
    for i in range(len(per_rank[0]) // accum):
        steps.append(sorted(idx for r in per_rank for b in r[i * accum:(i + 1) * accum] for idx in b))
    return steps


def test_each_step_consumes_one_global_batch_without_overlap():
    steps = _epoch(50, micro=2, accum=3, world=2)
    assert len(steps) == 50 // 12
    flat = [i for s in steps for i in s]
    assert len(flat) == len(set(flat)) == 4 * 12


def test_global_order_does_not_depend_on_world_size():
    assert _epoch(64, micro=2, accum=4, world=2) == _epoch(64, micro=4, accum=4, world=1) == _epoch(64, micro=1, accum=8, world=2)


def test_resume_skips_consumed_steps_without_loading_them():
    full = _epoch(64, micro=2, accum=2, world=2, epoch=3)
    assert _epoch(64, micro=2, accum=2, world=2, epoch=3, start=5) == full[5:]
    s = StepBatchSampler(64, 2, 2, 2, 0, seed=0)
    s.set_position(3, 5)
    assert len(s) == (8 - 5) * 2


def test_epochs_and_seeds_differ():
    assert _epoch(64, 2, 2, 2, epoch=0) != _epoch(64, 2, 2, 2, epoch=1)
    assert _epoch(64, 2, 2, 2, seed=1) != _epoch(64, 2, 2, 2, seed=2)


def test_too_small_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match=r"10 samples, fewer than one global batch \(4 x 2 accumulation x 2 processes = 16\)"):
        StepBatchSampler(10, 4, 2, 2, 0, seed=0)


@pytest.mark.parametrize("num", [0, 1, 7, 8, 9])
def test_eval_sampler_covers_every_sample_once_with_equal_batch_counts(num):
    samplers = [EvalBatchSampler(num, 3, 2, r) for r in range(2)]
    assert len({len(s) for s in samplers}) == 1
    real = [i for s in samplers for b, batch in enumerate(s) if not s.is_padding(b) for i in batch]
    assert sorted(real) == list(range(num))


def test_length_grouping_keeps_each_steps_samples_and_groups_neighbours():
    lengths = [(i * 37) % 23 - (5 if i % 7 == 0 else 0) for i in range(64)]  # some negative: text-only samples

    def length_of(index, epoch):
        return lengths[index]

    world, micro, accum = 2, 4, 2
    plain = [StepBatchSampler(64, micro, accum, world, r, seed=3) for r in range(world)]
    grouped = [StepBatchSampler(64, micro, accum, world, r, seed=3, length_of=length_of) for r in range(world)]
    for step in range(plain[0].steps_per_epoch):
        mine = [g.step_indices(step) for g in grouped]
        assert sorted(i for r in mine for mb in r for i in mb) == sorted(
            i for p in plain for mb in p.step_indices(step) for i in mb)  # the same samples: the same loss
        micro_batches = sorted((mb for r in mine for mb in r), key=lambda mb: lengths[mb[0]])
        flat = [lengths[i] for mb in micro_batches for i in mb]
        assert flat == sorted(flat)  # each micro-batch holds neighbours in length
        assert mine == [g.step_indices(step) for g in grouped]  # a function of (seed, epoch, step)
