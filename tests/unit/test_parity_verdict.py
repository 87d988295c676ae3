"""check_parity's result (paddle_cp/api/parity.py's Parity): the plain dict it always was, and the float64 verdict
beside it (the figures of a real launch are checked in tests/multiproc/test_tensor_parallel.py)."""
import json

from paddle_cp.api.parity import TOLERANCE, Parity


def test_without_the_float64_pass_it_is_the_plain_dict():
    parity = Parity({"loss": 2e-7, "logits": 3e-6})
    assert parity == {"loss": 2e-7, "logits": 3e-6} and max(parity.values()) < TOLERANCE
    assert parity.one_card is None and parity.ratio is None and parity.as_close_as_one_card
    assert not Parity({"logits": 2 * TOLERANCE}).as_close_as_one_card
    assert str(parity).endswith("equal to one card within 1e-05")


def test_the_verdict_is_three_times_one_cards_distance_or_the_tolerance():
    def verdict(parallel, one_card):
        return Parity({"logits": 5e-5}, one_card={"logits": one_card}, parallel={"logits": parallel})

    assert verdict(9e-5, 3e-5).as_close_as_one_card  # exactly 3x
    assert not verdict(9.1e-5, 3e-5).as_close_as_one_card
    assert verdict(9e-6, 1e-7).as_close_as_one_card  # within the tolerance whatever one card's distance
    assert not verdict(2e-5, 0.0).as_close_as_one_card and verdict(2e-5, 0.0).ratio == {"logits": float("inf")}
    parity = verdict(7.7e-3, 3.4e-5)
    assert abs(parity.ratio["logits"] - 7.7e-3 / 3.4e-5) < 1e-9
    assert "FARTHER from the float64 truth than one card" in str(parity) and "(x226.47)" in str(parity)
    figures = json.loads(json.dumps(parity.as_dict()))
    assert figures == {"difference": {"logits": 5e-5}, "as_close_as_one_card": False, "one_card": {"logits": 3.4e-5},
                       "parallel": {"logits": 7.7e-3}, "ratio": {"logits": 7.7e-3 / 3.4e-5}}
