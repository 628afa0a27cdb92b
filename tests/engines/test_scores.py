import math

import numpy as np
import torch

from slotread.engines.base import Slot
from slotread.engines.scores import OutputHead, score_slot_rows, score_slots

IDENTITY = OutputHead(torch.eye(4))  # hidden states are their own logits


def test_scores_match_a_float64_softmax_by_hand():
    logits = torch.tensor([[2.0, 0.5, -1.0, 3.0], [0.0, 4.0, 1.0, 1.0]])
    first, second = score_slots(logits, logits, [(Slot(0, (0, 1)),), (Slot(3, (1, 2, 1)),)], IDENTITY)

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


def test_one_row_per_slot_regroups_by_request():
    logits = torch.tensor([[2.0, 0.5, -1.0, 3.0], [0.0, 4.0, 1.0, 1.0], [1.0, 1.0, 5.0, 0.0]])
    slots = [(Slot(0, (0, 1)), Slot(4, (1, 2))), (Slot(2, (2, 3)),)]
    two_slots, one_slot = score_slot_rows(logits, logits, slots, IDENTITY)
    rows = score_slots(logits, logits, [(slot,) for request in slots for slot in request], IDENTITY)
    np.testing.assert_array_equal(two_slots.logits[0], [2.0, 0.5])
    np.testing.assert_array_equal(two_slots.logits[1], [4.0, 1.0])
    np.testing.assert_array_equal(one_slot.logits[0], [5.0, 0.0])
    assert two_slots.argmax_id == (3, 1) and one_slot.argmax_id == (2,)
    assert two_slots.label_mass == (rows[0].label_mass[0], rows[1].label_mass[0])
    assert two_slots.log_normalizer == (rows[0].log_normalizer[0], rows[1].log_normalizer[0])
    assert one_slot.argmax_is_label == (True,) and two_slots.argmax_is_label == (False, True)


def test_a_row_without_slots_scores_empty_and_a_row_with_two_shares_its_normaliser():
    logits = torch.tensor([[2.0, 0.5, -1.0, 3.0], [0.0, 4.0, 1.0, 1.0]])
    none, two = score_slots(logits, logits, [(), (Slot(0, (0, 1)), Slot(1, (2, 3, 2)))], IDENTITY)
    assert none.logits == () and none.label_mass == ()
    probs = torch.softmax(logits[1].double(), dim=-1).numpy()
    assert abs(two.label_mass[0] - (probs[0] + probs[1])) < 1e-6
    assert abs(two.label_mass[1] - (probs[2] + probs[3])) < 1e-6  # the repeated id once
    assert two.argmax_id == (1, 1) and two.log_normalizer[0] == two.log_normalizer[1]
    np.testing.assert_array_equal(two.logits[1], [1.0, 1.0, 1.0])


def test_label_logits_are_exact_where_the_bfloat16_vocabulary_rounds_them():
    # 16 + 2**-7 needs 12 significant bits; bfloat16 keeps 8, so its projection gives 16 for both labels.
    head = OutputHead(torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]], dtype=torch.bfloat16))
    hidden = torch.tensor([[16.0, 2**-7]], dtype=torch.bfloat16)
    vocabulary = head.vocabulary(hidden)
    assert vocabulary[0, :2].tolist() == [16.0, 16.0]

    (scores,) = score_slots(vocabulary, hidden, [(Slot(0, (0, 1)),)], head)

    np.testing.assert_array_equal(scores.logits[0], np.array([16.0, 16.0078125], dtype=np.float32))
    # the diagnostics see the exact label logits: label 1 is the argmax, and the mass is theirs
    assert scores.argmax_id == (1,) and scores.argmax_logit == (16.0078125,)
    total = math.log(math.exp(16.0) + math.exp(16.0078125) + math.exp(float(vocabulary[0, 2])))
    assert abs(scores.log_normalizer[0] - total) < 1e-5
    assert abs(scores.label_mass[0] - (math.exp(16.0) + math.exp(16.0078125)) / math.exp(total)) < 1e-6


def test_the_head_applies_bias_scale_and_softcap_in_order():
    head = OutputHead(torch.tensor([[2.0, 1.0], [0.0, -1.0]]), torch.tensor([0.5, 1.0]), scale=0.25, softcap=3.0)
    hidden = torch.tensor([[1.0, 4.0]])
    # id 0: 3 * tanh(0.25 * (2 + 4 + 0.5) / 3); id 1: 3 * tanh(0.25 * (-4 + 1) / 3)
    expected = [3 * math.tanh(0.25 * 6.5 / 3), 3 * math.tanh(0.25 * -3 / 3)]
    np.testing.assert_allclose(head.vocabulary(hidden)[0].numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(head.at(hidden.expand(2, -1), torch.tensor([0, 1])).numpy(), expected, rtol=1e-6)
