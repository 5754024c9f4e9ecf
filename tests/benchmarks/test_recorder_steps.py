"""The Recorder's step times (the simulator's jitter calibration) leave out what is not a training step."""

import itertools

from benchmarks.rank import Recorder
from tests.helpers import digits, digits_classifier, trainer


def test_step_times_skip_each_epochs_first_and_last_batch_and_every_interval_holding_a_validation():
    ticks = itertools.count()  # one tick per clock read: a step between two batch ends is exactly 1
    recorder = Recorder(clock=lambda: float(next(ticks)))
    fit = trainer(devices=1, max_epochs=2, limit_train_batches=5, limit_val_batches=2, callbacks=[recorder])
    fit.fit(digits_classifier(), datamodule=digits())
    # 5 batches: 4 intervals, the last left out; validations read the clock between epochs
    assert recorder.step_s == [1.0] * 6
