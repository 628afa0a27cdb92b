"""What answers go through after the reads: calibration and conformal prediction sets.

``quality`` sits above ``core``: it reads content-free prompts through ``core.decide``, and hands
``core.decide`` the function that turns each raw answer into the calibrated one (with its prediction
set) before later stages see it. Its maths are pure functions on numpy arrays; its state (fitted
artifacts, content-free distributions, batch priors) lives in one ``CalibrationStore`` per model.
"""
