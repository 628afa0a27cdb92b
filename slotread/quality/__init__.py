"""What happens to label distributions between the reads and the answers: option-order debiasing,
calibration and conformal prediction sets.

Pure maths on numpy arrays plus the calibration state of one model (artifacts, content-free reads,
batch priors). ``core.decide`` calls it between aggregating the reads and building the answers; it
knows nothing of questions, prompts, engines or wire formats.
"""
