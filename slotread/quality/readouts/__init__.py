"""Learned readouts: a small head per (model, question schema) that answers from the model's own read.

``readout`` is the fitted head and its artifact, ``logistic`` the head's regression, ``fusion`` the
temperature and partner weights fitted on held-out items, ``store`` one model's readouts and the bank
classifiers their partners read, and ``train`` fits a readout from labelled data (``slotread fit``).
"""
