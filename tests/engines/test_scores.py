import numpy as np
import torch

from slotread.engines.base import Slot
from slotread.engines.scores import score_slots


def test_scores_match_a_float64_softmax_by_hand():
    logits = torch.tensor([[2.0, 0.5, -1.0, 3.0], [0.0, 4.0, 1.0, 1.0]])
    first, second = score_slots(logits, [(Slot(0, (0, 1)),), (Slot(3, (1, 2, 1)),)])

    probs = np.exp(logits.double().numpy())
    probs /= probs.sum(axis=1, keepdims=True)
    np.testing.assert_array_equal(first.logits[0], [2.0, 0.5])
    assert abs(first.label_mass[0] - (probs[0, 0] + probs[0, 1])) < 1e-6  # the normaliser is a float32 logsumexp
    assert (first.argmax_id, first.argmax_logit, first.argmax_is_label) == ((3,), (3.0,), (False,))
    # a label id listed twice counts once in the mass
    assert abs(second.label_mass[0] - (probs[1, 1] + probs[1, 2])) < 1e-6  # the normaliser is a float32 logsumexp
    assert second.argmax_is_label == (True,)
    # logit - log_normalizer is the vocabulary log-probability
    assert abs(second.argmax_logit[0] - second.log_normalizer[0] - np.log(probs[1, 1])) < 1e-6
