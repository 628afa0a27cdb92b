"""What answers go through around the reads: calibration, example banks and learned readouts.

``quality`` sits above ``core`` and reads nothing itself: ``slotread.pipeline`` calls its pieces
before the reads (each question's solved examples and shortlist, ``examples.shortlist``; refusals of
missing fits and the content-free prompts, ``calibration.apply``, ``calibration.content_free`` and
``readouts.apply``) and after them (each raw answer calibrated with its prediction set,
``calibration.apply``, or replaced by a learned readout's, ``readouts.apply``). Each feature keeps its
state in one store per model, and the fitted ones write one artifact per (model, question schema) with
a shared header (``artifact``). The maths are pure functions on numpy arrays (torch for the fits); each
feature's ``train`` module is the entry point that fits it from labelled data through a ``Decider``
(``slotread calibrate``, ``slotread fit``), the only modules here that import the layers above.
"""
