"""Calibration and conformal prediction sets: ``x_calibration`` and ``x_coverage``.

``methods`` turns a read's label logits into calibrated probabilities (temperature, contextual,
batch, binned), ``conformal`` gives prediction sets from nonconformity scores, ``artifact`` is the
fitted JSON file, ``store`` one model's artifacts, content-free distributions and batch priors, and
``train`` fits an artifact from labelled data (``slotread calibrate``).
"""
