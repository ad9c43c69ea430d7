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


def test_simulate_option_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="simulate: gpus must be an integer"):
        distca.simulate(gpus="many")


def test_throughput_sets_what_the_planner_prices():
    """throughput="cpu" is cpu_throughput_profile() (the same plan as its dict), and its 16-row
    tiles price 300 short documents at what their rows cost, where a GPU's 128-row tile prices each
    as 128 rows: the colocated imbalance of one long document against them is higher on the CPU."""
    ranks = [[6144], [20] * 307 + [4]]
    by_name = distca.plan(ranks, throughput="cpu")
    by_dict = distca.plan(ranks, throughput=distca.cpu_throughput_profile())
    assert by_name.hash == by_dict.hash and np.array_equal(by_name.tasks, by_dict.tasks)
    cpu = distca.plan(ranks, policy="none", throughput="cpu").load["imbalance"]
    gpu = distca.plan(ranks, policy="none").load["imbalance"]
    assert cpu > gpu + 0.05, (cpu, gpu)
    slow = dict(distca.cpu_throughput_profile(), flops_per_second=1e9)
    assert distca.plan(ranks, policy="none", throughput=slow).load["max"] > distca.plan(
        ranks, policy="none", throughput="cpu").load["max"] * 10


@pytest.mark.parametrize("throughput, error, message", [
    ("gpu", ValueError, "throughput must be None, 'cpu' or a dict"),
    ({"flops_per_second": 1e9, "tile_rows": 16}, ValueError, "missing key task_overhead_seconds"),
    ({"flops_per_second": 1e9, "tile_rows": 16, "task_overhead_seconds": 0, "rate": 1}, ValueError, "unknown key rate"),
    ({"flops_per_second": 1e9, "tile_rows": 1.5, "task_overhead_seconds": 0}, TypeError, "tile_rows must be an integer"),
    ({"flops_per_second": True, "tile_rows": 16, "task_overhead_seconds": 0}, TypeError, "flops_per_second must be a number"),
    ({"flops_per_second": -1.0, "tile_rows": 16, "task_overhead_seconds": 0}, ValueError, "flops_per_second must be positive"),
    ({"flops_per_second": 1e9, "tile_rows": 0, "task_overhead_seconds": 0}, ValueError, "tile_rows must be positive"),
    (7, TypeError, "throughput must be None, 'cpu' or a dict"),
])
def test_bad_throughput_is_refused(throughput, error, message):
    with pytest.raises(error, match=message):
        distca.plan([[64]], throughput=throughput)
