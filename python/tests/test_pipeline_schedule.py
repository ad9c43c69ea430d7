"""distca.pipeline_schedule, the C++ tick tables as bound: hand-written tables and the rules."""
import pytest

import distca


def table(text: str) -> list:
    """Hand-written rows, one per stage ("F0 F1 . B0") -> [tick][stage] of (op, micro_batch)."""
    rows = [line.split() for line in text.strip().splitlines()]
    return [tuple(("", None) if tok == "." else (tok[0], int(tok[1:])) for tok in column) for column in zip(*rows)]


HAND = {
    ("cad", 1, 3): "F0 B0 F1 B1 F2 B2",
    ("cad", 2, 2): """
        F0 F1 .  .  B0 B1
        .  F0 B0 F1 B1 .""",
    ("cad", 3, 1): """
        F0 .  .  .  .  B0
        .  F0 .  .  B0 .
        .  .  F0 B0 .  .""",
    ("cad", 2, 3): """
        F0 F1 .  F2 B0 .  B1 B2
        .  F0 B0 F1 B1 F2 B2 .""",
    ("colocated", 2, 2): """
        F0 F1 .  B0 .  B1
        .  F0 B0 F1 B1 .""",
}


@pytest.mark.parametrize("key", sorted(HAND))
def test_equals_hand_written_tables(key):
    name, stages, micro_batches = key
    s = distca.pipeline_schedule(name, stages, micro_batches)
    assert list(s.ticks) == table(HAND[key]), s.text
    assert (s.name, s.stages, s.micro_batches) == key


def check_rules(s, lockstep: bool) -> None:
    """Every rank every tick, one direction a tick (lockstep), each (stage, micro-batch) forward
    and backward once, F(s, m) after F(s - 1, m), B(s, m) after F(s, m) and after B(s + 1, m)."""
    P, M = s.stages, s.micro_batches
    when = {}
    for t, tick in enumerate(s.ticks):
        assert len(tick) == P, f"tick {t} has {len(tick)} slots"
        ops = {op for op, _ in tick if op}
        assert ops, f"tick {t}: no stage works"
        if lockstep:
            assert len(ops) == 1, f"tick {t} mixes {ops}"
            assert s.direction(t) in ("F", "B")
        for stage, (op, m) in enumerate(tick):
            if not op:
                assert m is None
                continue
            assert 0 <= m < M
            assert (op, stage, m) not in when, f"{op}{m} twice on stage {stage}"
            when[op, stage, m] = t
    assert len(when) == 2 * P * M
    for stage in range(P):
        for m in range(M):
            assert when["B", stage, m] > when["F", stage, m]
            if stage:
                assert when["F", stage, m] > when["F", stage - 1, m]
            if stage + 1 < P:
                assert when["B", stage, m] > when["B", stage + 1, m]
    for stage in range(P):
        assert s.idle_ticks(stage) == sum(1 for tick in s.ticks if not tick[stage][0])


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4, 5, 6])
def test_rules(stages, micro_batches):
    cad = distca.pipeline_schedule("cad", stages, micro_batches)
    check_rules(cad, lockstep=True)
    # The lockstep table's length: P - 1 warm-up, 2M steady, P - 1 cool-down ticks.
    assert len(cad.ticks) == 2 * micro_batches + 2 * (stages - 1)
    check_rules(distca.pipeline_schedule("colocated", stages, micro_batches), lockstep=False)
    assert cad.text.count("\n") == stages


def test_bad_arguments():
    with pytest.raises(ValueError, match="no pipeline schedule 'zigzag'"):
        distca.pipeline_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="^stages must be 1..1024, got 0"):
        distca.pipeline_schedule("cad", 0, 2)
    with pytest.raises(ValueError, match="^micro_batches must be"):
        distca.pipeline_schedule("cad", 2, 0)
    with pytest.raises(TypeError, match="stages must be an integer"):
        distca.pipeline_schedule("cad", 2.0, 2)
    with pytest.raises(TypeError, match="name must be a string"):
        distca.pipeline_schedule(None, 2, 2)
    with pytest.raises(ValueError, match="one direction"):
        distca.pipeline_schedule("colocated", 2, 2).direction(3)
