"""Batches from every form distca.plan takes give the same plan, and a malformed one is refused."""
import numpy as np
import pytest

import distca


def test_pieces_give_the_packed_batch_and_its_plan():
    packed = distca.pack([1800, 100, 700, 300], 3, 1024)
    d = packed.to_dict()
    assert d["num_ranks"] == 3 and d["pieces"].shape[1] == 4
    assert (d["pieces"][:, 3] != d["pieces"][0, 3]).any()  # a document spans ranks
    again = distca.batch_from_pieces(d["doc_lengths"], d["pieces"], d["tokens_per_rank"])
    for key in ("num_ranks", "tokens_per_rank"):
        assert again.to_dict()[key] == d[key]
    assert np.array_equal(again.to_dict()["pieces"], d["pieces"])
    a, b = distca.plan(packed), distca.plan(again)
    assert a.hash == b.hash and np.array_equal(a.tasks, b.tasks)
    for r in range(3):
        assert np.array_equal(a.for_rank(r).q_send_index, b.for_rank(r).q_send_index)


def test_list_dict_and_batch_forms_agree():
    ranks = [[4096, 512], [1024] * 4, [256] * 16]
    by_list = distca.plan(ranks)
    by_dict = distca.plan({"ranks": ranks})
    by_batch = distca.plan(by_list.batch)
    by_numpy = distca.plan([np.array(r, dtype=np.int64) for r in ranks])
    assert by_list.hash == by_dict.hash == by_batch.hash == by_numpy.hash


@pytest.mark.parametrize("pieces, message", [
    ([[0, 0, 50, 0], [1, 0, 50, 0]], "document 0 end at 50 of 100"),  # not covered
    ([[0, 0, 100, 0], [1, 0, 60, 0]], "malformed piece: doc 1"),    # past its end (50)
    ([[0, 0, 60, 0], [0, 50, 100, 1], [1, 0, 50, 1]], "do not tile"),  # overlapping pieces
    ([[3, 0, 10, 0]], "doc 3 must be in"),              # no such document
    ([[0, 0, 100, -1]], "rank -1"),                     # no such rank
])
def test_malformed_pieces_are_refused(pieces, message):
    with pytest.raises(ValueError, match=message):
        distca.batch_from_pieces([100, 50], np.array(pieces))


def test_pieces_must_be_rows_of_four():
    with pytest.raises(ValueError, match=r"\(n, 4\)"):
        distca.batch_from_pieces([10], np.array([[0, 0, 10]]))


def test_unknown_batch_type_and_model_keys_are_refused():
    with pytest.raises(ValueError, match="batch must be"):
        distca.plan(42)
    with pytest.raises(ValueError, match="unknown key"):
        distca.plan([[64]], model={"preset": "llama-8b", "layer": 2})
    with pytest.raises(ValueError, match="one plan"):
        distca.plan([[64]], policy="all")


def test_simulate_option_of_the_wrong_type_is_a_value_error():
    with pytest.raises(ValueError, match="gpus must be int"):
        distca.simulate(gpus="many")
