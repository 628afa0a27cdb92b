"""What answers go through around the reads: calibration, example banks and learned readouts.

``quality`` sits above ``core``: ``answering.decide_calibrated`` hands ``core.decide`` each question with
its solved examples and shortlist (``examples``), and the function that turns each raw answer into the
calibrated one with its prediction set (``calibration``) or into a learned readout's answer
(``readouts``). Each feature keeps its state in one store per model, and the fitted ones write one
artifact per (model, question schema) with a shared header (``artifact``). The maths are pure functions
on numpy arrays (torch for the fits); each feature's ``train`` module is the entry point that fits it
from labelled data through a ``Decider`` (``slotread calibrate``, ``slotread fit``), the only modules
here that import the layers above.
"""
