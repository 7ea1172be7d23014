"""SQuAD's exact match and F1 against the official script's normalisation and examples."""

import pytest

from scalenlp.train.squad import exact_match, f1, normalize_answer, question_scores, squad_scores


@pytest.mark.parametrize("text,normal", [
    ("The Denver Broncos", "denver broncos"),
    ("  a   Santa Clara,  California. ", "santa clara california"),
    ("Levi's Stadium", "levis stadium"),
    ("An apple and the pear", "apple and pear"),
    ("theatre another anthem", "theatre another anthem"),  # articles as words only
    ("24–10", "24–10"),  # an en dash is not ASCII punctuation: the script keeps it
    ("(Saint) Bernadette Soubirous!", "saint bernadette soubirous"),
])
def test_normalisation(text, normal):
    assert normalize_answer(text) == normal


def test_exact_match_and_f1_of_squad_answers():
    assert exact_match("the Denver Broncos", "Denver Broncos") == 1
    assert exact_match("Denver", "Denver Broncos") == 0
    assert f1("Denver", "Denver Broncos") == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert f1("Santa Clara, California", "Levi's Stadium in the San Francisco Bay Area at Santa Clara, "
              "California") == pytest.approx(2 * 1 * (3 / 11) / (1 + 3 / 11))
    assert f1("gold gold", "gold") == pytest.approx(2 * 0.5 * 1 / 1.5)  # counted as bags, not sets
    assert f1("Carolina", "Panthers") == 0


def test_best_over_references_and_unanswerable_questions():
    assert question_scores("Denver Broncos", ["Broncos", "Denver Broncos", "the Broncos"]) == (1.0, 1.0)
    assert question_scores("", []) == (1.0, 1.0)  # SQuAD v2.0: no answer, none predicted
    assert question_scores("Broncos", []) == (0.0, 0.0)
    assert question_scores("", ["Broncos"]) == (0.0, 0.0)
    scores = squad_scores(["Denver Broncos", "Denver", "x"], [["Denver Broncos"], ["Denver Broncos"], ["y"]])
    assert scores["exact_match"] == pytest.approx(100 / 3)
    assert scores["f1"] == pytest.approx(100 * (1 + 2 / 3) / 3)
