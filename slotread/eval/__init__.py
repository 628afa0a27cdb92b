"""The evaluation harness: datasets in, run folders out, through the public Decider API.

datasets     labelled files -> items (id, state, gold class) and the System One question for them
runner       one request per item through ``Decider.decide``, appended to predictions.csv (resumes)
baseline     TF-IDF + logistic regression on the train split, written as a run like any other
predictions  the predictions.csv format
metrics      accuracy, macro-F1, ECE, Brier, NLL, kappa, precision/recall, McNemar: numpy only
report       metrics.json, reliability.png, the table, paired comparison of two runs
evaluate     ``evaluate(settings)``: one ``slotread eval`` run, the system and bank it needs picked
banks        the example bank an evaluation builds from its training data
training     what an evaluation, ``calibrate`` or ``fit`` may learn from: never the evaluated items
fitting      ``slotread calibrate`` and ``slotread fit`` from settings, their results typed
"""
