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


def test_a_low_precision_verdict_is_twice_one_cards_distance_from_its_fp32_run():
    def verdict(parallel, one_card):
        return Parity({"logits": 3e-2}, one_card={"logits": one_card}, parallel={"logits": parallel},
                      reference="float32")

    assert verdict(2e-2, 1e-2).as_close_as_one_card and not verdict(2.1e-2, 1e-2).as_close_as_one_card
    assert verdict(9e-6, 0.0).as_close_as_one_card  # the tolerance still holds where rounding left no trace
    parity = verdict(5e-2, 1e-2)
    assert parity.ratio == {"logits": 5.0}
    assert "FARTHER from its fp32 run than one card (over 2x)" in str(parity) and "(x5.00)" in str(parity)
    assert "as close to its fp32 run as one card" in str(verdict(1e-2, 1e-2))
    assert json.loads(json.dumps(parity.as_dict())) == {
        "difference": {"logits": 3e-2}, "as_close_as_one_card": False, "one_card": {"logits": 1e-2},
        "parallel": {"logits": 5e-2}, "ratio": {"logits": 5.0}, "reference": "float32", "rounding": {}}


def test_a_low_precision_output_within_one_rounding_of_its_magnitude_is_rounding():
    """A scalar is one sample of the rounding: one card may land close to its fp32 value by chance; a distance
    within one rounding of the output's magnitude in the model's dtype is still rounding, and above it the 2x rule
    judges."""
    def verdict(parallel, one_card, rounding):
        return Parity({"loss": 1e-3}, one_card={"loss": one_card}, parallel={"loss": parallel}, reference="float32",
                      rounding={"loss": rounding})

    loss_rounding = 2.0 ** -8 * 4.8  # a bf16 loss of 4.8
    assert verdict(7.2e-4, 6.1e-5, loss_rounding).as_close_as_one_card  # 11.8x one card's, within one rounding
    assert not verdict(2 * loss_rounding, 6.1e-5, loss_rounding).as_close_as_one_card
    assert verdict(2 * loss_rounding, loss_rounding, loss_rounding).as_close_as_one_card
    assert "one rounding 1.87e-02" in str(verdict(7.2e-4, 6.1e-5, loss_rounding))
