"""The Recorder's step times (the simulator's jitter calibration) leave out what is not a training step."""

import itertools
import time

from benchmarks.rank import Recorder
from benchmarks.schedstat import thread_schedstat
from tests.helpers import digits, digits_classifier, trainer


def test_step_times_skip_each_epochs_first_and_last_batch_and_every_interval_holding_a_validation():
    ticks = itertools.count()  # one tick per clock read: a step between two batch ends is exactly 1
    recorder = Recorder(clock=lambda: float(next(ticks)))
    fit = trainer(devices=1, max_epochs=2, limit_train_batches=5, limit_val_batches=2, callbacks=[recorder])
    fit.fit(digits_classifier(), datamodule=digits())
    # 5 batches: 4 intervals, the last left out; validations read the clock between epochs
    assert recorder.step_s == [1.0] * 6


def test_the_fit_records_its_threads_time_on_the_cpu_and_queued_for_its_core():
    recorder = Recorder()  # the kernel's schedstat of the training thread
    fit = trainer(devices=1, max_epochs=1, limit_train_batches=5, limit_val_batches=2, callbacks=[recorder])
    fit.fit(digits_classifier(), datamodule=digits())
    assert 0 < recorder.cpu_s <= recorder.wall_s + 0.01
    assert 0 <= recorder.queued_s <= recorder.wall_s - recorder.cpu_s + 0.01


def test_thread_schedstat_counts_the_threads_own_cpu_time():
    cpu0, queued0 = thread_schedstat()
    start = time.thread_time()
    while time.thread_time() - start < 0.05:  # 50 ms of this thread's CPU
        pass
    cpu1, queued1 = thread_schedstat()
    assert cpu1 - cpu0 >= 0.045 and queued1 >= queued0


def test_thread_schedstat_is_zero_where_the_kernel_has_none(tmp_path):
    assert thread_schedstat(tmp_path / "missing") == (0.0, 0.0)


def test_the_recorder_counts_the_samples_validated_after_the_sanity_check():
    recorder = Recorder()
    limits = {"limit_train_batches": 2, "limit_val_batches": 3, "num_sanity_val_steps": 2}
    fit = trainer(devices=1, max_epochs=2, callbacks=[recorder], **limits)
    fit.fit(digits_classifier(), datamodule=digits(batch_size=16, val_batch_size=10))
    assert recorder.val_samples == 2 * 3 * 10  # two validations of 3 batches; the sanity check's 2 not counted
